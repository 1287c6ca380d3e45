"""Admission of a sliding-window model's requests: a request is refused only if what it holds at once (its window,
one step's chunk, a prefix hit's blocks its first query sees) exceeds the pool even in steps of one token
(`Scheduler.max_chunk` caps its steps where the token budget's would not fit), not its whole length; and on a pool
of exactly that size every request finishes with the cache-free reference's tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.kv_cache_manager import RELEASED, KVCacheManager
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams
from tests.core.harness import (
    VOCAB,
    Checker,
    FakeModel,
    max_blocks_held,
    reference_outputs,
    run_step,
    run_to_completion,
)

BS, WINDOW, CHUNK, MAX_LEN = 4, 10, 8, 256


def scheduler(num_blocks: int, *, block_size: int = BS, window: int | None = WINDOW, chunk: int = CHUNK,
              max_model_len: int = MAX_LEN, chunked: bool = True, max_num_seqs: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
                                     max_model_len=max_model_len, enable_chunked_prefill=chunked),
                     CacheConfig(block_size=block_size), num_blocks, sliding_window=window)


def test_max_blocks_held_matches_the_step_by_step_count():
    for block_size in (1, 2, 3, 4, 8):
        for window in (None, 1, 2, 3, 5, 6, 9, 10, 17):
            kv = KVCacheManager(1, block_size, sliding_window=window)
            for chunk in (1, 2, 3, 5, 8, 13, 32):
                for tokens in range(70):
                    assert kv.max_blocks_held(tokens, chunk) == max_blocks_held(tokens, block_size, window, chunk), \
                        (block_size, window, chunk, tokens)


def test_max_request_tokens_follows_the_window():
    bound = max_blocks_held(MAX_LEN, BS, WINDOW, CHUNK)
    assert bound == 5 < MAX_LEN // BS
    assert scheduler(bound).max_request_tokens == MAX_LEN  # the window's pool serves the whole context
    assert scheduler(bound, window=None).max_request_tokens == bound * BS + 1  # else what the pool holds
    # Smaller pools serve it in smaller steps, down to steps of one token.
    least = max_blocks_held(MAX_LEN, BS, WINDOW, 1)
    assert least == 4 and scheduler(least).max_request_tokens == MAX_LEN
    assert scheduler(least).max_chunk(MAX_LEN - 1) == 4 and scheduler(bound).max_chunk(MAX_LEN - 1) == CHUNK
    smaller = scheduler(least - 1)
    tokens = smaller.max_request_tokens
    assert tokens < MAX_LEN
    kv = smaller.kv_cache_manager
    assert kv.max_blocks_held(tokens - 1, 1) <= least - 1 < kv.max_blocks_held(tokens, 1)
    # Without chunked prefill a recompute takes the whole sequence in one step: the window saves nothing.
    assert scheduler(bound, chunk=MAX_LEN, chunked=False).max_request_tokens == bound * BS + 1


def test_a_pool_one_block_short_of_the_bound_is_refused_clearly():
    prompt, max_tokens = list(range(40)), 200  # 239 tokens of KV: 60 blocks without the window
    least = max_blocks_held(len(prompt) + max_tokens - 1, BS, WINDOW, 1)  # in steps of one token
    s = scheduler(least - 1)
    with pytest.raises(ValueError, match=rf"may need {least} blocks of {BS} tokens at once \(its {WINDOW}-token "
                                         rf"sliding window and a step of one token\), more than the whole pool of "
                                         rf"{least - 1} blocks"):
        s.add_request(Request("r", prompt, SamplingParams(max_tokens=max_tokens)))
    # The pool of the token budget's steps, and the least one, where the prompt is prefilled in smaller chunks.
    for num_blocks in (max_blocks_held(len(prompt) + max_tokens - 1, BS, WINDOW, CHUNK), least):
        s = scheduler(num_blocks)
        r = Request("r", [t % VOCAB for t in prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        s.add_request(r)
        model = FakeModel(num_blocks, BS, window=WINDOW)
        outputs, _ = run_to_completion(s, model, checker=Checker(s, model), max_steps=400)
        assert outputs["r"] == reference_outputs(r, MAX_LEN, window=WINDOW) and len(outputs["r"]) == max_tokens


def test_a_long_cached_prefix_is_admitted_on_a_window_sized_pool():
    """The pool's every block cached as one prefix, then a request extending it: the hit covers the whole pool,
    so taking every hit block plus one for the new token could never fit; the hits out of the first query's
    window are not taken (RELEASED), and the request runs."""
    max_tokens = 60
    num_blocks = max_blocks_held(MAX_LEN, BS, WINDOW, CHUNK)
    s = scheduler(num_blocks)
    model = FakeModel(num_blocks, BS, window=WINDOW)
    checker = Checker(s, model)
    prefix = [t % VOCAB for t in range(num_blocks * BS)]
    s.add_request(Request("a", prefix, SamplingParams(max_tokens=1)))
    run_to_completion(s, model, checker=checker, max_steps=20)
    hits, num_hit = s.kv_cache_manager.get_computed_blocks(Request("probe", prefix + [1], SamplingParams()))
    assert num_hit == num_blocks * BS and RELEASED not in hits[-2:]
    unread = (num_hit - WINDOW + 1) // BS
    assert hits[:unread] == [RELEASED] * unread and unread > 0
    b = Request("b", prefix + [1], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.add_request(b)
    plan = s.schedule()
    assert plan.request_ids == ["b"] and b.status is RequestStatus.RUNNING and b.num_computed_tokens == num_hit
    checker.check(mid_step=True)
    s.update(plan, model.step(plan))
    outputs, _ = run_to_completion(s, model, checker=checker, max_steps=2 * max_tokens)
    assert b.num_cached_tokens == num_hit
    assert outputs["b"] == reference_outputs(b, MAX_LEN, window=WINDOW)


@settings(deadline=None)
@given(block_size=st.sampled_from([1, 2, 4]), window=st.sampled_from([1, 2, 3, 5, 9]), chunk=st.integers(1, 12),
       chunked=st.booleans(), max_num_seqs=st.integers(1, 3), fused=st.sampled_from([0, 3]),
       workload=st.lists(st.tuples(st.sampled_from([[], [1, 2, 3, 1, 2, 3, 1, 2, 3], [0] * 11]),
                                   st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14),
                                   st.integers(1, 30)), min_size=1, max_size=6))
def test_every_request_finishes_exactly_on_the_smallest_pool_that_admits_it(block_size, window, chunk, chunked,
                                                                            max_num_seqs, fused, workload):
    max_model_len = 48
    chunk = chunk if chunked else max_model_len
    requests = [Request(f"r{i}", prefix + suffix, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i, (prefix, suffix, max_tokens) in enumerate(workload)]
    probe = scheduler(1, block_size=block_size, window=window, chunk=chunk, max_model_len=max_model_len,
                      chunked=chunked)
    # The least pool: each request held in steps of one token (its steps capped to what fits: `max_chunk`).
    num_blocks = max(max_blocks_held(probe.max_kv_tokens(r), block_size, window, 1 if chunked else chunk)
                     for r in requests)
    s = scheduler(num_blocks, block_size=block_size, window=window, chunk=chunk, max_model_len=max_model_len,
                  chunked=chunked, max_num_seqs=max_num_seqs)
    for r in requests:
        s.add_request(r)
    model = FakeModel(num_blocks, block_size, window=window)
    bound = sum(s.max_kv_tokens(r) + 2 for r in requests) + 2
    outputs, _ = run_to_completion(s, model, checker=Checker(s, model), fused_steps=fused, max_steps=bound)
    for r in requests:
        assert outputs[r.request_id] == reference_outputs(r, max_model_len, window=window), r.request_id
    assert s.stats().memory.num_used_blocks == 0


def test_a_short_prompt_whose_recompute_chunk_would_not_fit_is_admitted():
    """Issue 63's case: a 4-token prompt + 60 tokens on a window-8 model with a 48-token budget and a 14-block pool
    was refused because a recompute after a preemption could take a 48-token step on top of the window (15
    blocks); its steps are capped to what fits instead, and it finishes with the reference's tokens."""
    s = scheduler(14, window=8, chunk=48, max_model_len=64)
    assert s.kv_cache_manager.max_blocks_held(63, 48) == 15 and s.max_chunk(63) < 48
    r = Request("r", [3, 1, 4, 1], SamplingParams(max_tokens=60, ignore_eos=True))
    s.add_request(r)
    model = FakeModel(14, BS, window=8)
    checker = Checker(s, model)
    while r.num_computed_tokens < 40:
        run_step(s, model, checker)
    assert s.preempt("r")  # recomputed in capped steps
    outputs, _ = run_to_completion(s, model, checker=checker, max_steps=200)
    assert outputs["r"] == reference_outputs(r, 64, window=8) and len(outputs["r"]) == 60
