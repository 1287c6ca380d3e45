"""Smoke test of scripts/bench_mla_hf.py on its micro DeepSeek V3 checkpoint (pagedjax + transformers, one round,
no timing assertions: the numbers are this machine's)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_mla_hf  # noqa: E402


@pytest.mark.hf
@pytest.mark.slow  # (CI time) a script's smoke run: MLA against transformers runs in tests/model/test_deepseek.py
def test_bench_mla_hf_micro(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    res = bench_mla_hf.main(["--quick", "--folder", str(tmp_path / "micro")])  # micro, 1 round, 1 torch thread
    out = capsys.readouterr().out
    assert "| workload | system | prefill tok/s | vs pagedjax | decode tok/s | vs pagedjax | same tokens |" in out
    assert [(r["workload"], r["system"]) for r in res["rows"]] == [
        (w, s) for w in ("b1 8+6", "b2 8+6") for s in ("pagedjax, 8-step decode", "transformers, 1 torch thread")]
    # Absorbed MLA over latent pages and transformers' expanded K / V: the same greedy tokens, every round.
    assert "Greedy tokens identical to pagedjax's for every system, workload and round: yes" in out
    assert all(r["agreement"] == 1.0 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in res["rows"])
    assert (tmp_path / "micro" / "bench_mla_hf_spec.json").is_file()  # reused by a second run of the same shape
