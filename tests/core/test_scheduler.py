"""The scheduler: plans, budgets, chunked prefill, stops, preemption, abort, errors, stats."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams
from tests.core.harness import Checker, FakeModel, reference_outputs, run_step, run_to_completion

BS = 4


def make_scheduler(num_blocks: int = 32, *, block_size: int = BS, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int = 64, chunked: bool = True,
                   caching: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len, enable_chunked_prefill=chunked),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks)


def req(rid: str, prompt: list[int] | int, max_tokens: int = 4, *, stop=(), eos=(), ignore_eos=False,
        salt=None) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop,
                                               ignore_eos=ignore_eos),
                   eos_token_ids=tuple(eos), cache_salt=salt)


def step(sched: Scheduler, tokens: int | list[int] = 0):
    plan = sched.schedule()
    sampled = np.full(plan.num_seqs, tokens) if isinstance(tokens, int) else np.array(tokens)
    return plan, sched.update(plan, sampled)


# -- input validation ------------------------------------------------------------------------------

def test_bad_requests_get_clear_errors():
    s = make_scheduler(num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(req("a", []))
    with pytest.raises(ValueError, match="longer than max_model_len"):
        s.add_request(req("b", 33))
    with pytest.raises(ValueError, match="whole pool"):
        s.add_request(req("c", 17, max_tokens=1))  # 17 tokens need 5 blocks of 4
    with pytest.raises(ValueError, match="whole pool"):
        s.add_request(req("d", 8, max_tokens=10))  # 8 + 10 - 1 = 17 KV tokens at the end
    s.add_request(req("e", 8, max_tokens=9))  # 16 KV tokens: fits exactly
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(req("e", 3))
    used = req("f", 3)
    used.output_token_ids.append(1)
    with pytest.raises(ValueError, match="not a fresh request"):
        s.add_request(used)
    assert [r.request_id for r in s.waiting] == ["e"]
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_prompt_of_max_model_len_generates_one_token():
    s = make_scheduler(num_blocks=8, max_model_len=16)
    s.add_request(req("a", 16, max_tokens=8))
    plan, finished = step(s, 5)
    assert plan.positions.max() == 15
    assert [r.request_id for r in finished] == ["a"] and finished[0].status is RequestStatus.FINISHED_LENGTH
    assert finished[0].output_token_ids == [5]


# -- plans -----------------------------------------------------------------------------------------

def test_prefill_then_decode_plan_contents():
    s = make_scheduler()
    s.add_request(req("a", [10, 11, 12, 13, 14, 15], max_tokens=4))
    plan = s.schedule()
    assert plan.request_ids == ["a"] and plan.num_tokens == 6 and plan.num_decodes == 0
    np.testing.assert_array_equal(plan.token_ids, [10, 11, 12, 13, 14, 15])
    np.testing.assert_array_equal(plan.positions, np.arange(6))
    np.testing.assert_array_equal(plan.cu_q_lens, [0, 6])
    np.testing.assert_array_equal(plan.kv_lens, [6])
    np.testing.assert_array_equal(plan.block_tables, [[0, 1]])
    np.testing.assert_array_equal(plan.slot_mapping, [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(plan.emits_token, [True])
    np.testing.assert_array_equal(plan.logits_indices, [5])
    assert not plan.is_empty and plan.preempted_request_ids == []
    assert s.update(plan, np.array([42])) == []
    r = s.get_request("a")
    assert r.output_token_ids == [42] and r.num_computed_tokens == 6 and r.num_cached_tokens == 0
    plan = s.schedule()
    np.testing.assert_array_equal(plan.token_ids, [42])
    np.testing.assert_array_equal(plan.positions, [6])
    np.testing.assert_array_equal(plan.kv_lens, [7])
    np.testing.assert_array_equal(plan.slot_mapping, [6])
    assert plan.num_decodes == 1
    s.update(plan, np.array([43]))
    plan = s.schedule()
    np.testing.assert_array_equal(plan.slot_mapping, [7])
    s.update(plan, np.array([44]))
    plan = s.schedule()  # crosses into a third block
    np.testing.assert_array_equal(plan.block_tables, [[0, 1, 2]])
    np.testing.assert_array_equal(plan.slot_mapping, [8])
    finished = s.update(plan, np.array([45]))
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].output_token_ids == [42, 43, 44, 45] and finished[0].finish_reason() == "length"
    assert not s.has_unfinished_requests() and s.get_request("a") is None
    assert s.schedule().is_empty


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_the_end():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(req("a", 40, max_tokens=2))
    chunks = []
    while True:
        plan = s.schedule()
        chunks.append((plan.num_tokens, bool(plan.emits_token[0]), int(plan.positions[0])))
        s.update(plan, np.array([7]))
        if s.get_request("a").num_output_tokens:
            break
    assert chunks == [(16, False, 0), (16, False, 16), (8, True, 32)]
    assert s.get_request("a").num_computed_tokens == 40


def test_decodes_come_first_and_budgets_hold():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    s.add_request(req("a", 3, max_tokens=20))
    s.add_request(req("b", 3, max_tokens=20))
    step(s)  # both prefilled (6 tokens)
    for rid in "cde":
        s.add_request(req(rid, 12, max_tokens=20))
    plan = s.schedule()
    # decodes of a and b first, then a chunk of c: 10 - 2 = 8 tokens; d, e wait (max_num_seqs = 3)
    assert plan.request_ids == ["a", "b", "c"] and plan.num_decodes == 2
    np.testing.assert_array_equal(plan.q_lens, [1, 1, 8])
    np.testing.assert_array_equal(plan.emits_token, [True, True, False])
    assert plan.num_tokens == 10 and len(s.running) == 3
    assert [r.request_id for r in s.waiting] == ["d", "e"]


def test_without_chunked_prefill_a_prompt_waits_for_room_in_the_budget():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, chunked=False)
    s.add_request(req("a", 4, max_tokens=20 - 8))
    step(s)
    s.add_request(req("b", [7] * 16, max_tokens=1))
    plan = s.schedule()
    assert plan.request_ids == ["a"]  # b's 16 tokens do not fit next to a's decode
    s.abort("a")
    plan = s.schedule()
    assert plan.request_ids == ["b"] and plan.num_tokens == 16


# -- stopping --------------------------------------------------------------------------------------

def test_stop_token_eos_and_ignore_eos():
    s = make_scheduler()
    s.add_request(req("stop", 3, max_tokens=10, stop=(9,)))
    s.add_request(req("eos", 3, max_tokens=10, eos=(8,)))
    s.add_request(req("ign", 3, max_tokens=10, eos=(8,), ignore_eos=True))
    step(s, [1, 1, 1])
    _, finished = step(s, [9, 8, 8])
    assert {r.request_id: r.status for r in finished} == {
        "stop": RequestStatus.FINISHED_STOPPED, "eos": RequestStatus.FINISHED_STOPPED}
    assert s.get_request("ign").output_token_ids == [1, 8]


def test_max_model_len_finishes_with_length():
    s = make_scheduler(max_model_len=10)
    s.add_request(req("a", 7, max_tokens=100))
    outs = []
    while s.has_unfinished_requests():
        outs += step(s, 3)[1]
    assert outs[0].num_tokens == 10 and outs[0].finish_reason() == "length"


def test_stop_wins_over_length_on_the_same_token():
    s = make_scheduler()
    s.add_request(req("a", 3, max_tokens=1, stop=(9,)))
    assert step(s, 9)[1][0].status is RequestStatus.FINISHED_STOPPED


# -- preemption, abort -----------------------------------------------------------------------------

def test_preemption_takes_the_newest_and_requeues_it_at_the_front():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    s.add_request(req("old", 8, max_tokens=16))
    s.add_request(req("new", list(range(11, 19)), max_tokens=16))  # no prefix shared with "old"
    s.add_request(req("later", 4, max_tokens=1))
    plan, _ = step(s, 5)  # old and new: 2 blocks each; later: 1 block; 1 block free
    assert plan.request_ids == ["old", "new", "later"]
    _, fin = step(s, 5)  # old, new cross into block 3: 2 blocks needed, 1 + later's 1 (finished) free
    assert [r.request_id for r in fin] == []
    # later finished at step 1 (max_tokens=1); now each decode step grows old and new
    for _ in range(3):
        plan, _ = step(s, 5)
        assert plan.preempted_request_ids == []
    plan = s.schedule()  # both need a 4th block (tokens 12..15), but only one is left after old takes its
    assert plan.preempted_request_ids == ["new"] and plan.request_ids == ["old"]
    new = s.get_request("new")
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_preemptions == 1 and new.output_token_ids == [5] * 5
    assert [r.request_id for r in s.waiting] == ["new"]
    assert s.stats().num_preemptions == 1
    s.update(plan, np.array([5]))


def test_preempted_request_recomputes_prompt_and_outputs_and_hits_its_own_blocks():
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=64)
    s.add_request(req("a", 9, max_tokens=30))
    step(s, 1)
    for t in range(2, 6):
        step(s, t)
    a = s.get_request("a")
    assert a.num_tokens == 14 and a.num_computed_tokens == 13
    assert s.preempt("a") and not s.preempt("a")
    queries_before = s.stats().prefix_cache_queries
    plan = s.schedule()
    # 3 full blocks are still cached: 12 tokens hit; tokens 12, 13 are recomputed
    np.testing.assert_array_equal(plan.token_ids, a.all_token_ids[12:14])
    assert plan.emits_token[0] and a.status is RequestStatus.RUNNING and a.num_computed_tokens == 12
    assert a.num_cached_tokens == 0, "set once, at the first admission"
    assert s.stats().prefix_cache_queries == queries_before, "recompute after preemption is not a lookup"
    s.update(plan, np.array([6]))
    assert a.output_token_ids == [1, 2, 3, 4, 5, 6]


def test_preempted_request_is_not_readmitted_in_the_same_step():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    s.add_request(req("a", 4, max_tokens=9))
    s.add_request(req("b", 4, max_tokens=9))
    step(s)
    for _ in range(5):
        plan, _ = step(s)
        if plan.preempted_request_ids:
            break
    assert plan.preempted_request_ids == ["b"] and "b" not in plan.request_ids


def test_abort_anywhere_frees_everything():
    s = make_scheduler(num_blocks=16)
    for rid in "abc":
        s.add_request(req(rid, 6, max_tokens=10))
    plan = s.schedule()
    s.add_request(req("d", 5))
    assert s.abort("b").status is RequestStatus.FINISHED_ABORTED  # between schedule and update
    assert s.abort("d").status is RequestStatus.FINISHED_ABORTED  # waiting
    assert s.abort("zzz") is None and s.abort("b") is None
    finished = s.update(plan, np.zeros(plan.num_seqs))  # skips the aborted b
    assert finished == [] and s.get_request("b") is None
    assert s.kv_cache_manager.get_block_ids("b") == ()
    Checker(s).check()
    s.abort("a")
    s.abort("c")
    st = s.stats()
    assert st.memory.num_used_blocks == 0 and st.num_running == st.num_waiting == 0
    assert not s.has_unfinished_requests()
    # aborted ids can be reused
    s.add_request(req("a", 3))


def test_stale_plan_is_rejected():
    s = make_scheduler()
    s.add_request(req("a", 3, max_tokens=5))
    plan = s.schedule()
    s.update(plan, np.zeros(1))
    with pytest.raises(RuntimeError, match="stale"):
        s.update(plan, np.zeros(1))
    with pytest.raises(ValueError, match="sampled tokens"):
        s.update(s.schedule(), np.zeros(0))


# -- prefix caching through the scheduler -----------------------------------------------------------

def test_prefix_hits_are_counted_once_and_set_num_cached_tokens():
    s = make_scheduler(block_size=4)
    shared = list(range(100, 112))  # 3 blocks
    s.add_request(req("a", shared + [1, 2], max_tokens=1))
    step(s)
    s.add_request(req("b", shared + [3], max_tokens=1))
    plan = s.schedule()
    b = s.get_request("b")
    assert b.num_cached_tokens == 12 and plan.num_tokens == 1
    st = s.stats()
    assert st.prefix_cache_queries == 14 + 13 and st.prefix_cache_hits == 12
    assert st.prefix_cache_hit_rate == pytest.approx(12 / 27)
    s.update(plan, np.zeros(1))
    s.add_request(req("c", shared, max_tokens=1))  # a full hit still computes its last block
    plan = s.schedule()
    assert s.get_request("c").num_cached_tokens == 8 and plan.num_tokens == 4
    s.update(plan, np.zeros(1))
    assert s.reset_prefix_cache()
    s.add_request(req("d", shared, max_tokens=1))
    assert s.schedule().num_tokens == 12


def test_reset_prefix_cache_refused_while_running():
    s = make_scheduler()
    s.add_request(req("a", 8, max_tokens=4))
    step(s)
    assert not s.reset_prefix_cache()


# -- stats -----------------------------------------------------------------------------------------

def test_stats_account_for_every_block_and_the_waste():
    s = make_scheduler(num_blocks=20, block_size=4)
    s.add_request(req("a", 5, max_tokens=8))  # 5 computed -> 2 blocks, 3 slots wasted
    s.add_request(req("b", list(range(20, 28)), max_tokens=8))  # 8 computed -> 2 blocks, none wasted
    step(s)
    st = s.stats()
    assert st.memory.num_free_blocks + st.memory.num_used_blocks + st.memory.num_cached_blocks == 20
    assert st.memory.num_used_blocks == 4 and st.num_running == 2 and st.num_waiting == 0
    assert st.memory.slots_reserved == 16 and st.memory.slots_used == 13 and st.memory.slots_wasted == 3
    assert st.memory.waste_fraction == pytest.approx(3 / 16)
    assert st.memory.num_partial_blocks == 1
    assert st.memory.free_runs is None
    detailed = s.stats(detailed=True)
    assert detailed.memory.free_runs == 1 and detailed.memory.largest_free_run == 16
    assert st.memory.block_usage == pytest.approx(4 / 20)


# -- end to end with the fake model -----------------------------------------------------------------

def _workload(n: int = 12, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(0, 6, 10)), list(rng.integers(0, 6, 23))]
    out = []
    for i in range(n):
        prompt = (prefixes[i % 2] if i % 3 else []) + list(rng.integers(0, 6, int(rng.integers(1, 14))))
        out.append(Request(f"r{i}", [int(t) for t in prompt],
                           SamplingParams(max_tokens=int(rng.integers(1, 20)), stop_token_ids=(5,) if i % 4 else ())))
    return out


@pytest.mark.parametrize("block_size,num_blocks,budget,caching,multi", [
    (4, 64, 64, True, 0),
    (4, 64, 64, False, 0),
    (1, 60, 7, True, 0),  # tiny pool: heavy preemption
    (16, 4, 16, True, 0),
    (2, 26, 5, True, 4),
    (4, 14, 13, False, 3),
    (8, 9, 32, True, 8),
])
def test_outputs_match_the_reference_under_any_configuration(block_size, num_blocks, budget, caching, multi):
    """Invariant 4 on the host side: the outputs depend only on each request's tokens."""
    s = make_scheduler(num_blocks, block_size=block_size, max_num_seqs=6, max_num_batched_tokens=budget,
                       max_model_len=64, caching=caching)
    reqs = _workload()
    for r in reqs:
        s.add_request(r)
    model = FakeModel(num_blocks, block_size)
    outputs, _ = run_to_completion(s, model, checker=Checker(s, model), fused_steps=multi)
    expected = {r.request_id: reference_outputs(r, 64) for r in _workload()}
    assert outputs == expected
    st = s.stats()
    assert st.memory.num_used_blocks == 0 and st.memory.num_lent_blocks == 0
    if num_blocks <= 9:
        assert st.num_preemptions > 0


def test_every_request_finishes_in_bounded_steps_under_preemption_pressure():
    s = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=8, max_num_batched_tokens=9, max_model_len=16)
    rng = np.random.default_rng(1)
    reqs = [Request(f"r{i}", [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 12)))],
                    SamplingParams(max_tokens=int(rng.integers(1, 10)))) for i in range(30)]
    for r in reqs:
        s.add_request(r)
    bound = sum(s.max_kv_tokens(r) + 2 for r in reqs) + 5
    model = FakeModel(8, 2)
    outputs, steps = run_to_completion(s, model, checker=Checker(s, model), max_steps=bound)
    assert len(outputs) == 30 and steps <= bound
    assert s.num_preemptions > 0
    for r in reqs:
        assert r.is_finished and outputs[r.request_id] == reference_outputs(r, 16)


def test_run_step_with_checker_smoke():
    s = make_scheduler()
    s.add_request(req("a", 5, max_tokens=2))
    model = FakeModel(32, BS)
    run_step(s, model, Checker(s, model))
    assert s.get_request("a").num_output_tokens == 1


def test_check_invariants_catches_a_leaked_or_doubly_owned_block():
    s = make_scheduler(num_blocks=8)
    s.add_request(req("a", 6))
    s.add_request(req("b", 5))
    step(s)
    s.check_invariants()
    pool = s.kv_cache_manager.block_pool
    held = s.kv_cache_manager.get_block_ids("a")
    pool.touch([held[0]])  # one more reference than holders: a leak
    with pytest.raises(RuntimeError, match=f"block {held[0]}"):
        s.check_invariants()


def test_fail_step_fails_a_lone_request_and_isolates_a_batch():
    """A failed step of several requests reruns each alone (suspects); a failed step of one fails it."""
    s = make_scheduler()
    for i, rid in enumerate("abc"):
        s.add_request(req(rid, [10 * i + t for t in range(1, 7)], max_tokens=3))
    plan = s.schedule()
    assert s.fail_step(plan.request_ids, "boom") == []
    assert all(s.get_request(r).suspect and s.get_request(r).status is RequestStatus.PREEMPTED for r in "abc")
    s.check_invariants()
    alone = s.schedule()
    assert alone.num_seqs == 1
    failed = s.fail_step(alone.request_ids, "boom again")
    assert [r.request_id for r in failed] == alone.request_ids
    assert failed[0].status is RequestStatus.FINISHED_ERROR and failed[0].error == "boom again"
    s.check_invariants()
    second = s.schedule()  # the next suspect, alone too; success clears its flag
    assert second.num_seqs == 1
    s.update(second, np.zeros(1, np.int32))
    assert not s.get_request(second.request_ids[0]).suspect
    run_to_completion_plain(s)
    s.check_invariants()
    assert s.kv_cache_manager.block_pool.num_used == 0


def test_drop_computed_kv_preempts_everything_and_forgets_the_prefix_cache():
    s = make_scheduler()
    s.add_request(req("a", 9, max_tokens=8))
    s.add_request(req("b", 5, max_tokens=8))
    step(s)
    step(s)
    assert s.kv_cache_manager.block_pool.num_hashed > 0
    s.drop_computed_kv()
    s.check_invariants()
    assert not s.running and [r.request_id for r in s.waiting] == ["a", "b"]
    assert s.kv_cache_manager.block_pool.num_hashed == 0
    run_to_completion_plain(s)


def run_to_completion_plain(s: Scheduler) -> None:
    for _ in range(200):
        if not s.has_unfinished_requests():
            return
        step(s)
        s.check_invariants()
    raise AssertionError("did not finish")


@pytest.mark.parametrize("budget", [64, 512, 4096])
def test_requests_sharing_a_prefix_that_arrive_together_compute_it_once(budget):
    """64 requests with a common 96-token prefix, queued at once: the prefix is computed by one request and
    hit by the other 63 (they wait for it a step), whatever the token budget; outputs are unchanged."""
    bs, prefix_len, suffix_len, n = 16, 96, 32, 64
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 1000, prefix_len).tolist()
    prompts = [prefix + rng.integers(0, 1000, suffix_len).tolist() for _ in range(n)]
    computed = {}
    for caching in (True, False):
        s = make_scheduler(num_blocks=n * 10, block_size=bs, max_num_seqs=n, max_num_batched_tokens=budget,
                           max_model_len=256, caching=caching)
        for i, p in enumerate(prompts):
            s.add_request(req(str(i), p, max_tokens=3))
        model = FakeModel(n * 10, bs)
        checker = Checker(s, model)
        tokens_run = 0
        outputs: dict[str, list[int]] = {}
        while s.has_unfinished_requests():
            plan = s.schedule()
            checker.check_plan(plan)
            tokens_run += plan.num_tokens
            for r in s.update(plan, model.step(plan)):
                outputs[r.request_id] = r.output_token_ids
            checker.check()
        assert s.num_preemptions == 0
        computed[caching] = (tokens_run - n * 2, outputs)  # each request feeds back 2 of its 3 outputs
    assert computed[True][1] == computed[False][1]
    assert computed[False][0] == n * (prefix_len + suffix_len)
    assert computed[True][0] == prefix_len + n * suffix_len  # the prefix once, every suffix
