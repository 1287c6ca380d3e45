"""Tensor and data parallelism on 8 CPU devices: the checks in `tests/parallel/worker.py`, run in one subprocess
that JAX starts with `--xla_force_host_platform_device_count=8` (the device count is fixed when JAX's CPU
backend starts, and this pytest process has one device). Each check is reported as its own test here.

Under pytest-xdist the workers share one run of the subprocess: the first to need it runs it (holding a file
lock), the others wait and read its results.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel import worker_names

ROOT = Path(__file__).resolve().parents[2]
# The default checks, or (PAGEDJAX_PARALLEL_CHECKS=newest: CI's newest-JAX pass) those that differ by JAX version.
FAST = worker_names.NEWEST if os.environ.get("PAGEDJAX_PARALLEL_CHECKS") == "newest" else worker_names.FAST
SLOW = worker_names.SLOW


def run_worker(out: Path, names: list[str], timeout: float = 900) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # its engines run without the persistent cache (tests/conftest.py)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "tests.parallel.worker", str(out), *names], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"the parallel worker exited with {proc.returncode}:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def fast_results(tmp_path_factory) -> dict:
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's folder, the same for every xdist worker
    out = shared / "pagedjax-parallel-results.json"
    with open(shared / "pagedjax-parallel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not out.is_file():
                run_worker(out.with_suffix(".tmp"), FAST)
                out.with_suffix(".tmp").rename(out)
            return json.loads(out.read_text())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _report(result: dict | None, name: str) -> None:
    assert result is not None, f"check {name} did not run (the worker stopped before it)"
    if result["status"] == "skipped":
        pytest.skip(result["detail"])
    assert result["status"] == "passed", f"check {name} failed in the 8-device worker:\n{result['detail']}"


@pytest.mark.parametrize("name", FAST)
def test_parallel(fast_results, name):
    _report(fast_results.get(name), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_parallel_slow(tmp_path, name):
    _report(run_worker(tmp_path / "out.json", [name]).get(name), name)
