"""Smoke test of scripts/bench_mla.py --quick (no timing assertions: the numbers are this machine's)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_mla.py"


def test_bench_mla_quick(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_mla", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_mla", bench)
    spec.loader.exec_module(bench)
    rows = bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "prefill MLA" in out and "decode MLA" in out
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 16), (1, 32)]
    # The KV bytes per token come from the layer specs: MLA (32 + 8 per layer) vs GQA-4 (2 x 4 x 16), 2 layers, f32.
    assert rows[0]["kv_bytes_per_token_MLA"] == 2 * (32 + 8) * 4
    assert rows[0]["kv_bytes_per_token_GQA-4"] == 2 * 2 * 4 * 16 * 4
    assert all(r["prefill_tok_s_MLA"] > 0 and r["prefill_tok_s_GQA-4"] > 0 for r in rows)
