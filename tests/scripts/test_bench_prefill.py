"""Smoke test: scripts/bench_prefill.py prints a row per dtype and budget, ratios to the first (slow: two engines
compile every program, 8 s)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_prefill  # noqa: E402


@pytest.mark.slow
def test_bench_prefill_prints_a_row_per_dtype_and_budget(capsys):
    bench_prefill.main(["--shape", "tiny", "--prompt", "40", "--long-prompt", "24", "--repeats", "1", "--budgets",
                        "32"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("float32", "32"), ("bfloat16", "32")]
    assert rows[0][3] == rows[0][5] == rows[0][7] == rows[0][9] == "1.00x" and all(float(r[2]) > 0 for r in rows)
