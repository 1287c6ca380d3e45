"""Speculative decoding's host side (proposals after a step: `Speculator.propose`; verification and rollback:
`Scheduler.update`) against the fake model over a shadow KV cache.

The fake model's token after a context is a hash of that context read back through the plan's block tables, so a
rejected proposal's KV that stayed visible, a block of rejected tokens that got a prefix-cache hash, or a slot
written into a shared block changes some output. A hypothesis state machine mixes speculative steps (proposals
right, wrong, or partly right), plain and fused steps, multi-sample forks, held (beam) requests, aborts and
preemptions on small pools; every invariant is checked after every step and every finished request against the
cache-free reference: speculation on gives the same tokens as speculation off.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from pagedjax.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedjax.config.sampling import SamplingDefaults
from pagedjax.core.kv_cache_manager import cdiv
from pagedjax.core.request import Request, RequestStatus, sample_id
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.step_plan import first_rows
from pagedjax.core.step_result import StepResult
from pagedjax.core.step_result import emitted_tokens as accepted_tokens
from pagedjax.sampling_params import SamplingParams
from pagedjax.spec_decode.proposer import ProposalAsk
from pagedjax.spec_decode.speculator import Speculator, speculates
from tests.core.harness import VOCAB, Checker, FakeModel, SchedulerMachine, next_token, reference_outputs, run_step

# What an engine gives every request it takes (these tests make Requests without one; the speculator reads them).
DEFAULTS = SamplingDefaults()


def spec_sample(model: FakeModel, plan) -> np.ndarray:
    """The fake device step of a speculative plan: write every token's KV, then sample a token at every row of
    `plan.logits_indices` from the context up to and including that row's position."""
    bs = model.block_size
    blocks = model.kv.reshape(-1, bs)
    if len(plan.block_copies):
        blocks[plan.block_copies[:, 1]] = blocks[plan.block_copies[:, 0]].copy()
    assert (plan.slot_mapping >= 0).all() and len(np.unique(plan.slot_mapping)) == plan.num_tokens
    model.kv[plan.slot_mapping] = plan.token_ids
    first = first_rows(plan)
    out = []
    for s in range(plan.num_seqs):
        rows = int(first[s + 1] - first[s])
        start = int(plan.kv_lens[s] - plan.q_lens[s])
        for j in range(rows):
            length = int(plan.kv_lens[s]) - rows + 1 + j
            out.append(next_token(model.read(plan.block_tables[s], length, start),
                                  model.salts.get(plan.request_ids[s], 0)))
    assert len(out) == len(plan.logits_indices)
    return np.array(out, np.int32)


class each:  # noqa: N801  (reads as a function: each(lambda request, cap: ...))
    """A batched proposer (`spec_decode.proposer.Proposer`) of a per-request one, or of a batched function."""

    def __init__(self, propose, batched: bool = False):
        self.propose = (lambda asks, step=None: propose(asks)) if batched else (
            lambda asks, step=None: [propose(ask.request, ask.cap) for ask in asks])

    def forget(self, live_request_ids) -> None:
        pass


class Outcome(NamedTuple):
    """What a verifying step did: the requests it finished, and the speculator's counts."""

    finished: list[Request]
    num_sequences: int
    num_proposed: int
    num_accepted: int


def schedule_speculative(sched: Scheduler, proposer, k: int):
    """The engine's order between steps: the speculator's proposals (`Speculator.propose`), then the next plan."""
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=k))
    speculator.proposer = proposer
    speculator.propose(sched)
    return sched.schedule()


def update_speculative(sched: Scheduler, plan, sampled) -> Outcome:
    """`Scheduler.update` of a plan, with the counts `Speculator.count` makes of it."""
    requests = [sched.get_request(rid) for rid in plan.request_ids]
    before = [r.num_output_tokens for r in requests]
    finished = sched.update(plan, sampled)
    speculator = Speculator(SpeculativeConfig())
    speculator.count(plan, StepResult.from_rows(plan, sampled),
                     [r.num_output_tokens - b for r, b in zip(requests, before, strict=True)])
    return Outcome(finished, speculator.num_sequences, speculator.num_proposed, speculator.num_accepted)


class TruthProposer:
    """Proposes the request's true continuation (the fake model run without a cache), corrupted at a random place
    or not at all, and sometimes nothing: every acceptance length occurs."""

    def __init__(self, salts: dict[str, int], window: int | None, k: int, rng: random.Random):
        self.salts, self.window, self.k, self.rng = salts, window, k, rng
        self.asked: dict[str, int] = {}  # request id -> the cap it was last asked with

    def propose(self, asks: list[ProposalAsk], step=None) -> list[list[int]]:
        return [self.propose_for(ask.request, ask.cap) for ask in asks]

    def forget(self, live_request_ids) -> None:
        pass

    def propose_for(self, request: Request, cap: int) -> list[int]:
        assert cap >= 1 and speculates(request)
        self.asked[request.request_id] = cap
        tokens = list(request.all_token_ids)
        out = []
        for _ in range(min(self.k, cap)):
            t = next_token(tokens if self.window is None else tokens[-self.window:],
                           self.salts.get(request.request_id, 0))
            out.append(t)
            tokens.append(t)
        wrong = self.rng.randrange(len(out) + 2)
        if wrong < len(out):
            out[wrong] = (out[wrong] + 1) % VOCAB
        return out[:self.rng.randrange(len(out) + 1)] if self.rng.random() < 0.2 else out


def check_spec_plan(sched: Scheduler, plan, proposer: TruthProposer, budget: int) -> None:
    """Proposals sit at the end of decoding requests' chunks, within their caps, in private unhashed blocks."""
    assert plan.num_tokens <= budget
    if plan.num_drafts is None:
        return
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    bs = sched.block_size
    for i, rid in enumerate(plan.request_ids):
        d = int(plan.num_drafts[i])
        r = sched.get_request(rid)
        a, b = int(plan.cu_q_lens[i]), int(plan.cu_q_lens[i + 1])
        np.testing.assert_array_equal(plan.positions[a:b], np.arange(r.num_computed_tokens, plan.kv_lens[i]))
        if d == 0:
            continue
        assert b - a == d + 1 and r.num_computed_tokens + 1 == r.num_tokens and plan.emits_token[i]
        assert d <= proposer.asked[rid] <= sched.max_new_tokens_left(r) - 1
        assert plan.token_ids[a] == r.all_token_ids[-1]
        held = kv.get_block_ids(rid)
        assert len(held) == cdiv(int(plan.kv_lens[i]), bs)
        for t in range(a, b):
            block = int(plan.slot_mapping[t]) // bs
            assert block == held[int(plan.positions[t]) // bs]
            assert pool.ref_cnt(block) == 1 and pool.block_hash(block) is None


class SpeculationMachine(SchedulerMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 30),
                budget=st.sampled_from([2, 5, 64]), caching=st.booleans(), window=st.sampled_from([None, None, 3]),
                k=st.integers(1, 5), seed=st.integers(0, 2**16))
    def setup(self, block_size, num_blocks, budget, caching, window, k, seed):
        self.max_model_len = 20
        self.budget = budget
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                               max_model_len=self.max_model_len),
                               CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks,
                               sliding_window=window)
        self.salts: dict[str, int] = {}
        self.model = FakeModel(num_blocks, block_size, self.salts, window=window)
        self.window = window
        self.checker = Checker(self.sched, self.model)
        self.proposer = TruthProposer(self.salts, window, k, random.Random(seed))
        self.finished: list[Request] = []
        self.aborted: set[str] = set()
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9), samples=st.integers(1, 3),
          max_tokens=st.integers(1, 10), stop=st.booleans(), held=st.booleans())
    def add(self, prompt, samples, max_tokens, stop, held):
        self.next_id += 1
        rid = f"r{self.next_id}"
        params = SamplingParams(max_tokens=max_tokens, n=1 if held else samples,
                                stop_token_ids=(3,) if stop else ()).with_defaults(DEFAULTS)
        try:
            self.sched.add_request(Request(rid, prompt, params, hold=held))
        except ValueError:
            return
        for i in range(params.num_samples if params.num_samples > 1 else 0):
            self.salts[sample_id(rid, i)] = i + 1

    @rule()
    def spec_step(self):
        for r in self.sched.running:  # a held request goes on (beam search would decide here)
            r.paused = False
        if not self.sched.has_unfinished_requests():
            return
        plan = schedule_speculative(self.sched, self.proposer, self.proposer.k)
        check_spec_plan(self.sched, plan, self.proposer, self.budget)
        self.checker.check(mid_step=True, pending_copies=plan.block_copies)
        before = {rid: self.sched.get_request(rid).num_output_tokens for rid in plan.request_ids}
        outcome = self.last_outcome = update_speculative(self.sched, plan, spec_sample(self.model, plan))
        if outcome.num_sequences:
            event("all proposals accepted" if outcome.num_accepted == outcome.num_proposed else
                  "some proposals accepted" if outcome.num_accepted else "no proposal accepted")
            if plan.num_drafts is not None and plan.num_decodes < plan.num_seqs - int((plan.num_drafts > 0).sum()):
                event("proposals verified beside a prefill chunk")
        assert 0 <= outcome.num_accepted <= outcome.num_proposed
        assert outcome.num_proposed == (0 if plan.num_drafts is None else int(plan.num_drafts.sum()))
        for i, rid in enumerate(plan.request_ids):  # never more tokens than verified positions
            r = self.sched.get_request(rid) or next((f for f in outcome.finished if f.request_id == rid), None)
            if r is not None and not r.prefill_only:
                d = 0 if plan.num_drafts is None else int(plan.num_drafts[i])
                assert r.num_output_tokens - before[rid] <= d + 1
        self.finished += outcome.finished

    @rule(num_steps=st.integers(1, 4))
    def plain_step(self, num_steps):
        for r in self.sched.running:
            r.paused = False
        if self.sched.has_unfinished_requests():
            self.finished += run_step(self.sched, self.model, self.checker, fused_steps=num_steps)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            for r in self.sched.waiting:  # a held request preempted while paused
                r.paused = False
            self.spec_step()
        assert not self.sched.has_unfinished_requests() and not self.sched.groups
        assert self.sched.kv_cache_manager.block_pool.num_used == 0, "blocks leaked"
        for r in self.finished:
            assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
            if r.request_id in self.aborted or (r.group is not None and r.group.request.request_id in self.aborted):
                continue
            expected = reference_outputs(r, self.max_model_len, self.salts.get(r.request_id, 0), window=self.window)
            assert r.output_token_ids == expected, r.request_id


SpeculationMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
TestSpeculation = SpeculationMachine.TestCase


@pytest.mark.parametrize("drafts, sampled, emitted", [
    ([], [5], [5]),
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted, plus the token after them
    ([1, 2, 3], [1, 9, 3, 4], [1, 9]),  # the first mismatch is emitted: the target's own token there
    ([1, 2, 3], [7, 2, 3, 4], [7]),
])
def test_accepted_tokens(drafts, sampled, emitted):
    assert accepted_tokens(drafts, sampled) == emitted


def test_accepted_tokens_needs_one_more_sampled_token():
    with pytest.raises(ValueError, match="4 sampled tokens for 2 proposals"):
        accepted_tokens([1, 2], [1, 2, 3, 4])


def _decoding_scheduler(max_tokens: int = 8, stop: tuple[int, ...] = (), block_size: int = 4,
                        prompt: tuple[int, ...] = (1, 2, 3, 4, 5)):
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                      CacheConfig(block_size=block_size), 32)
    model = FakeModel(32, block_size)
    request = Request("a", list(prompt),
                      SamplingParams(max_tokens=max_tokens, stop_token_ids=stop).with_defaults(DEFAULTS))
    sched.add_request(request)
    run_step(sched, model)  # the prompt: one output, decoding from now on
    return sched, model, request


def test_a_full_acceptance_emits_k_plus_one_tokens_and_keeps_only_their_blocks():
    sched, model, r = _decoding_scheduler()
    truth = reference_outputs(r, 64)
    plan = schedule_speculative(sched, each(lambda req, cap: truth[1:5]), 64)
    assert plan.num_drafts.tolist() == [4] and plan.num_tokens == 5
    outcome = update_speculative(sched, plan, spec_sample(model, plan))
    assert (outcome.num_sequences, outcome.num_proposed, outcome.num_accepted) == (1, 4, 4)
    assert r.output_token_ids == truth[:6] and r.num_computed_tokens == 10
    Checker(sched, model).check()  # 3 blocks for 10 tokens: the rest went back


def test_a_rejection_rolls_back_the_length_and_the_blocks():
    sched, model, r = _decoding_scheduler()
    truth = reference_outputs(r, 64)
    free_before = sched.kv_cache_manager.num_free_blocks
    wrong = [(t + 1) % VOCAB for t in truth[1:8]]
    plan = schedule_speculative(sched, each(lambda req, cap: wrong[:cap]), 64)
    assert plan.num_drafts.tolist() == [6]  # capped: 8 max_tokens, 1 out, 1 the target's own
    outcome = update_speculative(sched, plan, spec_sample(model, plan))
    assert outcome.num_accepted == 0 and r.output_token_ids == truth[:2] and r.num_computed_tokens == 6
    assert sched.kv_cache_manager.num_free_blocks == free_before  # 6 tokens in the 2 blocks it had
    Checker(sched, model).check()


def test_emission_stops_at_a_stop_token_inside_the_accepted_proposals():
    # a prompt whose continuation's third token is new: make it a stop token
    prompt, truth = next((p, t) for p in ((i, 2, 3, 4, 5) for i in range(VOCAB))
                         if (t := reference_outputs(Request("x", list(p), SamplingParams(max_tokens=8)), 64))[2]
                         not in t[:2])
    sched, model, r = _decoding_scheduler(stop=(truth[2],), prompt=prompt)
    plan = schedule_speculative(sched, each(lambda req, cap: truth[1:cap + 1]), 64)
    assert plan.num_drafts.tolist() == [6]
    outcome = update_speculative(sched, plan, spec_sample(model, plan))
    assert outcome.finished == [r] and r.output_token_ids == truth[:3]
    assert r.status is RequestStatus.FINISHED_STOPPED and sched.kv_cache_manager.block_pool.num_used == 0


def test_a_proposer_that_returns_more_than_asked_is_an_error():
    sched, _, _ = _decoding_scheduler()
    with pytest.raises(ValueError, match="returned 9 tokens for request 'a', at most 6"):
        schedule_speculative(sched, each(lambda req, cap: [0] * 9), 64)


def test_a_proposer_that_answers_another_number_of_requests_is_an_error():
    sched, _, _ = _decoding_scheduler()
    with pytest.raises(ValueError, match="the proposer returned 2 proposals for 1 requests"):
        schedule_speculative(sched, each(lambda asks: [[1], [2]], batched=True), 64)


def test_no_proposal_leaves_the_plan_as_the_scheduler_made_it():
    sched, model, r = _decoding_scheduler()
    plan = schedule_speculative(sched, each(lambda req, cap: []), 64)
    assert plan.num_drafts is None
    np.testing.assert_array_equal(plan.logits_indices, [0])
    assert update_speculative(sched, plan, model.step(plan)).num_sequences == 0
    assert r.num_output_tokens == 2


def test_proposals_follow_a_decoding_request_only_and_never_past_its_limits():
    # 4 computed tokens in a block of 4, its last token the first of the next block; one output: 3 more to go, so
    # at most 2 proposals may be verified
    sched, _, r = _decoding_scheduler(max_tokens=4, prompt=(1, 2, 3, 4))
    with pytest.raises(ValueError, match="at most 2 may still be verified"):
        sched.set_draft_tokens(r, [1, 2, 3])
    waiting = Request("w", [1, 2, 3], SamplingParams(max_tokens=4).with_defaults(DEFAULTS))
    sched.add_request(waiting)
    with pytest.raises(ValueError, match="follow a decoding request's last token"):
        sched.set_draft_tokens(waiting, [1])
    assert sched.reserve_draft_slots(r, 2) is not None
    sched.set_draft_tokens(r, [4])
    assert sched.kv_cache_manager.num_held_blocks("a") == 2  # its last token and one proposal, no more
    Checker(sched).check()
    sched.set_draft_tokens(r, [])
    assert sched.kv_cache_manager.num_held_blocks("a") == 1  # no proposal: its computed tokens' block only
    Checker(sched).check()
