"""Speculative decoding through the whole engine (`pagedjax.spec_decode.speculator`): the output is the
non-speculative one, greedy (against the dense model) and seeded-sampled (against the engine without
speculation, log-probabilities included); the sampled path's acceptance is rejection sampling (a chi-square test
on the device's sampler); the n-gram proposer; the configuration's errors.

The tiny random model of `test_engine` loops in its greedy output (a token repeated, or a short cycle), so the
n-gram proposer has both right and wrong proposals to verify; the tests assert that both happened."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.scipy.special import gammaincc

from pagedjax import CacheConfig, LLMEngine, SamplingParams
from pagedjax.config import SamplingDefaults, SchedulerConfig, SpeculativeConfig
from pagedjax.core.request import Request
from pagedjax.core.step_plan import build_step_plan
from pagedjax.core.step_result import emitted_tokens as accepted_tokens
from pagedjax.device.sampling import SamplingMetadata, filter_logits, sample
from pagedjax.runner.inputs import step_inputs
from pagedjax.runner.shapes import StepShape, dominates, warmup_shapes
from pagedjax.serve.metrics import DurationHistogram, ServerMetrics
from pagedjax.spec_decode.proposer import NgramProposer
from pagedjax.spec_decode.speculator import Speculator
from tests.engine.test_engine import CFG, MAX_LEN, PROMPTS, SEED, assert_all_free, dense_greedy, make_engine
from tests.engine.test_engine_properties import workloads
from tests.serve.server_utils import metric

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
# The test prompts, and two that repeat themselves (a copy-heavy text's shape).
SPEC_PROMPTS = PROMPTS[:4] + [[5, 6, 7, 8] * 4, [9, 9, 1, 9, 9, 1, 9]]


def test_greedy_speculation_of_a_small_batch_gives_the_dense_tokens():
    """The default run's check (a few compiled programs): two requests, one copying its prompt, with
    log-probabilities; steps without a proposal run the fused decode."""
    prompts = SPEC_PROMPTS[4:6]
    expected, margin = dense_greedy(prompts, 14)
    assert margin > 1e-3, margin
    engine = make_engine(block_size=8, max_num_seqs=2, speculative_config=NGRAM, decode_steps_per_call=4)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=14, logprobs=1), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    s = engine.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_proposed_tokens and s.fused_decode_calls > 0
    for o in outs:  # each token's log-probability is its own, and the best
        assert all(t.top[0][0] == t.token_id and t.top[0][1] == t.logprob for t in o.outputs[0].logprobs)
    assert_all_free(engine)
    text = ServerMetrics(engine.stats, lambda: 0, DurationHistogram()).render().decode()
    assert metric(text, "pagedjax_spec_decode_num_draft_tokens_total") == s.spec_proposed_tokens
    assert metric(text, "pagedjax_spec_decode_num_accepted_tokens_total") == s.spec_accepted_tokens
    assert metric(text, "pagedjax_spec_decode_mean_accepted_length") == pytest.approx(
        s.spec_accepted_tokens / s.spec_sequences)
    assert 0 < s.spec_proposer_s < s.elapsed_s
    assert metric(text, "pagedjax_spec_decode_proposer_seconds_total") == pytest.approx(s.spec_proposer_s)
    assert engine.stats_dict()["spec_acceptance_rate"] == pytest.approx(s.spec_accepted_tokens / s.spec_proposed_tokens)


@pytest.mark.slow
def test_greedy_speculation_gives_the_dense_tokens_and_returns_every_block():
    expected, margin = dense_greedy(SPEC_PROMPTS, 20)
    assert margin > 1e-3, margin
    engine = make_engine(block_size=8, speculative_config=NGRAM)
    outs = engine.generate(SPEC_PROMPTS, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    s = engine.stats()
    # both paths ran: proposals accepted and proposals rejected
    assert 0 < s.spec_accepted_tokens < s.spec_proposed_tokens and s.spec_sequences > 0
    assert s.steps < sum(len(o) for o in expected)
    assert_all_free(engine)


@pytest.mark.slow
@settings(max_examples=6)
@given(w=workloads(), k=st.integers(1, 5))
def test_speculation_matches_dense_on_random_workloads(w, k):
    """`test_engine_properties`' random workloads (block sizes, pools down to preemption, budgets down to chunked
    prefill, batch limits, fused decode, prefix caching), each prompt followed by a copy of itself so that
    proposals are right as well as wrong: the dense model's greedy tokens."""
    half = (MAX_LEN - w["max_tokens"]) // 2
    prompts = [p[:half] + p[:half] for p in w["prompts"]]
    expected, margin = dense_greedy(prompts, w["max_tokens"])
    if margin < 1e-3:
        return
    longest = max(map(len, prompts)) + w["max_tokens"]
    engine = LLMEngine(model_config=CFG, cache_config=CacheConfig(block_size=w["block_size"],
                                                                  num_blocks=max(w["num_blocks"],
                                                                                 -(-longest // w["block_size"])),
                                                                  enable_prefix_caching=w["prefix"]),
                       scheduler_config=SchedulerConfig(max_num_seqs=w["max_num_seqs"],
                                                        max_num_batched_tokens=w["budget"], max_model_len=MAX_LEN),
                       seed=SEED, decode_steps_per_call=w["num_steps"],
                       speculative_config=SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=w["max_tokens"]), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == expected
    assert_all_free(engine)


@pytest.mark.slow
def test_seeded_sampling_logprobs_stops_and_samples_equal_non_speculative():
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, top_p=0.95, seed=3, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.0, logprobs=1),
              SamplingParams(max_tokens=7, temperature=1.0, seed=11, n=2, best_of=3),
              SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(13,)),
              # not speculated, in the same steps as the others (penalty rows per sampled row)
              SamplingParams(max_tokens=12, presence_penalty=0.5, frequency_penalty=0.3, temperature=0.9, seed=2)]
    prompts = [SPEC_PROMPTS[4], SPEC_PROMPTS[5], SPEC_PROMPTS[4], PROMPTS[0], SPEC_PROMPTS[5]]
    runs = []
    for config in (None, NGRAM):
        engine = make_engine(block_size=4, speculative_config=config)
        runs.append(engine.generate(prompts, params, use_tqdm=False))
        assert_all_free(engine)
    assert engine.stats().spec_accepted_tokens > 0
    for plain, spec in zip(*runs, strict=True):
        assert_same_outputs(plain, spec)


def assert_same_outputs(plain, spec) -> None:
    """A speculative run's `RequestOutput` is the non-speculative one: tokens, finish reason, log-probabilities
    (to float32 rounding) and their top alternatives."""
    assert [c.token_ids for c in spec.outputs] == [c.token_ids for c in plain.outputs]
    assert spec.finish_reason == plain.finish_reason
    for a, b in zip(plain.outputs, spec.outputs, strict=True):
        if a.logprobs is not None:
            np.testing.assert_allclose([t.logprob for t in b.logprobs], [t.logprob for t in a.logprobs],
                                       rtol=1e-5, atol=1e-5)
            assert [[i for i, _ in t.top] for t in b.logprobs] == [[i for i, _ in t.top] for t in a.logprobs]
        if a.cumulative_logprob is not None:
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.0), (0.7, 4, 0.9, 0.05)])
def test_rejection_sampling_of_a_one_hot_proposal_follows_the_target(temperature, top_k, top_p, min_p):
    """A proposal x that is not p's most likely token, verified at many seeds: x is accepted with probability p(x),
    and the token emitted (x, or the target's own draw when x is rejected) follows p, with p the request's
    temperature / top-k / top-p / min-p distribution; rejected, it follows p without x, renormalised."""
    vocab, n = 8, 20000
    logits = np.log(np.array([0.3, 0.05, 0.2, 0.1, 0.15, 0.02, 0.08, 0.1], np.float32))
    x = 2
    rows = np.tile(logits, (n, 1))
    meta = SamplingMetadata.from_lists([temperature] * n, [top_k] * n, [top_p] * n, np.arange(n) * 7919 + 1,
                                       [0] * n, min_p=[min_p] * n)
    drawn = np.asarray(sample(rows, meta))  # row 0 of each verifying sequence: the target's draw
    verdicts = [accepted_tokens([x], [int(t), -1]) for t in drawn]  # -1: the bonus row, not looked at here
    emitted = np.array([v[0] for v in verdicts])
    accepted = np.array([len(v) == 2 for v in verdicts])
    p = np.asarray(jax.nn.softmax(filter_logits(logits[None], np.float32([temperature]), np.int32([top_k]),
                                                np.float32([top_p]), np.float32([min_p])), axis=-1))[0]
    assert p[x] < p.max()
    z = (accepted.sum() - n * p[x]) / np.sqrt(n * p[x] * (1 - p[x]))
    assert abs(z) < 4, z
    counts = np.bincount(emitted, minlength=vocab)
    assert (counts[p == 0] == 0).all()
    assert chi_square_pvalue(counts, p) > 1e-3
    residual = np.where(np.arange(vocab) == x, 0.0, p)
    rejected = np.bincount(emitted[~accepted], minlength=vocab)
    assert rejected[x] == 0
    assert chi_square_pvalue(rejected, residual / residual.sum()) > 1e-3


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit of `counts` to `probs` over the support of `probs`."""
    support = probs > 0
    expected = counts.sum() * probs[support]
    statistic = float((((counts[support] - expected) ** 2) / expected).sum())
    return float(gammaincc((support.sum() - 1) / 2, statistic / 2))  # the chi-square distribution's tail


def _request(tokens: list[int]) -> Request:
    return Request("r", tokens[:1], output_token_ids=tokens[1:])


@pytest.mark.parametrize("tokens, cap, proposal", [
    ([1, 2, 3, 9, 1, 2, 3], 4, [9, 1, 2, 3]),  # the longest suffix (1 2 3) found: what followed it
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # capped
    ([5, 1, 7, 0, 5, 1, 8, 5, 1], 4, [8, 5, 1]),  # the most recent occurrence, up to the end
    ([4, 4, 4, 4], 4, [4]),
    ([1, 2, 3, 4, 5], 4, []),  # nothing repeats: no proposal
    ([7], 4, []),
])
def test_ngram_proposer(tokens, cap, proposal):
    assert NgramProposer(k=4, min_n=1, max_n=3).propose_for(_request(tokens), cap) == proposal


def test_ngram_proposer_backs_off_below_its_min_n():
    # only a 1-gram (3) repeats: a min_n of 2 proposes nothing
    assert NgramProposer(k=4, min_n=2, max_n=3).propose_for(_request([3, 1, 2, 3]), 4) == []
    assert NgramProposer(k=4, min_n=1, max_n=3).propose_for(_request([3, 1, 2, 3]), 4) == [1, 2, 3]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_speculative_tokens=0), ValueError, "SpeculativeConfig.num_speculative_tokens must be in"),
    (dict(num_speculative_tokens=2.0), TypeError, "SpeculativeConfig.num_speculative_tokens must be an int"),
    (dict(method="eagle"), ValueError, "SpeculativeConfig.method 'eagle' is not supported"),
    (dict(method="draft"), ValueError, "SpeculativeConfig.draft_model is needed by method 'draft'"),
    (dict(draft_model="some/folder"), ValueError, "draft_model is for methods 'draft' and 'mtp', got str "
                                                  "'some/folder' with method 'ngram'"),
    (dict(prompt_lookup_min=0), ValueError, "SpeculativeConfig.prompt_lookup_min must be >= 1"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), ValueError, "SpeculativeConfig.prompt_lookup_max must be >= 3"),
])
def test_bad_speculative_config(kwargs, error, match):
    with pytest.raises(error, match=match):
        SpeculativeConfig(**kwargs)


def test_engine_refuses_a_speculative_config_of_another_type():
    with pytest.raises(TypeError, match="speculative_config must be a SpeculativeConfig, got dict"):
        make_engine(speculative_config={"num_speculative_tokens": 2})


def test_warmup_adds_programs_wide_enough_for_every_verified_row():
    """A step that verifies proposals samples up to 1 + k rows per sequence: `LLMEngine.warmup` then also compiles
    the ragged steps with that many rows, so they stand in for it."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)
    shapes = warmup_shapes(max_tokens=64, max_seqs=4, max_blocks=6, block_size=16, decode_steps=4, narrow=True)
    extra = Speculator(NGRAM).warmup_shapes(shapes, config)
    assert [(s.tables, s.rows) for s in extra] == [((4, 8), 16), ((4, 8), 16), ((4, 2), 16), ((4, 2), 16)]
    widest = StepShape("step", 64, (4, 8), False, False, 4, 512, False, 20, 0, True, 16)
    assert not any(dominates(s, widest) for s in shapes) and dominates(extra[0], widest)
    budget_bound = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=96)
    assert [s.rows for s in Speculator(NGRAM).warmup_shapes(shapes, budget_bound)] == [8] * 4
    many = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=96)  # 64 rows: capped by T
    assert [(s.tokens, s.rows) for s in Speculator(NGRAM).warmup_shapes(shapes, many)] == [
        (64, 64), (64, 64), (64, 64), (16, 16)]


def test_a_failing_verifying_step_fails_its_request_alone_and_frees_every_block(monkeypatch):
    engine = make_engine(block_size=8, max_num_seqs=2, speculative_config=NGRAM)
    engine.add_request("a", SPEC_PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=10))
    # proposals come after a step: the prompt's step is followed by these
    monkeypatch.setattr(engine.speculator.proposer, "propose", lambda asks, step: [[1] * min(2, a.cap) for a in asks])
    engine.step()  # the prompt
    plans = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda **kw: plans.append(schedule(**kw)) or plans[-1])

    def broken(inputs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    (out,) = engine.step()
    assert plans[0].num_drafts is not None and plans[0].num_drafts.sum() > 0  # it was verifying proposals
    assert out.finish_reason == "error" and "device lost" in out.error
    assert engine.stats().failed_steps == 1 and not engine.has_unfinished_requests()
    assert_all_free(engine)


class _AllowFive:
    """A stand-in structured-output matcher: allows tokens 0 and 2 of every 32 (mask word 5)."""

    def fill(self, row: np.ndarray) -> None:
        row[:] = 5


def test_speculative_step_inputs_give_each_verified_position_its_own_row():
    """Beside a request verifying two proposals: a constrained decode and a prefill with penalties. Each sequence's
    rows carry its own sampling parameters, penalties and mask; a verified position j samples as output number
    `num_output_tokens + j`; the rows are padded to their bucket, the sequences to theirs."""
    # Requests made here, not by an engine: their parameters get the defaults an engine would give them.
    a = Request("a", [1, 2, 3], SamplingParams(temperature=0.5, seed=4).with_defaults(SamplingDefaults()),
                output_token_ids=[7], num_computed_tokens=3)
    b = Request("b", [4, 5], SamplingParams(temperature=0.0, presence_penalty=0.5).with_defaults(SamplingDefaults()))
    c = Request("c", [6], SamplingParams(temperature=0.0).with_defaults(SamplingDefaults()), output_token_ids=[2],
                num_computed_tokens=1, constrained=True)
    plan = build_step_plan([(a, 3), (b, 2), (c, 1)], {"a": [0], "b": [1], "c": [2]}, 16,
                           draft_token_ids={"a": [8, 9]})
    assert plan.request_ids == ["c", "a", "b"] and plan.num_drafts.tolist() == [0, 2, 0]
    np.testing.assert_array_equal(plan.token_ids, [2, 7, 8, 9, 4, 5])
    np.testing.assert_array_equal(plan.logits_indices, [0, 1, 2, 3, 5])
    mask = np.full((3, 2), -1, np.int32)  # the sequences' mask rows, as the structured-output manager fills them
    _AllowFive().fill(mask[0])
    inputs = step_inputs(plan, [c, a, b], vocab_size=40, engine_seed=0, token_mask=mask)
    assert not inputs.decode_only and len(inputs.token_ids) == 6  # tokens and rows to `fine_bucket`: 6 and 5
    assert inputs.meta.block_tables.shape[0] == inputs.meta.kv_lens.shape[0] == 4 and len(inputs.logits_indices) == 5
    np.testing.assert_array_equal(inputs.logits_indices[:5], plan.logits_indices)
    np.testing.assert_array_equal(inputs.sampling.step[:5], [1, 1, 2, 3, 0])
    np.testing.assert_allclose(inputs.sampling.temperature[:5], [0, 0.5, 0.5, 0.5, 0])
    assert inputs.sampling.seed_lo[1] == inputs.sampling.seed_lo[3] == 4
    np.testing.assert_allclose(inputs.extras.penalties.presence[:5], [0, 0, 0, 0, 0.5])
    np.testing.assert_array_equal(inputs.extras.token_mask[:5], [[5, 5], [-1, -1], [-1, -1], [-1, -1], [-1, -1]])
    np.testing.assert_array_equal(inputs.meta.kv_lens[:4], [2, 6, 2, 0])  # a padding sequence: nothing attended


def test_ngram_proposer_backs_off_after_failed_proposals_and_recovers_after_an_accepted_one():
    proposer = NgramProposer(k=2, min_n=1, max_n=1)
    r = _request([5, 6, 5])
    assert proposer.propose_for(r, 2) == [6, 5]
    r.output_token_ids.append(9)  # not the proposal's first token: hold back for 1 token
    assert proposer.propose_for(r, 2) == []
    r.output_token_ids.append(5)
    assert proposer.propose_for(r, 2) == [9, 5]  # proposing again: what followed the most recent 5
    r.output_token_ids.append(7)  # failed again: hold back for 2 tokens
    assert proposer.propose_for(r, 2) == []
    r.output_token_ids.append(5)
    assert proposer.propose_for(r, 2) == []
    r.output_token_ids.append(5)
    proposal = proposer.propose_for(r, 2)
    assert proposal == [5]  # the most recent 5 is followed by the last token only
    r.output_token_ids.append(5)  # accepted: no more holding back
    assert proposer.propose_for(r, 2) == [5] and proposer._backoff[r.request_id].wait == 0
