"""hypothesis state machine: random add / step / finish / abort / preempt / fused decode / reset on small
pools, checking every invariant after every step (see harness.Checker), and that everything left
finishes in a bounded number of steps (no starvation, no livelock)."""

from __future__ import annotations

import numpy as np
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.kv_cache_manager import cdiv
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.step_result import StepResult
from pagedjax.sampling_params import SamplingParams
from tests.core.harness import VOCAB, Checker, FakeModel, run_to_completion

STOP = VOCAB  # a token the fake model never emits: only the "finish" choices below produce it
PREFIXES = [[], [1, 2, 3, 1, 2, 3, 1, 2], [0] * 9, [4, 4, 1]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 16),
                max_num_seqs=st.integers(1, 4), budget=st.integers(1, 12), max_model_len=st.integers(4, 20),
                caching=st.booleans(), chunked=st.booleans(),
                initial=st.lists(st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, VOCAB - 1),
                                                                                max_size=6),
                                           st.integers(1, 8)), max_size=6))
    def setup(self, block_size, num_blocks, max_num_seqs, budget, max_model_len, caching, chunked, initial):
        if not chunked:
            budget = max(budget, max_model_len)
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, enable_chunked_prefill=chunked),
            CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks)
        self.model = FakeModel(num_blocks, block_size)
        self.checker = Checker(self.sched, self.model)
        self.next_id = 0
        self.num_steps = 0
        self.finished: dict[str, Request] = {}
        for prefix, suffix, max_tokens in initial:
            self.add(prefix, suffix, max_tokens, None)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, VOCAB - 1), max_size=10),
          max_tokens=st.integers(1, 8), salt=st.sampled_from([None, None, "t1"]))
    def add(self, prefix, suffix, max_tokens, salt):
        s = self.sched
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Request(rid, prefix + suffix, SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,)),
                    cache_salt=salt)
        p = r.num_prompt_tokens
        valid = 0 < p <= s.max_model_len and cdiv(s.max_kv_tokens(r), s.block_size) <= \
            s.kv_cache_manager.num_blocks
        try:
            s.add_request(r)
        except ValueError:
            assert not valid
        else:
            assert valid and s.get_request(rid) is r

    @rule(batch=st.lists(st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, VOCAB - 1), max_size=6),
                                    st.integers(1, 8)), min_size=2, max_size=5))
    def add_many(self, batch):
        for prefix, suffix, max_tokens in batch:
            self.add(prefix, suffix, max_tokens, None)

    @rule(num_steps=st.integers(1, 8), data=st.data())
    def steps(self, num_steps, data):
        for _ in range(num_steps):
            self.step(data)

    def step(self, data):
        s = self.sched
        running_before = [r.request_id for r in s.running]
        waiting_before = {r.request_id for r in s.waiting}
        plan = s.schedule()
        self.num_steps += 1
        self.checker.check_plan(plan, running_before)
        self.checker.check(mid_step=True)
        if plan.preempted_request_ids:
            event("rule step preempted")
        if any(rid in waiting_before and s.get_request(rid).num_computed_tokens > 0
               for rid in plan.request_ids):
            event("step with a prefix hit")
        sampled = self.model.step(plan)
        if plan.num_seqs:  # "finish": some sequences emit the stop token
            stop = data.draw(st.lists(st.sampled_from([False] * 5 + [True]), min_size=plan.num_seqs,
                                      max_size=plan.num_seqs))
            sampled = np.where(stop, STOP, sampled)
        for r in s.update(plan, sampled):
            assert r.is_finished and r.request_id not in s.requests
            self.finished[r.request_id] = r

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.sched.requests)
        rid = data.draw(st.sampled_from(ids))
        r = self.sched.abort(rid)
        assert r.status is RequestStatus.FINISHED_ABORTED and self.sched.get_request(rid) is None
        assert self.sched.abort(rid) is None

    @precondition(lambda self: bool(self.sched.running))
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from([r.request_id for r in self.sched.running]))
        assert self.sched.preempt(rid)
        r = self.sched.get_request(rid)
        assert r.status is RequestStatus.PREEMPTED and self.sched.waiting[0] is r

    @rule(num_steps=st.integers(1, 5), settle=st.booleans(), data=st.data())
    def fused_decode(self, num_steps, settle, data):
        s = self.sched
        kv = s.kv_cache_manager
        if settle:  # step until nothing waits and every running request decodes (or give up)
            for _ in range(8):
                if not s.waiting and all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running):
                    break
                self.step(data)
        eligible = (num_steps > 1 and not s.waiting and s.running
                    and len(s.running) <= s.scheduler_config.max_num_batched_tokens
                    and all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running))
        need = 0
        if eligible:
            for r in s.running:
                m = min(num_steps, r.sampling_params.max_tokens - r.num_output_tokens,
                        max(1, s.max_model_len - r.num_tokens))  # a max_model_len prompt still gets 1
                need += cdiv(r.num_computed_tokens + m, s.block_size) - len(kv.get_block_ids(r.request_id))
        free_before = kv.num_free_blocks
        fused_plan = s.schedule_fused_decode(num_steps)
        if not eligible or need > free_before:
            assert fused_plan is None
            return
        assert fused_plan is not None and len(fused_plan.fused.lent_block_ids) == need
        event("fused decode ran")
        self.checker.check(mid_step=True)
        n = fused_plan.num_seqs
        stop_early = np.array(data.draw(st.lists(st.integers(0, num_steps), min_size=n, max_size=n)))
        sampled, tables = self.model.fused_decode(fused_plan, [frozenset()] * n, stop_early)
        # a stop token where a sequence stopped early, as the device would have sampled it
        for i in range(n):
            k = int(min(stop_early[i], fused_plan.fused.max_new_tokens[i]))
            if 0 < k < fused_plan.fused.max_new_tokens[i] and data.draw(st.booleans()):
                sampled[k - 1, i] = STOP
        if n and data.draw(st.booleans()):  # abort one while the device runs
            self.sched.abort(data.draw(st.sampled_from(fused_plan.request_ids)))
        for r in s.update(fused_plan, StepResult.from_fused(fused_plan, sampled, tables)):
            self.finished[r.request_id] = r
        assert not kv.lent_block_ids

    @rule()
    def reset_prefix_cache(self):
        pool = self.sched.kv_cache_manager.block_pool
        in_use = pool.num_used > 0
        assert self.sched.reset_prefix_cache() == (not in_use)
        if not in_use:
            assert pool.num_cached == 0 and pool.num_hashed == 0
            self.checker.hash_tokens.clear()

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "sched"):
            self.checker.check()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        s = self.sched
        left = list(s.requests.values())
        # the oldest running request advances every step and is never preempted by others: bounded
        bound = sum(s.max_kv_tokens(r) + 2 for r in left) + 2
        preemptions_before = s.num_preemptions
        _, steps = run_to_completion(s, self.model, checker=self.checker, max_steps=bound)
        if s.num_preemptions > preemptions_before:
            event("drain preempted")
        event(f"drained {len(left)} requests" if len(left) < 3 else "drained >= 3 requests")
        event(f"steps before teardown: {min(self.num_steps // 10 * 10, 50)}+")
        assert steps <= bound
        assert all(r.is_finished for r in left)
        st_ = s.stats()
        assert st_.memory.num_used_blocks == 0 and st_.num_running == st_.num_waiting == 0


SchedulerMachine.TestCase.settings = settings(settings.default, stateful_step_count=30,
                                              max_examples=4 * settings.default.max_examples)
TestSchedulerMachine = SchedulerMachine.TestCase
