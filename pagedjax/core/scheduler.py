"""Continuous batching: which requests advance by how many tokens each step (policy only; the arrays a
step runs on are built by `pagedjax.core.step_plan`).

Plain Python + numpy, no JAX. One rule, no prefill/decode phases: a request's tokens are its prompt plus
its outputs; `num_computed_tokens` counts those whose KV is in the cache; every step the scheduler closes
the gap `num_tokens - num_computed_tokens` of as many requests as the token budget
(`max_num_batched_tokens`) and `max_num_seqs` allow. A decode is a gap of 1 (the last sampled token); a
prompt longer than the remaining budget is split into chunks across steps (chunked prefill).

Order within a step: running requests first, in admission order, then waiting ones, first come first
served. When a running request cannot get blocks, the most recently admitted running request is
preempted (by recompute: it releases every block, `num_computed_tokens` drops to 0, its outputs are kept,
and it goes to the front of the waiting queue; its released blocks stay findable in the prefix cache).
No waiting request is admitted in a step that preempted.

Why every request finishes (no starvation, no livelock): the oldest running request is never preempted
by anyone but itself, and it can always get its blocks by preempting the others, because `add_request`
rejects a request that could not fit in the whole pool; so it advances by >= 1 token every step and
finishes, after which the next oldest takes its place. An idle waiting queue head is admitted as soon as
nothing runs.

Several samples of one prompt (best_of / n > 1): the prompt but its last token is prefilled once by a
`prefill_only` request; when that is done it is forked into the samples (`KVCacheManager.fork`: shared blocks,
copy-on-write of the partial last one), each of which then computes the last prompt token and samples with
its own seed. Samples beyond `max_num_seqs` wait (and recompute, through the prefix cache). Beam search forks
running requests itself (`fork`, with `hold`: a held request pauses after each token until `resume`). All
of this lives in `pagedjax.core.forking`.

A step that fails on device (`fail_step`) fails its request if it ran alone; otherwise its requests are
preempted and marked suspect, and each suspect runs alone in its next step, so a request that breaks
steps fails by itself and the others lose nothing (recompute is exact). See `pagedjax.core.failures`.

Life of a step: `plan = schedule()` -> the engine runs `plan` -> `update(plan, sampled)`; or, when every
running request is a pure decode, `schedule_fused_decode(n)` -> the engine runs up to n decode steps on
device -> `update_fused_decode(...)` (see `pagedjax.core.fused_decode`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core import failures, forking, fused_decode
from pagedjax.core.invariants import check_scheduler_invariants
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.memory_stats import KVMemoryStats, kv_memory_stats
from pagedjax.core.request import Request, RequestStatus, SampleGroup, sample_id
from pagedjax.core.step_plan import FusedDecodePlan, StepPlan, build_step_plan


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler: its queues, the prefix cache, and the pool's memory."""

    num_waiting: int
    num_running: int
    prefix_cache_queries: int  # prompt tokens of first-time admissions
    prefix_cache_hits: int  # of those, tokens found in the cache
    num_evictions: int  # cached blocks reused for other content
    num_preemptions: int
    num_steps: int  # plans made: schedule() calls plus fused decodes
    memory: KVMemoryStats

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class Scheduler:
    """Waiting and running queues, the token budget, preemption, and the KV cache manager.

    Invariants: a request is in exactly one of `waiting` (FIFO; holds no blocks), `running` (admission
    order; holds `cdiv(num_computed_tokens, block_size)` blocks between steps) or neither (finished /
    aborted, and forgotten). `len(running) <= max_num_seqs`; a step never schedules more than
    `max_num_batched_tokens` tokens.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int, *,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the model's `kv_window` (no layer reads positions older than p - window from
        position p; None when some layer attends globally): running requests release blocks that fell out of
        it after each step."""
        if scheduler_config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len is None: resolve it first "
                             "(SchedulerConfig.resolve(max_position_embeddings))")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager.from_config(cache_config, num_blocks, sliding_window=sliding_window)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, SampleGroup] = {}  # multi-sample requests by the caller's id
        self._stop_ids: dict[str, frozenset[int]] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self._pending_fused: FusedDecodePlan | None = None  # a fused decode not yet reconciled

    # -- requests --------------------------------------------------------------------------------------

    def max_kv_tokens(self, request: Request) -> int:
        """The most tokens whose KV this request can ever need at once: it stops when it reaches
        max_tokens outputs or max_model_len tokens, and its last sampled token is never fed back."""
        p = request.num_prompt_tokens
        return max(p, min(p + request.sampling_params.max_tokens, self.max_model_len) - 1)

    def max_new_tokens_left(self, request: Request) -> int:
        """How many more tokens an unfinished request may still generate (>= 1): up to max_tokens
        outputs, and until it has max_model_len tokens (a prompt of exactly max_model_len tokens still
        gets one)."""
        return max(1, min(request.sampling_params.max_tokens - request.num_output_tokens,
                          self.max_model_len - request.num_tokens))

    def check_request(self, request: Request) -> None:
        """Raise ValueError if `add_request` would refuse `request`: an empty prompt, a prompt longer than
        max_model_len, a duplicate request id, a request that is not fresh, or one that could not fit even
        in an empty pool (`KVCacheManager.max_blocks_held`: with a sliding window, what its window and one
        step's chunk hold at once). Changes nothing."""
        rid = request.request_id
        if rid in self.requests or rid in self.groups or any(rid in g.sample_ids for g in self.groups.values()):
            raise ValueError(f"duplicate request id {rid!r}")
        if request.sampling_params.num_samples > 1:
            taken = [i for i in (sample_id(rid, j) for j in range(request.sampling_params.num_samples))
                     if i in self.requests]
            if taken:
                raise ValueError(f"request {rid!r}: the ids of its samples {taken[:3]} are in use")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r}: empty prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens is longer than "
                             f"max_model_len={self.max_model_len}")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.output_token_ids):
            raise ValueError(f"request {rid!r}: not a fresh request (status {request.status.value}, "
                             f"{request.num_computed_tokens} computed, {request.num_output_tokens} outputs)")
        kv = self.kv_cache_manager
        chunk = self.scheduler_config.max_num_batched_tokens
        need = kv.max_blocks_held(self.max_kv_tokens(request), chunk)
        if need > kv.num_blocks:
            why = "" if kv.sliding_window is None else \
                f" at once (its {kv.sliding_window}-token sliding window and a step of up to {chunk} tokens)"
            raise ValueError(f"request {rid!r}: its prompt and max_tokens may need {need} blocks of {self.block_size}"
                             f" tokens{why}, more than the whole pool of {kv.num_blocks} blocks")

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold: `max_model_len`, or fewer when the pool could
        not hold their KV (its last sampled token needs none; a windowed model needs only its window's)."""
        tokens = self.kv_cache_manager.max_kv_tokens_held(self.scheduler_config.max_num_batched_tokens,
                                                          self.max_model_len - 1)
        return min(self.max_model_len, tokens + 1)

    def add_request(self, request: Request) -> None:
        """Queue a new request (ValueError if `check_request` refuses it). A multi-sample request is queued
        as its prefill (or, for a one-token prompt, as its samples); see `pagedjax.core.forking`."""
        self.check_request(request)
        k = request.sampling_params.num_samples
        if k == 1:
            self._register(request)
            self.waiting.append(request)
            return
        forking.add_multi_sample(self, request)

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._stop_ids[request.request_id] = request.stop_ids

    def fork(self, source_id: str, child: Request) -> None:
        """Start `child` (fresh, same prompt) as a fork of the running request `source_id` between steps (beam
        search): it shares the source's blocks and continues from its computed tokens, which must be the
        child's first tokens. ValueError if the source is not running or max_num_seqs is reached."""
        forking.fork(self, source_id, child)

    def replace_last_token(self, request_id: str, token: int) -> None:
        """Replace the last output token of a paused request whose KV is not computed yet (beam search keeps the
        beam but continues it with another token)."""
        forking.replace_last_token(self, request_id, token)

    def resume(self, request_id: str) -> None:
        """Let a paused (held) request be scheduled again."""
        forking.resume(self, request_id)

    def stop_at(self, request: Request, num_output_tokens: int, stop_str: str) -> None:
        """End `request` (one the last step advanced) at a stop string whose text its `num_output_tokens`-th
        output token completed (the engine's output layer finds it): later tokens and their log-probabilities
        are dropped, and an unfinished request is finished now, freeing its blocks. One the same step finished
        (max_tokens, EOS) gets the stop string as its reason: it came first."""
        del request.output_token_ids[num_output_tokens:], request.output_logprobs[num_output_tokens:]
        if request.logprobs is not None:
            del request.logprobs[num_output_tokens:]
        request.stop_str = stop_str
        if self.requests.get(request.request_id) is request:
            self._finish_early(request, RequestStatus.FINISHED_STOPPED)
        request.status = RequestStatus.FINISHED_STOPPED

    def get_request(self, request_id: str) -> Request | None:
        """A waiting or running request (finished and aborted ones are forgotten)."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request at any point, freeing everything it holds (for a multi-sample request, every
        sample). Returns it, or None if unknown."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            return forking.abort_group(self, group)
        request = self.requests.get(request_id)
        if request is not None:
            self._finish_early(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _finish_early(self, request: Request, status: RequestStatus) -> None:
        """Take a waiting or running request out of the queues, free its blocks, and forget it."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        del self._stop_ids[request.request_id]
        request.status = status
        forking.forget_finished_group(self, request)

    # -- failures --------------------------------------------------------------------------------------

    def fail_request(self, request: Request, error: str) -> None:
        """End an unfinished request (one the last step advanced) with FINISHED_ERROR and `error`: its own
        failure, found by the engine after the step (its structured-output constraint refused a token)."""
        request.error = error
        if self.requests.get(request.request_id) is request:
            self._finish_early(request, RequestStatus.FINISHED_ERROR)

    def fail_step(self, request_ids: Sequence[str], error: str) -> list[Request]:
        """The step that ran `request_ids` failed before its results reached `update` (a fused decode in
        flight must be cancelled first). Nothing the step computed is trusted:

          - a step of one request fails it: FINISHED_ERROR, `request.error = error`, blocks freed;
          - a step of several requests preempts each of them (recompute: exact) and marks it `suspect`,
            so that it runs alone in its next step; the request that breaks a step then fails alone, and
            the others go on (a suspect's flag is cleared by its next successful step).

        Requests aborted or finished since are skipped. Returns the requests that failed.
        """
        return failures.fail_step(self, request_ids, error)

    def drop_computed_kv(self) -> None:
        """The device lost the KV cache (e.g. a failed step after the cache was donated): every running
        request is preempted (recomputed later) and the prefix cache forgets every block."""
        failures.drop_computed_kv(self)

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request now (by recompute). Returns False if it is not running."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return False
        self.running.remove(request)
        self._preempt(request)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; refused (False) while any block is in use."""
        return self.kv_cache_manager.reset_prefix_cache()

    # -- scheduling ------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step: running requests first (preempting the newest when blocks run out), then
        waiting ones while the token budget, max_num_seqs and the pool allow."""
        self._check_no_pending_fused()
        if self.waiting and self.waiting[0].suspect:
            return failures.schedule_alone(self, self.waiting.popleft())
        cfg = self.scheduler_config
        kv = self.kv_cache_manager
        chunked = cfg.enable_chunked_prefill
        budget = cfg.max_num_batched_tokens
        running = self.running
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            if request.paused:
                i += 1
                continue
            gap = request.num_tokens - request.num_computed_tokens
            assert gap > 0, f"running request {request.request_id!r} has nothing to compute"
            n = min(gap, budget)
            if n < gap and not chunked:
                i += 1
                continue
            new_blocks = kv.allocate_slots(request, n)
            while new_blocks is None:
                victim = running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, n)
            if new_blocks is None:
                break  # it preempted itself; it was the last running request
            scheduled.append((request, n))
            budget -= n
            i += 1

        if not preempted:
            # Full blocks that running requests are computing, not yet published: a waiting request whose
            # next missing block is one of them waits a step and then hits it, rather than computing the
            # same prefix again in this step (requests sharing a prefix that arrive together).
            in_flight = ({h for r in running for h in kv.unpublished_block_hashes(r)}
                         if kv.enable_caching and self.waiting else set())
            admitted: set[str] = set()
            skipped = False
            for request in self.waiting:
                if budget <= 0 or len(running) >= cfg.max_num_seqs or request.suspect:
                    break
                if request.paused:  # a held request preempted while paused waits for `resume`
                    skipped = True
                    continue
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                if in_flight and kv.next_block_hash(request, len(hit_blocks)) in in_flight:
                    skipped = True
                    continue
                gap = request.num_tokens - num_hit_tokens
                n = min(gap, budget)
                if n < gap and not chunked:
                    break
                if kv.allocate_slots(request, n, hit_blocks) is None:
                    break
                admitted.add(request.request_id)
                self._admit(request, num_hit_tokens)
                scheduled.append((request, n))
                budget -= n
                if kv.enable_caching:
                    in_flight.update(kv.unpublished_block_hashes(request))
            if skipped:
                self.waiting = deque(r for r in self.waiting if r.request_id not in admitted)
            else:  # the admitted requests are a prefix of the queue
                for _ in range(len(admitted)):
                    self.waiting.popleft()

        self.num_steps += 1
        return self._plan(scheduled, preempted_request_ids=[r.request_id for r in preempted])

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        """A waiting request (its blocks allocated) starts running after its `num_hit_tokens` cached tokens."""
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:  # first admission: the only one counted as a lookup
            request.num_cached_tokens = num_hit_tokens
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _plan(self, scheduled: list[tuple[Request, int]], **kwargs) -> StepPlan:
        kv = self.kv_cache_manager
        block_ids = {r.request_id: kv.get_block_ids(r.request_id) for r, _ in scheduled}
        return build_step_plan(scheduled, block_ids, self.block_size, block_copies=kv.take_block_copies(),
                               **kwargs)

    # -- results ---------------------------------------------------------------------------------------

    def _finish_status(self, request: Request, token: int, num_output_tokens: int,
                       num_tokens: int) -> RequestStatus | None:
        """The status a request reaches by emitting `token` as its `num_output_tokens`-th output."""
        if token in self._stop_ids[request.request_id]:
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= request.sampling_params.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def update(self, plan: StepPlan, sampled_token_ids: np.ndarray) -> list[Request]:
        """Apply a step's results: advance each scheduled request by its q_len, append the sampled token
        where `plan.emits_token`, finish requests that hit a stop id, max_tokens or max_model_len (freeing
        their blocks), and hash blocks that became full. Requests aborted or preempted since the plan was
        made are skipped. Returns the requests that finished in this step."""
        n = plan.num_seqs
        if n == 0:
            return []
        sampled = np.asarray(sampled_token_ids).reshape(-1)
        if sampled.shape[0] < n:
            raise ValueError(f"got {sampled.shape[0]} sampled tokens for {n} sequences")
        kv = self.kv_cache_manager
        q_lens = np.diff(plan.cu_q_lens).tolist()
        kv_lens = plan.kv_lens.tolist()
        emits_token = plan.emits_token.tolist()
        tokens = sampled[:n].tolist()
        finished: list[Request] = []
        prefilled: list[Request] = []
        for i, rid in enumerate(plan.request_ids):
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens + q_lens[i] != kv_lens[i]:
                raise RuntimeError(f"stale plan for request {rid!r}: it has {request.num_computed_tokens} "
                                   f"computed tokens, the plan ends at {kv_lens[i]}")
            request.num_computed_tokens = kv_lens[i]
            request.suspect = False
            status = None
            if emits_token[i] and request.prefill_only:
                prefilled.append(request)
            elif emits_token[i]:
                token = int(tokens[i])
                request.output_token_ids.append(token)
                request.paused = request.hold
                status = self._finish_status(request, token, request.num_output_tokens, request.num_tokens)
            kv.cache_blocks(request)
            if status is not None:
                request.status = status
                finished.append(request)
            else:
                kv.release_out_of_window(request)
        if finished:
            self._remove_finished(finished)
        for request in prefilled:
            forking.spawn_samples(self, request)
        return finished

    def _remove_finished(self, finished: list[Request]) -> None:
        self.running = [r for r in self.running if not r.is_finished]
        for request in finished:
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]
            del self._stop_ids[request.request_id]
            forking.forget_finished_group(self, request)

    # -- fused decode -----------------------------------------------------------------------

    def schedule_fused_decode(self, num_steps: int) -> FusedDecodePlan | None:
        """Plan up to `num_steps` decode steps of every running request, run on device in one go.

        Only when num_steps > 1, nothing waits, every running request is a pure decode (a gap of exactly
        1) and they fit the token budget; and only if the pool can lend enough blocks. Otherwise returns
        None and changes nothing (the engine then falls back to `schedule()`).
        """
        return fused_decode.schedule_fused_decode(self, num_steps)

    def _check_no_pending_fused(self) -> None:
        fused_decode.check_no_pending_multi(self)

    def cancel_fused_decode(self, plan: FusedDecodePlan) -> None:
        """Forget a fused decode that did not run (e.g. the device step failed): the lent blocks come
        back and no request changes. Only valid if the device wrote nothing the host relies on: it writes
        only into lent blocks and the unfilled tails of blocks the requests hold."""
        fused_decode.cancel_fused_decode(self, plan)

    def update_fused_decode(self, plan: FusedDecodePlan, sampled_token_ids: np.ndarray,
                            block_tables: np.ndarray) -> list[Request]:
        """Reconcile after a fused decode.

        sampled_token_ids int [num_steps, num_seqs] (a negative id: the sequence did not run that step);
        block_tables int [num_seqs, max_blocks] as the device left them. Each sequence consumes its tokens
        step by step until it finishes (stop id / max_tokens / max_model_len), runs out of tokens, or
        reaches max_new_tokens; `num_computed_tokens` grows by the tokens consumed; it adopts the blocks
        in its table row beyond its current block count, up to what its new length needs; every other
        lent block is returned; blocks that became full are hashed. Everything is validated before
        anything changes (RuntimeError if the device's tables disagree with the host's).
        Returns the requests that finished.
        """
        return fused_decode.update_fused_decode(self, plan, sampled_token_ids, block_tables)

    # -- invariants ------------------------------------------------------------------------------------

    def check_invariants(self, *, mid_step: bool = False) -> None:
        """Raise RuntimeError naming the first broken invariant (see `pagedjax.core.invariants`)."""
        check_scheduler_invariants(self, mid_step=mid_step)

    # -- stats -----------------------------------------------------------------------------------------

    def stats(self, *, detailed: bool = False) -> SchedulerStats:
        """A snapshot; O(running requests). `detailed` adds the free-block scatter (O(num_blocks))."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running),
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_evictions=kv.block_pool.num_evictions, num_preemptions=self.num_preemptions,
            num_steps=self.num_steps, memory=kv_memory_stats(kv, self.running, with_free_runs=detailed))
