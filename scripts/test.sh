#!/usr/bin/env bash
# Sets up the test environments from scratch (idempotent) and runs the test suite:
#   1. the whole default suite on python3 (JAX from pip, the [test,hf] extras: torch is the local CPU wheel),
#   2. what can differ by JAX version again on python3.12 with the newest JAX: kernels, device functions,
#      model, the engine's core paths, checkpoints, README examples (the GPU machines run Python 3.12 with
#      newer JAX than python3 here gets).
# Extra arguments go to the first pytest run, e.g. scripts/test.sh -k block_pool. Both runs end with the 15
# slowest tests (--durations=15), to keep the suite inside CI's budget.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  if python3.12 -c 'import sys' >/dev/null 2>&1; then command -v python3.12; return; fi
  local root; root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for p in "$root"/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$p" ] && { echo "$p"; return; }
  done
  return 1
}

quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
quiet_pip .venv/bin/pip install -q "torch==2.13.0"
quiet_pip .venv/bin/pip install -q -e ".[test,hf]"

echo "== pagedjax tests: $(.venv/bin/python -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__)')"
.venv/bin/python -m pytest -n 2 -q --durations=15 "$@"

if PY312=$(find_python312); then
  if [ ! -x .venv312/bin/python ]; then "$PY312" -m venv .venv312; fi
  quiet_pip .venv312/bin/pip install -q --upgrade jax jaxlib flax
  quiet_pip .venv312/bin/pip install -q -e ".[test]"
  echo "== newest JAX: $(.venv312/bin/python -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__)')"
  # Only what can differ by JAX version: the kernels (and their lowering), the device functions, the model and
  # the engine's core paths, checkpoints, the README's examples and sharding (meshes, shard_map). The host-side core is plain Python, and the
  # engine's long property, fault and CLI suites exercise that same core over these same device paths.
  .venv312/bin/python -m pytest -n 2 -q --durations=15 tests/kernels tests/device tests/engine/test_model.py \
    tests/engine/test_engine.py tests/engine/test_gpu_lowering.py tests/engine/test_tpu_lowering.py tests/engine/test_checkpoint_train.py \
    tests/engine/test_readme.py tests/engine/test_engine_validation.py tests/parallel
else
  echo "python3.12 not found: the newest-JAX run cannot happen" >&2
  exit 1
fi
