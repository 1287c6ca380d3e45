"""Smoke test: the engine benchmark runs end to end on a tiny workload (no timing assertions)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_engine  # noqa: E402


@pytest.mark.slow  # (CI time) a script's smoke run; its decode_weight_bytes below runs by default
def test_bench_engine_quick_runs(capsys):
    bench_engine.main(["--quick"])
    out = capsys.readouterr().out
    assert "pagedjax engine, num_steps=1" in out and "contiguous cache" in out
    # Every implementation produced the same greedy tokens.
    rows = [line for line in out.splitlines() if line.startswith(("pagedjax", "contiguous"))]
    assert len(rows) == 4 and all(line.rstrip().endswith("True") for line in rows)


@pytest.mark.slow  # (CI time) a script's smoke run
def test_bench_engine_parallel_sampling_quick(capsys):
    bench_engine.main(["--quick", "--n", "3"])  # --quick: 8-token prompts
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("1 request", "3 requests"))]
    assert len(rows) == 3 and all(r[-1] == "True" for r in rows)  # the samples equal the single requests
    forked, alone = int(rows[0][-3]), int(rows[1][-3])
    assert forked == 8 - 1 + 3 and alone == 3 * 8  # prefill tokens: once (+ each sample's last token) vs 3x


def test_decode_weight_bytes_skip_an_untied_input_embedding():
    from pagedjax import ModelConfig
    from pagedjax.model.llama import init_model

    cfg = ModelConfig(vocab_size=96, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16,
                      intermediate_size=64, tie_word_embeddings=False)
    untied = bench_engine.decode_weight_bytes(init_model(cfg, seed=0))
    tied = bench_engine.decode_weight_bytes(init_model(cfg.replace(tie_word_embeddings=True), seed=0))
    # The untied model reads its own LM head (96 x 32 f32) and not the table; the tied one reads the table as head.
    assert untied == tied == 4 * (2 * 32 + 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 32 + 96 * 32)
