"""A bidirectional model (`ModelSpec.bidirectional`: an encoder such as EmbeddingGemma) on the paged engine, against
the dense model's hidden states (`Llama.hidden_dense`, whose mask lets every token see every token of its sequence,
within W - 1 positions either way in a layer of window W).

Property: random batches of pooling requests (prompts of 1 token, of exact block multiples, longer than every window;
tight step budgets and pools) give every vector to float32 rounding, each prompt computed whole in one step, no
prefix-cache hit, no block left held; the Pallas kernels (interpreted) the same. Refused: generation, a prompt
longer than one step holds, speculation and KV tiers (a bidirectional model keeps no prefix cache), a spec that is
bidirectional over latent layers or images.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedjax import (
    CacheConfig,
    ContextLengthExceeded,
    LLMEngine,
    ModelConfig,
    ModelSpec,
    PoolingParams,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
    UnsupportedFeature,
)
from pagedjax.config.kv_spec import LatentAttention
from pagedjax.model.llama import init_model

CFG = ModelConfig(vocab_size=97, hidden_size=32, num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, sliding_windows=(5, None, 3), bidirectional=True, max_position_embeddings=128)
SEED = 3
MAX_LEN = 64


@functools.cache
def _hidden_fn(bidirectional: bool = True):
    graphdef, state = nnx.split(init_model(CFG.replace(bidirectional=bidirectional), SEED))
    return jax.jit(lambda tokens: nnx.merge(graphdef, state).hidden_dense(tokens))


def dense_embedding(prompt: list[int], params: PoolingParams, bidirectional: bool = True) -> np.ndarray:
    """The reference vector: the dense hidden states of the prompt alone (no padding: attention goes both ways),
    pooled, cut, normalised."""
    h = np.asarray(_hidden_fn(bidirectional)(np.asarray([prompt], np.int32)), np.float64)[0]
    v = {"last": h[-1], "mean": h.mean(axis=0), "cls": h[0]}[params.pooling][: params.dimensions]
    return v / np.linalg.norm(v) if params.normalize else v


def engine(block_size=4, num_blocks=64, budget=64, max_num_seqs=4, backend="xla", **kw) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks, **kw),
                     scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                      max_model_len=MAX_LEN), seed=SEED, backend=backend)


def run(eng: LLMEngine, prompts, kinds) -> tuple[dict, list[set]]:
    """Queue the pooling requests, step to the end: (finished outputs by id, the ids each step computed)."""
    for i, (prompt, kind) in enumerate(zip(prompts, kinds, strict=True)):
        eng.add_request(f"r{i}", prompt, pooling=kind)
    outs, steps = {}, []
    while eng.has_unfinished_requests():
        step = eng.step()
        steps.append({o.request_id for o in step})
        outs.update({o.request_id: o for o in step if o.finished})
    return outs, steps


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([4, 8]), label="block_size")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="token_seed"))
    lengths = draw(st.lists(st.one_of(st.integers(1, 40), st.sampled_from([1, block_size, 3 * block_size])),
                            min_size=1, max_size=5), label="lengths")
    kinds = [draw(st.builds(PoolingParams, st.sampled_from(["last", "mean", "cls"]), st.booleans(),
                            st.one_of(st.none(), st.integers(1, CFG.hidden_size))), label=f"pooling_{i}")
             for i in range(len(lengths))]
    budget = draw(st.sampled_from([max(lengths), 64]), label="budget")
    return dict(prompts=[rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths], kinds=kinds,
                block_size=block_size, budget=budget, max_num_seqs=draw(st.integers(1, 4), label="max_num_seqs"),
                # a pool just above what the longest prompt holds in its three KV cache groups, or a roomy one
                num_blocks=draw(st.sampled_from([3 * -(-(max(lengths) + 1) // block_size), 64]), label="num_blocks"))


# (CI time: ~1 s an example) 4 drawn and 1 explicit: the same prompt twice (no prefix hit), one token, a block
# multiple, a prompt past every window, in a budget that takes one long prompt a step and a pool that holds one.
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(w=dict(prompts=[list(range(3, 27)), list(range(3, 27)), [5], list(range(40, 48))],
                kinds=[PoolingParams("mean", False), PoolingParams("last", True), PoolingParams("cls", False),
                       PoolingParams("mean", True, 7)], block_size=8, budget=24, max_num_seqs=4, num_blocks=12))
@given(w=workloads())
def test_bidirectional_pooling_matches_dense(w):
    eng = engine(w["block_size"], w["num_blocks"], w["budget"], w["max_num_seqs"])
    outs, steps = run(eng, w["prompts"], w["kinds"])
    for i, (prompt, kind) in enumerate(zip(w["prompts"], w["kinds"], strict=True)):
        out = outs[f"r{i}"]
        want = dense_embedding(prompt, kind)
        np.testing.assert_allclose(np.asarray(out.embedding, np.float64), want, rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want).max()))
        assert out.num_cached_tokens == 0
        assert sum(f"r{i}" in s for s in steps) == 1  # the whole prompt in one step
    mem = eng.stats().scheduler.memory
    assert mem.num_used_blocks == 0 and mem.num_cached_blocks == 0 and mem.num_free_blocks == mem.num_blocks


def test_the_pallas_kernels_attend_both_ways_too():
    """The kernels (interpreted here; what runs on a GPU) on a step of a long prompt and a one-token one: the
    bound ahead of each row (its prompt's end, capped by the window) as the XLA path and the dense model have it."""
    prompts = [np.random.default_rng(5).integers(0, CFG.vocab_size, 21).tolist(), [9]]
    kinds = [PoolingParams("mean", False), PoolingParams("last", False)]
    outs, steps = run(engine(backend="pallas"), prompts, kinds)
    assert len(steps) == 1
    for i, (prompt, kind) in enumerate(zip(prompts, kinds, strict=True)):
        want = dense_embedding(prompt, kind)
        np.testing.assert_allclose(outs[f"r{i}"].embedding, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    causal = dense_embedding(prompts[0], kinds[0], bidirectional=False)
    assert np.abs(causal - dense_embedding(prompts[0], kinds[0])).max() > 1e-3  # the test can tell the two apart


def test_what_a_bidirectional_model_cannot_do_is_refused():
    eng = engine(budget=16)
    with pytest.raises(UnsupportedFeature, match="attention goes both ways .an encoder.: it serves embed") as e:
        eng.add_request("g", [1, 2, 3], SamplingParams(max_tokens=2))
    assert e.value.code == "generation_not_supported"
    with pytest.raises(ContextLengthExceeded, match="prompt of 17 tokens runs in one step, which holds at most 16 "
                                                    "tokens") as e:
        eng.add_request("long", list(range(17)), pooling=PoolingParams())
    assert e.value.param == "prompt"
    small = engine(num_blocks=9)  # each of the 3 KV cache groups holds a prompt's blocks during its step
    with pytest.raises(ContextLengthExceeded, match="prompt of 13 tokens runs in one step, holding 12 blocks of 4 "
                                                    "tokens in its 3 KV cache groups at once, more than the pool of 9"):
        small.add_request("pool", list(range(13)), pooling=PoolingParams())
    small.add_request("fits", list(range(12)), pooling=PoolingParams())  # 3 blocks in each group
    assert not eng.has_unfinished_requests() and small.has_unfinished_requests()
    for options, error in ((dict(speculative_config=SpeculativeConfig(num_speculative_tokens=2)), "speculative_config"),
                           (dict(cache_config=CacheConfig(num_blocks=8, kv_host_memory_bytes=1 << 20)),
                            "kv_host_memory_bytes: a bidirectional model keeps no prefix cache")):
        with pytest.raises(ValueError, match=error):
            LLMEngine(model_config=CFG, seed=SEED, **options)
    with pytest.raises(ValueError, match="attention both ways is for text models of K/V layers"):
        ModelSpec(vocab_size=8, num_layers=1, num_q_heads=2, bidirectional=True,
                  kv_layers=(LatentAttention(kv_lora_rank=8, rope_dim=4),))


def test_a_ragged_step_without_attend_until_and_dense_layers_of_the_wrong_size_are_refused():
    """A bidirectional layer given a ragged step without `attend_until` (a caller of the model API that forgot it)
    raises instead of attending causally; an engine whose pooling's first Dense layer does not take the model's
    hidden size is refused at construction."""
    import jax.numpy as jnp

    from pagedjax import PoolingDefaults
    from pagedjax.config.pooling import DenseLayer
    from pagedjax.device.attention import AttentionMetadata
    from pagedjax.device.kv_cache import LayerKV
    from pagedjax.model.api import PagedAttention, PagedKVCache

    attn = PagedAttention(0, num_q_heads=2, num_kv_heads=1, head_dim=16, bidirectional=True)
    layer = LayerKV(jnp.zeros((1, 4, 4, 16)), jnp.zeros((1, 4, 4, 16)))
    meta = AttentionMetadata(np.arange(3, dtype=np.int32), np.zeros((1, 4), np.int32), np.array([3], np.int32),
                             np.array([0, 3], np.int32))
    q, kv = jnp.zeros((3, 2, 16)), jnp.zeros((3, 1, 16))
    with pytest.raises(ValueError, match="a bidirectional layer's ragged step needs AttentionMetadata.attend_until"):
        attn(q, kv, kv, PagedKVCache((layer,), meta, backend="xla"))
    dense = (DenseLayer(np.zeros((8, CFG.hidden_size + 1), np.float32), None),)
    with pytest.raises(ValueError, match=f"dense.0. takes {CFG.hidden_size + 1} inputs, the model's hidden size is "
                                         f"{CFG.hidden_size}"):
        LLMEngine(model_config=CFG, seed=SEED, pooling_defaults=PoolingDefaults(pooling="mean", dense=dense))
