"""Pooling requests (embeddings: `PoolingParams`, `LLMEngine.embed`) against the dense model's hidden states.

A pooling request's vector is pooled from the final hidden states (`Llama.hidden_dense`: no cache, whole
sequences): the last prompt position's, the mean over every prompt position, or the first's; cut to `dimensions`,
L2-normalised when asked. Property: random workloads of pooling and generation requests together (chunked prefill,
prefix hits, preemption, prompts of 1 token and of exact block multiples) give every vector to float32 rounding
and the dense greedy tokens, and leave no block held.
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
    InvalidRequest,
    InvalidType,
    LLMEngine,
    PoolingDefaults,
    PoolingParams,
    SamplingParams,
    SchedulerConfig,
    UnsupportedFeature,
)
from pagedjax.model.llama import init_model
from tests.engine.test_engine import CFG, MAX_LEN, SEED, dense_greedy

TYPES = ("last", "mean", "cls")


@functools.cache
def _hidden_fn():
    graphdef, state = nnx.split(init_model(CFG, SEED))
    return jax.jit(lambda tokens: nnx.merge(graphdef, state).hidden_dense(tokens))


def dense_embedding(prompt: list[int], params: PoolingParams) -> np.ndarray:
    """The reference vector, written from the definition: pool the dense hidden states, cut, normalise."""
    batch = np.zeros((1, MAX_LEN), np.int32)
    batch[0, : len(prompt)] = prompt  # right padding: causal, changes nothing before it
    h = np.asarray(_hidden_fn()(batch), np.float64)[0, : len(prompt)]
    v = {"last": h[-1], "mean": h.mean(axis=0), "cls": h[0]}[params.pooling]
    v = v[: params.dimensions]
    return v / np.linalg.norm(v) if params.normalize else v


def assert_close(got, want) -> None:
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def engine(block_size=8, num_blocks=64, budget=256, max_num_seqs=4, prefix=True, **kw) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                enable_prefix_caching=prefix),
                     scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                                      max_model_len=MAX_LEN), seed=SEED, **kw)


def run_all(eng: LLMEngine, requests: list) -> dict:
    """Queue (id, prompt, SamplingParams | PoolingParams) requests, step to the end: finished outputs by id."""
    for rid, prompt, params in requests:
        if isinstance(params, PoolingParams):
            eng.add_request(rid, prompt, pooling=params)
        else:
            eng.add_request(rid, prompt, params)
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def assert_nothing_held(eng: LLMEngine) -> None:
    mem = eng.stats().scheduler.memory
    assert mem.num_used_blocks == 0 and mem.num_free_blocks + mem.num_cached_blocks == mem.num_blocks


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([4, 8, 16]), label="block_size")
    shared = draw(st.integers(0, 3 * block_size), label="shared_prefix_len")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="token_seed"))
    prefix = rng.integers(0, CFG.vocab_size, shared).tolist()
    lengths = draw(st.lists(st.one_of(st.integers(1, 30), st.sampled_from([block_size, 2 * block_size])),
                            min_size=1, max_size=5), label="suffix_lengths")
    kinds = [draw(st.one_of(st.none(), st.builds(
        PoolingParams, st.sampled_from(TYPES), st.booleans(), st.one_of(st.none(), st.integers(1, CFG.hidden_size)))),
        label=f"pooling_{i}") for i in range(len(lengths))]
    max_tokens = draw(st.integers(1, 6), label="max_tokens")
    prompts = [prefix + rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]
    min_blocks = -(-(max(len(p) for p in prompts) + max_tokens) // block_size)
    return dict(prompts=prompts, kinds=kinds, max_tokens=max_tokens, block_size=block_size,
                num_blocks=draw(st.sampled_from([min_blocks, 2 * min_blocks, 64]), label="num_blocks"),
                budget=draw(st.sampled_from([8, 32, 256]), label="budget"),
                max_num_seqs=draw(st.integers(1, 4), label="max_num_seqs"), prefix=draw(st.booleans(), label="prefix"))


# (CI time: ~2 s an example) 3 drawn and 2 explicit: blocks of 8, a shared prefix of two blocks, a pool that fits one
# request (preemption), 8-token chunks, every pooling type beside a generation; prompts of 1 token and of exactly 16
# and 32 (block multiples) one at a time without the prefix cache.
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(w=dict(prompts=[[5] * 16 + [6, 7, 8], [5] * 16 + [7], [5] * 16 + [9, 1], [5] * 16 + [2] * 9],
                kinds=[PoolingParams("mean", True), None, PoolingParams("last", False, 7), PoolingParams("cls", True)],
                max_tokens=4, block_size=8, num_blocks=4, budget=8, max_num_seqs=3, prefix=True))
@example(w=dict(prompts=[[11], list(range(20, 36)), list(range(40, 72))],
                kinds=[PoolingParams("last", True), PoolingParams("mean", False), PoolingParams("cls", False, 64)],
                max_tokens=2, block_size=16, num_blocks=64, budget=256, max_num_seqs=1, prefix=False))
@given(w=workloads())
def test_pooling_and_generation_together_match_dense(w):
    want_tokens, margin = dense_greedy(w["prompts"], w["max_tokens"])
    eng = engine(w["block_size"], w["num_blocks"], w["budget"], w["max_num_seqs"], w["prefix"])
    greedy = SamplingParams(temperature=0.0, max_tokens=w["max_tokens"])
    outs = run_all(eng, [(f"r{i}", p, greedy if k is None else k)
                         for i, (p, k) in enumerate(zip(w["prompts"], w["kinds"], strict=True))])
    for i, (prompt, kind) in enumerate(zip(w["prompts"], w["kinds"], strict=True)):
        out = outs[f"r{i}"]
        if kind is None:
            assert out.embedding is None
            if margin > 1e-3:  # a near tie: the "right" token depends on rounding
                assert out.output_token_ids == want_tokens[i]
        else:
            assert out.finish_reason == "stop" and out.output_token_ids == [] and out.num_generated_tokens == 0
            assert_close(out.embedding, dense_embedding(prompt, kind))
            if kind.pooling != "last":
                assert out.num_cached_tokens == 0  # it takes no prefix hit: hidden states are not cached
    assert_nothing_held(eng)


def test_last_token_pooling_takes_prefix_hits_inside_a_block_and_at_its_boundary():
    """A "last" request reuses cached blocks (its last position always runs); "mean" and "cls" recompute."""
    eng = engine(block_size=8)
    base = list(range(1, 21))  # 2 full blocks and 4 tokens
    eng.embed([base])
    last, mean, cls = PoolingParams("last"), PoolingParams("mean"), PoolingParams("cls")
    for prompt in (base[:16] + [50], base[:19], base[:17]):  # past the boundary, inside the third block
        for params in (last, mean, cls):
            out, = eng.embed([prompt], params)
            assert out.num_cached_tokens == (16 if params is last else 0)
            assert_close(out.outputs.embedding, dense_embedding(prompt, params.with_defaults(PoolingDefaults())))
    assert_nothing_held(eng)


def test_a_preempted_mean_pooling_request_pools_each_position_once():
    """A pooling request preempted mid-prefill recomputes its positions; those it had pooled are not added again."""
    eng = engine(block_size=4, num_blocks=12, budget=8, max_num_seqs=2)
    rng = np.random.default_rng(3)
    prompt, params = rng.integers(0, CFG.vocab_size, 37).tolist(), PoolingParams("mean", False)
    # The generation's decode needs blocks the pooling request's chunks took: it preempts it, again and again.
    outs = run_all(eng, [("gen", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0.0, max_tokens=16)),
                         ("pool", prompt, params)])
    assert eng.stats().scheduler.num_preemptions >= 3
    assert_close(outs["pool"].embedding, dense_embedding(prompt, params))
    assert outs["gen"].output_token_ids == dense_greedy([[1, 2, 3, 4, 5, 6]], 16)[0][0]
    assert_nothing_held(eng)


def test_embed_returns_vllm_shaped_outputs_and_an_abort_holds_nothing():
    eng = engine()
    outs = eng.embed([[1, 2, 3], {"prompt_token_ids": [4, 5]}], [PoolingParams(dimensions=5), PoolingParams()])
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5]] and all(o.finished for o in outs)
    assert outs[0].outputs.hidden_size == 5 and outs[1].outputs.hidden_size == CFG.hidden_size
    assert abs(np.linalg.norm(outs[0].outputs.embedding) - 1) < 1e-6  # cut, then normalised
    small_chunks = engine(budget=8)
    small_chunks.add_request("x", list(range(1, 60)), pooling=PoolingParams("mean"))
    small_chunks.step()  # one chunk of 8 of its 59 tokens
    assert small_chunks.abort("x")
    assert_nothing_held(small_chunks)
    assert_nothing_held(eng)


def test_bad_pooling_requests_are_refused_naming_the_field():
    with pytest.raises(InvalidRequest, match="pooling must be one of") as e:
        PoolingParams("max")
    assert e.value.param == "pooling"
    with pytest.raises(InvalidType, match="normalize must be a bool"):
        PoolingParams(normalize=1)
    for bad, error in ((0, InvalidRequest), ("3", InvalidType), (True, InvalidType)):
        with pytest.raises(error) as e:
            PoolingParams(dimensions=bad)
        assert e.value.param == "dimensions"
    eng = engine()
    with pytest.raises(InvalidRequest, match="samples nothing") as e:
        eng.add_request("a", [1, 2], SamplingParams(max_tokens=1), pooling=PoolingParams())
    assert e.value.param == "sampling_params"
    with pytest.raises(InvalidRequest, match="64 embedding dimensions") as e:
        eng.add_request("a", [1, 2], pooling=PoolingParams(dimensions=65))
    assert e.value.param == "dimensions"
    with pytest.raises(InvalidType, match="pooling must be PoolingParams"):
        eng.add_request("a", [1, 2], pooling={"pooling": "last"})
    with pytest.raises(ValueError, match="2 pooling params for 3 prompts"):
        eng.embed([[1], [2], [3]], [PoolingParams()] * 2)
    with pytest.raises(TypeError, match="pooling_params must be PoolingParams"):
        eng.embed([[1]], {"pooling": "last"})
    assert not eng.has_unfinished_requests()
    refused = engine(pooling_defaults=PoolingDefaults(refused="a Dense module after pooling"))
    with pytest.raises(UnsupportedFeature, match="a Dense module after pooling") as e:
        refused.embed([[1, 2]])
    assert e.value.param == "pooling"
    assert refused.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finish_reason == "length"


def test_batch_invariant_embeddings_are_bitwise_the_same_alone_and_in_a_batch():
    eng = engine(batch_invariant=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (7, 19, 3)]
    together = eng.embed(prompts, PoolingParams("mean"))
    for prompt, out in zip(prompts, together, strict=True):
        assert eng.embed([prompt], PoolingParams("mean"))[0].outputs.embedding == out.outputs.embedding


def test_relevance_of_an_embedding_model_is_the_cosine_of_its_vectors():
    eng = engine()
    query, docs = [3, 1, 4, 1, 5], [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]]
    last = PoolingDefaults().pooling
    vec = {tuple(t): dense_embedding(t, PoolingParams(last, True)) for t in [query, *docs]}
    for text_1, text_2 in ((query, docs), ([query, docs[1]], docs[1:])):
        outs = eng.relevance(text_1, text_2)
        queries = [text_1] * len(text_2) if isinstance(text_1[0], int) else text_1
        for q, d, out in zip(queries, text_2, outs, strict=True):
            assert abs(out.outputs.score - float(vec[tuple(q)] @ vec[tuple(d)])) < 1e-5
            assert out.prompt_token_ids == q + d
    assert abs(eng.relevance(query, docs[:1])[0].outputs.score - 1) < 1e-6
    with pytest.raises(InvalidRequest, match="2 queries for 3 documents") as e:
        eng.relevance(docs[:2], docs)
    assert e.value.param == "text_1"
    with pytest.raises(InvalidRequest, match="no pair to score"):
        eng.relevance(query, [])
    assert_nothing_held(eng)


def test_a_pooling_request_whose_step_fails_raises_naming_it_and_holds_nothing(monkeypatch):
    eng = engine()
    run = eng.runner.run

    def broken(plan, inputs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "run", broken)
    with pytest.raises(RuntimeError, match=r"request 'embed-\d+-0' ended with 'error': RuntimeError: device lost"):
        eng.embed([[1, 2, 3]])
    assert_nothing_held(eng)
    monkeypatch.setattr(eng.runner, "run", run)
    assert_close(eng.embed([[1, 2, 3]])[0].outputs.embedding,
                 dense_embedding([1, 2, 3], PoolingParams().with_defaults(PoolingDefaults())))
