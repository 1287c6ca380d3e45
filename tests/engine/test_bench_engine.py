"""Smoke test: the engine benchmark runs end to end on a tiny workload (no timing assertions)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_engine  # noqa: E402


def test_bench_engine_quick_runs(capsys):
    bench_engine.main(["--quick"])
    out = capsys.readouterr().out
    assert "pagedjax engine, num_steps=1" in out and "contiguous cache" in out
    # Every implementation produced the same greedy tokens.
    rows = [line for line in out.splitlines() if line.startswith(("pagedjax", "contiguous"))]
    assert len(rows) == 4 and all(line.rstrip().endswith("True") for line in rows)
