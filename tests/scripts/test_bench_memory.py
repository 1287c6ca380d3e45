"""Smoke test of scripts/bench_memory.py --quick (no timing assertions; the memory numbers are seeded)."""

from __future__ import annotations

import pytest

from tests.scripts_module import load_script


# (CI time: 7-10 s) the block pool's accounting it reports is tests/core's; -m slow runs the script's own numbers.
@pytest.mark.slow
def test_bench_memory_quick(tmp_path, capsys, monkeypatch):
    bench = load_script("bench_memory", monkeypatch)
    plot = tmp_path / "occupancy.png"
    result = bench.main(["--quick", "--plot", str(plot), "--timing-requests", "256", "--timing-iters", "3"])
    out = capsys.readouterr().out
    assert "paged (block 16)" in out and "max-length" in out and "exact, first-fit" in out
    assert "per schedule()" in out
    assert plot.exists() and plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    paged, max_len, exact = result["rows"]
    assert paged["waste_pct"] < 4.0
    assert result["concurrency_ratio"] >= 3.0
    assert paged["failures_despite_free"] == 0 and max_len["failures_despite_free"] == 0
    assert exact["failures_despite_free"] > 0  # first-fit fragments
    assert result["timing"]["num_running"] == 256
    sharing = {(r["workload"], r["kind"], r["k"]): r["saving_pct"] for r in result["sharing"]}
    assert len(sharing) == 12 and all(0.0 < v < 100.0 for v in sharing.values())
    for w in ("ShareGPT-like", "Alpaca-like"):  # wider forks share more; beams share more than samples
        assert sharing[(w, "parallel sampling", 2)] < sharing[(w, "parallel sampling", 6)]
        assert sharing[(w, "parallel sampling", 4)] < sharing[(w, "beam search", 4)]
    # KV dtypes, one budget: 8-bit pages (1 byte + a 4-byte scale per 128 values) hold ~1.94x bfloat16's tokens.
    kv = {r["kv_dtype"]: r for r in result["kv_dtypes"]}
    assert [kv[d]["bytes_per_token"] for d in ("float32", "bfloat16", "int8", "fp8")] == [
        2 * 32 * 8 * 128 * 4, 2 * 32 * 8 * 128 * 2, 2 * 32 * 8 * 132, 2 * 32 * 8 * 132]
    assert kv["bfloat16"]["kv_slots"] == 16384 and kv["float32"]["kv_slots"] == 8192
    assert kv["int8"]["kv_slots"] == kv["fp8"]["kv_slots"] == 16384 * 256 // (132 * 16) * 16 == 31760
    assert kv["float32"]["mean_concurrency"] < kv["bfloat16"]["mean_concurrency"] < kv["int8"]["mean_concurrency"]
    assert kv["int8"]["preemptions"] <= kv["bfloat16"]["preemptions"] <= kv["float32"]["preemptions"]
    # Sliding window (512, quick): releasing out-of-window blocks bounds each request's KV by the window (plus
    # the block being filled) instead of its whole length, so more of the same requests run at once.
    keep, release = result["windows"]
    assert keep["peak_kv_tokens_per_request"] == 256 + 1500 - 2  # its last sampled token is never fed back
    assert release["peak_kv_tokens_per_request"] <= 512 + 16
    assert release["mean_concurrency"] > keep["mean_concurrency"] and release["preemptions"] <= keep["preemptions"]
    # Attention kinds on a DeepSeek-V3 shape (61 layers): MLA's 576 numbers per token and layer against GQA-8's
    # 2 x 8 x 128 and MHA's 2 x 128 x 128; fp8 adds one 4-byte scale per vector. Allocated pools were checked
    # against the arithmetic inside the script.
    kinds = {(r["kind"], r["kv_dtype"]): r for r in result["attention_kinds"]}
    assert kinds[("MLA (512 + 64)", "bfloat16")]["bytes_per_token"] == 61 * 576 * 2
    assert kinds[("GQA-8 x 128", "bfloat16")]["bytes_per_token"] == 61 * 2 * 8 * 128 * 2
    assert kinds[("MHA 128 x 128", "bfloat16")]["bytes_per_token"] == 61 * 2 * 128 * 128 * 2
    assert kinds[("MLA (512 + 64)", "fp8")]["bytes_per_token"] == 61 * (576 + 4)
    assert kinds[("MHA 128 x 128", "bfloat16")]["sequences"] < kinds[("GQA-8 x 128", "bfloat16")]["sequences"] \
        < kinds[("MLA (512 + 64)", "bfloat16")]["sequences"] < kinds[("MLA (512 + 64)", "fp8")]["sequences"]
    # KV cache groups (quick: 8k tokens, checked against the scheduler inside the script): gpt-oss's window and
    # full groups hold the full group's blocks and a window's, ~half the one-table bytes; Gemma 3 (5:1) far less.
    groups = {r["model"]: r for r in result["groups"]}
    assert groups["gpt-oss-120b"]["groups"] == 2 and 1.9 < groups["gpt-oss-120b"]["saving"] < 2.0
    assert groups["gemma3-27b"]["saving"] > 3 and groups["gemma3-27b"]["grouped_sequences"] > \
        groups["gemma3-27b"]["one_table_sequences"]
