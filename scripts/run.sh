#!/usr/bin/env bash
# Sets up pagedjax on a fresh machine (idempotent) and runs the main job: a decode on the bundled model,
# with prompts sharing a prefix so the prefix cache shows. Extra arguments go to pagedjax-generate
# (e.g. scripts/run.sh --prompt "def fib(n):" --max-tokens 64).
#
# `pip install -e .` runs only when needed: on a fresh clone, when the console script is missing, or when
# pyproject.toml changed since the last install (its hash is kept in .venv/.pagedjax-install-stamp). The
# install is editable, so edits to the sources need none.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then echo "run.sh: creating .venv" >&2; python3 -m venv .venv; fi
stamp=.venv/.pagedjax-install-stamp
project_hash=$(.venv/bin/python -c \
  'import hashlib; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())')
if [ ! -x .venv/bin/pagedjax-generate ] || [ "$(cat "$stamp" 2>/dev/null)" != "$project_hash" ]; then
  # pip -q prints nothing for the minute a fresh install takes (its progress: hundreds of lines): one line says so.
  echo "run.sh: installing pagedjax and its dependencies into .venv (about a minute the first time) ..." >&2
  .venv/bin/pip install -q -e . 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$project_hash" > "$stamp"
fi
if [ $# -eq 0 ]; then set -- --demo; fi
exec .venv/bin/pagedjax-generate "$@"
