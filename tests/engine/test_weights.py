"""An engine inside a training loop (`pagedjax.runner.weights`): weights replaced in place, the KV pool released
and re-created, and completions scored by the engine's own compiled step.

Each is checked against an engine that never did it: a fresh engine built with the new weights, the same
engine's uninterrupted run, and the dense model (`Llama.forward_dense`, what a trainer computes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.model.llama import init_model
from tests.dense import dense_forward

CFG = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128)
OLD, NEW = 7, 11  # seeds of the weights served first and of those swapped in
_rng = np.random.default_rng(3)
_shared = _rng.integers(0, CFG.vocab_size, 20).tolist()
# Two prompts sharing 2 blocks of 8 (a prefix-cache hit when cached KV would be reused), and two others.
PROMPTS = [_shared + [5, 6], _shared + [7], _rng.integers(0, CFG.vocab_size, 3).tolist(),
           _rng.integers(0, CFG.vocab_size, 11).tolist()]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)


@functools.cache
def state(seed: int) -> nnx.State:
    return nnx.split(init_model(CFG, seed))[1]


def make_engine(seed: int = OLD) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=8, num_blocks=48),
                     scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                     params=state(seed), seed=0)


def tokens_and_logprobs(outputs) -> tuple[list[list[int]], list[list[float]]]:
    return [o.output_token_ids for o in outputs], [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs]


def run(engine, prompts=PROMPTS, params=GREEDY):
    return tokens_and_logprobs(engine.generate(prompts, params, use_tqdm=False))


@functools.cache
def fresh(seed: int):
    """What an engine built with these weights generates."""
    return run(make_engine(seed))


def test_update_weights_serves_like_a_fresh_engine_without_recompiling_or_copying():
    engine = make_engine(OLD)
    old = run(engine)
    assert engine.stats().scheduler.memory.num_cached_blocks > 0
    compilations = engine.stats().compilations
    new_state = state(NEW)
    engine.update_weights(new_state)
    # No copy: the engine serves the caller's arrays themselves; the prefix cache forgot the old weights' KV.
    assert all(a is b for a, b in zip(jax.tree.leaves(engine.runner.params), jax.tree.leaves(new_state),
                                      strict=True))
    assert engine.stats().scheduler.memory.num_cached_blocks == 0
    got = run(engine)
    assert got[0] != old[0]  # the weights did change what is generated
    assert got == fresh(NEW)  # tokens and log-probabilities, bitwise
    assert engine.stats().compilations == compilations
    engine.update_weights(init_model(CFG, OLD))  # a module is taken too
    assert run(engine) == old


def test_update_weights_mid_flight_recomputes_running_requests_with_the_new_weights():
    engine = make_engine(OLD)
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, p, GREEDY)
    for _ in range(3):
        engine.step()
    before = [list(engine.scheduler.get_request(rid).output_token_ids) for rid in ids]
    assert all(before) and engine.scheduler.running
    engine.update_weights(state(NEW))
    assert not engine.scheduler.running  # every running request preempted: its KV is recomputed
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    # Each continues as a fresh engine with the new weights continues its sequence so far.
    expect = [o.output_token_ids for o in make_engine(NEW).generate(
        [p + b for p, b in zip(PROMPTS, before, strict=True)],
        [SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens - len(b)) for b in before], use_tqdm=False)]
    for rid, b, e in zip(ids, before, expect, strict=True):
        assert finished[rid].output_token_ids == b + e


def _replace_leaf(s: nnx.State, name: str, fn) -> nnx.State:
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if jax.tree_util.keystr(path, simple=True, separator=".") == name + ".value" else x, s)


LEAF = "layers.1.self_attn.q_proj.kernel"


@pytest.mark.parametrize("bad, error, match", [
    (lambda x: x[:, :-1], ValueError, rf"leaf '{LEAF}' is float32\[64, 63\], the model's is float32\[64, 64\]"),
    (lambda x: x.astype(jnp.bfloat16), ValueError, rf"leaf '{LEAF}' is bfloat16\[64, 64\]"),
    (np.asarray, TypeError, rf"leaf '{LEAF}' is a ndarray, not a jax.Array"),
    (lambda x: jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")),
     ValueError, rf"leaf '{LEAF}' has sharding .*pinned_host.*, the engine's is"),
])
def test_a_mismatching_leaf_is_refused_by_name_and_nothing_changes(bad, error, match):
    engine = make_engine(OLD)
    old_params = engine.runner.params
    with pytest.raises(error, match=match):
        engine.update_weights(_replace_leaf(state(NEW), LEAF, bad))
    assert engine.runner.params is old_params


def test_params_of_another_structure_or_deleted_arrays_are_refused():
    engine = make_engine(OLD)
    other = nnx.split(init_model(dataclasses.replace(CFG, num_layers=1), NEW))[1]
    with pytest.raises(ValueError, match=r"missing leaf 'layers\.1\..*' \(11 leaves, the model has 20\)"):
        engine.update_weights(other)
    deleted = jax.tree.map(jnp.copy, state(NEW))
    jax.tree.leaves(deleted)[0].delete()
    old_params = engine.runner.params
    with pytest.raises(ValueError, match=r"leaf 'embed_tokens.embedding' was deleted"):
        engine.update_weights(deleted)
    assert engine.runner.params is old_params


def test_sleep_releases_the_kv_pool_and_wake_serves_on_without_recompiling():
    engine = make_engine(OLD)
    first = run(engine)
    compilations = engine.stats().compilations
    kv_arrays = jax.tree.leaves(engine.runner.kv_cache)
    assert engine.sleep() == engine.runner.kv_cache.nbytes_per_device == 48 * 8 * 2 * 2 * 2 * 16 * 4
    assert all(x.is_deleted() for x in kv_arrays)
    assert engine.sleep() == 0  # already asleep
    with pytest.raises(RuntimeError, match=r"asleep .*call wake\(\) first"):
        engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()  # generate aborted what it queued
    with pytest.raises(RuntimeError, match="asleep"):
        engine.warmup()
    assert engine.wake() >= 0.0 and engine.wake() == 0.0
    assert run(engine) == first  # the prefix cache was emptied too: the same steps, the same programs
    assert engine.stats().compilations == compilations


def test_sleep_mid_flight_recomputes_running_requests_after_wake():
    engine = make_engine(OLD)
    expect = run(engine)[0]  # uninterrupted
    assert engine.scheduler.reset_prefix_cache()
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS, strict=True):
        engine.add_request(rid, p, GREEDY)
    engine.step()
    engine.step()
    engine.sleep()
    assert not engine.scheduler.running
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.add_request("late", PROMPTS[0], GREEDY)  # queueing still works
    engine.wake()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finished[rid].output_token_ids for rid in ids] == expect
    assert finished["late"].output_token_ids == expect[0]


def dense_logprobs(seed: int, prompts, completions) -> list[np.ndarray]:
    """The trainer's numbers: log-softmax of the dense forward over each prompt + completion (one batch,
    right-padded: causal attention makes padding change nothing before it)."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    batch = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, seq in enumerate(seqs):
        batch[i, :len(seq)] = seq
    lps = np.asarray(jax.nn.log_softmax(dense_forward(CFG, seed)(jnp.asarray(batch)), axis=-1))  # init_model's
    return [lps[i, np.arange(len(p) - 1, len(s) - 1), c] for i, (p, c, s) in enumerate(zip(prompts, completions, seqs,
                                                                                          strict=True))]


def test_score_equals_the_dense_forward_and_the_rollouts_logprobs():
    engine = make_engine(NEW)
    tokens, rollout_lps = fresh(NEW)
    scored = engine.score(PROMPTS, tokens)
    dense = dense_logprobs(NEW, PROMPTS, tokens)
    for c, s, d, r in zip(tokens, scored, dense, rollout_lps, strict=True):
        assert s.dtype == np.float32 and s.shape == (len(c),)
        np.testing.assert_allclose(s, d, rtol=0, atol=2e-5)
        np.testing.assert_allclose(s, r, rtol=0, atol=2e-5)


def test_score_refuses_bad_pairs():
    engine = make_engine(OLD)
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        engine.score(PROMPTS[:2], [[1]])
    with pytest.raises(ValueError, match="pair 1 has an empty completion"):
        engine.score(PROMPTS[:2], [[1], []])
    with pytest.raises(ValueError, match="pair 0 has an empty prompt"):
        engine.score([[]], [[1]])
