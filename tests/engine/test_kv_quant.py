"""8-bit KV pages in the engine (`CacheConfig(kv_dtype="int8" | "fp8")`): configuration and sizing, exactness
of the engine path against float32 pages that hold exactly the dequantized values, and the scheduler's paths
(prefix caching, preemption, forks) on 8-bit pages."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pagedjax.model.api
import pagedjax.parallel.attention
from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.config.cache import KV_DTYPES
from pagedjax.device import kv_cache
from pallas_kernels.quant import dequantize_kv, quantize_kv
from tests.engine.test_engine import CFG, MAX_LEN, PROMPTS, SEED

ARRAY_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _engine(kv_dtype: str, *, block_size: int = 8, num_blocks: int = 64, prefix: bool = True, max_batched: int = 64,
            **kw) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                enable_prefix_caching=prefix, kv_dtype=kv_dtype),
                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched,
                                                      max_model_len=MAX_LEN), seed=SEED, **kw)


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("value, error", [("int4", ValueError), ("float8_e4m3fn", ValueError), ("", ValueError),
                                          (None, TypeError), (jnp.int8, TypeError), (8, TypeError)])
def test_kv_dtype_is_validated(value, error):
    with pytest.raises(error, match="CacheConfig.kv_dtype"):
        CacheConfig(kv_dtype=value)


def test_kv_dtype_names_resolve():
    bf16 = CFG.replace(dtype="bfloat16")
    assert CacheConfig().resolve_kv_dtype(bf16) == CacheConfig().kv_array_dtype(bf16) == "bfloat16"
    assert CacheConfig(kv_dtype="float32").kv_array_dtype(bf16) == "float32"
    assert CacheConfig(kv_dtype="fp8").resolve_kv_dtype(CFG) == "fp8"
    assert CacheConfig(kv_dtype="fp8").kv_array_dtype(CFG) == "float8_e4m3fn"
    assert CacheConfig(kv_dtype="int8").kv_array_dtype(CFG) == "int8"
    assert set(KV_DTYPES) == {"auto", "float32", "bfloat16", "float16", "int8", "fp8"}


def test_block_bytes_count_the_scales():
    # CFG: 2 layers, 2 KV heads, head_dim 16; K and V. 8-bit: 16 one-byte values + one float32 scale per head.
    per_token = {"float32": 2 * 2 * 2 * 16 * 4, "bfloat16": 2 * 2 * 2 * 16 * 2, "int8": 2 * 2 * 2 * (16 + 4),
                 "fp8": 2 * 2 * 2 * (16 + 4)}
    for name, want in per_token.items():
        cache = CacheConfig(block_size=8, kv_dtype=name)
        assert cache.kv_bytes_per_token(CFG) == want and cache.block_bytes(CFG) == 8 * want
    assert CacheConfig(kv_dtype="auto").kv_bytes_per_token(CFG.replace(dtype="bfloat16")) == per_token["bfloat16"]
    # A memory budget buys 3.2x the float32 blocks in int8 (20 bytes per head and token instead of 64).
    budget = 10 * 8 * per_token["float32"]
    assert CacheConfig(block_size=8, kv_memory_bytes=budget).resolve_num_blocks(CFG) == 10
    assert CacheConfig(block_size=8, kv_memory_bytes=budget, kv_dtype="int8").resolve_num_blocks(CFG) == 32
    assert CacheConfig(block_size=8, kv_memory_bytes=budget - 1, kv_dtype="int8").resolve_num_blocks(CFG) == 31


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_engine_allocates_what_the_config_counts_and_reports_it(kv_dtype):
    cache = CacheConfig(block_size=8, kv_memory_bytes=100_000, kv_dtype=kv_dtype)
    engine = LLMEngine(model_config=CFG, cache_config=cache, seed=SEED, backend="xla")
    layer = engine.runner.kv_cache.layers[0]
    assert layer.k.dtype == ARRAY_DTYPES[kv_dtype] and layer.k_scales.dtype == jnp.float32
    assert engine.runner.kv_cache.nbytes == cache.pool_bytes(CFG) <= 100_000
    stats = engine.stats()
    assert stats.kv_dtype == kv_dtype and stats.kv_bytes_per_token == cache.kv_bytes_per_token(CFG) == 160
    assert engine.stats_dict()["kv_bytes_per_token"] == 160
    float_stats = _engine("auto").stats()
    assert float_stats.kv_dtype == "float32" and float_stats.kv_bytes_per_token == 512


# ---------------------------------------------------------------------------------------------- exactness
def _dequantized_writes(monkeypatch, dtype) -> None:
    """Make every KV write (single device and tensor parallel) store quantize -> dequantize of the new K/V in
    float32 pages: the oracle holds exactly the values 8-bit pages dequantize to."""
    real = kv_cache.write_kv

    def write(layer, k_new, v_new, slot_mapping):
        assert layer.k.dtype == jnp.float32  # the oracle's own pages
        fake = lambda x: dequantize_kv(*quantize_kv(x, dtype), jnp.float32)
        return real(layer, fake(k_new), fake(v_new), slot_mapping)

    monkeypatch.setattr(pagedjax.model.api, "write_kv", write)
    monkeypatch.setattr(pagedjax.parallel.attention, "write_kv", write)
    jax.clear_caches()  # engines of one structure share traces: the oracle's steps must be traced with the fake


def _logprob_run(engine: LLMEngine, prompts, max_tokens: int):
    """Greedy outputs with the top-5 log-probabilities of every generated token and every prompt position."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, prompt_logprobs=5)
    outs = engine.generate(prompts, params, use_tqdm=False)
    tokens = [o.output_token_ids for o in outs]
    lps = [[(t.token_id, t.logprob, t.top) for t in o.outputs[0].logprobs] for o in outs]
    prompt_lps = [[(t.token_id, t.logprob, t.top) for t in o.prompt_logprobs[1:]] for o in outs]
    return tokens, lps, prompt_lps


def _assert_logprobs_close(got, want):
    for g_seq, w_seq in zip(got, want, strict=True):
        assert len(g_seq) == len(w_seq)
        for (g_id, g_lp, g_top), (w_id, w_lp, w_top) in zip(g_seq, w_seq, strict=True):
            assert g_id == w_id
            np.testing.assert_allclose(g_lp, w_lp, rtol=1e-5, atol=1e-5)
            # The top alternatives: the same ids (this model has no near ties among them) and log-probabilities
            # within float32 rounding.
            assert [i for i, _ in g_top] == [i for i, _ in w_top]
            np.testing.assert_allclose([lp for _, lp in g_top], [lp for _, lp in w_top], rtol=1e-5, atol=1e-5)


# Both 8-bit formats, both backends, the fused decode loop and single decode steps (two cases: CI time).
@pytest.mark.parametrize("backend, kv_dtype, fused", [("xla", "int8", 4), ("pallas", "fp8", 1)])
def test_8bit_engine_equals_float32_pages_holding_the_dequantized_values(monkeypatch, backend, kv_dtype, fused):
    """Chunked prefill (ragged steps over cached context) and decode (single or fused steps): every prompt
    position's and generated token's top-5 log-probabilities equal, within float32 rounding, those of an engine
    whose float32 pages hold exactly the values the 8-bit pages dequantize to. Quantization error itself is
    `quantize_kv`'s alone (tested with it)."""
    prompts = [PROMPTS[2], PROMPTS[5]]  # 53 tokens, prefilled in two chunks of the 32-token budget; 7 tokens
    max_tokens = 5
    got = _logprob_run(_engine(kv_dtype, backend=backend, decode_steps_per_call=fused, max_batched=32), prompts,
                       max_tokens)
    _dequantized_writes(monkeypatch, ARRAY_DTYPES[kv_dtype])
    want = _logprob_run(_engine("float32", backend=backend, decode_steps_per_call=fused, max_batched=32), prompts,
                        max_tokens)
    assert got[0] == want[0]
    _assert_logprobs_close(got[1], want[1])
    _assert_logprobs_close(got[2], want[2])


def test_the_oracle_differs_from_unquantized_pages(monkeypatch):
    """The oracle above is not the plain float32 engine: quantization moves the log-probabilities, so the
    exactness test would catch an 8-bit engine that skipped quantizing (or dequantized wrongly)."""
    prompts = [PROMPTS[2]]
    plain = _logprob_run(_engine("float32"), prompts, 1)
    _dequantized_writes(monkeypatch, jnp.int8)
    oracle = _logprob_run(_engine("float32"), prompts, 1)
    diff = max(abs(a[1] - b[1]) for a, b in zip(plain[2][0], oracle[2][0], strict=True))
    assert diff > 1e-4, diff


# ------------------------------------------------------------------------------------ the scheduler's paths
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SCHEDULED = [PROMPTS[2], PROMPTS[3], PROMPTS[4], PROMPTS[5]]  # 53, 45, 49 (40 shared with the 45) and 7 tokens


def test_int8_preemption_prefix_cache_and_forks_give_the_same_tokens():
    """On int8 pages, against an engine with room for everything and no prefix cache: (1) a pool of 10 blocks
    of 8 for 25 blocks' worth of requests (preemption by recompute, whose prefill reads the prefix cache), fused
    decode; (2) forks: n = 3 greedy samples share the prompt's blocks and the partly filled last block is copied
    on the first write (values and scales): every sample equals the request's single completion."""
    baseline = _engine("int8", prefix=False, backend="xla")
    want = [o.output_token_ids for o in baseline.generate(SCHEDULED, GREEDY, use_tqdm=False)]
    tight = _engine("int8", num_blocks=10, backend="xla", decode_steps_per_call=4)
    got = [o.output_token_ids for o in tight.generate(SCHEDULED, GREEDY, use_tqdm=False)]
    stats = tight.stats().scheduler
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_rate > 0, stats
    assert got == want
    outs = baseline.generate([SCHEDULED[0], SCHEDULED[3]], SamplingParams(temperature=0.0,
                                                                          max_tokens=8, n=3), use_tqdm=False)
    for out, i in zip(outs, (0, 3), strict=True):
        assert [s.token_ids for s in out.outputs] == [want[i]] * 3


# ---------------------------------------------------------------------------------------------- error paths
def test_unknown_kv_dtype_never_reaches_the_engine():
    with pytest.raises(ValueError, match="kv_dtype"):
        _engine("int4")


def test_8bit_pages_on_the_tpu_kernels_are_refused_at_construction(monkeypatch):
    """The TPU kernels do not take 8-bit pages: on a TPU the Pallas backend refuses them when the engine is built
    (the kernels' own reason in the message), not at the first step. Simulated here: JAX reports a TPU backend,
    so the kernels pick their TPU target; the check only traces, nothing compiles for a TPU."""
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match=r"'pallas' attention backend on tpu cannot serve int8 KV pages.*target 'tpu'"):
        _engine("int8", backend="pallas")
    _engine("bfloat16", block_size=16, backend="pallas")  # what the TPU kernels take is still accepted


def test_a_kernel_limit_is_reported_at_construction():
    """Any combination the Pallas kernels reject fails when the engine is built, naming it (here head_dim 8)."""
    with pytest.raises(ValueError, match=r"cannot serve float8_e4m3fn KV pages.*head_dim"):
        LLMEngine(model_config=CFG.replace(head_dim=8), cache_config=CacheConfig(num_blocks=16, kv_dtype="fp8"),
                  seed=SEED, backend="pallas")


# ------------------------------------------------------------------------------------------ command line
def test_cli_kv_dtype_reports_dtype_and_bytes_per_token(capsys):
    """`--kv-dtype int8`: the header names the KV dtype and bytes per token, the table has a row for it, and
    `--json` keeps `stats` numeric (the dtype beside it)."""
    from pagedjax import cli

    # The bundled model: 4 layers, 2 KV heads of 32 dims -> 2 x 4 x 2 x (32 + 4) = 576 bytes per token in int8.
    argv = ["--prompt", "def f(x):\n", "--max-tokens", "2", "--num-blocks", "16", "--ignore-eos", "--kv-dtype", "int8",
            "--backend", "xla"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "16 KV blocks x 16 tokens (576 KV bytes per token)" in out and ", KV cache int8\n" in out, out
    assert re.search(r"^KV bytes per token\s+576$", out, re.MULTILINE), out
    assert cli.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kv_dtype"] == "int8" and result["stats"]["kv_bytes_per_token"] == 576
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in result["stats"].values())


def test_cli_rejects_an_unknown_kv_dtype(capsys):
    from pagedjax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--kv-dtype", "int4"])
    assert e.value.code == 2 and "--kv-dtype" in capsys.readouterr().err
