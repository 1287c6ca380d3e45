#!/usr/bin/env bash
# Sets up pagedjax on a fresh machine (idempotent) and runs the main job: a decode on the bundled model,
# with prompts sharing a prefix so the prefix cache shows. Extra arguments go to pagedjax-generate
# (e.g. scripts/run.sh --prompt "def fib(n):" --max-tokens 64).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q -e . 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
if [ $# -eq 0 ]; then set -- --demo; fi
exec .venv/bin/pagedjax-generate "$@"
