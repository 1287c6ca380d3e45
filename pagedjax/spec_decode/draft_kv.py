"""A draft model's proposals over the target's paged KV cache, the host side: which tokens the draft runs in a
step, where its KV goes, and how much of it is still valid at the next step. Plain Python + numpy, no JAX (the
engine runs the draft model: `pagedjax.spec_decode.draft_model`).

Where the draft's KV lives: in arrays of its own (its layers, heads and head size) addressed by the target's block
ids, so a request's blocks hold both models' KV at the same slots and there is no second allocator. The proposals'
positions get their blocks the way the target's do: `Scheduler.reserve_draft_slots` makes a request's blocks cover
`1 + cap` more tokens before the proposer is asked (`ProposalAsk.block_ids`), and `set_draft_tokens` returns what
the proposal does not need.

One step's proposals for a batch of asks, at most `cap` tokens each (`draft_proposals`):
  1. catch-up: each request's tokens the draft has not computed, up to and including its last token t (at
     position c = num_computed_tokens), run as one chunk: the prompt, the token accepted beyond the draft's last
     proposals, a prefix-cache hit the draft never computed, a recompute after a preemption. The draft's logits at
     t give the first proposal d_1;
  2. d_j at position c + j gives d_{j+1}, for j = 1 .. cap - 1.
  Every call runs all the asked requests that have a token in it: one call for the catch-up (more when the chunks
  exceed `max_tokens`) and one per further proposal, whatever the batch.
  Afterwards the draft has computed positions c .. c + cap - 1 (t, d_1 .. d_{cap-1}).

Validity (`DraftKV`, the proposer's record of the request), checked when the request is next asked, so the
scheduler needs no hook: the draft's KV of positions [0, c + 1) is in the request's blocks, and of the positions after c
as far as the tokens the draft ran there (its proposals) are the request's tokens now, i.e. accepted: the first rejected
proposal's position holds the target's token, not the draft's, and the verifying step released the blocks past it
(`Scheduler.update`; the last block kept holds only positions up to there or rejected ones). Unless
  - a preemption since (the request's `num_preemptions` changed) freed its blocks: 0 (a failed step's requests are
    preempted or finished too: `Scheduler.fail_step`);
  - a block the request holds now that differs from the one it held then (copy-on-write of a block shared with a
    fork), or is the same block allocated again since (a reserved block the step did not use goes back, and
    another request may write it before this one takes it again: `BlockPool.allocations`), invalidates the KV
    from that block on;
  - `epoch` differs: the engine lost the draft's KV arrays (a failed draft call): 0.
A new request (a fork too) starts at 0: a prefix-cache hit is recomputed by the draft, into the shared blocks: the
same tokens at the same positions, so the same KV as any other holder's (up to rounding). A sliding-window target
releases leading blocks the catch-up would write into: the engine refuses a draft model for one.

Exactness does not depend on any of this: a proposal is only ever verified by the target
(`pagedjax.core.step_result`), so wrong draft KV costs acceptance, never tokens. The bookkeeping is what makes a
draft identical to the target accept every proposal (tested).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pagedjax.core.kv_cache_manager import cdiv
from pagedjax.core.step_plan import StepPlan
from pagedjax.spec_decode.proposer import ProposalAsk

# Runs a draft step: the draft's greedy token after each sequence's last token of the plan, i32[num_seqs].
RunDraft = Callable[[StepPlan], np.ndarray]


@dataclass
class DraftKV:
    """How far a request's draft KV is computed (see the module's docstring for when it stays valid)."""

    num_computed: int  # the draft's KV of positions [0, num_computed) was written into `block_ids`' blocks
    tail: tuple[int, ...]  # the tokens it ran at the last len(tail) of them: t and its proposals but the last
    block_ids: tuple[int, ...]  # the request's blocks covering those positions when they were written
    num_preemptions: int  # the request's count then
    epoch: int  # the engine's draft KV arrays' epoch then
    block_allocations: tuple[int, ...] = ()  # those blocks' allocation counts then (`ProposalAsk.block_allocations`)


def draft_start(ask: ProposalAsk, state: DraftKV | None, block_size: int, epoch: int) -> int:
    """The first position of `ask.request` whose draft KV is not (or no longer) valid (`state`: its record)."""
    request = ask.request
    if (not isinstance(state, DraftKV) or state.epoch != epoch
            or state.num_preemptions != request.num_preemptions):
        return 0
    n = state.num_computed - len(state.tail)  # the request's tokens when the draft ran: valid
    for token in state.tail:  # then its proposals as far as they were accepted
        if n >= request.num_tokens or request.get_token_id(n) != token:
            break
        n += 1
    then = zip(state.block_ids, state.block_allocations or (None,) * len(state.block_ids), strict=True)
    now = zip(ask.block_ids, ask.block_allocations or (None,) * len(ask.block_ids), strict=True)
    same = next((i for i, (a, b) in enumerate(zip(then, now, strict=False)) if a != b),
                min(len(state.block_ids), len(ask.block_ids)))
    return min(n, same * block_size)


def draft_plan(rows: list[tuple[ProposalAsk, int, list[int]]], block_size: int) -> StepPlan:
    """The draft step running, for each `(ask, start, tokens)`, `tokens` at positions start, start + 1, ... through
    the ask's blocks; it samples after each row's last token."""
    n = len(rows)
    q_lens = np.fromiter((len(t) for _, _, t in rows), np.int32, n)  # i32[S]
    starts = np.fromiter((s for _, s, _ in rows), np.int32, n)  # i32[S]
    cu_q_lens = np.zeros(n + 1, np.int32)  # i32[S + 1]
    np.cumsum(q_lens, out=cu_q_lens[1:])
    total = int(cu_q_lens[-1])
    width = max(len(ask.block_ids) for ask, _, _ in rows)
    tables = np.zeros((n, width), np.int32)  # i32[S, B]
    for i, (ask, _, _) in enumerate(rows):
        tables[i, :len(ask.block_ids)] = ask.block_ids
    seq = np.repeat(np.arange(n), q_lens)  # i32[T]
    positions = (np.arange(total) - cu_q_lens[:-1][seq] + starts[seq]).astype(np.int32)  # i32[T]
    if (positions // block_size >= np.fromiter((len(a.block_ids) for a, _, _ in rows), np.int32, n)[seq]).any():
        raise ValueError("a draft token has no block")  # `reserve_draft_slots` allocates them first
    slots = (tables[seq, positions // block_size] * block_size + positions % block_size).astype(np.int32)
    return StepPlan(request_ids=[ask.request.request_id for ask, _, _ in rows],
                    token_ids=np.fromiter(itertools.chain.from_iterable(t for _, _, t in rows), np.int32, total),
                    positions=positions, cu_q_lens=cu_q_lens, kv_lens=starts + q_lens, block_tables=tables,
                    slot_mapping=slots, emits_token=np.ones(n, bool), num_decodes=n if total == n else 0)


def draft_proposals(asks: list[ProposalAsk], run: RunDraft, states: dict[str, DraftKV], *, block_size: int,
                    max_tokens: int, epoch: int) -> list[list[int]]:
    """Each ask's `cap` greedy proposals of the draft model that `run` runs (see the module's docstring), and its
    `DraftKV` in `states` (by request id) updated. `max_tokens`: the most tokens one draft call runs."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not asks:
        return []
    # 1. catch-up: [start, num_tokens) per request, in calls of at most max_tokens tokens
    todo = {i: draft_start(ask, states.get(ask.request.request_id), block_size, epoch) for i, ask in enumerate(asks)}
    proposals: list[list[int]] = [[] for _ in asks]
    while todo:
        rows, budget, ends = [], max_tokens, []
        for i, start in todo.items():
            if budget == 0:
                break
            request = asks[i].request
            end = min(request.num_tokens, start + budget)
            rows.append((asks[i], start, request.get_token_ids(start, end)))
            ends.append((i, end))
            budget -= end - start
        sampled = run(draft_plan(rows, block_size))
        for (i, end), token in zip(ends, sampled.tolist(), strict=True):
            if end == asks[i].request.num_tokens:
                proposals[i].append(int(token))
                del todo[i]
            else:
                todo[i] = end
    # 2. one token per call: d_j at c + j gives d_{j+1}
    for j in range(1, max(ask.cap for ask in asks)):
        live = [i for i, ask in enumerate(asks) if ask.cap > j]
        rows = [(asks[i], asks[i].request.num_computed_tokens + j, [proposals[i][-1]]) for i in live]
        for i, token in zip(live, run(draft_plan(rows, block_size)).tolist(), strict=True):
            proposals[i].append(int(token))
    for ask, proposal in zip(asks, proposals, strict=True):
        r = ask.request
        n = r.num_computed_tokens + ask.cap
        tail = (r.get_token_id(n - ask.cap), *proposal[:-1])  # t, d_1 .. d_{cap-1}
        kept = cdiv(n, block_size)
        states[r.request_id] = DraftKV(n, tail, ask.block_ids[:kept], r.num_preemptions, epoch,
                                       ask.block_allocations[:kept])
    return proposals
