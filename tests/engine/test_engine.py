"""The paged engine against the plain dense model (no cache, recompute everything each step).

Invariant 4 of the design: greedy output is identical with prefix caching on or off, with or without
preemption, for any block size, batch composition, fused decode steps, backend and block placement.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from tests import dense
from tests.pool import EnginePool

CFG = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)
SEED = 7
MAX_TOKENS = 12
MAX_LEN = 96
# Lengths: 1 token, exactly one block of 16, many blocks, and two prompts sharing a 40-token prefix.
_rng = np.random.default_rng(1)
_shared = _rng.integers(0, CFG.vocab_size, 40).tolist()
PROMPTS = [
    _rng.integers(0, CFG.vocab_size, 1).tolist(),
    _rng.integers(0, CFG.vocab_size, 16).tolist(),
    _rng.integers(0, CFG.vocab_size, 53).tolist(),
    _shared + _rng.integers(0, CFG.vocab_size, 5).tolist(),
    _shared + _rng.integers(0, CFG.vocab_size, 9).tolist(),
    _rng.integers(0, CFG.vocab_size, 7).tolist(),
]


def dense_greedy(prompts, max_tokens):
    """Greedy continuation by full recompute; also returns the smallest top-1/top-2 logit margin seen."""
    return dense.dense_greedy(CFG, SEED, prompts, max_tokens, MAX_LEN)


@functools.cache
def reference():
    outputs, margin = dense_greedy(PROMPTS, MAX_TOKENS)
    # A near tie would make "identical tokens" depend on rounding; this model and seed have none.
    assert margin > 1e-3, margin
    return outputs


def make_engine(block_size=16, num_blocks=64, prefix=True, max_num_seqs=8, max_batched=64, **kw):
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                enable_prefix_caching=prefix),
                     scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                                      max_model_len=MAX_LEN), seed=SEED, **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# (CI time) Engines of a configuration shared by the module's tests (tests/pool.py: each left idle, its prefix cache
# emptied before the next): each compiles its step programs once.
POOL = EnginePool(make_engine)


@pytest.fixture(autouse=True, scope="module")
def _drop_pooled_engines():
    yield
    POOL.clear()


def assert_all_free(engine):
    mem = engine.stats().scheduler.memory
    assert mem.num_used_blocks == 0
    assert mem.num_free_blocks + mem.num_cached_blocks == mem.num_blocks


@pytest.mark.parametrize("block_size", [8, 16, pytest.param(32, marks=pytest.mark.slow)])  # (CI time)
def test_greedy_matches_dense_recompute(block_size):
    with POOL.engine(block_size=block_size) as engine:
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.output_token_ids for o in outs] == reference()
        assert all(o.finish_reason == "length" for o in outs)
        assert_all_free(engine)


@pytest.mark.parametrize("variant", ["no-prefix-cache", "preemption", "one-at-a-time", "fused-8-steps",
                                     "tiny-token-budget"])
def test_greedy_is_invariant(variant):
    config = {"no-prefix-cache": dict(prefix=False),
              # 11 blocks of 8 tokens: the longest request alone needs 9, so others must be preempted.
              "preemption": dict(block_size=8, num_blocks=11), "one-at-a-time": {},
              "fused-8-steps": dict(decode_steps_per_call=8),
              "tiny-token-budget": dict(max_batched=8, max_num_seqs=3)}[variant]  # chunked prefill, few per step
    with POOL.engine(**config) as engine:
        before = engine.stats()
        if variant == "one-at-a-time":
            outs = [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
        else:
            outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
        if variant == "preemption":
            assert engine.stats().scheduler.num_preemptions > before.scheduler.num_preemptions
        if variant == "fused-8-steps":
            assert engine.stats().fused_decode_calls > before.fused_decode_calls
        assert [o.output_token_ids for o in outs] == reference()
        assert_all_free(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_match_dense(dtype):
    """One mixed step straight from the scheduler (no prefix cache: the two prompts sharing a prefix would
    otherwise run a step apart): each sequence's logits equal the dense model's."""
    engine = LLMEngine(model_config=CFG.replace(dtype=dtype), cache_config=CacheConfig(block_size=8, num_blocks=64,
                                                                                       enable_prefix_caching=False),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                                        max_model_len=MAX_LEN), seed=SEED)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    plan = engine.scheduler.schedule()
    assert plan.num_seqs == len(PROMPTS)
    requests = [engine.scheduler.get_request(r) for r in plan.request_ids]
    logits = engine.runner.execute(engine.step_inputs(plan), return_logits=True).logits
    dense_logits = np.asarray(dense.dense_forward(CFG.replace(dtype=dtype), SEED)(
        jnp.asarray(_pad([r.prompt_token_ids for r in requests]))))
    for i, kv_len in enumerate(plan.kv_lens):
        want = dense_logits[i, kv_len - 1]
        if dtype == "float32":
            np.testing.assert_allclose(logits[i], want, rtol=1e-5, atol=1e-5)
        else:  # bf16 weights, activations and KV: ~1e-2 of the logits' scale
            np.testing.assert_allclose(logits[i], want, rtol=0, atol=2e-2 * np.abs(want).max())


def _pad(seqs):
    out = np.zeros((len(seqs), MAX_LEN), np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def test_prefix_cache_hits_skip_prefill_work():
    with POOL.engine(block_size=8) as engine:
        hit_rate = engine.stats().scheduler.prefix_cache_hit_rate
        first = engine.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0]
        computed_before = engine.stats().prefill_tokens_computed
        second = engine.generate([PROMPTS[4]], GREEDY, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 40  # the 5 full blocks of the shared 40-token prefix
        assert engine.stats().prefill_tokens_computed - computed_before == len(PROMPTS[4]) - 40
        assert engine.stats().scheduler.prefix_cache_hit_rate > hit_rate
        assert second.output_token_ids == reference()[4]


def test_abort_mid_generation_returns_every_block():
    with POOL.engine(block_size=8) as engine:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=40))
        for _ in range(3):
            engine.step()
        used = engine.stats().scheduler.memory.num_used_blocks
        assert engine.abort("2")
        assert not engine.abort("2")
        assert engine.stats().scheduler.memory.num_used_blocks < used
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.request_id != "2"
        assert_all_free(engine)


def test_stop_tokens_end_requests_in_both_decode_modes():
    target = reference()[2]
    stop = target[5]
    first = target.index(stop)
    for num_steps in (1, 8):
        with POOL.engine(decode_steps_per_call=num_steps) as engine:
            out = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0,
                                                               max_tokens=MAX_TOKENS, stop_token_ids=(stop,)),
                                  use_tqdm=False)[0]
            assert out.finish_reason == "stop"
            assert out.output_token_ids == target[: first + 1]
            assert_all_free(engine)


def test_seeded_sampling_is_reproducible_across_batches_and_fused_steps():
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    with POOL.engine() as engine:
        alone = engine.generate([PROMPTS[1]], params, use_tqdm=False)[0].output_token_ids
    with POOL.engine(decode_steps_per_call=8) as engine:
        batched = engine.generate(PROMPTS, [SamplingParams(max_tokens=10, temperature=1.0)] +
                                  [params] * (len(PROMPTS) - 1), use_tqdm=False)
    assert batched[1].output_token_ids == alone
    with POOL.engine() as engine:
        other_seed = engine.generate([PROMPTS[1]], SamplingParams(
            max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, seed=99), use_tqdm=False)[0].output_token_ids
    assert other_seed != alone


def test_bad_input_gives_clear_errors():
    engine = make_engine()
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("a", [1, CFG.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("a", [-1], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("b", [1] * (MAX_LEN + 1), GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(temperature=0.0, max_tokens=0)
    with pytest.raises(ValueError):
        engine.add_request("c", [], GREEDY)
    engine.add_request("d", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="d"):
        engine.add_request("d", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="backend"):
        make_engine(backend="cuda")
    with pytest.raises(ValueError, match="string prompts"):
        engine.generate(["hello"], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("num_steps", [1, 4])
def test_pallas_backend_matches_xla(num_steps):
    """The engine on the Pallas kernels (interpret mode on CPU) gives the same greedy tokens."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    engine = make_engine(block_size=16, backend="pallas", decode_steps_per_call=num_steps)
    assert engine.backend == "pallas"
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [reference()[i][:5] for i in (0, 2, 3)]
    assert_all_free(engine)


@pytest.mark.parametrize("scenario", ["prefix-cache", "preemption", "seeded-sampling"])
def test_pallas_backend_scenarios(scenario):
    """The Pallas kernels (interpreted on CPU) through the engine's harder paths, small shapes."""
    tokens = 4
    if scenario == "prefix-cache":
        engine = make_engine(block_size=8, backend="pallas")
        first = engine.generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)[0]
        second = engine.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)[0]
        assert second.num_cached_tokens == 40
        assert [first.output_token_ids, second.output_token_ids] == [reference()[3][:tokens], reference()[4][:tokens]]
    elif scenario == "preemption":
        # 53 + 7 prompt tokens fill all 8 blocks of 8; the second request's next block preempts it.
        engine = make_engine(block_size=8, num_blocks=8, backend="pallas", decode_steps_per_call=4)
        outs = engine.generate([PROMPTS[2], PROMPTS[5]], SamplingParams(temperature=0.0,
                                                                        max_tokens=tokens), use_tqdm=False)
        assert engine.stats().scheduler.num_preemptions > 0
        assert [o.output_token_ids for o in outs] == [reference()[i][:tokens] for i in (2, 5)]
    else:
        params = [SamplingParams(max_tokens=tokens, temperature=0.9, top_k=20, top_p=0.9, seed=s) for s in (1, 2)]
        prompts = [PROMPTS[1], PROMPTS[3]]
        with POOL.engine() as xla:
            want = [o.output_token_ids for o in xla.generate(prompts, params, use_tqdm=False)]
        engine = make_engine(backend="pallas", decode_steps_per_call=4)
        assert [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)] == want
    assert_all_free(engine)


def test_decode_batches_bucket_from_one_and_outputs_do_not_depend_on_the_bucket():
    """Batch sizes 1..6 decode in buckets 1, 2, 4, 8 (a lone sequence is not padded to 4 rows); each
    prompt's greedy output is the same whatever it is batched with."""
    engine = make_engine(prefix=False)
    for k in range(1, len(PROMPTS) + 1):
        outs = engine.generate(PROMPTS[:k], GREEDY, use_tqdm=False)
        assert [o.output_token_ids for o in outs] == reference()[:k]
    decode_rows = {key[2][0] for key in engine.runner.programs.executables if key[0] == "step" and key[3]}
    assert 1 in decode_rows and decode_rows <= {1, 2, 4, 8}
    compiled = engine.stats().compilations
    engine.generate(PROMPTS[:3], GREEDY, use_tqdm=False)  # batch 3 again: its bucket (4) is compiled
    assert engine.stats().compilations == compiled
