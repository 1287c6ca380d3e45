"""A sliding-window model's requests hold KV blocks for their window only, however long they run, and still
produce the dense model's tokens (the host releases blocks out of every layer's window after each step). Layers
of different windows are KV cache groups of their own (`pagedjax.config.kv_layout`): each group holds its own
window's blocks, a global layer's group every block."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.core.kv_cache_manager import cdiv
from tests import dense

BS = 4
WINDOWS = (6, 10)  # per layer; no layer reads further back than 10 positions: kv_window 10
CFG = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, sliding_windows=WINDOWS)
PROMPT_LEN, MAX_TOKENS, MAX_LEN = 9, 40, 64
SEED = 3


def dense_greedy(cfg: ModelConfig, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs, margin = dense.dense_greedy(cfg, SEED, prompts, max_tokens, MAX_LEN)
    assert margin > 1e-3, margin  # no near tie: identical tokens do not hang on rounding
    return outputs


def run(cfg: ModelConfig, prompts, *, decode_steps_per_call: int, prefix: bool = True):
    """Greedy outputs and, per KV cache group, the most blocks held after any step."""
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=BS, num_blocks=64,
                                                                  enable_prefix_caching=prefix),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8,
                                                        max_model_len=MAX_LEN),
                       seed=SEED, decode_steps_per_call=decode_steps_per_call)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    outputs, peak = {}, (0,) * cfg.kv_layout.num_groups
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        engine.scheduler.check_invariants()
        peak = tuple(map(max, peak, engine.stats().scheduler.memory.group_blocks))
    assert engine.stats().scheduler.memory.num_used_blocks == 0
    return [outputs[str(i)] for i in range(len(prompts))], peak


# (CI time) single steps in the slow run: the release is the scheduler's, per step either way (tests/core), and 4
# steps a call add the blocks a fused call lends
@pytest.mark.parametrize("decode_steps_per_call", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_long_generation_holds_only_its_window_and_matches_dense(decode_steps_per_call):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, CFG.vocab_size, PROMPT_LEN).tolist()
    # The same prompt twice (a prefix hit on blocks the first request may already have released) and a third.
    prompts = [prompt, prompt, rng.integers(0, CFG.vocab_size, 5).tolist()]
    outputs, peak = run(CFG, prompts, decode_steps_per_call=decode_steps_per_call)
    assert outputs == dense_greedy(CFG, prompts, MAX_TOKENS)
    assert outputs != dense_greedy(CFG.replace(sliding_windows=None), prompts, MAX_TOKENS)  # windows matter here
    # Between steps a request holds, in each window's group, the blocks of positions >= p - window + 1 and its
    # newest block: at most cdiv(window - 1, BS) + 1 blocks each (a fused call lends one more per request while
    # it runs).
    assert CFG.kv_layout.windows == WINDOWS
    for window, group_peak in zip(WINDOWS, peak, strict=True):
        assert group_peak <= len(prompts) * (cdiv(window - 1, BS) + 1)
    # Without windows the same requests end up holding every block of their PROMPT_LEN + MAX_TOKENS tokens (one
    # run for both parametrizations, CI time: the bound above is what each checks).
    assert _windowless_peak(tuple(map(tuple, prompts)))[0] >= 2 * cdiv(PROMPT_LEN + MAX_TOKENS - 1, BS)


@functools.cache
def _windowless_peak(prompts: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return run(CFG.replace(sliding_windows=None), [list(p) for p in prompts], decode_steps_per_call=1)[1]


def test_a_global_layer_keeps_every_block():
    cfg = CFG.replace(sliding_windows=(6, None))  # Gemma-style local/global: the global layer reads everything
    assert cfg.kv_window is None
    prompt = list(range(PROMPT_LEN))
    outputs, (window_peak, global_peak) = run(cfg, [prompt], decode_steps_per_call=1)
    assert outputs == dense_greedy(cfg, [prompt], MAX_TOKENS)
    assert global_peak == cdiv(PROMPT_LEN + MAX_TOKENS - 1, BS)  # the global layer's group keeps every block
    assert window_peak <= cdiv(6 - 1, BS) + 1  # while the window layer's releases what it no longer reads


# ---------------------------------------------------------------------------------------- window-aware admission
LONG_LEN, CHUNK = 128, 8  # chunked prefill: a step computes at most 8 tokens of a request


def serve_one(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """Greedy outputs of one request run alone, and the most blocks in use after any step."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    outputs, peak = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs = out.output_token_ids
        engine.scheduler.check_invariants()
        peak = max(peak, engine.stats().scheduler.memory.num_used_blocks)
    return outputs, peak


# (CI time) the release that lets a small pool serve long requests runs in
# test_long_generation_holds_only_its_window_and_matches_dense (its peak blocks asserted) and in tests/core
@pytest.mark.slow
def test_a_pool_sized_for_the_window_serves_requests_far_longer_than_itself():
    """The pool holds what one request holds at once (each window and one chunk, in the groups of the 10- and the
    6-token window: 5 + 4 blocks of 4 tokens): it serves ~100-token requests, with and without a prefix hit as long
    as the pool has blocks, with the tokens of a pool of 64."""
    def engine(num_blocks: int) -> LLMEngine:
        return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BS, num_blocks=num_blocks),
                         scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK,
                                                          max_model_len=LONG_LEN), seed=SEED)

    big = engine(64)
    bound = big.scheduler.kv_cache_manager.max_blocks_held(LONG_LEN - 1, CHUNK)
    assert bound == 9
    small = engine(bound)
    assert small.max_request_tokens == LONG_LEN  # what the server advertises and defaults max_tokens to
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, CFG.vocab_size, bound * BS).tolist()  # as many tokens as the whole pool holds
    jobs = [("long", rng.integers(0, CFG.vocab_size, 30).tolist(), 70),  # 99 tokens, chunked prefill of 30
            ("prefix", prefix, 1),  # leaves the whole pool cached as one prefix
            ("hit", prefix + rng.integers(0, CFG.vocab_size, 3).tolist(), 80)]  # hits all of it, then 83 more
    for rid, prompt, max_tokens in jobs:
        tokens, peak = serve_one(small, rid, prompt, max_tokens)
        assert tokens == serve_one(big, rid, prompt, max_tokens)[0] and len(tokens) == max_tokens, rid
        assert peak <= bound
    assert small.stats().scheduler.prefix_cache_hits == big.stats().scheduler.prefix_cache_hits == bound * BS
    # Smaller pools take it in smaller steps (`Scheduler.max_chunk`); one short of steps of one token refuses it.
    least = big.scheduler.kv_cache_manager.max_blocks_held(LONG_LEN - 1, 1)
    with pytest.raises(ValueError, match=f"more than the whole pool of {least - 1} blocks"):
        engine(least - 1).add_request("long", jobs[0][1], SamplingParams(temperature=0.0, max_tokens=70))
