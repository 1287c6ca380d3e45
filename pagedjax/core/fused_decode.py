"""Fused decode on the host: when every running request is a pure decode, the scheduler plans up
to n decode steps that the device runs in one go, lending it the blocks they may need, and reconciles the
host with what the device did afterwards (`Scheduler.schedule_fused_decode`, `update_fused_decode`,
`cancel_fused_decode`).

Plain Python + numpy, no JAX. The arrays are built and the device's results validated by
`pagedjax.core.step_plan` (`FusedDecodePlan`, `reconcile_fused_decode`); this module owns the policy and the
bookkeeping around them.

Invariant: at most one fused decode is in flight (`Scheduler._pending_fused`), and while one is, nothing
else plans a step, forks or fails requests (each such entry point calls `check_no_pending_multi` first), so
the requests and blocks the device works on are the ones the plan saw. The blocks lent to it are held by no
request until the in-flight plan is either reconciled (each request adopts the blocks its table row took, up
to what its new length needs, and every other lent block comes back) or cancelled (every lent block comes
back and no request changes): afterwards nothing is lent, and every block's ref_cnt is its holders again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedjax.core.kv_cache_manager import cdiv
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.step_plan import FusedDecodePlan, reconcile_fused_decode

if TYPE_CHECKING:
    from pagedjax.core.scheduler import Scheduler


def schedule_fused_decode(scheduler: Scheduler, num_steps: int) -> FusedDecodePlan | None:
    """See `Scheduler.schedule_fused_decode`."""
    check_no_pending_multi(scheduler)
    if num_steps < 2 or scheduler.waiting or not scheduler.running:
        return None
    if len(scheduler.running) > scheduler.scheduler_config.max_num_batched_tokens:
        return None
    kv = scheduler.kv_cache_manager
    bs = scheduler.block_size
    max_new: list[int] = []
    num_to_lend = 0
    width = 0
    for r in scheduler.running:
        # A held request (beam search) runs one token at a time; a fork's first write into its shared
        # block needs a copy-on-write, which only a plain step makes (one step, then fused again); a
        # constrained request (structured output) needs its token mask from the host before every token.
        if (r.num_tokens - r.num_computed_tokens != 1 or r.hold or r.prefill_only or kv.needs_copy(r)
                or r.constraint is not None):
            return None
        m = min(num_steps, scheduler.max_new_tokens_left(r))
        max_new.append(m)
        num_to_lend += cdiv(r.num_computed_tokens + m, bs) - kv.num_held_blocks(r.request_id)
        width = max(width, cdiv(r.num_tokens + num_steps - 1, bs))
    lent = kv.lend_blocks(num_to_lend)
    if lent is None:
        return None
    plan = scheduler._plan([(r, 1) for r in scheduler.running], min_width=width, allow_missing_blocks=True)
    assert plan.request_ids == [r.request_id for r in scheduler.running]
    scheduler.num_steps += 1
    scheduler._pending_fused = FusedDecodePlan(plan=plan, lent_block_ids=np.array(lent, dtype=np.int32),
                                             max_new_tokens=np.array(max_new, dtype=np.int32),
                                             num_steps=num_steps, block_size=bs)
    return scheduler._pending_fused


def check_no_pending_multi(scheduler: Scheduler) -> None:
    """RuntimeError while a fused decode is in flight (called by everything that changes the queues)."""
    if scheduler._pending_fused is not None:
        raise RuntimeError("a fused decode is in flight: call update_fused_decode (or "
                           "cancel_fused_decode) before scheduling again")


def check_pending_multi(scheduler: Scheduler, plan: FusedDecodePlan) -> None:
    if plan is not scheduler._pending_fused:
        raise RuntimeError("this fused decode plan is not the one in flight")


def cancel_fused_decode(scheduler: Scheduler, plan: FusedDecodePlan) -> None:
    """See `Scheduler.cancel_fused_decode`."""
    check_pending_multi(scheduler, plan)
    scheduler.kv_cache_manager.return_lent_blocks(plan.lent_block_ids.tolist())
    scheduler._pending_fused = None


def update_fused_decode(scheduler: Scheduler, plan: FusedDecodePlan, sampled_token_ids: np.ndarray,
                        block_tables: np.ndarray) -> list[Request]:
    """See `Scheduler.update_fused_decode`."""
    check_pending_multi(scheduler, plan)
    step = plan.plan
    n = step.num_seqs
    sampled = np.asarray(sampled_token_ids)
    tables = np.asarray(block_tables)
    if sampled.ndim != 2 or sampled.shape[1] < n:
        raise ValueError(f"sampled_token_ids must be [num_steps, >= {n}], got {sampled.shape}")
    if tables.ndim != 2 or tables.shape[0] < n:
        raise ValueError(f"block_tables must be [>= {n}, max_blocks], got {tables.shape}")
    kv = scheduler.kv_cache_manager
    live = [r if r is not None and r.status is RequestStatus.RUNNING else None  # aborted/preempted: skip
            for r in map(scheduler.requests.get, step.request_ids)]
    outcomes = reconcile_fused_decode(plan, sampled, tables, live, [kv.get_block_ids(rid) for rid in
                                                                     step.request_ids], scheduler._finish_status)
    claimed = {b for o in outcomes for b in o.new_blocks}
    finished: list[Request] = []
    for o in outcomes:
        r = o.request
        r.output_token_ids.extend(o.tokens)
        r.num_computed_tokens += len(o.tokens)
        if o.new_blocks:
            kv.adopt_blocks(r, o.new_blocks)
        kv.cache_blocks(r)
        if o.status is not None:
            r.status = o.status
            finished.append(r)
        else:
            kv.release_out_of_window(r)
    kv.return_lent_blocks([b for b in plan.lent_block_ids.tolist() if b not in claimed])
    scheduler._pending_fused = None
    if finished:
        scheduler._remove_finished(finished)
    return finished
