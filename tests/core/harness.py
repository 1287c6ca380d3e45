"""Test harness for the host side: a fake model over a shadow KV cache, drivers and invariant checks.

`FakeModel` stands in for the jitted step. It writes each scheduled token id into a shadow KV cache at
the plan's slots, and "samples" the next token as a hash of the context it reads back through the plan's
block tables. So any wrong slot, block table, prefix hit or block handed to two requests changes the
output, and the output of a request depends only on its own tokens: greedy output must be identical with
prefix caching on or off, with or without preemption, for any block size, budget or fused decode.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedjax.core.kv_cache_manager import RELEASED, cdiv
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.step_plan import StepPlan, device_pop_step
from pagedjax.core.step_result import StepResult

VOCAB = 6


def next_token(context: list[int] | np.ndarray, salt: int = 0) -> int:
    """The fake model: a deterministic function of the whole context (and of a per-request salt, which makes
    the samples of one prompt differ, as their seeds do)."""
    data = np.asarray(context, dtype=np.int64).tobytes() + (salt.to_bytes(8, "little") if salt else b"")
    return hashlib.blake2b(data, digest_size=8).digest()[0] % VOCAB


class FakeModel:
    """`window`: a sliding-window model: the token after position p depends on positions (p - window, p] only,
    and a step's query at position q may read positions > q - window only (asserted: blocks released out of the
    window must never be needed again)."""

    def __init__(self, num_blocks: int, block_size: int, salts: dict[str, int] | None = None,
                 window: int | None = None) -> None:
        self.block_size = block_size
        self.kv = np.full((num_blocks * block_size,), -1, np.int64)
        self.salts = salts if salts is not None else {}  # request id -> salt (0 if absent)
        self.window = window

    def read(self, table_row: np.ndarray, length: int, first_query: int | None = None) -> np.ndarray:
        """The context of the query at position length - 1 (its window's positions). `first_query`: the
        step's first query position: every block any of the step's queries may read must be present."""
        first = 0 if self.window is None else max(0, length - self.window)
        if self.window is not None and first_query is not None:
            lo = max(0, first_query - self.window + 1)
            needed = table_row[lo // self.block_size:cdiv(length, self.block_size)]
            assert (needed >= 0).all(), "a block a query of this step can see was released"
        pos = np.arange(first, length)
        assert (table_row[pos // self.block_size] >= 0).all(), "attention would read a released block"
        slots = table_row[pos // self.block_size] * self.block_size + pos % self.block_size
        ctx = self.kv[slots]
        assert (ctx >= 0).all(), "attention would read a slot that was never written"
        return ctx

    def step(self, plan: StepPlan) -> np.ndarray:
        """Write the plan's tokens, then sample one token per sequence (whether or not it is used)."""
        bs = self.block_size
        blocks = self.kv.reshape(-1, bs)
        if len(plan.block_copies):  # all reads before any write, as on device
            blocks[plan.block_copies[:, 1]] = blocks[plan.block_copies[:, 0]].copy()
        slots = plan.slot_mapping
        assert (slots >= 0).all()
        assert len(np.unique(slots)) == len(slots), "two tokens of one step write the same slot"
        self.kv[slots] = plan.token_ids
        first_query = plan.kv_lens - plan.q_lens
        return np.array([next_token(self.read(plan.block_tables[s], int(plan.kv_lens[s]), int(first_query[s])),
                                    self.salts.get(plan.request_ids[s], 0))
                         for s in range(plan.num_seqs)], dtype=np.int32)

    def fused_decode(self, fused_plan: StepPlan, stop_ids: list[frozenset[int]],
                   stop_early: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The fused decode loop as the device runs it (mirrors runner._fused_decode_loop): returns
        (sampled [num_steps, num_seqs] with -1 after a sequence stopped, final block tables).
        `stop_early[s]` (optional) stops sequence s after that many steps, as a stop id would."""
        plan = fused_plan
        n = plan.num_seqs
        tables = plan.block_tables.copy()
        lens = fused_plan.fused.seq_lens.astype(np.int64)
        cur = plan.token_ids.astype(np.int64).copy()
        limit = fused_plan.fused.max_new_tokens.copy()
        if stop_early is not None:
            limit = np.minimum(limit, stop_early)
        active = limit > 0
        generated = np.zeros(n, np.int64)
        out = np.full((fused_plan.fused.num_steps, n), -1, np.int32)
        popped = 0
        for step in range(fused_plan.fused.num_steps):
            if not active.any():
                break
            slots, popped = device_pop_step(tables, lens, active, fused_plan.fused.lent_block_ids, popped,
                                            self.block_size)
            # step 1's slots must agree with the host plan wherever the host knew them
            if step == 0:
                known = (plan.slot_mapping >= 0) & active
                assert (plan.slot_mapping[known] == slots[known]).all()
            written = slots[active]
            assert len(np.unique(written)) == len(written)
            self.kv[written] = cur[active]
            for s in np.flatnonzero(active):
                new = next_token(self.read(tables[s], int(lens[s]), int(lens[s]) - 1),
                                 self.salts.get(plan.request_ids[s], 0))
                out[step, s] = new
                cur[s] = new
                generated[s] += 1
                if new in stop_ids[s] or generated[s] >= limit[s]:
                    active[s] = False
        return out, tables


class Checker:
    """Checks every invariant of a scheduler (and, with a FakeModel, of the KV content it implies)."""

    def __init__(self, scheduler: Scheduler, model: FakeModel | None = None) -> None:
        self.sched = scheduler
        self.model = model
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}  # block hash -> the block's tokens

    def check_plan(self, plan: StepPlan, running_before: list[str] | None = None,
                   shared_before: dict[str, int] | None = None) -> None:
        """Check a fresh plan; `running_before` is the running queue's ids before `schedule()`, `shared_before`
        the running requests whose next write needed a copy then (id -> the shared block)."""
        shared_before = shared_before or {}
        s = self.sched
        cfg = s.scheduler_config
        bs = s.block_size
        kv = s.kv_cache_manager
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert plan.num_seqs <= cfg.max_num_seqs
        assert len(s.running) <= cfg.max_num_seqs
        assert len(set(plan.request_ids)) == plan.num_seqs
        assert not set(plan.request_ids) & set(plan.preempted_request_ids)
        for rid in plan.preempted_request_ids:
            r = s.get_request(rid)
            assert r is not None and r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
            assert not kv.get_block_ids(rid)
        # victims are the most recently admitted, newest first; they sit at the front of the waiting queue
        num_preempted = len(plan.preempted_request_ids)
        front = [r.request_id for r in list(s.waiting)[:num_preempted]]
        assert front == plan.preempted_request_ids[::-1]
        if running_before is not None and num_preempted:
            assert plan.preempted_request_ids == running_before[::-1][:num_preempted]
        q_lens = plan.q_lens
        assert (q_lens >= 1).all()
        assert (q_lens[:plan.num_decodes] == 1).all() and (q_lens[plan.num_decodes:] > 1).all()
        assert plan.cu_q_lens[0] == 0 and plan.cu_q_lens[-1] == plan.num_tokens
        assert plan.token_ids.dtype == np.int32 and plan.slot_mapping.dtype == np.int32
        assert plan.block_tables.dtype == np.int32 and plan.positions.dtype == np.int32
        np.testing.assert_array_equal(plan.logits_indices, plan.cu_q_lens[1:] - 1)
        num_copies = 0
        for i, rid in enumerate(plan.request_ids):
            r = s.get_request(rid)
            assert r is not None and r.status is RequestStatus.RUNNING
            a, b = plan.cu_q_lens[i], plan.cu_q_lens[i + 1]
            start = r.num_computed_tokens
            assert plan.kv_lens[i] == start + (b - a) <= r.num_tokens
            np.testing.assert_array_equal(plan.token_ids[a:b], r.get_token_ids(start, int(plan.kv_lens[i])))
            np.testing.assert_array_equal(plan.positions[a:b], np.arange(start, plan.kv_lens[i]))
            assert plan.emits_token[i] == (plan.kv_lens[i] == r.num_tokens)
            held = kv.get_block_ids(rid)
            assert len(held) == cdiv(int(plan.kv_lens[i]), bs)
            np.testing.assert_array_equal(plan.block_tables[i, :len(held)], held)
            assert (plan.block_tables[i, len(held):] == 0).all()
            for t in range(a, b):
                block, off = divmod(int(plan.slot_mapping[t]), bs)
                pos = int(plan.positions[t])
                assert block == held[pos // bs] and off == pos % bs
                # a step never writes into a block someone else also holds, or a hashed block
                assert kv.block_pool.ref_cnt(block) == 1 and kv.block_pool.block_hash(block) is None
            # copy-on-write only when its first write lands in a block it shared before the step: then it
            # either copied that block, or kept it because the others had copied it first (it is the only
            # holder now: the written blocks' ref_cnt == 1 above)
            copies = [tuple(c) for c in plan.block_copies.tolist() if start % bs and c[1] == held[start // bs]]
            if rid in shared_before:
                assert copies in ([(shared_before[rid], held[start // bs])], []), (rid, copies)
                assert copies or held[start // bs] == shared_before[rid]
            else:
                assert not copies, (rid, copies)
            num_copies += len(copies)
        assert len(np.unique(plan.slot_mapping)) == plan.num_tokens
        assert len(plan.block_copies) == num_copies

    def check(self, *, mid_step: bool = False, pending_copies: np.ndarray | None = None) -> None:
        """`pending_copies` [C, 2]: (src, dst) copies the planned step will make first (mid-step: dst still
        holds nothing, so a request's KV is read from src there)."""
        s = self.sched
        kv = s.kv_cache_manager
        pool = kv.block_pool
        bs = s.block_size
        s.check_invariants(mid_step=mid_step)
        st = s.stats(detailed=True)
        mem = st.memory
        assert 0 <= mem.slots_wasted <= mem.slots_reserved
        assert mem.slots_reserved == bs * (pool.num_used - len(kv.lent_block_ids))
        assert mem.free_runs <= pool.num_free_blocks and mem.largest_free_run <= pool.num_free_blocks
        assert (mem.free_runs == 0) == (pool.num_free_blocks == 0)
        for r in s.running:
            assert 0 < r.num_computed_tokens < r.num_tokens or mid_step
            assert r.num_tokens <= s.max_model_len or r.num_prompt_tokens == s.max_model_len
        holders = kv.holders()
        count = Counter(b for blocks in holders.values() for b in blocks if b != RELEASED)
        window = kv.sliding_window
        for r in s.running:
            # exactly the leading blocks no query from the next position on can read are released (between
            # steps; a request admitted in this step has not released yet)
            p = r.num_computed_tokens
            expected = 0 if window is None else min(max(0, (p - window + 1) // bs), p // bs)
            assert kv.num_released_blocks(r.request_id) == expected or mid_step, (r.request_id, expected)
        # hashes: a request's hashed blocks carry its own chained hashes; remember what each hash holds
        by_id = {r.request_id: r for r in s.running}
        for rid, blocks in holders.items():
            r = by_id[rid]
            hashes = kv.block_hashes(r) if kv.enable_caching else []
            for i, b in enumerate(blocks):
                if b == RELEASED:
                    continue
                h = pool.block_hash(b)
                if h is not None:
                    assert i < len(hashes) and h == hashes[i]
                    assert (i + 1) * bs <= r.num_computed_tokens
            for i, h in enumerate(hashes):
                tokens = tuple(r.get_token_ids(i * bs, (i + 1) * bs))
                assert self.hash_tokens.setdefault(h, tokens) == tokens
        # blocks shared by two requests hold the same computed tokens for both (a partial one only between
        # forks, which copy it before writing more)
        seen: dict[int, tuple[int, ...]] = {}
        for rid, blocks in holders.items():
            r = by_id[rid]
            for i, b in enumerate(blocks):
                if b != RELEASED and count[b] > 1:
                    filled = min(bs, r.num_computed_tokens - i * bs)
                    assert filled > 0
                    tokens = tuple(r.get_token_ids(i * bs, i * bs + filled))
                    assert seen.setdefault(b, tokens) == tokens
        if self.model is None:
            return
        # the shadow KV: every running request's computed tokens are where its blocks say
        kvc = self.model.kv
        for rid, blocks in holders.items():
            r = by_id[rid]
            n = r.num_computed_tokens
            if n == 0:
                continue
            pos = np.arange(kv.num_released_blocks(rid) * bs, n)
            if pending_copies is not None and len(pending_copies):
                remap = dict(pending_copies[:, ::-1].tolist())
                blocks = [remap.get(b, b) for b in blocks]
            slots = np.asarray(blocks)[pos // bs] * bs + pos % bs
            np.testing.assert_array_equal(kvc[slots], r.get_token_ids(int(pos[0]) if len(pos) else n, n),
                                          err_msg=f"KV of {rid}")
        # every hashed block (used or idle) still holds the tokens its hash stands for
        for b in range(pool.num_blocks):
            h = pool.block_hash(b)
            if h is not None and h in self.hash_tokens:
                np.testing.assert_array_equal(kvc[b * bs:(b + 1) * bs], self.hash_tokens[h])


def run_step(sched: Scheduler, model: FakeModel, checker: Checker | None = None,
             fused_steps: int = 0) -> list[Request]:
    """One engine iteration: a fused decode when possible (fused_steps > 1), else a plain step."""
    if fused_steps > 1:
        fused_plan = sched.schedule_fused_decode(fused_steps)
        if fused_plan is not None:
            if checker:
                checker.check(mid_step=True)
            stop_ids = [sched.get_request(rid).stop_ids for rid in fused_plan.request_ids]
            sampled, tables = model.fused_decode(fused_plan, stop_ids)
            finished = sched.update(fused_plan, StepResult.from_fused(fused_plan, sampled, tables))
            if checker:
                checker.check()
            return finished
    running_before = [r.request_id for r in sched.running]
    kv = sched.kv_cache_manager
    shared_before = {r.request_id: kv.get_block_ids(r.request_id)[-1] for r in sched.running if kv.needs_copy(r)}
    plan = sched.schedule()
    if checker:
        checker.check_plan(plan, running_before, shared_before)
        checker.check(mid_step=True, pending_copies=plan.block_copies)
    sampled = model.step(plan)
    finished = sched.update(plan, sampled)
    if checker:
        checker.check()
    return finished


def run_to_completion(sched: Scheduler, model: FakeModel, *, checker: Checker | None = None,
                      fused_steps: int = 0, max_steps: int = 100_000) -> tuple[dict[str, list[int]], int]:
    """Step until every request finished; returns ({request id: outputs}, number of steps)."""
    outputs: dict[str, list[int]] = {}
    steps = 0
    while sched.has_unfinished_requests():
        assert steps < max_steps, f"not finished after {max_steps} steps"
        for r in run_step(sched, model, checker, fused_steps):
            outputs[r.request_id] = list(r.output_token_ids)
        steps += 1
    return outputs, steps


def max_blocks_held(num_kv_tokens: int, block_size: int, window: int | None, max_chunk: int) -> int:
    """The most blocks one request holds at once on its way to `num_kv_tokens` tokens of KV, counted step by step
    (the oracle for `KVCacheManager.max_blocks_held`): a step from any p computes n = min(max_chunk, T - p) tokens
    and holds cdiv(p + n, block_size) blocks, less the leading ones no query from p on reads."""
    most = 0
    for p in range(num_kv_tokens):
        unread = 0 if window is None else min(max(0, (p - window + 1) // block_size), p // block_size)
        most = max(most, cdiv(p + min(max_chunk, num_kv_tokens - p), block_size) - unread)
    return most


def reference_outputs(request: Request, max_model_len: int, salt: int = 0,
                      outputs: list[int] | None = None, window: int | None = None) -> list[int]:
    """What a request must produce under the fake model (with `window`, a sliding-window one), computed
    without any cache (continuing from `outputs` it already has, if given)."""
    out: list[int] = list(outputs or [])
    tokens = list(request.prompt_token_ids) + out
    stop = request.stop_ids
    while True:
        t = next_token(tokens if window is None else tokens[-window:], salt)
        out.append(t)
        tokens.append(t)
        if t in stop or len(out) >= request.sampling_params.max_tokens or len(tokens) >= max_model_len:
            return out


class SchedulerMachine(RuleBasedStateMachine):
    """Rules every scheduler state machine shares: abort any request or sample group, preempt any running
    request, and the `Checker`'s invariants after every step. A subclass's `initialize` sets `sched`, `checker`
    and `aborted` (the ids aborted)."""

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(set(self.sched.requests) | set(self.sched.groups))
        if ids:
            rid = data.draw(st.sampled_from(ids))
            self.sched.abort(rid)
            self.aborted.add(rid)

    @rule(data=st.data())
    def preempt(self, data):
        if self.sched.running:
            self.sched.preempt(data.draw(st.sampled_from([r.request_id for r in self.sched.running])))

    @invariant()
    def consistent(self):
        if hasattr(self, "sched"):
            self.checker.check()
