"""Smoke test: the tool-calling benchmark runs end to end on a small vocabulary (no timing assertions): the
three mask rows and the beam-search row exist."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_tools  # noqa: E402


@pytest.mark.slow  # ~30 s (a tokenizer trained, programs compiled): CI's budget
def test_bench_tools_quick_runs(capsys):
    assert bench_tools.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "json schema (arguments)" in out and "tool call, 1 function" in out and "tool call, 8 functions" in out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].replace(".", "").isdigit()]
    assert len(rows) == 1 and float(rows[0][2]) > 0  # unconstrained s, constrained s, ratio, tok/s
