"""`RolloutEngine` (`pagedjax.integrations.rollout`), an engine as an RL framework's rollout worker, and the
padded arrays of `pagedjax.integrations.policy`: grouping, seeds, stop tokens, truncation, padding, scoring,
in-place weights, and every refusal."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax import SamplingParams
from pagedjax.integrations.policy import completion_batch, exact_logprobs, scatter_logprobs
from pagedjax.integrations.rollout import RolloutEngine
from pagedjax.model.llama import init_model
from tests.integrations.test_policy import CFG, STOP, rollout_engine

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]


def sample(rollout: RolloutEngine, prompts, **kw):
    kw = dict(max_tokens=10, max_prompt_length=8, temperature=1.0, seed=7, return_logprobs=True) | kw
    return rollout.generate(prompts, **kw)


def test_a_group_is_one_request_whose_samples_equal_single_requests_seeded_seed_plus_index():
    rollout = rollout_engine(32)
    grouped = sample(rollout, [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2)
    for j, p in enumerate([PROMPTS[0]] * 3 + [PROMPTS[1]] * 2):
        alone = rollout.engine.generate([p], SamplingParams(max_tokens=10, temperature=1.0, seed=7 + j, logprobs=0,
                                                            stop_token_ids=(STOP,)), use_tqdm=False)[0].outputs[0]
        ids = alone.token_ids[:-1] if alone.finish_reason == "stop" else alone.token_ids
        assert grouped.tokens[j].tolist() == ids
        assert grouped.logprobs[j].tolist() == [lp.logprob for lp in alone.logprobs[:len(ids)]]
        assert grouped.tokens[j].dtype == np.int32 and grouped.logprobs[j].dtype == np.float32


def test_the_stop_token_is_stripped_and_a_length_stop_keeps_every_token():
    rollout = rollout_engine(32)
    full = sample(rollout, PROMPTS * 4, stop_ids=[])  # nothing stops: max_tokens each
    assert all(len(t) == 10 for t in full.tokens)
    stop = int(full.tokens[0][4])  # a token the first sample draws at its 5th place
    out = sample(rollout, PROMPTS * 4, stop_ids=[stop])
    assert out.tokens[0].tolist() == full.tokens[0][:4].tolist()  # cut before its stop token, which is dropped
    for t, lps in zip(out.tokens, out.logprobs, strict=True):
        assert stop not in t.tolist() and len(lps) == len(t)


def test_prompts_are_cut_to_their_last_tokens_with_a_warning_and_left_padded(caplog):
    rollout = rollout_engine(32)
    long = list(range(10, 22))
    with caplog.at_level(logging.WARNING, logger="pagedjax.integrations.rollout"):
        out = sample(rollout, [long, PROMPTS[0]], max_prompt_length=5)
    assert "1 of 2 prompts are longer than max_prompt_length 5" in caplog.text
    assert out.left_padded_prompt_tokens.tolist() == [long[-5:], [0, 0, 5, 6, 7]]
    same = sample(rollout, [long[-5:], PROMPTS[0]], max_prompt_length=5)
    assert [t.tolist() for t in out.tokens] == [t.tolist() for t in same.tokens]


def test_no_logprobs_unless_asked_and_an_empty_batch():
    rollout = rollout_engine(32)
    assert sample(rollout, PROMPTS, return_logprobs=False).logprobs is None
    empty = sample(rollout, [])
    assert empty.tokens == [] and empty.logprobs == [] and empty.left_padded_prompt_tokens.shape == (0, 8)


def test_greedy_with_top_k_and_top_p_is_reproducible_without_a_seed():
    rollout = rollout_engine(32)
    a = sample(rollout, PROMPTS, temperature=0.0, seed=None, top_k=-1, top_p=None)
    b = sample(rollout, PROMPTS, temperature=0.0, seed=None, top_k=5, top_p=0.5)
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]  # greedy: the filters change nothing


def test_score_reads_left_padded_prompts_and_right_padded_completions():
    rollout = rollout_engine(32)
    out = sample(rollout, PROMPTS, stop_ids=[])
    completions = np.zeros((2, 12), np.int32)
    completions[0, :10], completions[1, :3] = out.tokens[0], out.tokens[1][:3]
    scored = rollout.score(out.left_padded_prompt_tokens, completions)
    assert scored.dtype == np.float32 and scored.shape == (2, 12)
    assert scored[0, :10].tobytes() == out.logprobs[0].tobytes() and not scored[0, 10:].any()
    assert scored[1, :3].tobytes() == out.logprobs[1][:3].tobytes() and not scored[1, 3:].any()
    nothing = rollout.score(out.left_padded_prompt_tokens, np.zeros((2, 4), np.int32))  # all padding: zeros
    assert not nothing.any()


def test_update_params_serves_new_weights_in_place():
    rollout = rollout_engine(16)
    before = sample(rollout, PROMPTS)
    other = nnx.state(init_model(CFG, 2))
    rollout.update_params(other)
    try:
        after = sample(rollout, PROMPTS)
        fresh = RolloutEngine(type(rollout.engine)(model_config=CFG, params=other, batch_invariant=True,
                                                   cache_config=rollout.engine.cache_config,
                                                   scheduler_config=rollout.engine.scheduler_config),
                              pad_id=0, stop_ids=[STOP])
        assert [t.tolist() for t in after.tokens] == [t.tolist() for t in sample(fresh, PROMPTS).tokens]
        assert [t.tolist() for t in after.tokens] != [t.tolist() for t in before.tokens]
    finally:
        rollout.update_params(nnx.state(init_model(CFG, 1)))


def test_sleep_releases_the_pool_until_the_next_call():
    rollout = rollout_engine(16)
    before = sample(rollout, PROMPTS)
    assert rollout.sleep() > 0
    with pytest.raises(RuntimeError):  # the engine itself refuses steps while asleep
        rollout.engine.generate([PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert [t.tolist() for t in sample(rollout, PROMPTS).tokens] == [t.tolist() for t in before.tokens]
    assert rollout.sleep() > 0 and rollout.score(np.asarray([[5]]), np.asarray([[6]])).shape == (1, 1)
    assert rollout.wake() == 0.0  # awake after the call: nothing to do


def test_sleep_when_idle_keeps_the_pool_only_during_calls():
    engine = rollout_engine(16).engine
    idle = RolloutEngine(engine, pad_id=0, stop_ids=[STOP], sleep_when_idle=True)
    try:
        assert idle.sleep() == 0  # asleep from the start
        out = sample(idle, PROMPTS)
        assert idle.sleep() == 0  # and again after the call
        scored = idle.score(out.left_padded_prompt_tokens, np.asarray([list(t[:2]) for t in out.tokens]))
        assert idle.sleep() == 0 and scored[0].tobytes() == out.logprobs[0][:2].tobytes()
    finally:
        idle.wake()


@pytest.mark.parametrize("call, error", [
    (lambda r: RolloutEngine(r.engine, pad_id=0, stop_ids=[]), "stop_ids is empty"),
    (lambda r: sample(r, [[5], []]), "prompt 1 is empty"),
    (lambda r: sample(r, PROMPTS, max_prompt_length=0), "max_prompt_length must be >= 1, got 0"),
    (lambda r: r.score(np.zeros((2, 3), np.int32), np.ones((2, 3), np.int32)), "prompt row 0 is all padding"),
    (lambda r: r.score(np.ones((2, 3), np.int32), np.ones((3, 3), np.int32)), r"must be \[B, P\] and \[B, C\]"),
    (lambda r: r.score(np.ones(3, np.int32), np.ones(3, np.int32)), r"must be \[B, P\] and \[B, C\]"),
])
def test_refusals(call, error):
    with pytest.raises(ValueError, match=error):
        call(rollout_engine(16))


@pytest.mark.parametrize("call, error", [
    (lambda: completion_batch([[1]], [[2], [3]]), "1 prompts for 2 completions"),
    (lambda: completion_batch([[1], []], [[2], [3]]), "prompt 1 is empty"),
    (lambda: completion_batch([[1, 2]], [[3, 4]], width=3), "width 3 < 4"),
    (lambda: completion_batch([[1]], [[]], width=1), "width 1 < 2"),
    (lambda: scatter_logprobs(completion_batch([[1]], [[2, 3]]), [[0.1]]), "row 0 has 1 log-probabilities for a "
                                                                          "completion of 2 tokens"),
    (lambda: scatter_logprobs(completion_batch([[1]], [[2]]), []), "0 rows of log-probabilities for a batch of 1"),
    (lambda: exact_logprobs(jnp.zeros((2, 3)), jnp.zeros((2, 4))), r"differ in shape"),
    (lambda: exact_logprobs(jnp.zeros((2, 3), jnp.bfloat16), jnp.zeros((2, 3))), "float32 log-probabilities"),
])
def test_policy_refusals(call, error):
    with pytest.raises(ValueError, match=error):
        call()


def test_completion_batch_layout_and_a_non_finite_trainer_value_stays_visible():
    batch = completion_batch([[1, 2], [3]], [[4], [5, 6, 7]], width=5, pad_id=9)
    assert batch.tokens.tolist() == [[1, 2, 4, 9, 9], [3, 5, 6, 7, 9]]
    assert batch.mask.tolist() == [[0, 1, 0, 0], [1, 1, 1, 0]]
    assert scatter_logprobs(batch, [[-0.5], [-1, -2, -3]]).tolist() == [[0, -0.5, 0, 0], [-1, -2, -3, 0]]
    assert completion_batch([[1]], [[]], width=2).mask.tolist() == [[0]]
    dense = jnp.asarray([[-1.0, jnp.inf, jnp.nan]])
    assert np.isnan(np.asarray(exact_logprobs(dense, jnp.asarray([[-2.0, -3.0, -4.0]])))[0, 1:]).all()



def test_a_sample_that_failed_is_never_returned():
    from types import SimpleNamespace

    failed = SimpleNamespace(request_id="gen-0-0", error="step failed: device lost", outputs=[
        SimpleNamespace(token_ids=[5, 6], finish_reason="error", logprobs=[])])
    broken = SimpleNamespace(generate=lambda *a, **k: [failed], sleep=lambda: 0, wake=lambda: 0.0)
    with pytest.raises(RuntimeError, match="rollout of request gen-0-0 ended with 'error': step failed: device lost"):
        sample(RolloutEngine(broken, pad_id=0, stop_ids=[STOP]), [PROMPTS[0]])
