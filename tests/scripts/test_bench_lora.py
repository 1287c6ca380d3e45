"""Smoke test of `scripts/bench_lora.py`: its quick run makes the table end to end (no timing assertions)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_lora  # noqa: E402


@pytest.mark.slow  # (CI time) a script's smoke run
def test_bench_lora_quick_runs(capsys):
    bench_lora.main(["--quick", "--batch", "4", "--adapters", "0,2"])
    out = capsys.readouterr().out
    for row in ("| base ", "| 0 adapters", "| 2 adapters", "swap"):
        assert row in out, out
