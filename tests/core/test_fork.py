"""Forking on the paged cache: several samples of one prompt and held (beam-search) requests that fork, against
the fake model over a shadow KV cache.

A sample (or a forked child) reads its context through its own block table, so a sibling's write into a shared
block, a copy that is missing or made too late, or a block freed while another holder still uses it changes its
output. Every plan is checked (copy-on-write exactly when a shared block is written), every invariant after
every step, and every finished request against a cache-free reference.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.request import Request, RequestStatus, sample_id
from pagedjax.core.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams
from tests.core.harness import VOCAB, Checker, FakeModel, SchedulerMachine, reference_outputs, run_step


class ForkMachine(SchedulerMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(12, 40),
                budget=st.sampled_from([3, 8, 64]), caching=st.booleans(),
                window=st.sampled_from([None, None, 2, 5]))
    def setup(self, block_size, num_blocks, budget, caching, window):
        self.max_model_len = 24
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                               max_model_len=self.max_model_len),
                               CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks,
                               sliding_window=window)
        self.salts: dict[str, int] = {}
        self.model = FakeModel(num_blocks, block_size, self.salts, window=window)
        self.window = window
        self.checker = Checker(self.sched, self.model)
        self.expected_prefix: dict[str, list[int]] = {}  # forked child -> the outputs it started with
        self.finished: list[Request] = []
        self.aborted: set[str] = set()
        self.next_id = 0
        self.block_size = block_size

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(blocks=st.integers(0, 3), extra=st.integers(0, 3), samples=st.integers(1, 4),
          max_tokens=st.integers(1, 6), held=st.booleans(), data=st.data())
    def add(self, blocks, extra, samples, max_tokens, held, data):
        """A prompt of a whole number of blocks (+ extra tokens, >= 1 in all) with several samples, or a held
        request (beam search) with one."""
        n = max(1, blocks * self.block_size + extra)
        prompt = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
        rid = self._new_id()
        params = SamplingParams(max_tokens=max_tokens, n=1 if held else samples)
        request = Request(rid, prompt, params, hold=held)
        try:
            self.sched.add_request(request)
        except ValueError:
            return  # could not fit the whole pool
        for i in range(params.num_samples):
            self.salts[sample_id(rid, i)] = i + 1

    @rule()
    def step(self):
        for r in self.sched.running:  # between steps, a held request decides (here: go on)
            r.paused = False
        if not self.sched.has_unfinished_requests():
            return
        self.finished += run_step(self.sched, self.model, self.checker)

    @rule(num_steps=st.integers(2, 5))
    def fused_decode(self, num_steps):
        self.finished += run_step(self.sched, self.model, self.checker, fused_steps=num_steps)

    @precondition(lambda self: any(r.paused for r in self.sched.running))
    @rule(data=st.data())
    def fork_held(self, data):
        """Beam search's move: a paused request forks into a child whose last (not yet computed) token is
        another one; the source may then be dropped."""
        paused = [r for r in self.sched.running if r.paused]
        source = data.draw(st.sampled_from(paused))
        if len(self.sched.running) >= self.sched.scheduler_config.max_num_seqs:
            return
        token = data.draw(st.integers(0, VOCAB - 1))
        outputs = source.output_token_ids[:-1] + [token]
        child = Request(self._new_id(), list(source.prompt_token_ids), source.sampling_params,
                        output_token_ids=list(outputs), hold=True)
        self.sched.fork(source.request_id, child)
        self.salts[child.request_id] = data.draw(st.integers(0, 5))
        self.expected_prefix[child.request_id] = list(outputs)
        if data.draw(st.booleans()):
            self.sched.abort(source.request_id)
            self.aborted.add(source.request_id)
        self.checker.check()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            for r in self.sched.running + list(self.sched.waiting):
                r.paused = False
            self.finished += run_step(self.sched, self.model, self.checker)
        assert not self.sched.has_unfinished_requests()
        assert not self.sched.groups
        pool = self.sched.kv_cache_manager.block_pool
        assert pool.num_used == 0, "blocks leaked"
        for r in self.finished:
            assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
            if r.request_id in self.aborted or (r.group is not None and r.group.request.request_id in self.aborted):
                continue
            prefix = self.expected_prefix.get(r.request_id)
            expected = reference_outputs(r, self.max_model_len, self.salts.get(r.request_id, 0), prefix,
                                         window=self.window)
            assert r.output_token_ids == expected, r.request_id


ForkMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestForks = ForkMachine.TestCase


def test_samples_of_a_prompt_share_its_blocks_and_copy_the_partial_one():
    """A 7-token prompt in blocks of 4 with 3 samples: the prefill computes the first 6 tokens once, the
    samples share both blocks (ref_cnt 3), and when they compute the last prompt token the first two copy the
    partial block while the last writes into it in place; then each generates its own tokens."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32),
                      CacheConfig(block_size=4), 16)
    model = FakeModel(16, 4, {sample_id("a", i): i + 1 for i in range(3)})
    checker = Checker(sched, model)
    request = Request("a", [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=3, n=3))
    sched.add_request(request)
    plan = sched.schedule()
    assert plan.request_ids == ["a"] and plan.num_tokens == 6  # the prompt but its last token
    sched.update(plan, model.step(plan))
    samples = sched.groups["a"].samples
    assert [s.request_id for s in samples] == ["a[0]", "a[1]", "a[2]"]
    kv = sched.kv_cache_manager
    shared = kv.get_block_ids("a[0]")
    assert all(kv.get_block_ids(s.request_id) == shared for s in samples)
    assert [kv.block_pool.ref_cnt(b) for b in shared] == [3, 3]
    checker.check()
    assert sched.schedule_fused_decode(4) is None  # a pending copy-on-write takes a plain step
    finished = run_step(sched, model, checker)
    assert kv.get_block_ids("a[2]") == shared  # the last holder kept the original
    assert kv.get_block_ids("a[0]")[0] == kv.get_block_ids("a[1]")[0] == shared[0]  # full block still shared
    assert len({kv.get_block_ids(s.request_id)[1] for s in samples}) == 3
    while sched.has_unfinished_requests():
        finished += run_step(sched, model, checker, fused_steps=4)
    assert kv.block_pool.num_used == 0
    for s in samples:
        assert s.output_token_ids == reference_outputs(dataclasses.replace(s), 32, s.sample_index + 1)
    assert len({tuple(s.output_token_ids) for s in samples}) > 1  # the salts make them differ
