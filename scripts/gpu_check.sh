#!/usr/bin/env bash
# GPU check, one command, under 8 minutes on an H100/H200:
#   1. the kernel tests (tests/kernels) with the kernels *compiled* by Triton on the GPU (interpret=None
#      picks compiled on a GPU backend), against the float32 references;
#   2. the kernel benchmark (scripts/bench_kernels.py), table on stdout and JSON in out/gpu_check/.
# Usage: scripts/gpu_check.sh            (PYTHON=/path/to/python to choose the interpreter)
# Exit status: that of the tests (the benchmark runs whatever they say).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
export JAX_PLATFORMS=cuda  # tests/conftest.py defaults to cpu; a GPU check must not fall back silently
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the benchmark sizes its cache itself
mkdir -p out/gpu_check

if ! "$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.default_backend(); print("jax", jax.__version__, jax.devices()[0].device_kind)'; then
  echo "gpu_check: no GPU visible to JAX ($PY)" >&2
  exit 2
fi
"$PY" -c 'import pytest, hypothesis' || { echo "gpu_check: pytest and hypothesis are needed" >&2; exit 2; }

echo "== kernel tests, compiled on the GPU"
timeout 300 "$PY" -m pytest tests/kernels -q -x -p no:cacheprovider -o addopts="" -m "kernels" \
  --durations=10 2>&1 | tee out/gpu_check/tests.log
status=${PIPESTATUS[0]}
echo "== tests exit status: $status"

echo "== kernel benchmark"
timeout 140 "$PY" scripts/bench_kernels.py --iters 10 --json out/gpu_check/bench_kernels.json 2>&1 \
  | tee out/gpu_check/bench.log
echo "== benchmark exit status: ${PIPESTATUS[0]}"
exit "$status"
