"""Speculative decoding's host decisions: which decoding requests verify proposed tokens in a step, how many of
the proposals each accepts, and the paged-KV rollback of the rest.

Plain Python + numpy, no JAX. The proposals come from a callback (`pagedjax.engine.speculative` has the
proposers); the device only samples, at more positions than one per sequence (`StepPlan.logits_indices`).

Verification: a decoding request (gap 1: its last token t's KV is not computed yet) with proposals d_1..d_k runs
its step as the query chunk [t, d_1, ..., d_k] at positions c..c+k (c = num_computed_tokens) through the ragged
path, like a prefill chunk. The token sampled at each of the k + 1 positions, s_0..s_k, is drawn with the
request's own parameters and its seed keyed by output index, exactly as a non-speculative step would draw it. The
request accepts the longest prefix d_1..d_a with d_j == s_{j-1} and emits s_0..s_a (a + 1 tokens).

Exactness: for every j <= a the context before s_j is t, s_0..s_{j-1}: the context a non-speculative run would
have had there, so s_j is the token it would have produced: greedy and seeded outputs are the non-speculative ones,
token for token. For a proposal that is a single token x (q one-hot, as an n-gram proposal is), this is rejection
sampling: x is accepted with probability p(x) = min(1, p(x) / q(x)), and when rejected the emitted token is
distributed as p with x removed, renormalised, i.e. the residual max(0, p - q) normalised; the randomness is the
non-speculative draw's own.

Emission stops at the first emitted token that finishes the request (a stop id, max_tokens, max_model_len):
nothing past it is kept.

Paged KV rollback, the rule:
  - `num_computed_tokens` grows by 1 + a only. The KV written at rejected positions lies past the request's length,
    which no kernel reads, and the request's next step overwrites it.
  - Blocks past `cdiv(num_computed_tokens, block_size)` go back to the pool after the step
    (`KVCacheManager.release_past_computed`), so between steps a request holds exactly its computed tokens' blocks,
    as without speculation (`pagedjax.core.invariants`).
  - Prefix-cache hashes are published only for blocks full of computed, i.e. accepted, tokens (`cache_blocks`
    counts `num_computed_tokens`).
  - Forks keep copy-on-write: the scheduler's own allocation of the step's first token copies a shared last block
    first, so the proposals are written into private blocks only.

Which requests speculate (`speculates`): a decoding request that is not a multi-sample prefill, not held (beam
search takes one token per step), has no structured-output constraint (its matcher would have to walk every
proposal) and no penalties (they count output tokens, which would differ from row to row of the chunk). Its
proposals are capped so that it never computes past max_tokens or max_model_len, by the proposer's own maximum and
by the token budget the plan left. Speculation never preempts: a request's cap shrinks to what the pool's free
blocks cover after the plan.

The proposer is asked once per step for every speculating request (`Propose`: a draft model batches its device
calls), after their blocks cover `1 + cap` more tokens: a draft model writes its own KV at the proposals'
positions into them. Blocks past what the proposal then needs go back at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.step_plan import StepPlan, build_step_plan

if TYPE_CHECKING:
    from pagedjax.core.scheduler import Scheduler


class ProposalAsk(NamedTuple):
    """One request a proposer is asked for at most `cap` (>= 1) tokens to follow its known tokens."""

    request: Request
    cap: int
    block_ids: tuple[int, ...]  # the request's blocks (logical order): they cover its tokens and `cap` more


# A proposer: one proposal (at most `cap` tokens, maybe none) per ask, in order; called once per step.
Propose = Callable[[list[ProposalAsk]], Sequence[Sequence[int]]]


class VerifyOutcome(NamedTuple):
    """What a step's verification did: the requests it finished, and its counts."""

    finished: list[Request]
    num_sequences: int  # sequences that verified proposals
    num_proposed: int  # proposals verified
    num_accepted: int  # of those, accepted (counted before a finished request's truncation)


def speculates(request: Request) -> bool:
    """Whether a decoding request may verify proposals (see the module's docstring)."""
    return (not request.prefill_only and not request.hold and request.constraint is None
            and not request.sampling_params.has_penalties)


def schedule_speculative(scheduler: Scheduler, propose: Propose, max_proposal: int) -> StepPlan:
    """`scheduler.schedule()`, with the proposals of `propose` (at most `max_proposal` per request) added to its
    decoding requests that `speculates` allows, as far as the token budget and the free blocks allow. The plan is
    the scheduler's own (`num_drafts` None) when no request got a proposal."""
    plan = scheduler.schedule()
    if plan.is_empty:
        return plan
    kv = scheduler.kv_cache_manager
    budget = scheduler.scheduler_config.max_num_batched_tokens - plan.num_tokens
    asks: list[ProposalAsk] = []
    for rid, q_len, emits in zip(plan.request_ids, plan.q_lens.tolist(), plan.emits_token.tolist(), strict=True):
        request = scheduler.get_request(rid)
        cap = min(budget, scheduler.max_new_tokens_left(request) - 1, max_proposal)
        if q_len == 1 and emits and cap > 0 and speculates(request):
            while cap and kv.allocate_slots(request, 1 + cap) is None:
                cap -= 1  # never preempt or wait for a proposal: fewer fit in the free blocks
            if cap:
                asks.append(ProposalAsk(request, cap, kv.get_block_ids(rid)))
                budget -= cap
    if not asks:
        return plan
    proposals = propose(asks)
    if len(proposals) != len(asks):
        raise ValueError(f"the proposer returned {len(proposals)} proposals for {len(asks)} requests")
    drafts: dict[str, list[int]] = {}
    for ask, proposal in zip(asks, proposals, strict=True):
        proposal = [int(t) for t in proposal]
        if len(proposal) > ask.cap:
            raise ValueError(f"the proposer returned {len(proposal)} tokens for request {ask.request.request_id!r}, "
                             f"at most {ask.cap} were asked for")
        kv.release_past_computed(ask.request, 1 + len(proposal))  # the blocks of a shorter proposal go back
        if proposal:
            drafts[ask.request.request_id] = proposal
    if not drafts:
        return plan
    scheduled = [(scheduler.get_request(rid), q + len(drafts.get(rid, ())))
                 for rid, q in zip(plan.request_ids, plan.q_lens.tolist(), strict=True)]
    block_ids = {r.request_id: kv.get_block_ids(r.request_id) for r, _ in scheduled}
    copies = [tuple(c) for c in plan.block_copies.tolist()] + kv.take_block_copies()
    return build_step_plan(scheduled, block_ids, scheduler.block_size, preempted_request_ids=plan.preempted_request_ids,
                           block_copies=copies, draft_token_ids=drafts)


def first_rows(plan: StepPlan) -> np.ndarray:
    """int32 [num_seqs + 1]: sequence s's sampled tokens are rows first[s]..first[s + 1] - 1 of the step's
    (`StepPlan.logits_indices`)."""
    rows = np.ones(plan.num_seqs, np.int32) if plan.num_drafts is None else plan.num_drafts + 1
    out = np.zeros(plan.num_seqs + 1, np.int32)
    np.cumsum(rows, out=out[1:])
    return out


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a sequence emits: `sampled` (len(drafts) + 1 tokens, one per position of its query chunk) up to
    and including the first that differs from the proposal at its position (all of them when every proposal
    matched)."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(sampled)} sampled tokens for {len(drafts)} proposals (expected one more)")
    a = 0
    while a < len(drafts) and drafts[a] == sampled[a]:
        a += 1
    return [int(t) for t in sampled[:a + 1]]


def update_speculative(scheduler: Scheduler, plan: StepPlan, sampled: np.ndarray) -> VerifyOutcome:
    """Apply a step of `schedule_speculative` (`Scheduler.update` for a plan without proposals): sampled int
    `[>= len(plan.logits_indices)]`, one token per row. Each verifying sequence emits its `accepted_tokens` (cut at
    the first that finishes it); then it goes through `Scheduler.update` as a one-token step after its accepted
    proposals, and returns the blocks of its rejected ones."""
    if plan.num_drafts is None:
        return VerifyOutcome(scheduler.update(plan, sampled), 0, 0, 0)
    sampled = np.asarray(sampled).reshape(-1)
    first = first_rows(plan)
    if sampled.shape[0] < first[-1]:
        raise ValueError(f"got {sampled.shape[0]} sampled tokens for {int(first[-1])} rows")
    q_lens, kv_lens = plan.q_lens.copy(), plan.kv_lens.copy()
    last = sampled[first[:-1]].astype(np.int32)
    cu = plan.cu_q_lens.tolist()
    verifying: list[Request] = []
    num_proposed = num_accepted = 0
    for i, d in enumerate(plan.num_drafts.tolist()):
        request = scheduler.get_request(plan.request_ids[i])
        if d == 0 or request is None or request.status is not RequestStatus.RUNNING:
            continue  # a request aborted or preempted since the plan: `update` skips it
        if request.num_computed_tokens + q_lens[i] != kv_lens[i]:
            raise RuntimeError(f"stale plan for request {request.request_id!r}: it has "
                               f"{request.num_computed_tokens} computed tokens, the plan ends at {kv_lens[i]}")
        drafts = plan.token_ids[cu[i + 1] - d:cu[i + 1]].tolist()
        emitted = accepted_tokens(drafts, sampled[first[i]:first[i + 1]].tolist())
        num_proposed += d
        num_accepted += len(emitted) - 1
        n_out, n_tok = request.num_output_tokens, request.num_tokens
        keep = next((j + 1 for j, t in enumerate(emitted[:-1])
                     if scheduler._finish_status(request, t, n_out + j + 1, n_tok + j + 1) is not None), len(emitted))
        # The accepted proposals before the last emitted token: their KV is computed, they are outputs now.
        request.output_token_ids.extend(emitted[:keep - 1])
        request.num_computed_tokens += keep - 1
        q_lens[i] = 1
        kv_lens[i] = request.num_computed_tokens + 1
        last[i] = emitted[keep - 1]
        verifying.append(request)
    cu_q_lens = np.zeros_like(plan.cu_q_lens)
    np.cumsum(q_lens, out=cu_q_lens[1:])
    one_token = dataclasses.replace(plan, cu_q_lens=cu_q_lens, kv_lens=kv_lens, num_drafts=None)
    finished = scheduler.update(one_token, last)
    for request in verifying:
        if not request.is_finished:
            scheduler.kv_cache_manager.release_past_computed(request)
    return VerifyOutcome(finished, len(verifying), num_proposed, num_accepted)
