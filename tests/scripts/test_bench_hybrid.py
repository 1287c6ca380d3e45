"""Smoke test of scripts/bench_hybrid.py --quick: the tables' structure and the invariants that do not depend on
timing (the memory arithmetic, the state part flat in the context, hits only with caching, identical tokens)."""

from __future__ import annotations

import math

import pytest

from tests.scripts_module import load_script

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("transformers has no Qwen3.5", allow_module_level=True)


def test_qwen3_5_27b_shape_takes_transformers_defaults_for_what_it_leaves_out(monkeypatch):
    bench = load_script("bench_hybrid", monkeypatch)
    cfg = bench.qwen3_5_27b()
    hf = transformers.Qwen3_5TextConfig()  # the defaults the published config relies on for the rest
    assert (cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel) == (
        hf.head_dim, hf.linear_key_head_dim, hf.linear_value_head_dim, hf.linear_conv_kernel_dim) == (256, 128, 128, 4)
    assert cfg.layer_types == tuple(hf.layer_types[:4]) * 16 and cfg.layer_types.count("full_attention") == 16
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (5120, 64, 24, 4)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 48)


def test_bench_hybrid_memory_quick(capsys, monkeypatch):
    bench = load_script("bench_hybrid", monkeypatch)
    result = bench.main(["--quick", "--tables", "memory"])
    out = capsys.readouterr().out
    for title in ("memory: KV + state per sequence", "prefix-caching snapshot overhead"):
        assert title in out

    # memory: bf16 K/V of 4 KV heads of 256 per full layer; one f32 snapshot of every linear layer per sequence.
    rows = {(r["model"], r["tokens"]): r for r in result["memory"]}
    snapshot = 48 * 4 * (48 * 128 * 128 + (2 * 16 * 128 + 48 * 128) * 3)
    for tokens in (4096, 32768):
        hybrid, full = rows[("hybrid 3:1", tokens)], rows[("all full attention", tokens)]
        assert hybrid["kv_bytes"] == 16 * 2 * 4 * 256 * 2 * tokens
        assert full["kv_bytes"] == 64 * 2 * 4 * 256 * 2 * tokens and full["state_bytes"] == 0
        assert hybrid["state_bytes"] == snapshot  # flat in the context
        assert hybrid["bytes"] == hybrid["kv_bytes"] + snapshot
        assert hybrid["full_over_this"] == full["bytes"] / hybrid["bytes"] > 1
        assert 0 < full["sequences"] <= full["sequences_by_bytes"] == 64 * 2**30 // full["bytes"]
        assert 0 < hybrid["sequences"] <= hybrid["sequences_by_bytes"] == 64 * 2**30 // hybrid["bytes"]
        assert hybrid["sequences_by_bytes"] > full["sequences_by_bytes"]
        assert hybrid["allocated_bytes"] <= 64 * 2**30 and full["allocated_bytes"] <= 64 * 2**30
    assert rows[("hybrid 3:1", 32768)]["full_over_this"] > rows[("hybrid 3:1", 4096)]["full_over_this"]
    # The engine reserves its state pool for every sequence it could run (2 snapshots each, and 1 per state block
    # of a prefill chunk, twice): the hybrid then holds more sequences than the all-full model at every context.
    for tokens in (4096, 32768):
        assert rows[("hybrid 3:1", tokens)]["sequences"] > rows[("all full attention", tokens)]["sequences"]
    snaps = {r["block_size"]: r for r in result["snapshots"]}
    for bs, r in snaps.items():
        # The state block: the least multiple of the KV block at which one of the 48 state layers' snapshot takes no
        # more than one of the 16 attention layers' K/V of its tokens (64 KiB per token for all 16), rounded up to
        # a multiple of 64 tokens.
        kv_per_token = 16 * 2 * 4 * 256 * 2
        tokens, unit = (snapshot / 48) / (kv_per_token / 16), math.lcm(bs, 64)
        assert r["state_block_size"] % unit == 0 and r["state_block_size"] - unit < tokens <= r["state_block_size"]
        assert r["snapshot_bytes"] == snapshot and r["kv_block_bytes"] == bs * kv_per_token
        assert r["covered_kv_bytes"] == r["state_block_size"] * kv_per_token
        assert math.isclose(r["snapshot_over_kv"], snapshot / r["covered_kv_bytes"]) and r["snapshot_over_kv"] <= 3
        assert r["snapshots_over_prefix_kv"] <= 3
    assert snaps[16]["state_block_size"] == 832


@pytest.mark.slow  # (CI time: 12-17 s, engines and transformers compiled) the memory tables run by default
def test_bench_hybrid_speed_and_prefix_quick(capsys, monkeypatch):
    bench = load_script("bench_hybrid", monkeypatch)
    result = bench.main(["--quick", "--tables", "speed", "prefix"])
    out = capsys.readouterr().out
    for title in ("speed on this CPU", "prefix cache:"):
        assert title in out
    # speed: one row per context, every rate positive; greedy tokens compared with transformers.
    speed = result["speed"]
    assert [r["context"] for r in speed] == [64, 256]
    for r in speed:
        for side in ("hybrid", "full", "transformers"):
            assert r[side]["prefill_tok_s"] > 0 and r[side]["decode_tok_s"] > 0
            assert r[side]["prefill_tokens"] == r["context"] and r[side]["decode_tokens"] == 4
        assert 0.0 <= r["same_tokens"] <= 1.0
        assert r["hybrid_params"] > 0 and r["full_params"] > 0

    # prefix: hits only with caching; the tokens were asserted identical inside the script (and are here).
    off, on = result["prefix"]
    assert (off["caching"], on["caching"]) == (False, True)
    assert off["hit_rate"] == 0.0 and on["hit_rate"] > 0.0
    assert off["all_tokens"] == on["all_tokens"]
    assert len(on["ttft"]) == 4 and all(t > 0 for t in on["ttft"] + off["ttft"])
    assert on["ttft_p50"] <= on["ttft_p90"]


def test_bad_arguments_are_refused(monkeypatch):
    bench = load_script("bench_hybrid", monkeypatch)
    with pytest.raises(SystemExit):
        bench.main(["--contexts", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--pool-gib", "-1", "--tables", "memory"])
    with pytest.raises(SystemExit):
        bench.main(["--tables", "nope"])
