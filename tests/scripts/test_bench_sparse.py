"""Smoke test of scripts/bench_sparse.py --quick (no timing assertions: the numbers are this machine's)."""


import pytest

from tests.scripts_module import load_script


@pytest.mark.slow  # (CI time: 6 s) its 8-bit indexer run stays (below); the kernels: tests/kernels/test_sparse.py
def test_bench_sparse_quick(tmp_path, capsys, monkeypatch):
    bench = load_script("bench_sparse", monkeypatch)
    plot = tmp_path / "sparse.png"
    rows = bench.main(["--quick", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "indexer" in out and "dense MLA" in out and "time ~ n^k" in out
    assert [(r["mode"], r["context"]) for r in rows] == [("decode", 64), ("decode", 128), ("prefill", 64),
                                                          ("prefill", 128)]
    assert all(r[k] > 0 for r in rows for k in ("indexer", "top_k", "sparse", "dense"))
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_bench_sparse_indexer_8bit_quick(capsys, monkeypatch):
    bench = load_script("bench_sparse", monkeypatch)
    rows = bench.main(["--indexer-8bit", "--quick"])
    out = capsys.readouterr().out
    assert "| int8 keys | fp8 keys | fp8 q + k, rotated |" in out
    assert [(r["topk"], r["context"], r["outlier_channels"]) for r in rows] == [
        (16, 64, 0), (32, 256, 0), (16, 64, 4), (32, 256, 4)]
    schemes = ("int8 keys", "fp8 keys", "fp8 q + k, rotated")
    assert all(0.5 < r[k][1] <= r[k][0] <= 1.0 for r in rows for k in schemes)  # (mean, min) overlap fractions
    h = bench.hadamard(8)
    assert abs(h @ h.T - bench.np.eye(8)).max() < 1e-6  # orthogonal: the rotation leaves exact scores unchanged
