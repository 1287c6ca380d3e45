"""pagedjax inside other frameworks' loops: the trainer's exact log-probabilities (`policy`), an engine as a
rollout worker (`rollout`), and Tunix's rollout interface over it (`tunix`, with `pip install 'pagedjax[tunix]'`)."""
