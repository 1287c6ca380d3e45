"""Batch-invariant mode (`pagedjax.runner.invariant`): one request's tokens and log-probabilities are bitwise the
same alone and inside any mix of other requests (chunk boundaries, prefix-cache hits, preemption, forks), and
equal to the engine's scoring of the same tokens."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config import SpeculativeConfig
from pagedjax.model.llama import init_model
from pagedjax.runner.shapes import padding_step

CFG = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)
PROMPT = np.random.default_rng(0).integers(0, CFG.vocab_size, 37).tolist()  # prefilled in 2+ chunks of <= 32
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=0)


def make_engine(**kw) -> LLMEngine:
    # 24 blocks of 8 hold 2 requests of 96 tokens: a busy mix preempts.
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=8, num_blocks=24),
                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96),
                     seed=1, batch_invariant=True, **kw)


def result(out, index: int = 0) -> tuple[list[int], list[float]]:
    sample = out.outputs[index]
    return sample.token_ids, [lp.logprob for lp in sample.logprobs]


@functools.cache
def engine_and_alone():
    engine = make_engine()
    return engine, result(engine.generate([PROMPT], SAMPLED, use_tqdm=False)[0])


other_request = st.tuples(st.integers(1, 60), st.integers(1, 10), st.integers(0, 2**16), st.integers(1, 2))


@settings(max_examples=8)
@given(others=st.lists(other_request, max_size=6), position=st.integers(0, 6), shared_prefix=st.integers(0, 36),
       forked=st.booleans())
def test_a_request_is_bitwise_the_same_in_any_mix(others, position, shared_prefix, forked):
    engine, alone = engine_and_alone()
    rng = np.random.default_rng(len(others) * 100 + shared_prefix)
    if shared_prefix >= 8:  # a finished request leaves the prefix's full blocks cached: a prefix-cache hit
        engine.generate([PROMPT[:shared_prefix] + [1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n, *_ in others]
    params = [SamplingParams(max_tokens=m, temperature=1.0, seed=s, n=n) for _, m, s, n in others]
    at = min(position, len(prompts))
    mine = dataclasses.replace(SAMPLED, n=2) if forked else SAMPLED  # sample 0 has seed 5 too
    outs = engine.generate(prompts[:at] + [PROMPT] + prompts[at:], params[:at] + [mine] + params[at:], use_tqdm=False)
    assert result(outs[at]) == alone


def test_a_preempted_request_is_bitwise_the_same_and_one_program_ran():
    engine, alone = engine_and_alone()
    preemptions = engine.stats().scheduler.num_preemptions
    prompts = [np.random.default_rng(i).integers(0, CFG.vocab_size, 60).tolist() for i in range(6)]
    outs = engine.generate([PROMPT] + prompts, [SAMPLED] + [SamplingParams(temperature=0.0,
                                                                           max_tokens=30)] * 6, use_tqdm=False)
    assert engine.stats().scheduler.num_preemptions > preemptions
    assert result(outs[0]) == alone
    assert engine.stats().compilations == 1


def test_scoring_gives_the_rollouts_log_probabilities_bitwise():
    engine, (tokens, logprobs) = engine_and_alone()
    assert engine.score([PROMPT], [tokens])[0].tolist() == logprobs
    model = init_model(CFG, 1)  # the dense model: another program, equal to float32 rounding
    ref = np.asarray(jax.jit(lambda t: jax.nn.log_softmax(model.forward_dense(t), axis=-1))(
        np.asarray([PROMPT + tokens], np.int32))[0])
    np.testing.assert_allclose(logprobs, ref[np.arange(36, 36 + len(tokens)), tokens], rtol=0, atol=2e-5)


def test_batch_invariant_refuses_fused_decode_and_a_step_asking_for_logits():
    with pytest.raises(ValueError, match="batch_invariant=True needs decode_steps_per_call=1, got 4"):
        make_engine(decode_steps_per_call=4)
    with pytest.raises(ValueError, match="batch_invariant=True cannot be combined with speculative_config"):
        make_engine(speculative_config=SpeculativeConfig(method="ngram"))
    with pytest.raises(TypeError, match="batch_invariant must be true or false"):
        LLMEngine(model_config=CFG, batch_invariant=1)
    engine, _ = engine_and_alone()
    with pytest.raises(ValueError, match="runs every step on one program, .* which cannot run this step"):
        engine.runner.execute(padding_step(engine.runner.fixed_shape, CFG.vocab_size), return_logits=True)


def test_batch_invariant_on_the_pallas_backend_warns_that_it_was_checked_on_xla_only(caplog):
    make_engine(backend="xla")
    assert "measured on the XLA path only" not in caplog.text
    make_engine(backend="pallas")
    assert "measured on the XLA path only" in caplog.text


def test_warmup_compiles_the_one_program_every_step_runs():
    engine = make_engine()
    engine.warmup()
    assert result(engine.generate([PROMPT], SAMPLED, use_tqdm=False)[0]) == engine_and_alone()[1]
    assert engine.stats().compilations == 1
