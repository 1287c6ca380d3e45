"""Hypothesis: random workloads through the whole engine give the dense model's greedy tokens.

Random prompt lengths (1, exact block multiples, shared prefixes), block sizes, pool sizes (down to
preemption pressure), token budgets (chunked prefill), batch limits, fused decode steps and prefix caching.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from tests.engine.test_engine import CFG, MAX_LEN, SEED, dense_greedy

MAX_PROMPTS = 5


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([4, 8, 16]), label="block_size")
    shared = draw(st.integers(0, 3 * block_size), label="shared_prefix_len")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="token_seed"))
    prefix = rng.integers(0, CFG.vocab_size, shared).tolist()
    lengths = draw(st.lists(st.one_of(st.integers(1, 30), st.sampled_from([block_size, 2 * block_size])),
                            min_size=1, max_size=MAX_PROMPTS), label="suffix_lengths")
    prompts = [prefix + rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]
    max_tokens = draw(st.integers(1, 10), label="max_tokens")
    longest = max(len(p) for p in prompts) + max_tokens
    min_blocks = -(-longest // block_size)
    # Pools from "only the longest request fits" (preemption) to roomy; a few sizes keep compilations few.
    num_blocks = draw(st.sampled_from([min_blocks, 2 * min_blocks, 64]), label="num_blocks")
    return dict(
        prompts=prompts, max_tokens=max_tokens, block_size=block_size, num_blocks=max(num_blocks, min_blocks),
        budget=draw(st.sampled_from([8, 32, 256]), label="max_num_batched_tokens"),
        max_num_seqs=draw(st.integers(1, 4), label="max_num_seqs"),
        num_steps=draw(st.sampled_from([1, 4]), label="num_steps"),
        prefix=draw(st.booleans(), label="prefix_caching"),
    )


# (CI time: ~2 s an example) 3 drawn, and 2 explicit examples at opposite corners: blocks of 8, a shared prefix of
# exactly two blocks, a 1-token prompt, a pool that fits one request (preemption), 8-token chunks and fused decode
# on; blocks of 16, prompts of 1, 16 and 32 tokens (exact multiples) one at a time, no prefix cache, one step a call.
@settings(max_examples=3, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(w=dict(prompts=[[5] * 16, [5] * 16 + [7], [9]], max_tokens=6, block_size=8, num_blocks=3, budget=8,
                max_num_seqs=3, num_steps=4, prefix=True))
@example(w=dict(prompts=[[11], list(range(20, 36)), list(range(40, 72))], max_tokens=5, block_size=16, num_blocks=64,
                budget=256, max_num_seqs=1, num_steps=1, prefix=False))
@given(w=workloads())
def test_engine_matches_dense_on_random_workloads(w):
    expected, margin = dense_greedy(w["prompts"], w["max_tokens"])
    if margin < 1e-3:  # a near tie: the "right" token depends on rounding, so nothing to check
        return
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=w["block_size"],
                                                                  num_blocks=w["num_blocks"],
                                                                  enable_prefix_caching=w["prefix"]),
                       scheduler_config=SchedulerConfig(max_num_seqs=w["max_num_seqs"],
                                                        max_num_batched_tokens=w["budget"], max_model_len=MAX_LEN),
                       seed=SEED, decode_steps_per_call=w["num_steps"])
    outs = engine.generate(w["prompts"], SamplingParams(temperature=0.0, max_tokens=w["max_tokens"]), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    st_ = engine.stats()
    mem = st_.scheduler.memory
    assert mem.num_used_blocks == 0 and mem.num_free_blocks + mem.num_cached_blocks == mem.num_blocks
