"""Failed steps on the host: a step that failed on device (`Scheduler.fail_step`) fails its request if it ran
alone; otherwise its requests are preempted and marked suspect, and each suspect runs alone in its next step
(`schedule_alone`). A device that lost its KV cache (`Scheduler.drop_computed_kv`) costs every running
request a recompute, and the prefix cache forgets every block.

Plain Python, no JAX.

Invariant: nothing a failed step computed is trusted, and only a request that breaks a step alone fails.
Each request of a failed step either fails by itself (it ran alone: FINISHED_ERROR, blocks freed) or is
preempted by recompute, which is exact, and marked `suspect`; a suspect at the head of the waiting queue is
scheduled before anything else, alone, so the others lose at most a recompute (a suspect's flag is cleared
by its next successful step). After `drop_computed_kv` no request holds a block and the prefix cache is
empty, so no KV the device lost is ever read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.step_plan import StepPlan

if TYPE_CHECKING:
    from pagedjax.core.scheduler import Scheduler


def fail_step(scheduler: Scheduler, request_ids: Sequence[str], error: str) -> list[Request]:
    """See `Scheduler.fail_step`."""
    scheduler._check_no_pending_fused()
    live = [scheduler.requests[rid] for rid in request_ids if rid in scheduler.requests]
    if len(request_ids) == 1 and live:
        request = live[0]
        request.error = error
        scheduler._finish_early(request, RequestStatus.FINISHED_ERROR)
        return [request]
    for request in live:
        if request.status is RequestStatus.RUNNING:
            scheduler.running.remove(request)
            scheduler._preempt(request)
        request.suspect = True
    return []


def drop_computed_kv(scheduler: Scheduler) -> None:
    """See `Scheduler.drop_computed_kv`."""
    scheduler._check_no_pending_fused()
    while scheduler.running:
        scheduler._preempt(scheduler.running.pop())  # newest first: the oldest ends at the front of the queue
    if not scheduler.kv_cache_manager.reset_prefix_cache():
        raise RuntimeError("blocks are still in use after preempting every request (a bug)")


def schedule_alone(scheduler: Scheduler, request: Request) -> StepPlan:
    """A step of `request` alone (a suspect, see `fail_step`): running requests wait one step, and the
    newest are preempted if the pool cannot hold its next chunk otherwise."""
    kv = scheduler.kv_cache_manager
    hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
    n = min(request.num_tokens - num_hit_tokens, scheduler.scheduler_config.max_num_batched_tokens)
    preempted: list[Request] = []
    while len(scheduler.running) >= scheduler.scheduler_config.max_num_seqs:
        preempted.append(scheduler.running.pop())
        scheduler._preempt(preempted[-1])
    while kv.allocate_slots(request, n, hit_blocks) is None:
        if not scheduler.running:
            raise RuntimeError(f"request {request.request_id!r} does not fit an idle pool (a bug)")
        victim = scheduler.running.pop()
        scheduler._preempt(victim)
        preempted.append(victim)
    scheduler._admit(request, num_hit_tokens)
    scheduler.num_steps += 1
    return scheduler._plan([(request, n)], preempted_request_ids=[r.request_id for r in preempted])
