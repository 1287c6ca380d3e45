"""Smoke test of scripts/bench_sparse.py --quick (no timing assertions: the numbers are this machine's)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_sparse.py"


def test_bench_sparse_quick(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_sparse", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_sparse", bench)
    spec.loader.exec_module(bench)
    plot = tmp_path / "sparse.png"
    rows = bench.main(["--quick", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "indexer" in out and "dense MLA" in out and "time ~ n^k" in out
    assert [(r["mode"], r["context"]) for r in rows] == [("decode", 64), ("decode", 128), ("prefill", 64),
                                                          ("prefill", 128)]
    assert all(r[k] > 0 for r in rows for k in ("indexer", "top_k", "sparse", "dense"))
    assert plot.read_bytes()[:4] == b"\x89PNG"
