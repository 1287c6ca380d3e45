"""KV cache groups (`pagedjax.config.kv_layout`): a model mixing sliding-window and global layers (gpt-oss, Gemma
2 / 3) keeps one block table per group, window groups release what their windows left while global groups keep
every block, and the groups share the pool's memory (one block serves a layer of each group). Greedy tokens equal
the dense model's through prefix hits (at a block boundary and inside a block), chunked prefill, preemption, fused
decode and several samples; the layouts of the leading models are what the module docstring promises."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import (
    CacheConfig,
    FullAttention,
    LLMEngine,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedjax.config.kv_layout import kv_cache_layout
from pagedjax.core.kv_cache_manager import cdiv
from pagedjax.serve.metrics import DurationHistogram, ServerMetrics
from tests import dense
from tests.pool import EnginePool
from tests.serve.server_utils import metric

BS, WINDOW, MAX_LEN, SEED = 4, 5, 64, 5
# gpt-oss's pattern at toy size: window and global layers alternating, two groups of two layers.
CFG = ModelConfig(vocab_size=97, hidden_size=64, num_layers=4, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, sliding_windows=(WINDOW, None, WINDOW, None),
                  max_position_embeddings=MAX_LEN)
rng = np.random.default_rng(11)
SHARED = rng.integers(0, CFG.vocab_size, 10).tolist()  # two full blocks and half of a third, past the window
PROMPTS = [rng.integers(0, CFG.vocab_size, 13).tolist(), SHARED + [3], SHARED + [5, 6, 7, 8, 9, 10],
           rng.integers(0, CFG.vocab_size, 2).tolist()]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def make_engine(*, num_blocks: int = 96, budget: int = 8, decode_steps: int = 4, ngram: bool = False) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BS, num_blocks=num_blocks),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                                      max_model_len=MAX_LEN), seed=SEED,
                     decode_steps_per_call=decode_steps,
                     speculative_config=SpeculativeConfig(num_speculative_tokens=3) if ngram else None)


POOL = EnginePool(make_engine)


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


def dense_greedy(prompts, max_tokens: int = GREEDY.max_tokens) -> list[list[int]]:
    want, margin = dense.dense_greedy(CFG, SEED, prompts, max_tokens, MAX_LEN)
    assert margin > 1e-3, margin  # no near tie: identical tokens do not hang on rounding
    return want


def test_the_leading_models_layouts():
    """Groups of equal size share page arrays (slot i serves the i-th layer of every group); a model of one kind is
    one group whose slot i is layer i."""
    gpt_oss = kv_cache_layout(tuple(FullAttention(8, 64, 128 if i % 2 == 0 else None) for i in range(24)))
    assert gpt_oss.describe() == "2 groups: 12 window-128 layers, 12 full layers"
    assert len(gpt_oss.slot_specs) == 12 and gpt_oss.layer_slot == tuple(i // 2 for i in range(24))
    gemma3_27b = kv_cache_layout(tuple(FullAttention(16, 128, 1024 if (i + 1) % 6 else None) for i in range(62)))
    assert gemma3_27b.describe() == "7 groups: 52 window-1024 layers (6 groups), 10 full layers"
    # 7 x 10 slots for 62 layers: the global layers' group unpadded (it holds nearly all of a long context), the
    # 8 unused slots in window groups
    full_groups = [len(g.layers) for g in gemma3_27b.groups if g.spec.sliding_window is None]
    assert len(gemma3_27b.slot_specs) == 10 and full_groups == [10]
    plain = kv_cache_layout((FullAttention(2, 16),) * 3)
    assert plain.num_groups == 1 and plain.layer_slot == (0, 1, 2) and len(plain.slot_specs) == 3
    # A block is the bytes of one layer of each group's slot: half the KV of all four layers here.
    config = CacheConfig(block_size=BS)
    assert config.block_bytes(CFG.spec) * 2 == config.kv_bytes_per_token(CFG.spec) * BS
    assert CacheConfig(block_size=BS, kv_memory_bytes=1 << 20).resolve_num_blocks(CFG.spec) == \
        2 * CacheConfig(block_size=BS, kv_memory_bytes=1 << 20).resolve_num_blocks(CFG.replace(sliding_windows=None))


@pytest.mark.slow  # (CI time: 10 s) tests/model/test_hf_gpt_oss.py runs these paths on gpt-oss's two groups
def test_greedy_equals_dense_through_hits_chunks_fused_decode_and_samples():
    want = dense_greedy(PROMPTS)
    assert want != dense.dense_greedy(CFG.replace(sliding_windows=None), SEED, PROMPTS, GREEDY.max_tokens,
                                      MAX_LEN)[0]  # the windows matter
    with POOL.engine() as engine:
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert engine.scheduler.kv_cache_manager.num_groups == 2
        # The same prompts again: hits at a block boundary (two full blocks of SHARED + [3]: 8 tokens) and on
        # every full block of the others, the window group serving the blocks its window reads at the hit's end.
        again = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want
        assert [o.num_cached_tokens for o in again] == [12, 8, 12, 0]
        # A prompt sharing SHARED's 10 tokens, its hit ending inside SHARED's third block (10 = 2 blocks + 2).
        inside = SHARED[:10] + [41, 42, 43]
        out = engine.generate([inside], GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 8 and out.outputs[0].token_ids == dense_greedy([inside])[0]
        # Several samples of one prompt share its blocks in both groups (greedy: every sample is the greedy one).
        samples = engine.generate([PROMPTS[2]], SamplingParams(n=3, temperature=0.0, max_tokens=GREEDY.max_tokens,
                                                               ignore_eos=True), use_tqdm=False)[0]
        assert [c.token_ids for c in samples.outputs] == [want[2]] * 3
        assert engine.stats().scheduler.memory.num_used_blocks == 0


def test_window_groups_release_while_global_groups_keep_every_block():
    """One long request: the global layers' group ends holding every block of its context, the window group at
    most the blocks of its window and its newest block (+ the blocks a fused call lends while it runs); the stats
    and the server's metrics show each group's blocks and bytes."""
    prompt = PROMPTS[0]
    with POOL.engine() as engine:
        engine.add_request("long", prompt, GREEDY)
        peak = [0, 0]
        while engine.has_unfinished_requests():
            engine.step()
            engine.scheduler.check_invariants()
            stats = engine.stats()
            held = stats.scheduler.memory.group_blocks
            assert stats.kv_groups == ("window-5", "full") and stats.kv_group_bytes == tuple(
                n * stats.kv_bytes_per_block for n in held)
            text = ServerMetrics(engine.stats, lambda: 0, DurationHistogram()).render().decode()
            assert metric(text, "pagedjax_kv_group_blocks_used", 'group="1",kind="full"') == held[1]
            assert metric(text, "pagedjax_kv_group_bytes_used", 'group="0",kind="window-5"') == \
                stats.kv_group_bytes[0]
            peak = [max(p, h) for p, h in zip(peak, held, strict=True)]
            if engine.has_unfinished_requests():
                r = engine.scheduler.running[0]
                window_blocks, global_blocks = engine.scheduler.kv_cache_manager.get_block_ids("long")
                assert global_blocks.count(-1) == 0 and len(global_blocks) == cdiv(r.num_computed_tokens, BS)
                assert len(window_blocks) - window_blocks.count(-1) <= cdiv(WINDOW - 1, BS) + 1
        total = len(prompt) + GREEDY.max_tokens - 1
        assert peak[1] == cdiv(total, BS) and peak[0] <= cdiv(WINDOW - 1, BS) + 1 + cdiv(4, BS)
        # A block holds one layer of each group: 2 layers' K and V of 2 heads of 16 floats per position.
        layer_bytes = 2 * 2 * 16 * 4  # K and V, 2 heads of 16 floats
        assert stats.kv_bytes_per_block == BS * 2 * layer_bytes and stats.kv_bytes_per_token == 4 * layer_bytes


# (CI time) preemption over both groups runs in tests/model/test_hf_gpt_oss.py's greedy test (window and full groups),
# the verifying step's blocks in tests/engine/test_speculative.py (one group)
@pytest.mark.slow
def test_a_small_pool_preempts_and_recomputes_exactly_with_speculation():
    """A pool that cannot hold all four requests at once in both groups: the newest are preempted and recomputed,
    and n-gram proposals verified (their positions' blocks taken and given back in both groups), with the dense
    model's tokens; nothing leaks."""
    prompts = PROMPTS + [[9, 10, 11] * 4]  # repeated n-grams: proposals from the first step
    want = dense_greedy(prompts)
    with POOL.engine(num_blocks=24, ngram=True) as engine:
        outs = engine.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = engine.stats()
        assert stats.scheduler.num_preemptions > 0 and stats.spec_proposed_tokens > 0
        assert stats.scheduler.memory.num_used_blocks == 0
