"""Smoke test: the structured-output benchmark runs end to end on a small vocabulary and model (no timing
assertions): both grammar libraries walk the document, and the engine rows exist."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_structured  # noqa: E402


@pytest.mark.slow  # ~20 s (a tokenizer trained, four programs compiled): CI's budget
def test_bench_structured_quick_runs(capsys):
    assert bench_structured.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "llguidance" in out and "outlines-core" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("1 ")]
    assert len(rows) == 1 and float(rows[0][1]) > 0 and float(rows[0][2]) > 0
