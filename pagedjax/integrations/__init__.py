"""pagedjax inside other frameworks' loops: the trainer's exact log-probabilities (`policy`), an engine as a
rollout worker (`rollout`), and Tunix's rollout interface over it (`tunix`, with Tunix's own models read by
`tunix_models`; both need `pip install 'pagedjax[tunix]'`)."""
