"""Continuous batching: the scheduler and the `StepPlan` it hands to the jitted step.

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

Life of a step: `plan = schedule()` -> the engine runs `plan` -> `update(plan, sampled)`; or, when every
running request is a pure decode, `schedule_multi_decode(n)` -> the engine runs up to n decode steps on
device -> `update_multi_decode(...)`.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.core.memory_stats import kv_memory_stats
from pagedjax.core.request import Request, RequestStatus

_EMPTY_I32 = np.zeros((0,), np.int32)


@dataclass
class StepPlan:
    """One step's work as plain numpy arrays, ready for a jitted step.

    Sequences: running decodes first (q_len 1), then prefills / prefill chunks. Tokens are laid out seq
    after seq (ragged): sequence s owns `token_ids[cu_q_lens[s]:cu_q_lens[s+1]]`, at positions
    `kv_lens[s] - q_len[s] ... kv_lens[s] - 1`, and attends to its first `kv_lens[s]` tokens through
    `block_tables[s]`. `slot_mapping[t] = block_id * block_size + offset` is where token t's K/V goes
    (-1 = padding / not written; in a plain step every token has a slot).
    """

    request_ids: list[str]
    token_ids: np.ndarray  # int32 [num_tokens]
    positions: np.ndarray  # int32 [num_tokens]
    cu_q_lens: np.ndarray  # int32 [num_seqs + 1]
    kv_lens: np.ndarray  # int32 [num_seqs]: context length including this step's tokens
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: np.ndarray  # int32 [num_tokens]
    sample: np.ndarray  # bool [num_seqs]: the seq's last scheduled token is its last known token
    preempted_request_ids: list[str] = field(default_factory=list)
    num_decodes: int = 0  # the first num_decodes seqs have q_len == 1

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.cu_q_lens).astype(np.int32)

    @property
    def logits_indices(self) -> np.ndarray:
        """Index of each sequence's last scheduled token: where its logits come from."""
        return (self.cu_q_lens[1:] - 1).astype(np.int32)

    @property
    def is_empty(self) -> bool:
        return self.num_seqs == 0

    @classmethod
    def empty(cls, preempted_request_ids: Sequence[str] = ()) -> StepPlan:
        return cls(request_ids=[], token_ids=_EMPTY_I32.copy(), positions=_EMPTY_I32.copy(),
                   cu_q_lens=np.zeros((1,), np.int32), kv_lens=_EMPTY_I32.copy(),
                   block_tables=np.zeros((0, 0), np.int32), slot_mapping=_EMPTY_I32.copy(),
                   sample=np.zeros((0,), bool), preempted_request_ids=list(preempted_request_ids))


@dataclass
class MultiStepPlan:
    """Up to `num_steps` fused decode steps of every running request, run on device with no host round trip.

    `plan` is step 1 as a `StepPlan` (decodes only). Its `block_tables` hold each request's current blocks
    and are wide enough for `num_steps` more tokens (`max ceil((kv_len + num_steps - 1) / block_size)`
    columns). The host allocates no block for the step's tokens: a sequence whose token starts a new block
    (`(kv_len - 1) % block_size == 0`) pops it from the lent stack on device, in step 1 as in every later
    step, and its `plan.slot_mapping` entry is -1 (the device computes it; see `simulate_device_pops`).

    `lent_block_ids` is the stack of lent blocks, popped front to back, exactly enough for every sequence
    to write `max_new_tokens[s]` tokens. `max_new_tokens[s] = min(num_steps, remaining max_tokens,
    max_model_len - num_tokens)` (at least 1; see `Scheduler.max_new_tokens_left`): the device stops
    sequence s after that many steps (or at a stop id).
    """

    plan: StepPlan
    lent_block_ids: np.ndarray  # int32 [num_lent]
    max_new_tokens: np.ndarray  # int32 [num_seqs]
    num_steps: int
    block_size: int

    @property
    def seq_lens(self) -> np.ndarray:
        """Tokens each sequence has in the cache before step 1 (the device's starting lengths)."""
        return (self.plan.kv_lens - 1).astype(np.int32)


def device_pop_step(block_tables: np.ndarray, seq_lens: np.ndarray, active: np.ndarray,
                    lent_block_ids: np.ndarray, num_popped: int, block_size: int) -> tuple[np.ndarray, int]:
    """One step of the device's block pops, in numpy (mutates `block_tables` and `seq_lens` in place).

    Every active sequence whose length (tokens in the cache) is a multiple of `block_size` needs a new
    block for the token it is about to write: it pops the next lent block, in sequence order, into column
    `length // block_size`. Then every active sequence writes its token at slot
    `table[s, length // block_size] * block_size + length % block_size` and its length grows by one.

    Returns (slot_mapping int32 [num_seqs], -1 where inactive; the new number of popped blocks).
    Raises ValueError if the stack runs dry or a row has no column left (the host lent too little).
    """
    num_seqs, width = block_tables.shape
    slots = np.full((num_seqs,), -1, np.int32)
    for s in range(num_seqs):
        if not active[s]:
            continue
        length = int(seq_lens[s])
        col = length // block_size
        if col >= width:
            raise ValueError(f"seq {s}: its block table row of {width} columns is full")
        if length % block_size == 0:
            if num_popped >= len(lent_block_ids):
                raise ValueError("the lent block stack ran dry")
            block_tables[s, col] = lent_block_ids[num_popped]
            num_popped += 1
        slots[s] = block_tables[s, col] * block_size + length % block_size
        seq_lens[s] = length + 1
    return slots, num_popped


def simulate_device_pops(block_tables: np.ndarray, seq_lens: np.ndarray, lent_block_ids: np.ndarray,
                         num_active_steps: np.ndarray, block_size: int,
                         ) -> tuple[np.ndarray, np.ndarray, int]:
    """Host (numpy) mirror of a whole fused decode's block pops: the reconciliation contract.

    Starts from `seq_lens[s]` cached tokens (`MultiStepPlan.seq_lens`, i.e. `plan.kv_lens - 1`); sequence
    s is active for its first `num_active_steps[s]` steps (its `max_new_tokens`, or fewer if it stopped
    early); each step applies `device_pop_step`.

    Returns (block tables after the loop, slot_mapping int32 [num_steps, num_seqs] with -1 where inactive,
    number of blocks popped). Raises ValueError if the stack runs dry or a row has no column left.
    """
    tables = np.array(block_tables, dtype=np.int32, copy=True)
    lens = np.array(seq_lens, dtype=np.int64, copy=True)
    active_steps = np.asarray(num_active_steps)
    num_steps = int(active_steps.max()) if active_steps.size else 0
    slots = np.full((num_steps, tables.shape[0]), -1, np.int32)
    popped = 0
    for step in range(num_steps):
        slots[step], popped = device_pop_step(tables, lens, active_steps > step, lent_block_ids, popped,
                                              block_size)
    return tables, slots, popped


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler and its pool. Block counts: free + used + cached == num_blocks."""

    num_waiting: int
    num_running: int
    num_blocks: int
    num_free_blocks: int  # idle, no hash
    num_used_blocks: int  # ref_cnt > 0 (lent blocks included)
    num_cached_blocks: int  # idle, still hashed (reusable by a prefix hit until evicted)
    num_lent_blocks: int
    prefix_cache_queries: int  # prompt tokens of first-time admissions
    prefix_cache_hits: int  # of those, tokens found in the cache
    prefix_cache_hit_rate: float
    num_evictions: int
    num_preemptions: int
    num_steps: int  # schedule() calls plus fused multi-step decodes
    kv_slots_reserved: int  # slots in blocks held by requests
    kv_slots_used: int  # reserved slots holding computed KV
    kv_slots_wasted: int  # reserved but unused (the tails of partially filled blocks)
    kv_waste_fraction: float
    num_partial_blocks: int
    # maximal runs of consecutive idle block ids (scatter; harmless when paged); only with detailed=True
    free_block_runs: int | None
    largest_free_run: int | None

    @property
    def block_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


@dataclass
class _DecodeOutcome:
    """What `update_multi_decode` will apply to one sequence (computed before anything is mutated)."""

    request: Request
    tokens: list[int]
    status: RequestStatus | None
    new_blocks: list[int]


class Scheduler:
    """Waiting and running queues, the token budget, preemption, and the KV cache manager.

    Invariants: a request is in exactly one of `waiting` (FIFO; holds no blocks), `running` (admission
    order; holds `cdiv(num_computed_tokens, block_size)` blocks between steps) or neither (finished /
    aborted, and forgotten). `len(running) <= max_num_seqs`; a step never schedules more than
    `max_num_batched_tokens` tokens.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager.from_config(cache_config, num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._stop_ids: dict[str, frozenset[int]] = {}
        self._next_arrival = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self._pending_multi: MultiStepPlan | None = None  # a fused decode not yet reconciled

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

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ValueError for an empty prompt, a prompt longer than max_model_len,
        a duplicate request id, or a request that could not fit even in an empty pool."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens is longer than "
                             f"max_model_len={self.max_model_len}")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.output_token_ids):
            raise ValueError(f"request {rid!r} is not a fresh request (status {request.status.value}, "
                             f"{request.num_computed_tokens} computed, {request.num_output_tokens} outputs)")
        need = cdiv(self.max_kv_tokens(request), self.block_size)
        if need > self.kv_cache_manager.num_blocks:
            raise ValueError(f"request {rid!r} may need {need} blocks of {self.block_size} tokens, more than "
                             f"the whole pool of {self.kv_cache_manager.num_blocks} blocks")
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        self.requests[rid] = request
        self._stop_ids[rid] = request.stop_ids
        self.waiting.append(request)

    def get_request(self, request_id: str) -> Request | None:
        """A waiting or running request (finished and aborted ones are forgotten)."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request at any point, freeing everything it holds. Returns it, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        self._stop_ids.pop(request_id, None)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

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
        self._check_no_pending_multi()
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
            while self.waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                request = self.waiting[0]
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                gap = request.num_tokens - num_hit_tokens
                n = min(gap, budget)
                if n < gap and not chunked:
                    break
                if kv.allocate_slots(request, n, hit_blocks) is None:
                    break
                self.waiting.popleft()
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:  # first admission: the only one counted as a lookup
                    request.num_cached_tokens = num_hit_tokens
                    kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
                request.status = RequestStatus.RUNNING
                running.append(request)
                scheduled.append((request, n))
                budget -= n

        self.num_steps += 1
        return self._build_plan(scheduled, [r.request_id for r in preempted])

    def _build_plan(self, scheduled: list[tuple[Request, int]], preempted_ids: list[str], *,
                    min_width: int = 0, allow_missing_blocks: bool = False) -> StepPlan:
        if not scheduled:
            return StepPlan.empty(preempted_ids)
        order = [x for x in scheduled if x[1] == 1]
        num_decodes = len(order)
        if num_decodes < len(scheduled):
            order += [x for x in scheduled if x[1] != 1]
        n = len(order)
        bs = self.block_size
        holders = self.kv_cache_manager.holders()

        request_ids: list[str] = []
        q_list: list[int] = []
        start_list: list[int] = []
        known_list: list[int] = []
        tokens: list[int] = []
        rows: list[list[int]] = []
        for r, k in order:
            s = r.num_computed_tokens
            request_ids.append(r.request_id)
            q_list.append(k)
            start_list.append(s)
            known_list.append(r.num_tokens)
            if k == 1:
                tokens.append(r.get_token_id(s))
            else:
                tokens.extend(r.get_token_ids(s, s + k))
            rows.append(holders[r.request_id])
        q_lens = np.array(q_list, np.int32)
        starts = np.array(start_list, np.int32)
        kv_lens = starts + q_lens
        cu_q_lens = np.zeros(n + 1, np.int32)
        np.cumsum(q_lens, out=cu_q_lens[1:])
        total = int(cu_q_lens[-1])
        token_ids = np.array(tokens, dtype=np.int32)

        row_lens = np.fromiter(map(len, rows), np.int32, n)
        width = max(int(row_lens.max()), min_width, 1)
        block_tables = np.zeros((n, width), np.int32)
        num_held = int(row_lens.sum())
        if num_held:
            flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, num_held)
            block_tables[np.arange(width) < row_lens[:, None]] = flat  # row-major fill of each prefix

        seq_of_token = np.repeat(np.arange(n), q_lens)
        positions = (np.arange(total, dtype=np.int32) - np.repeat(cu_q_lens[:-1], q_lens)
                     + np.repeat(starts, q_lens)).astype(np.int32)
        logical = positions // bs
        has_block = logical < row_lens[seq_of_token]
        if not allow_missing_blocks:
            assert has_block.all(), "a scheduled token has no block"
        slot_mapping = block_tables[seq_of_token, np.minimum(logical, width - 1)] * bs + positions % bs
        slot_mapping = np.where(has_block, slot_mapping, -1).astype(np.int32)

        return StepPlan(
            request_ids=request_ids, token_ids=token_ids, positions=positions,
            cu_q_lens=cu_q_lens, kv_lens=kv_lens, block_tables=block_tables,
            slot_mapping=slot_mapping, sample=kv_lens == np.array(known_list, np.int32),
            preempted_request_ids=preempted_ids, num_decodes=num_decodes)

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
        where `plan.sample`, finish requests that hit a stop id, max_tokens or max_model_len (freeing
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
        sample = plan.sample.tolist()
        tokens = sampled[:n].tolist()
        finished: list[Request] = []
        for i, rid in enumerate(plan.request_ids):
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request.num_computed_tokens + q_lens[i] != kv_lens[i]:
                raise RuntimeError(f"stale plan for request {rid!r}: it has {request.num_computed_tokens} "
                                   f"computed tokens, the plan ends at {kv_lens[i]}")
            request.num_computed_tokens = kv_lens[i]
            status = None
            if sample[i]:
                token = int(tokens[i])
                request.output_token_ids.append(token)
                status = self._finish_status(request, token, request.num_output_tokens, request.num_tokens)
            kv.cache_blocks(request)
            if status is not None:
                request.status = status
                finished.append(request)
        if finished:
            self._remove_finished(finished)
        return finished

    def _remove_finished(self, finished: list[Request]) -> None:
        self.running = [r for r in self.running if not r.is_finished]
        for request in finished:
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]
            del self._stop_ids[request.request_id]

    # -- fused multi-step decode -----------------------------------------------------------------------

    def schedule_multi_decode(self, num_steps: int) -> MultiStepPlan | None:
        """Plan up to `num_steps` decode steps of every running request, run on device in one go.

        Only when num_steps > 1, nothing waits, every running request is a pure decode (a gap of exactly
        1) and they fit the token budget; and only if the pool can lend enough blocks. Otherwise returns
        None and changes nothing (the engine then falls back to `schedule()`).
        """
        self._check_no_pending_multi()
        if num_steps < 2 or self.waiting or not self.running:
            return None
        if len(self.running) > self.scheduler_config.max_num_batched_tokens:
            return None
        kv = self.kv_cache_manager
        bs = self.block_size
        max_new: list[int] = []
        num_to_lend = 0
        width = 0
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens != 1:
                return None
            m = min(num_steps, self.max_new_tokens_left(r))
            max_new.append(m)
            num_to_lend += cdiv(r.num_computed_tokens + m, bs) - len(kv.get_block_ids(r.request_id))
            width = max(width, cdiv(r.num_tokens + num_steps - 1, bs))
        lent = kv.lend_blocks(num_to_lend)
        if lent is None:
            return None
        plan = self._build_plan([(r, 1) for r in self.running], [], min_width=width,
                                allow_missing_blocks=True)
        assert plan.request_ids == [r.request_id for r in self.running]
        self.num_steps += 1
        self._pending_multi = MultiStepPlan(plan=plan, lent_block_ids=np.array(lent, dtype=np.int32),
                                            max_new_tokens=np.array(max_new, dtype=np.int32),
                                            num_steps=num_steps, block_size=bs)
        return self._pending_multi

    def _check_no_pending_multi(self) -> None:
        if self._pending_multi is not None:
            raise RuntimeError("a fused decode is in flight: call update_multi_decode (or "
                               "cancel_multi_decode) before scheduling again")

    def _check_pending_multi(self, plan: MultiStepPlan) -> None:
        if plan is not self._pending_multi:
            raise RuntimeError("this multi-step plan is not the one in flight")

    def cancel_multi_decode(self, plan: MultiStepPlan) -> None:
        """Forget a fused decode that did not run (e.g. the device step failed): the lent blocks come
        back and no request changes. Only valid if the device wrote nothing the host relies on: it writes
        only into lent blocks and the unfilled tails of blocks the requests hold."""
        self._check_pending_multi(plan)
        self.kv_cache_manager.return_lent_blocks(plan.lent_block_ids.tolist())
        self._pending_multi = None

    def update_multi_decode(self, plan: MultiStepPlan, sampled_token_ids: np.ndarray,
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
        self._check_pending_multi(plan)
        step = plan.plan
        n = step.num_seqs
        sampled = np.asarray(sampled_token_ids)
        tables = np.asarray(block_tables)
        if sampled.ndim != 2 or sampled.shape[1] < n:
            raise ValueError(f"sampled_token_ids must be [num_steps, >= {n}], got {sampled.shape}")
        if tables.ndim != 2 or tables.shape[0] < n:
            raise ValueError(f"block_tables must be [>= {n}, max_blocks], got {tables.shape}")
        kv = self.kv_cache_manager
        bs = self.block_size
        lent = set(plan.lent_block_ids.tolist())
        claimed: set[int] = set()
        outcomes: list[_DecodeOutcome] = []
        max_new = plan.max_new_tokens.tolist()
        kv_lens = step.kv_lens.tolist()
        columns = sampled[:, :n].T.tolist()
        for i, rid in enumerate(step.request_ids):
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile: whatever it popped is returned below
            if request.num_computed_tokens + 1 != kv_lens[i]:
                raise RuntimeError(f"stale multi-step plan for request {rid!r}")
            consumed: list[int] = []
            status = None
            num_out, num_tok = request.num_output_tokens, request.num_tokens
            for token in columns[i][:max_new[i]]:
                if token < 0:
                    break
                consumed.append(int(token))
                status = self._finish_status(request, int(token), num_out + len(consumed),
                                             num_tok + len(consumed))
                if status is not None:
                    break
            held = kv.get_block_ids(rid)
            need = cdiv(request.num_computed_tokens + len(consumed), bs)
            row = tables[i]
            if row[:len(held)].tolist() != held:
                raise RuntimeError(f"request {rid!r}: the device changed blocks the host had placed "
                                   f"({row[:len(held)].tolist()} != {held})")
            new_blocks = row[len(held):need].tolist()
            bad = [b for b in new_blocks if b not in lent or b in claimed]
            if bad:
                raise RuntimeError(f"request {rid!r}: table row holds blocks {bad} that were not lent "
                                   "or are claimed twice")
            if len(new_blocks) != max(0, need - len(held)):
                raise RuntimeError(f"request {rid!r}: table row too narrow for {need} blocks")
            claimed.update(new_blocks)
            outcomes.append(_DecodeOutcome(request, consumed, status, new_blocks))

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
        kv.return_lent_blocks([b for b in plan.lent_block_ids.tolist() if b not in claimed])
        self._pending_multi = None
        if finished:
            self._remove_finished(finished)
        return finished

    # -- stats -----------------------------------------------------------------------------------------

    def stats(self, *, detailed: bool = False) -> SchedulerStats:
        """A snapshot; O(running requests). `detailed` adds the free-block scatter (O(num_blocks))."""
        kv = self.kv_cache_manager
        pool = kv.block_pool
        mem = kv_memory_stats(kv, self.running, with_free_runs=detailed)
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running), num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free, num_used_blocks=pool.num_used, num_cached_blocks=pool.num_cached,
            num_lent_blocks=mem.num_lent_blocks, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits, prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            num_evictions=pool.num_evictions, num_preemptions=self.num_preemptions,
            num_steps=self.num_steps, kv_slots_reserved=mem.slots_reserved, kv_slots_used=mem.slots_used,
            kv_slots_wasted=mem.slots_wasted, kv_waste_fraction=mem.waste_fraction,
            num_partial_blocks=mem.num_partial_blocks,
            free_block_runs=mem.free_runs if detailed else None,
            largest_free_run=mem.largest_free_run if detailed else None)
