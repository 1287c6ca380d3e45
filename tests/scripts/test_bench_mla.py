"""Smoke test of scripts/bench_mla.py --quick (no timing assertions: the numbers are this machine's)."""


import pytest

from tests.scripts_module import load_script


@pytest.mark.slow  # (CI time: 8 s) the kernels it times are tested in tests/kernels/test_mla.py
def test_bench_mla_quick(capsys, monkeypatch):
    bench = load_script("bench_mla", monkeypatch)
    rows = bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "prefill MLA" in out and "decode MLA" in out and "| 2 forks of 1 |" in out
    # batch 2 x 16 is over --quick's prefill budget (16 tokens): prefill at batch 1, decode over one prompt forked.
    assert [(r["batch"], r["context"], r["prefill_batch"], r["fork"]) for r in rows] == [(1, 16, 1, False),
                                                                                      (2, 16, 1, True)]
    # The KV bytes per token come from the layer specs: MLA (32 + 8 per layer) vs GQA-4 (2 x 4 x 16), 2 layers, f32.
    assert rows[0]["kv_bytes_per_token_MLA"] == 2 * (32 + 8) * 4
    assert rows[0]["kv_bytes_per_token_GQA-4"] == 2 * 2 * 4 * 16 * 4
    assert all(r[f"{k}_{m}"] > 0 for r in rows for k in ("prefill_tok_s", "decode_tok_s") for m in ("MLA", "GQA-4"))
