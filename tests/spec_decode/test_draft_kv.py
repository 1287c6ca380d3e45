"""A draft model's KV bookkeeping (`pagedjax.spec_decode.draft_kv`) in the speculation state machine, with a fake draft
model over a shadow KV cache of its own at the target's block ids.

The fake draft is the fake target model itself (`FakeDraft(other=False)`): its greedy proposal is the target's
next token whenever the draft KV it reads is right, so every proposal must be accepted (acceptance 1): any catch-up
token missed, KV read from a block the request no longer holds, stale KV after a preemption, a rejected proposal's
KV taken for an accepted token, or a copy-on-write block not recomputed would propose a wrong token. After every
step, the positions `draft_start` claims valid hold the request's tokens in the draft's shadow KV. A draft that
disagrees (`other=True`, another salt) still gives the reference outputs (the machine's teardown), as any draft must.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.config.sampling import SamplingDefaults
from pagedjax.core.request import Request
from pagedjax.core.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams
from pagedjax.spec_decode.draft_kv import DraftKV, draft_plan, draft_proposals, draft_start
from pagedjax.spec_decode.proposer import ProposalAsk
from tests.core.harness import Checker, FakeModel, next_token
from tests.spec_decode.test_speculation import SpeculationMachine

# What an engine gives every request it takes (these tests make Requests without one; the speculator reads them).
DEFAULTS = SamplingDefaults()


class FakeDraft:
    """The fake model as a draft over its own shadow KV; `other`: a disagreeing one (a salt of its own). Records
    each call's plan."""

    def __init__(self, num_blocks: int, block_size: int, salts: dict[str, int], other: bool):
        self.model = FakeModel(num_blocks, block_size)
        self.salts, self.other = salts, other
        self.plans = []

    def __call__(self, plan) -> np.ndarray:
        self.plans.append(plan)
        assert len(set(plan.request_ids)) == plan.num_seqs, "a request twice in one draft call"
        assert (plan.slot_mapping >= 0).all()
        written: dict[int, int] = {}
        for slot, token in zip(plan.slot_mapping.tolist(), plan.token_ids.tolist(), strict=True):
            # two requests may write one slot of a shared block in one call: the same token at the same position
            assert written.setdefault(slot, token) == token, "two tokens written into one draft slot"
        self.model.kv[plan.slot_mapping] = plan.token_ids
        return np.array([next_token(self.model.read(plan.block_tables[s], int(plan.kv_lens[s])),
                                    99 if self.other else self.salts.get(rid, 0))
                         for s, rid in enumerate(plan.request_ids)], np.int32)


class DraftCaller:
    """The machine's proposer: `draft_proposals` over a `FakeDraft`, recording each request's cap."""

    def __init__(self, draft: FakeDraft, block_size: int, max_tokens: int, k: int):
        self.draft, self.block_size, self.max_tokens, self.k = draft, block_size, max_tokens, k
        self.asked: dict[str, int] = {}
        self.epoch = 0
        self.states: dict[str, DraftKV] = {}

    def forget(self, live_request_ids) -> None:
        for rid in [rid for rid in self.states if rid not in live_request_ids]:
            del self.states[rid]

    def propose(self, asks: list[ProposalAsk], step=None) -> list[list[int]]:
        if not asks:  # the speculator asks after every step
            return draft_proposals(asks, self.draft, self.states, block_size=self.block_size,
                                   max_tokens=self.max_tokens, epoch=self.epoch)
        for ask in asks:
            self.asked[ask.request.request_id] = ask.cap
        calls = len(self.draft.plans)
        proposals = draft_proposals(asks, self.draft, self.states, block_size=self.block_size,
                                    max_tokens=self.max_tokens, epoch=self.epoch)
        plans = self.draft.plans[calls:]
        longest = max(ask.cap for ask in asks)
        # batched: the catch-up calls (each within max_tokens), then one decode call per further proposal, each for
        # every request that has a token in it
        catch_up = plans[:len(plans) - (longest - 1)]
        assert catch_up and all(p.num_tokens <= self.max_tokens for p in catch_up)
        for j, p in enumerate(plans[len(catch_up):], start=1):
            assert p.num_tokens == p.num_seqs == sum(ask.cap > j for ask in asks)
        assert [len(p) for p in proposals] == [ask.cap for ask in asks]
        return proposals


class DraftSpeculationMachine(SpeculationMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(6, 30),
                budget=st.sampled_from([2, 5, 64]), caching=st.booleans(), k=st.integers(1, 4), other=st.booleans())
    def setup(self, block_size, num_blocks, budget, caching, k, other):
        self.max_model_len = 20
        self.budget = budget
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                               max_model_len=self.max_model_len),
                               CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks)
        self.salts: dict[str, int] = {}
        self.model = FakeModel(num_blocks, block_size, self.salts)
        self.window = None
        self.checker = Checker(self.sched, self.model)
        self.other = other
        self.proposer = DraftCaller(FakeDraft(num_blocks, block_size, self.salts, other), block_size, budget, k)
        self.finished: list[Request] = []
        self.aborted: set[str] = set()
        self.next_id = 0

    @rule()
    def spec_step(self):
        self.last_outcome = None
        super().spec_step()
        outcome = self.last_outcome
        if outcome is not None and outcome.num_sequences and not self.other:
            assert outcome.num_accepted == outcome.num_proposed, "the target's own draft had a proposal rejected"
            event("draft: all accepted")
        self.check_draft_kv()

    @rule()
    def lose_draft_kv(self):
        """The engine lost the draft's KV arrays: a new epoch, and the shadow KV unwritten (read: an error)."""
        self.proposer.epoch += 1
        self.proposer.draft.model.kv[:] = -1

    def check_draft_kv(self):
        bs = self.sched.block_size
        for r in self.sched.running:
            blocks, allocations = self.sched.draft_blocks(r)
            n = draft_start(ProposalAsk(r, 1, blocks, allocations), self.proposer.states.get(r.request_id), bs,
                            self.proposer.epoch)
            if n:
                event("draft KV reused")
            pos = np.arange(n)
            slots = np.asarray(blocks, np.int64)[pos // bs] * bs + pos % bs
            np.testing.assert_array_equal(self.proposer.draft.model.kv[slots], r.get_token_ids(0, n),
                                          err_msg=f"draft KV of {r.request_id}")


DraftSpeculationMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                                     suppress_health_check=[HealthCheck.too_slow])
TestDraftSpeculation = DraftSpeculationMachine.TestCase


def test_a_proposal_equal_to_a_stop_token_is_accepted(monkeypatch):
    """Found by CI's run of the machine: a request's first output token, a stop id, equal to the draft's
    proposal finished the request at it, and the count took the proposal for a rejected one (it counted appended
    tokens, cut by the stop)."""
    monkeypatch.setattr("tests.spec_decode.test_speculation.event", lambda *_: None)
    monkeypatch.setattr(__name__ + ".event", lambda *_: None)
    state = DraftSpeculationMachine()
    state.setup(block_size=1, num_blocks=10, budget=2, caching=False, k=1, other=False)
    for _ in range(6):
        state.add(held=False, max_tokens=1, prompt=[0], samples=1, stop=False)
    state.add(held=False, max_tokens=2, prompt=[0] * 9, samples=2, stop=True)
    proposed = 0
    while state.sched.has_unfinished_requests():
        state.spec_step()
        proposed += state.last_outcome.num_proposed
    assert proposed > 0  # the example still verifies a proposal
    state.teardown()


@pytest.mark.parametrize("second", [[0, 2, 0, 0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0, 0]])
def test_a_reserved_block_given_back_and_taken_again_is_not_trusted(monkeypatch, second):
    """Found by a random run: a sample's block reserved for its proposal (its draft KV written there) went back
    unused when the step had no budget for it, another sample took it and wrote it, then the first took the same
    block id again and trusted its stale draft KV (a rejected proposal; in the other example, KV that did not hold
    its tokens). The blocks' allocation counts tell the two apart."""
    monkeypatch.setattr("tests.spec_decode.test_speculation.event", lambda *_: None)
    monkeypatch.setattr(__name__ + ".event", lambda *_: None)
    state = DraftSpeculationMachine()
    state.setup(block_size=2, num_blocks=9, budget=2, caching=True, k=1, other=False)
    state.add(held=False, max_tokens=1, prompt=[0], samples=2, stop=False)
    for _ in range(5):
        state.add(held=False, max_tokens=1, prompt=[0], samples=1, stop=False)
    state.add(held=False, max_tokens=1, prompt=[0, 0], samples=1, stop=False)
    state.add(held=False, max_tokens=8, prompt=second, samples=2, stop=False)
    state.add(held=False, max_tokens=1, prompt=[0, 0], samples=1, stop=False)
    state.teardown()  # steps to the end: every proposal accepted, the draft KV checked after each step


def _decoding(tokens: list[int], computed: int, blocks: tuple[int, ...], preemptions: int = 0) -> ProposalAsk:
    r = Request("a", tokens[:2], SamplingParams().with_defaults(DEFAULTS), output_token_ids=tokens[2:],
                num_computed_tokens=computed, num_preemptions=preemptions)
    return ProposalAsk(r, 2, blocks)


@pytest.mark.parametrize("state, ask, start", [
    (None, _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9)), 0),  # nothing computed yet
    (DraftKV(4, (), (7, 8), 0, 0), _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9)), 4),
    (DraftKV(6, (4, 9, 9), (7, 8, 9), 0, 0), _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9)), 4),  # 9 was rejected at 4
    (DraftKV(5, (4, 9), (7, 8, 9), 0, 0), _decoding([1, 2, 3, 4, 5, 6], 5, (7, 8, 9)), 4),  # ... computed since
    (DraftKV(5, (4, 5), (7, 8, 9), 0, 0), _decoding([1, 2, 3, 4, 5, 6], 5, (7, 8, 9)), 5),  # all accepted
    (DraftKV(6, (4, 5, 6), (7, 8, 9), 0, 0), _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9)), 5),  # 6 not verified yet
    (DraftKV(4, (), (7, 8), 0, 0), _decoding([1, 2, 3, 4, 5], 4, (7, 5, 9)), 2),  # block 1 was copied on write
    (DraftKV(4, (), (7, 8), 0, 0), _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9), preemptions=1), 0),
    (DraftKV(4, (), (7, 8), 0, 1), _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9)), 0),  # another epoch: KV lost
    # block 8 allocated again since (given back and taken again): its KV may be another request's
    (DraftKV(4, (), (7, 8), 0, 0, (1, 1)), _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9))._replace(
        block_allocations=(1, 2, 1)), 2),
    (DraftKV(4, (), (7, 8), 0, 0, (1, 1)), _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9))._replace(
        block_allocations=(1, 1, 3)), 4),
])
def test_draft_start(state, ask, start):
    assert draft_start(ask, state, 2, 0) == start


def test_draft_plan_places_each_row_at_its_positions_and_refuses_a_token_without_a_block():
    a = _decoding([1, 2, 3, 4, 5], 4, (7, 8, 9))
    plan = draft_plan([(a, 1, [2, 3, 4, 5]), (a._replace(request=Request("b", [6])), 0, [6])], 2)
    np.testing.assert_array_equal(plan.positions, [1, 2, 3, 4, 0])
    np.testing.assert_array_equal(plan.slot_mapping, [15, 16, 17, 18, 14])
    np.testing.assert_array_equal(plan.kv_lens, [5, 1])
    with pytest.raises(ValueError, match="a draft token has no block"):
        draft_plan([(a, 4, [5, 0, 0])], 2)
