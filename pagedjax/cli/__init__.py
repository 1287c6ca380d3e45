"""`pagedjax-generate` (also `python -m pagedjax`): decode text with the paged engine and show its statistics.

    pagedjax-generate                                  # a few prompts on the bundled model
    pagedjax-generate --demo                           # prompts sharing a long prefix: prefix-cache hits
    pagedjax-generate --prompt "def parse(" --prompt "import os" --max-tokens 64 --temperature 0.8 --top-p 0.95
    pagedjax-generate --model path/to/checkpoint --prompts-file prompts.txt --kv-memory 64MiB
    pagedjax-generate --compile-cache /tmp/jax-cache   # the second run loads its programs: a warm start

A single prompt streams as it is generated; with several, each completion is printed when it finishes.
The run ends with a table of the engine's statistics (`--json`: one JSON object, numbers with their unit in
the key name), including the compile time and whether JAX's persistent compilation cache made it a cold or a
warm start (`--no-compile-cache` turns the cache off).

Exit status: 0 on success; 1 if a request failed; 2 for a usage error (with the usage block) or an error found
while running (one line `pagedjax-generate: error: ...`: a model that cannot be loaded, a KV pool that cannot
fit, a prompt that is too long, ...); 130 after Ctrl-C, which stops the run between two engine steps (a second
Ctrl-C, or one before generation starts, exits at once).

Modules: `args` (the options), `prompts`, `warm_start` (the compile cache), `engine_setup` (model, engine, KV
pool check), `generation` (the loop), `report` (header, table, JSON), `ctrl_c`, `errors` (exit statuses), `multihost`
(one run over several processes: --nnodes, --node-rank, --dist-init-addr) and `command` (`main`, `run`).
"""

from pagedjax.cli.command import main, run

__all__ = ["main", "run"]
