"""What the hybrid (recurrent-state) families' parity tests share: tiny shapes, prompts that hit a cached prefix at
a block boundary and inside a block, the pooled engine they are served by, and the checks of those hits and of the
dense forward against transformers (tests/model/test_hf_qwen3_next.py, test_hf_qwen3_5.py, test_hf_nemotron_h.py).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from tests.model.test_hf import MIN_MARGIN, TOL, hf_greedy, hf_logits
from tests.pool import EnginePool
from tests.prefix_waves import later_wave_hits, run_waves, shared_prefix_waves

VOCAB, BS, MAX_LEN, MAX_NEW = 96, 4, 64, 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def hybrid_prompts(lengths: tuple[int | None, ...]):
    """(prompts, shared, at_boundary, inside): SHARED (14 tokens: 3 blocks and half of a fourth), then a prompt per
    entry of `lengths` (random tokens, or None: SHARED + one token); AT_BOUNDARY shares SHARED's first 3 blocks
    exactly, INSIDE all of SHARED (its hit: the snapshot at SHARED's last full block, 12)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(3, VOCAB, 14).tolist()
    prompts = [shared + [3] if n is None else rng.integers(3, VOCAB, n).tolist() for n in lengths]
    return prompts, shared, shared[:12] + [40, 41, 42], shared + [50, 51]


def hybrid_pool(num_blocks: int, max_num_seqs: int) -> EnginePool:
    """Engines of a folder: KV blocks of 4 (`num_blocks`: too few for every prompt at once, so preemption), a state
    snapshot every 3 of them (12 tokens: hits end at multiples of 12; 8-token prefill chunks cross those boundaries
    anywhere), fused decodes of 4 steps, the XLA backend."""
    def make_engine(folder: str) -> LLMEngine:
        return LLMEngine.from_pretrained(
            folder, cache_config=CacheConfig(block_size=BS, num_blocks=num_blocks, state_block_size=3 * BS),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8,
                                             max_model_len=MAX_LEN),
            decode_steps_per_call=4, backend="xla")

    return EnginePool(make_engine)


def assert_hits_equal_transformers(engine, shared_prompt, at_boundary, inside, greedy: dict) -> None:
    """`shared_prompt` cached by a request of its own, then hits in both groups: 3 KV blocks (one state block)
    exactly, and a prefix whose end is inside the fourth KV block (its whole blocks: 12, the state snapshot at
    position 11, never the live state); each request's tokens transformers' (`greedy[1]`, `["boundary"]`,
    `["inside"]`)."""
    assert engine.generate([shared_prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == greedy[1]
    for key, prompt in (("boundary", at_boundary), ("inside", inside)):
        out = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert (out.num_cached_tokens, out.outputs[0].token_ids) == (12, greedy[key]), key


def assert_dense_logits_match(model, hf_model, prompts) -> None:
    """`model.forward_dense` over the prompts padded into one batch: each prompt's logits transformers'."""
    batch = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        batch[i, :len(p)] = p
    got = np.asarray(nnx.jit(lambda m, b: m.forward_dense(b))(model, jax.numpy.asarray(batch)))
    ref = hf_logits(hf_model, prompts)
    for i, p in enumerate(prompts):
        np.testing.assert_allclose(got[i, :len(p)], ref[i], atol=TOL, rtol=TOL, err_msg=f"{len(p)} tokens")


# Random shared-prefix workloads on a family's pooled engine: prefixes inside the first state block (12 tokens), at
# it, inside the second and at it, suffixes that end inside or past the next.
WAVES = shared_prefix_waves(vocab=(3, VOCAB), prefix_lens=[0, 5, 3 * BS, 3 * BS + 2, 6 * BS, 6 * BS + 3],
                            suffix_lens=[0, 1, BS, 9], max_new=MAX_NEW, engines=[{}])


def assert_waves_equal_transformers(engine, hf_model, w: dict) -> None:
    """Workload `w` (`WAVES`) on `engine`: every request's greedy tokens transformers' for its prompt alone (cold),
    whatever hit the prefix cache, chunking, preemption and fused decodes did; a later wave sharing a whole state
    block with a finished one hits it. A workload with a near tie in transformers' greedy is skipped."""
    cold = [hf_greedy(hf_model, p, w["max_tokens"]) for p in w["prompts"]]
    if min(margin for _, margin in cold) <= MIN_MARGIN:
        return
    done = run_waves(engine, w)
    assert [o.outputs[0].token_ids for o in done] == [tokens for tokens, _ in cold], w
    if later_wave_hits(w, 3 * BS):
        assert sum(o.num_cached_tokens for o, v in zip(done, w["wave"], strict=True) if v > 0) > 0, w
