"""Forks on the scheduler: the samples of one multi-sample request (best_of / n > 1) and beam search's forks
of running requests, held requests, and the bookkeeping of a multi-sample request's group.

Plain Python, no JAX. A multi-sample request is queued as a `prefill_only` request of its prompt but the last
token (a one-token prompt: as its samples at once); when that is done it is forked into the samples, each of
which computes the last prompt token and samples with its own seed (seed + index). Beam search forks running
requests itself (`fork`, with `hold`: a held request pauses after each token until `resume`).

Invariant: a fork (a sample, or a beam) starts from its source's computed tokens, which are its own first
tokens, and shares its source's blocks only through the pool's refcounts (`KVCacheManager.fork`); a shared
block, the partial last one included, is copied before its first write (copy-on-write, `StepPlan.block_copies`),
so no request ever writes into a block another one reads. A multi-sample request is in `Scheduler.groups`
(by the caller's id) from `add_request` until its prefill fails or is aborted, or its last sample leaves;
its samples take its prefill's place in the running queue (those beyond max_num_seqs wait at the front of
the waiting queue, recomputing through the prefix cache), and the prefill itself is never reported.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pagedjax.core.request import Request, RequestStatus, SampleGroup, sample_id

if TYPE_CHECKING:
    from pagedjax.core.scheduler import Scheduler


def add_multi_sample(scheduler: Scheduler, request: Request) -> None:
    """Queue a checked multi-sample request: as its prefill, or, for a one-token prompt, as its samples."""
    k = request.sampling_params.num_samples
    group = scheduler.groups[request.request_id] = SampleGroup(request)
    if request.num_prompt_tokens == 1:
        group.samples = [make_sample(group, i) for i in range(k)]
        for sample in group.samples:
            scheduler._register(sample)
            scheduler.waiting.append(sample)
        return
    params = request.sampling_params
    prefill = Request(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids[:-1],
                      sampling_params=params, eos_token_ids=request.eos_token_ids,
                      cache_salt=request.cache_salt, adapter_id=request.adapter_id, group=group,
                      prefill_only=True, prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
    scheduler._register(prefill)
    scheduler.waiting.append(prefill)


def make_sample(group: SampleGroup, index: int) -> Request:
    """Sample `index` of a multi-sample request: a single request of the same prompt with seed + index."""
    r = group.request
    p = r.sampling_params
    params = dataclasses.replace(p, n=1, best_of=None, prompt_logprobs=None,
                                 seed=None if p.seed is None else p.seed + index)
    return Request(request_id=sample_id(r.request_id, index), prompt_token_ids=r.prompt_token_ids,
                   sampling_params=params, eos_token_ids=r.eos_token_ids, cache_salt=r.cache_salt,
                   adapter_id=r.adapter_id, group=group, sample_index=index,
                   logprobs=[] if params.logprobs is not None else None,
                   constraint=None if r.constraint is None else r.constraint.copy())  # each its own state


def spawn_samples(scheduler: Scheduler, prefill: Request) -> None:
    """A multi-sample request's prefill is done: fork it into its samples, which take its place in the
    running queue (those beyond max_num_seqs wait, at the front of the queue), and drop it."""
    group = prefill.group
    assert group is not None
    kv = scheduler.kv_cache_manager
    group.samples = [make_sample(group, i) for i in range(group.request.sampling_params.num_samples)]
    group.prompt_logprobs = prefill.prompt_logprobs
    room = scheduler.scheduler_config.max_num_seqs - len(scheduler.running) + 1
    placed = group.samples[:room]
    for sample in placed:
        kv.fork(prefill, sample)
        sample.num_computed_tokens = prefill.num_computed_tokens
        sample.num_cached_tokens = prefill.num_cached_tokens
        sample.status = RequestStatus.RUNNING
    i = scheduler.running.index(prefill)
    scheduler.running[i:i + 1] = placed
    scheduler.waiting.extendleft(reversed(group.samples[room:]))
    kv.free(prefill)
    del scheduler.requests[prefill.request_id]
    del scheduler._stop_ids[prefill.request_id]
    prefill.status = RequestStatus.FINISHED_STOPPED  # done; never reported (the group is)
    for sample in group.samples:
        scheduler._register(sample)


def fork(scheduler: Scheduler, source_id: str, child: Request) -> None:
    """See `Scheduler.fork`."""
    scheduler._check_no_pending_fused()
    source = scheduler.requests.get(source_id)
    if source is None or source.status is not RequestStatus.RUNNING:
        raise ValueError(f"request {source_id!r} is not running; only a running request can be forked")
    if len(scheduler.running) >= scheduler.scheduler_config.max_num_seqs:
        raise ValueError(f"cannot fork {source_id!r}: max_num_seqs={scheduler.scheduler_config.max_num_seqs} "
                         "requests are running")
    if child.request_id in scheduler.requests or child.request_id in scheduler.groups:
        raise ValueError(f"duplicate request id {child.request_id!r}")
    scheduler.kv_cache_manager.fork(source, child)
    child.num_computed_tokens = source.num_computed_tokens
    child.num_cached_tokens = max(source.num_cached_tokens, 0)
    child.status = RequestStatus.RUNNING
    scheduler._register(child)
    scheduler.running.append(child)


def replace_last_token(scheduler: Scheduler, request_id: str, token: int) -> None:
    """See `Scheduler.replace_last_token`."""
    request = scheduler.requests.get(request_id)
    if request is None or not request.paused or not request.output_token_ids:
        raise ValueError(f"request {request_id!r} is not a paused request with outputs")
    assert request.num_computed_tokens < request.num_tokens  # a paused request's last token is never computed
    request.output_token_ids[-1] = int(token)
    del request.block_hashes[(request.num_tokens - 1) // scheduler.block_size:]  # a hash over the old token


def resume(scheduler: Scheduler, request_id: str) -> None:
    """See `Scheduler.resume`."""
    request = scheduler.requests.get(request_id)
    if request is None:
        raise ValueError(f"unknown request {request_id!r}")
    request.paused = False


def abort_group(scheduler: Scheduler, group: SampleGroup) -> Request:
    """Abort a multi-sample request (already taken out of `groups`): every member still queued is finished
    as aborted and freed. Returns the caller's request."""
    group.request.status = RequestStatus.FINISHED_ABORTED
    request_id = group.request.request_id
    members = [scheduler.requests.get(request_id)] + [scheduler.requests.get(i) for i in group.sample_ids]
    for member in members:
        if member is not None and member.group is group:
            scheduler._finish_early(member, RequestStatus.FINISHED_ABORTED)
    return group.request


def forget_finished_group(scheduler: Scheduler, request: Request) -> None:
    """A member of a multi-sample request left: the group ends when its prefill fails or is aborted (with
    that status), or when its last sample finishes."""
    group = request.group
    if group is None or scheduler.groups.get(group.request.request_id) is not group:
        return
    if request.prefill_only:
        group.request.status, group.request.error = request.status, request.error
    elif not group.finished:
        return
    del scheduler.groups[group.request.request_id]
