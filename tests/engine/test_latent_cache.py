"""The per-layer KV cache spec: a model whose layers hold different things per token slot (MLA latent entries,
DeepSeek sparse attention's latents and indexer keys, GQA K/V heads: `tests/engine/latent_toy.py`) served by the
unchanged block tables, prefix cache, preemption, forks and fused decode: greedy tokens equal its dense
(non-absorbed) forward; the pool is sized from the specs and holds exactly the bytes they declare; 8-bit pages
stay close to float ones; a model whose layers disagree with its declared specs is refused at construction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.model.api import FullAttention, IndexedSparse, LatentAttention, check_model
from tests.dense import greedy_by_recompute
from tests.engine.latent_toy import (
    GQA_HEAD_DIM,
    GQA_KV_HEADS,
    INDEX_DIM,
    INDEX_TOPK,
    RANK,
    ROPE,
    VOCAB,
    LatentToy,
)
from tests.pool import EnginePool

MAX_LEN = 40
rng = np.random.default_rng(3)
SHARED = rng.integers(0, VOCAB, 9).tolist()
# Lengths 1, a block's (4) and more; two prompts sharing two full blocks (prefix cache hits).
PROMPTS = [[7], rng.integers(0, VOCAB, 4).tolist(), SHARED + [1, 2], SHARED + [3]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine(model=None, *, num_blocks: int = 64, kv_dtype: str = "auto", token_budget: int = 32, **kwargs):
    return LLMEngine(model=model or LatentToy(), cache_config=CacheConfig(block_size=4, num_blocks=num_blocks,
                                                                           kv_dtype=kv_dtype),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=token_budget,
                                                      max_model_len=MAX_LEN), **kwargs)


# (CI time) The default engine (the toy's float pages, 64 blocks) serves the module's tests that need it, left idle
# (tests/pool.py).
POOL = EnginePool(engine)


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


def _dense_greedy(model: LatentToy, prompts, max_tokens: int) -> list[list[int]]:
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))
    want, margin = greedy_by_recompute(forward, prompts, max_tokens, MAX_LEN)
    assert margin > 1e-4, "a near tie would make the comparison depend on rounding: pick another seed"
    # The sparse layers' selections must not hang on rounding either: at every query of every final sequence (a
    # query's scores never depend on later tokens, so right padding changes none of them), the k-th and (k+1)-th
    # best indexer scores differ, or are both exactly 0 (relu: a tie both sides break to the lower position) with
    # no score near 0 that rounding could move.
    seqs = [p + w for p, w in zip(prompts, want, strict=True)]
    batch = np.zeros((len(seqs), MAX_LEN), np.int32)
    for i, seq in enumerate(seqs):
        batch[i, :len(seq)] = seq
    for scores in jax.jit(model.dense_index_scores)(jnp.asarray(batch)):
        scores = np.asarray(scores)
        for seq, rows in zip(seqs, scores, strict=True):
            n = len(seq)
            for row in rows[:n, :n]:
                best = -np.sort(-row)[:INDEX_TOPK + 1]
                if len(best) <= INDEX_TOPK or not np.isfinite(best[INDEX_TOPK]):
                    continue  # the query sees at most k positions: it takes them all
                kth, next_ = best[INDEX_TOPK - 1], best[INDEX_TOPK]
                zero_tie = kth == next_ == 0 and not np.any((np.abs(row) > 0) & (np.abs(row) < 1e-4))
                assert kth - next_ > 1e-4 or zero_tie, f"a near tie in the indexer's top-k ({kth}, {next_})"
    return want


@pytest.fixture(scope="module")
def dense_greedy():
    return _dense_greedy(LatentToy(), PROMPTS, GREEDY.max_tokens)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_spec_sizes_the_pool_and_the_cache_holds_what_it_declares():
    model = LatentToy()
    assert model.spec.kv_layers == (LatentAttention(RANK, ROPE), FullAttention(GQA_KV_HEADS, GQA_HEAD_DIM),
                                    IndexedSparse(RANK, ROPE, INDEX_DIM, INDEX_TOPK))
    assert model.spec.num_kv_heads is None and model.spec.head_dim is None and model.spec.has_latent_layers
    config = CacheConfig(block_size=4, kv_memory_bytes=100_000)
    # f32: a latent layer, a GQA layer, a sparse layer (its latent and its indexer key)
    per_token = (RANK + ROPE) * 4 + 2 * GQA_KV_HEADS * GQA_HEAD_DIM * 4 + (RANK + ROPE + INDEX_DIM) * 4
    assert config.kv_bytes_per_token(model.spec) == per_token
    e = LLMEngine(model=model, cache_config=config)
    assert e.num_blocks == 100_000 // (4 * per_token)
    assert e.runner.kv_cache.nbytes == config.pool_bytes(model.spec) == e.num_blocks * 4 * per_token
    assert e.runner.kv_cache.layers[0].pages.shape == (e.num_blocks, 4, RANK + ROPE)
    assert e.runner.kv_cache.layers[2].index_keys.shape == (e.num_blocks, 4, INDEX_DIM)


# (CI time) MLA's latent pages through hits, chunks, preemption and fused decode run in the 8-device worker's
# latent_layers_tensor_parallel (V3.2: MLA with the indexer) and tests/model/test_deepseek*.py's engine tests (forks
# of n = 2 too)
@pytest.mark.slow
def test_greedy_equals_the_dense_forward_with_prefix_hits_chunks_preemption_forks_and_fused_decode(dense_greedy):
    with POOL.engine() as e:
        hits_before = e.stats().scheduler.prefix_cache_hit_rate
        assert _tokens(e.generate(PROMPTS, GREEDY, use_tqdm=False)) == dense_greedy
        assert e.stats().scheduler.prefix_cache_hit_rate > hits_before
        # A prefix hit restores every layer's part of the block: the shared prompt again, alone.
        again = e.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0]
        assert again.num_cached_tokens > 0 and _tokens([again]) == [dense_greedy[3]]
        # n > 1 forks share the prompt's blocks (copy-on-write of the last partial one): each greedy sample is the
        # dense continuation.
        three = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3)
        forks = e.generate([PROMPTS[2]], three, use_tqdm=False)[0]
        assert [c.token_ids for c in forks.outputs] == [dense_greedy[2]] * 3
    # Four requests of up to 19 tokens in 8 blocks of 4: some are preempted and recomputed; prompts of 10 and
    # 11 tokens run in chunks of at most 8; decode runs 4 fused steps a call.
    small = engine(num_blocks=8, token_budget=8, decode_steps_per_call=4)
    assert _tokens(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == dense_greedy
    assert small.stats().scheduler.num_preemptions > 0 and small.stats().fused_decode_calls > 0


def test_pallas_kernels_serve_the_latent_layers(dense_greedy):
    """The engine's Pallas path (the MLA kernels, interpreted on the CPU) gives the same tokens."""
    e = engine(backend="pallas", decode_steps_per_call=1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert _tokens(e.generate(PROMPTS[:2], params, use_tqdm=False)) == [t[:3] for t in dense_greedy[:2]]


def test_int8_latent_pages_stay_close_to_float_ones():
    """The first sampled token's top-5 log-probabilities over int8 pages (latent and GQA) within 0.05 of those
    over float32 pages."""
    kv_dtype = "int8"
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    with POOL.engine() as e:
        f32 = e.generate(PROMPTS, params, use_tqdm=False)
    narrow = engine(kv_dtype=kv_dtype)
    got_outputs = narrow.generate(PROMPTS, params, use_tqdm=False)
    assert narrow.runner.kv_cache.layers[0].pages.dtype == jnp.dtype(CacheConfig(kv_dtype=kv_dtype).kv_array_dtype(
        narrow.model_spec))
    for a, b in zip(f32, got_outputs, strict=True):
        want, got = dict(a.outputs[0].logprobs[0].top), dict(b.outputs[0].logprobs[0].top)
        best = max(want, key=want.get)
        assert best in got and abs(want[best] - got[best]) < 0.05, (want, got)


def test_a_layer_attending_other_than_its_declared_spec_is_refused():
    swapped = LatentToy()
    swapped.spec = swapped.spec.replace(kv_layers=(FullAttention(GQA_KV_HEADS, GQA_HEAD_DIM),
                                                   *swapped.spec.kv_layers[1:]))
    with pytest.raises(ValueError, match=r"declares layer 0 as FullAttention \(kv_layers\), not LatentAttention"):
        check_model(swapped)
    wider = LatentToy()
    wider.spec = wider.spec.replace(kv_layers=(LatentAttention(RANK + 1, ROPE), *wider.spec.kv_layers[1:]))
    with pytest.raises(ValueError, match=f"kv_lora_rank {RANK}, rope_dim {ROPE}, but the model's ModelSpec "
                                         f"declares {RANK + 1}, {ROPE}"):
        check_model(wider)
    sparse = LatentToy()
    sparse.spec = sparse.spec.replace(kv_layers=(*sparse.spec.kv_layers[:2],
                                                 IndexedSparse(RANK, ROPE, INDEX_DIM, INDEX_TOPK + 1)))
    with pytest.raises(ValueError, match=f"index_head_dim {INDEX_DIM}, index_topk {INDEX_TOPK}, but the model's "
                                         f"ModelSpec declares {INDEX_DIM}, {INDEX_TOPK + 1}"):
        check_model(sparse)


def test_sparse_layers_select_and_equal_mla_when_the_selection_holds_the_context():
    """With k at least the context the sparse layer is the MLA layer (the same weights, the same logits as the
    model whose third layer is plain MLA); with INDEX_TOPK below the context the selection changes them."""
    tokens = jnp.asarray([PROMPTS[2] + PROMPTS[3][:7]])  # 18 positions

    def forward(model):  # one program each (op by op, every operation compiled on its own: 136 of them)
        graphdef, state = nnx.split(model)
        return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))(state, tokens))

    plain = forward(LatentToy(("mla", "gqa", "mla")))
    np.testing.assert_allclose(forward(LatentToy(index_topk=MAX_LEN)), plain, rtol=1e-5, atol=1e-5)
    sparse = forward(LatentToy())
    np.testing.assert_allclose(sparse[:, :INDEX_TOPK], plain[:, :INDEX_TOPK], rtol=1e-5, atol=1e-5)  # sees <= k
    assert np.abs(sparse[:, INDEX_TOPK:] - plain[:, INDEX_TOPK:]).max() > 1e-2
