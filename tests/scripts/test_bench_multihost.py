"""Smoke test of scripts/bench_multihost.py --quick: three layouts (1, 2 and 4 processes), each with the
one-process tokens (no timing assertions). Slow: nine JAX processes compile the same engine (~45 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_multihost_quick():
    out = subprocess.run([sys.executable, "scripts/bench_multihost.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip().split(" x ")[0].strip().isdigit()]
    assert [r[:3] for r in rows] == [["1", "x", "4"], ["2", "x", "2"], ["4", "x", "1"]], out
    assert all(r[-1] == "True" for r in rows), out
    assert all(int(r[-4]) > 0 for r in rows[1:]), out  # exchanges counted where there are several processes
