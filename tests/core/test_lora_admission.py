"""The scheduler's LoRA rule: running requests use at most `max_loras` distinct adapters; a request of one more
waits (others pass it), and runs once an adapter's requests finish."""

from __future__ import annotations

import numpy as np

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.request import Request
from pagedjax.core.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams


def make_scheduler(max_loras):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                     CacheConfig(block_size=4), 64, max_loras=max_loras)


def req(rid, adapter, max_tokens=3):
    prompt = [ord(c) for c in rid] * 5  # distinct prompts: no request waits for another's blocks
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), adapter_id=adapter)


def run(sched):
    """Step to completion; the adapters of each step's requests."""
    steps = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        steps.append([sched.get_request(rid).adapter_id for rid in plan.request_ids])
        sched.update(plan, np.zeros(plan.num_seqs, np.int32))
        sched.check_invariants()
    return steps


def test_a_third_adapter_waits_while_two_run_and_base_requests_pass_it():
    sched = make_scheduler(2)
    for rid, adapter in (("a", "1"), ("b", "2"), ("c", "3"), ("d", None), ("e", "1")):
        sched.add_request(req(rid, adapter, max_tokens=3 if adapter != "1" else 2))
    steps = run(sched)
    assert all(len(set(s) - {None}) <= 2 for s in steps), steps
    assert steps[0] == ["1", "2", None, "1"]  # "3" skipped, the base and adapter-1 requests behind it admitted
    first_3 = next(i for i, s in enumerate(steps) if "3" in s)
    assert "1" not in steps[first_3]  # admitted once adapter 1's requests finished
    assert sum(s.count("3") for s in steps) == 3  # it ran to the end


def test_no_limit_without_max_loras():
    sched = make_scheduler(None)
    for i in range(4):
        sched.add_request(req(str(i), str(i)))
    assert len(set(run(sched)[0])) == 4


def test_a_suspect_of_a_new_adapter_preempts_until_it_fits():
    sched = make_scheduler(1)
    sched.add_request(req("a", "1", max_tokens=4))
    sched.add_request(req("b", None, max_tokens=4))
    plan = sched.schedule()
    sched.update(plan, np.zeros(plan.num_seqs, np.int32))
    suspect = req("s", "2")
    sched.add_request(suspect)
    suspect.suspect = True
    sched.waiting.remove(suspect)
    sched.waiting.appendleft(suspect)
    plan = sched.schedule()
    assert plan.request_ids == ["s"]
    running = {r.adapter_id for r in sched.running}
    assert len(running - {None}) <= 1, running  # adapter 1's request was preempted
    sched.check_invariants(mid_step=True)
    sched.update(plan, np.zeros(plan.num_seqs, np.int32))
    assert all(len(set(s) - {None}) <= 1 for s in run(sched))


def test_a_fork_keeps_its_sources_adapter():
    sched = make_scheduler(2)
    source = req("a", "1", max_tokens=4)
    sched.add_request(source)
    plan = sched.schedule()
    sched.update(plan, np.zeros(plan.num_seqs, np.int32))
    child = Request("a.1", list(source.prompt_token_ids), source.sampling_params,
                    output_token_ids=list(source.output_token_ids), adapter_id=None)
    try:
        sched.fork("a", child)
    except ValueError as e:
        assert "must keep its adapter_id" in str(e)
    else:
        raise AssertionError("a fork under another adapter would share blocks of other weights")
    sched.fork("a", Request("a.2", list(source.prompt_token_ids), source.sampling_params,
                            output_token_ids=list(source.output_token_ids), adapter_id="1"))
    sched.check_invariants()
