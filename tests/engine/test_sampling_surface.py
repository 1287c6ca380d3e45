"""Several samples per prompt (n / best_of on forked KV), log-probabilities, penalties, min_p, min_tokens and
stop strings, against single requests and the dense model.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.model.tokenizer import ByteTokenizer
from tests.dense import dense_beam_search, dense_forward
from tests.engine.test_engine import CFG, MAX_LEN, SEED

BLOCK = 8
_rng = np.random.default_rng(5)
PROMPT_FULL = _rng.integers(0, CFG.vocab_size, 2 * BLOCK + 1).tolist()  # last prompt token starts a block
PROMPT_PARTIAL = _rng.integers(0, CFG.vocab_size, 13).tolist()  # its samples share a partial block
SAMPLED = dict(temperature=1.0, max_tokens=10)


@functools.cache
def _engine(caching: bool, steps: int, num_blocks: int) -> LLMEngine:
    return LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                                                                enable_prefix_caching=caching),
                     scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_LEN),
                     seed=SEED, decode_steps_per_call=steps, tokenizer=ByteTokenizer(), compile_cache=False)


def _singles(engine, prompt, seeds, **kw):
    return [engine.generate([prompt], SamplingParams(seed=s, **kw), use_tqdm=False)[0] for s in seeds]


@pytest.mark.parametrize("caching, steps, num_blocks", [(True, 1, 64), (False, 4, 64), (True, 4, 9)])
def test_sample_i_equals_a_single_request_with_seed_plus_i(caching, steps, num_blocks):
    """Prompts whose last token starts a block (no copy) and ends inside a shared partial block (copy-on-write);
    num_blocks=9 forces preemption of the samples (recompute)."""
    engine = _engine(caching, steps, num_blocks)
    outs = engine.generate([PROMPT_FULL, PROMPT_PARTIAL], SamplingParams(n=3, seed=11, **SAMPLED), use_tqdm=False)
    for prompt, out in zip([PROMPT_FULL, PROMPT_PARTIAL], outs, strict=True):
        singles = _singles(engine, prompt, [11, 12, 13], **SAMPLED)
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [s.output_token_ids for s in singles]
        assert all(c.cumulative_logprob is None for c in out.outputs)  # not asked for: the lean step computes none
        assert out.output_token_ids == out.outputs[0].token_ids and out.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in outs[1].outputs}) > 1  # the seeds differ
    assert engine.scheduler.kv_cache_manager.block_pool.num_used == 0
    if num_blocks == 9:
        assert engine.stats().scheduler.num_preemptions > 0


def test_prompt_is_prefilled_once_for_n_samples():
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=64,
                                                                  enable_prefix_caching=False),
                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                        max_model_len=MAX_LEN), seed=SEED, compile_cache=False)
    engine.generate([PROMPT_PARTIAL], SamplingParams(n=8, seed=1, max_tokens=2, temperature=1.0), use_tqdm=False)
    # the prompt but its last token once, then each sample computes the last prompt token (its first decode)
    assert engine.stats().prefill_tokens_computed == len(PROMPT_PARTIAL) - 1 + 8


def test_greedy_samples_are_identical_and_equal_the_single_greedy_output():
    engine = _engine(True, 4, 64)
    out = engine.generate([PROMPT_PARTIAL], SamplingParams(temperature=0.0, n=4, max_tokens=8), use_tqdm=False)[0]
    single = engine.generate([PROMPT_PARTIAL], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [single.output_token_ids] * 4


def test_best_of_keeps_the_n_most_likely_samples_best_first():
    engine = _engine(True, 1, 64)
    out = engine.generate([PROMPT_FULL], SamplingParams(n=2, best_of=4, seed=3, **SAMPLED), use_tqdm=False)[0]
    singles = _singles(engine, PROMPT_FULL, [3, 4, 5, 6], logprobs=0, **SAMPLED)
    ranked = sorted(range(4), key=lambda i: -singles[i].outputs[0].cumulative_logprob)[:2]
    assert [c.index for c in out.outputs] == ranked
    assert [c.token_ids for c in out.outputs] == [singles[i].output_token_ids for i in ranked]
    np.testing.assert_allclose([c.cumulative_logprob for c in out.outputs],
                               [singles[i].outputs[0].cumulative_logprob for i in ranked], rtol=1e-5)


def _dense_logprobs(tokens: list[int]) -> np.ndarray:
    batch = np.zeros((1, MAX_LEN), np.int32)
    batch[0, : len(tokens)] = tokens
    logits = np.asarray(dense_forward(CFG, SEED)(jnp.asarray(batch)))[0, : len(tokens)]
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


@pytest.mark.parametrize("caching", [True, False])
def test_logprobs_and_prompt_logprobs_match_the_dense_model(caching):
    engine = _engine(caching, 4, 64)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    first = engine.generate([PROMPT_PARTIAL], params, use_tqdm=False)[0]
    again = engine.generate([PROMPT_PARTIAL], params, use_tqdm=False)[0]  # would hit the cache: bypassed
    assert again.num_cached_tokens == 0
    for out in (first, again):
        tokens = PROMPT_PARTIAL + out.output_token_ids
        ref = _dense_logprobs(tokens)
        p = len(PROMPT_PARTIAL)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == p
        for j in range(1, p):
            lp = out.prompt_logprobs[j]
            assert lp.token_id == PROMPT_PARTIAL[j]
            np.testing.assert_allclose(lp.logprob, ref[j - 1, PROMPT_PARTIAL[j]], rtol=1e-5, atol=1e-5)
            assert [t for t, _ in lp.top] == np.argsort(-ref[j - 1])[:2].tolist()
        comp = out.outputs[0]
        assert len(comp.logprobs) == len(out.output_token_ids)
        for k, lp in enumerate(comp.logprobs):
            row = ref[p - 1 + k]
            np.testing.assert_allclose(lp.logprob, row[lp.token_id], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose([v for _, v in lp.top], np.sort(row)[::-1][:3], rtol=1e-5, atol=1e-5)
            assert lp.top[0][0] == lp.token_id  # greedy
        np.testing.assert_allclose(comp.cumulative_logprob, sum(lp.logprob for lp in comp.logprobs), rtol=1e-5)


def test_prompt_logprobs_of_several_samples_equal_a_single_requests():
    """n=3 used to return one entry fewer than the prompt (19 for 20 tokens, no leading None): the shared
    prefill's list started empty."""
    engine = _engine(True, 4, 64)
    single = engine.generate([PROMPT_PARTIAL], SamplingParams(temperature=0.0,
                                                              max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    several = engine.generate([PROMPT_PARTIAL], SamplingParams(max_tokens=2, prompt_logprobs=2, n=3,
                                                               temperature=1.0, seed=5), use_tqdm=False)[0]
    assert len(several.prompt_logprobs) == len(single.prompt_logprobs) == len(PROMPT_PARTIAL)
    assert several.prompt_logprobs[0] is None
    for a, b in zip(several.prompt_logprobs[1:], single.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        np.testing.assert_allclose(a.logprob, b.logprob, rtol=1e-5, atol=1e-5)


def _penalized(logits, prompt, out, p: SamplingParams) -> np.ndarray:
    """The numpy reference of the penalty formulas."""
    logits = logits.astype(np.float64).copy()
    counts = np.bincount(out, minlength=len(logits)) if out else np.zeros(len(logits), int)
    seen = (counts > 0) | np.isin(np.arange(len(logits)), prompt)
    r = p.repetition_penalty
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / r, logits[seen] * r)
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if len(out) < p.min_tokens:
        logits[list(p.stop_token_ids)] = -np.inf
    return logits


@pytest.mark.parametrize("steps", [1, 4])
def test_penalties_and_min_tokens_match_a_numpy_reference(steps):
    engine = _engine(True, steps, 64)
    greedy = engine.generate([PROMPT_FULL], SamplingParams(temperature=0.0,
                                                           max_tokens=3), use_tqdm=False)[0].output_token_ids
    params = SamplingParams(temperature=0.0,
                            max_tokens=10, repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.9,
                            min_tokens=4, stop_token_ids=(greedy[0],))
    out = engine.generate([PROMPT_FULL], params, use_tqdm=False)[0].output_token_ids
    tokens, expected = list(PROMPT_FULL), []
    while len(expected) < params.max_tokens:
        logits = np.asarray(dense_forward(CFG, SEED)(jnp.asarray(np.pad(tokens, (0, MAX_LEN - len(tokens)))[None])))[0]
        t = int(np.argmax(_penalized(logits[len(tokens) - 1], PROMPT_FULL, expected, params)))
        expected.append(t)
        tokens.append(t)
        if t == greedy[0]:
            break
    assert out == expected
    assert greedy[0] not in out[:4]  # min_tokens held the stop id back


def test_stop_strings_cut_the_text_and_end_the_request():
    engine = _engine(True, 4, 64)
    prompt = [ord(c) for c in "DEF F(X):"]  # ASCII ids < vocab (97): one character per token
    params = dict(max_tokens=12, temperature=1.0, seed=4, logprobs=0)
    full = engine.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]
    text = full.text
    stop = text[5:7]
    at = text.find(stop)  # its first occurrence (at most 5)
    cut = engine.generate([prompt], SamplingParams(stop=[stop, "never there"], **params), use_tqdm=False)[0]
    assert cut.text == text[:at] and cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.output_token_ids == full.output_token_ids[:at + 2]  # up to the token completing the stop string
    assert len(cut.outputs[0].logprobs) == at + 2 and cut.outputs[0].cumulative_logprob == pytest.approx(
        full.outputs[0].cumulative_logprob - sum(lp.logprob for lp in full.outputs[0].logprobs[at + 2:]), abs=1e-4)
    kept = engine.generate([prompt], SamplingParams(stop=(stop,), include_stop_str_in_output=True, **params),
                           use_tqdm=False)[0]
    assert kept.text == text[:at + 2]


def test_aborting_a_multi_sample_request_frees_every_block():
    engine = _engine(True, 1, 64)
    engine.add_request("a", PROMPT_PARTIAL, SamplingParams(n=3, seed=1, **SAMPLED))
    engine.step()  # the prefill
    engine.step()  # the samples' first tokens
    assert len(engine.scheduler.groups["a"].samples) == 3
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("a[1]", PROMPT_FULL)  # a sample's id is taken while the request lives
    assert engine.abort("a")
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.block_pool.num_used == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), "n must be"), (dict(n=2, best_of=1), "best_of must be"), (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"),
    (dict(n=2.0), "n must be an int"), (dict(seed=2**63 - 1, n=2), "seed"),
])
def test_invalid_sampling_params_name_the_field(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


def test_stop_strings_need_a_tokenizer():
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=BLOCK, num_blocks=16), seed=SEED,
                       compile_cache=False)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("x", [1, 2], SamplingParams(temperature=0.0, stop=["a"]))


def _dense_beam_search(prompt, width, max_tokens, length_penalty, eos):
    """Beam search over the dense model (no cache): the reference (`tests.dense.dense_beam_search`)."""
    return dense_beam_search(lambda tokens: _dense_logprobs(prompt + tokens)[-1], width, max_tokens, eos,
                             length_penalty)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beam_search_equals_a_brute_force_beam_search_of_the_dense_model(width):
    from pagedjax.sampling_params import BeamSearchParams

    engine = _engine(True, 1, 64)
    greedy = engine.generate([PROMPT_PARTIAL], SamplingParams(temperature=0.0,
                                                              max_tokens=6), use_tqdm=False)[0].output_token_ids
    eos = (greedy[2],)  # an EOS the search meets
    engine.model_spec = dataclasses.replace(engine.model_spec, eos_token_ids=eos)
    try:
        out = engine.beam_search([PROMPT_PARTIAL, PROMPT_FULL],
                                 BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=0.7))
    finally:
        engine.model_spec = CFG.spec
    for prompt, result in zip([PROMPT_PARTIAL, PROMPT_FULL], out, strict=True):
        ref = _dense_beam_search(prompt, width, 6, 0.7, set(eos))
        assert [s.token_ids for s in result.sequences] == [t for t, _ in ref]
        np.testing.assert_allclose([s.cumulative_logprob for s in result.sequences], [c for _, c in ref],
                                   rtol=1e-4, atol=1e-4)
    if width == 1:  # greedy until EOS
        assert out[0].sequences[0].token_ids == greedy[:greedy.index(eos[0]) + 1]
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.block_pool.num_used == 0
