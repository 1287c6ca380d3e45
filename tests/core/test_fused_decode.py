"""Fused decode: lending, the device pop rule, and reconciliation."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.core.kv_cache_manager import cdiv
from pagedjax.core.request import RequestStatus
from pagedjax.core.step_plan import simulate_device_pops
from pagedjax.core.step_result import StepResult
from tests.core.harness import Checker, FakeModel, reference_outputs
from tests.core.test_scheduler import make_scheduler, req


def decoding_scheduler(prompts=(5, 8, 3), max_tokens=(20, 20, 20), num_blocks=32, block_size=4,
                       max_model_len=64, stops=None, model=None, **kw):
    """Requests r0, r1, ... prefilled in one step (each has 1 output token: 0, or the model's)."""
    s = make_scheduler(num_blocks, block_size=block_size, max_model_len=max_model_len, **kw)
    stops = stops or [()] * len(prompts)
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        s.add_request(req(f"r{i}", [i + 1] * p, max_tokens=m, stop=stops[i]))
    plan = s.schedule()
    s.update(plan, model.step(plan) if model else np.zeros(plan.num_seqs))
    return s


def snapshot(s):
    pool = s.kv_cache_manager.block_pool
    return (pool.free_block_ids(), [pool.ref_cnt(b) for b in range(pool.num_blocks)],
            {r.request_id: (r.num_computed_tokens, list(r.output_token_ids)) for r in s.running})


def test_fused_decode_refuses_unless_every_request_is_a_pure_decode():
    s = make_scheduler(max_num_batched_tokens=4)
    assert s.schedule_fused_decode(4) is None  # nothing running
    s.add_request(req("a", 10, max_tokens=8))
    s.update(s.schedule(), np.zeros(1))  # a 4-token chunk: a is mid-prefill
    assert s.schedule_fused_decode(4) is None
    s = decoding_scheduler()
    assert s.schedule_fused_decode(1) is None
    s.add_request(req("w", 3))
    assert s.schedule_fused_decode(4) is None  # someone is waiting
    s.abort("w")
    before = snapshot(s)
    m = s.schedule_fused_decode(4)
    assert m is not None
    s.update(m, StepResult.from_fused(m, np.zeros((4, 3), np.int32),
                          simulate_device_pops(m.block_tables, m.fused.seq_lens, m.fused.lent_block_ids,
                                               m.fused.max_new_tokens, 4)[0]))
    assert snapshot(s) != before


def test_fused_decode_refuses_when_lending_fails_and_changes_nothing():
    s = decoding_scheduler(prompts=(4, 4), max_tokens=(9, 9), num_blocks=5)  # 2 held, 3 free
    before = snapshot(s)
    assert s.schedule_fused_decode(8) is None  # 8 more tokens each: 2 new blocks each, 4 > 3
    assert snapshot(s) == before
    m = s.schedule_fused_decode(4)  # 4 tokens each: one new block each
    assert m is not None and len(m.fused.lent_block_ids) == 2


def test_last_chunk_of_a_max_model_len_prompt_fuses_and_generates_one_token():
    """Regression (hypothesis, dev profile): a prompt of exactly max_model_len tokens, chunked, ends with
    a gap of 1 and max_model_len - num_tokens == 0 room; it may still generate one token."""
    s = make_scheduler(3, block_size=4, max_num_seqs=1, max_num_batched_tokens=8, max_model_len=9)
    s.add_request(req("a", [1, 2, 3, 1, 2, 3, 1, 2, 0], max_tokens=1))
    s.update(s.schedule(), np.zeros(1))  # 8 of 9 prompt tokens
    m = s.schedule_fused_decode(2)
    assert m is not None and m.fused.max_new_tokens.tolist() == [1] and len(m.fused.lent_block_ids) == 1
    tables, _, _ = simulate_device_pops(m.block_tables, m.fused.seq_lens, m.fused.lent_block_ids,
                                        m.fused.max_new_tokens, 4)
    finished = s.update(m, StepResult.from_fused(m, np.array([[7], [-1]]), tables))
    assert finished[0].output_token_ids == [7] and finished[0].finish_reason() == "length"
    assert s.kv_cache_manager.block_pool.num_used == 0


def test_plan_shape_lent_stack_and_max_new_tokens():
    s = decoding_scheduler(prompts=(5, 8, 3), max_tokens=(20, 2, 20), max_model_len=12)
    # computed 5, 8, 3; tokens 6, 9, 4; the second has 1 token left (max_tokens 2), the first 6 (room)
    m = s.schedule_fused_decode(8)
    plan = m
    assert plan.request_ids == ["r0", "r1", "r2"] and plan.num_decodes == 3
    np.testing.assert_array_equal(m.fused.max_new_tokens, [6, 1, 8])
    np.testing.assert_array_equal(m.fused.seq_lens, [5, 8, 3])
    np.testing.assert_array_equal(plan.kv_lens, [6, 9, 4])
    assert plan.block_tables.shape == (3, max(cdiv(6 + 7, 4), cdiv(9 + 7, 4), cdiv(4 + 7, 4)))
    # r1 (8 computed) writes at position 8: a new block popped on device, so its slot is unknown here
    assert plan.slot_mapping[1] == -1 and plan.slot_mapping[0] >= 0 and plan.slot_mapping[2] >= 0
    # exactly enough: r0 5 -> 11 tokens (+1 block), r1 8 -> 9 (+1), r2 3 -> 11 (+2)
    assert len(m.fused.lent_block_ids) == 4
    assert s.kv_cache_manager.lent_block_ids == set(m.fused.lent_block_ids.tolist())
    tables, slots, popped = simulate_device_pops(plan.block_tables, m.fused.seq_lens, m.fused.lent_block_ids,
                                                 m.fused.max_new_tokens, 4)
    assert popped == 4
    # step 1's known slots agree with the simulation; pops go in sequence order
    known = plan.slot_mapping >= 0
    np.testing.assert_array_equal(slots[0][known], plan.slot_mapping[known])
    assert tables[1, 2] == m.fused.lent_block_ids[0]  # r1 pops first (step 1), r2 and r0 later
    assert slots[1:, 1].tolist() == [-1] * 7
    Checker(s).check(mid_step=True)


def test_reconcile_adopts_used_blocks_returns_the_rest_and_hashes_full_blocks():
    model = FakeModel(32, 4)
    s = decoding_scheduler(prompts=(5, 8, 3), max_tokens=(20, 20, 20), model=model)
    free_before = s.kv_cache_manager.num_free_blocks
    m = s.schedule_fused_decode(6)
    # r1 stops after 2 steps (as at a stop id), r2 did not run at all in the last 3 steps
    sampled, tables = model.fused_decode(m, [frozenset()] * 3, stop_early=np.array([6, 2, 3]))
    lent = m.fused.lent_block_ids.tolist()
    finished = s.update(m, StepResult.from_fused(m, sampled, tables))
    assert finished == []
    r0, r1, r2 = (s.get_request(f"r{i}") for i in range(3))
    assert (r0.num_computed_tokens, r1.num_computed_tokens, r2.num_computed_tokens) == (11, 10, 6)
    assert r0.num_output_tokens == 7 and r1.num_output_tokens == 3 and r2.num_output_tokens == 4
    kv = s.kv_cache_manager
    for r in (r0, r1, r2):
        assert len(kv.get_block_ids(r.request_id)) == cdiv(r.num_computed_tokens, 4)
    adopted = [b for r in (r0, r1, r2) for b in kv.get_block_ids(r.request_id) if b in lent]
    assert not kv.lent_block_ids
    assert kv.num_free_blocks == free_before - len(adopted)
    # r0's second block filled during the fused decode (tokens 4..7) and got its hash
    assert kv.block_pool.block_hash(kv.get_block_ids("r0")[1]) is not None
    Checker(s, model).check()


def test_reconcile_finishes_requests_on_stop_and_length_and_skips_aborted_ones():
    s = decoding_scheduler(prompts=(5, 8, 3), max_tokens=(20, 3, 20), stops=[(9,), (), ()])
    m = s.schedule_fused_decode(5)
    np.testing.assert_array_equal(m.fused.max_new_tokens, [5, 2, 5])
    tables, _, _ = simulate_device_pops(m.block_tables, m.fused.seq_lens, m.fused.lent_block_ids,
                                        np.array([2, 2, 5]), 4)
    sampled = np.array([[1, 1, 1], [9, 1, 1], [-1, -1, 1], [-1, -1, 1], [-1, -1, 1]])
    aborted = s.abort("r2")
    finished = s.update(m, StepResult.from_fused(m, sampled, tables))
    assert {r.request_id: r.status for r in finished} == {
        "r0": RequestStatus.FINISHED_STOPPED, "r1": RequestStatus.FINISHED_LENGTH}
    assert finished[0].output_token_ids == [0, 1, 9] and finished[1].output_token_ids == [0, 1, 1]
    assert aborted.output_token_ids == [0]
    assert not s.has_unfinished_requests()
    kv = s.kv_cache_manager
    assert kv.block_pool.num_used == 0 and not kv.lent_block_ids
    kv.block_pool.check_invariants()


def test_reconcile_rejects_a_device_that_broke_the_contract_and_changes_nothing():
    s = decoding_scheduler(prompts=(4, 8), max_tokens=(20, 20))
    m = s.schedule_fused_decode(4)
    tables, _, _ = simulate_device_pops(m.block_tables, m.fused.seq_lens, m.fused.lent_block_ids,
                                        m.fused.max_new_tokens, 4)
    sampled = np.zeros((4, 2), np.int32)
    before = snapshot(s)
    bad = tables.copy()
    bad[0, 0] = m.fused.lent_block_ids[0]  # overwrote a block the host had placed
    with pytest.raises(RuntimeError, match="changed blocks"):
        s.update(m, StepResult.from_fused(m, sampled, bad))
    bad = tables.copy()
    bad[1, 2] = bad[0, 1]  # the same lent block claimed twice
    with pytest.raises(RuntimeError, match="not lent or are claimed twice"):
        s.update(m, StepResult.from_fused(m, sampled, bad))
    with pytest.raises(ValueError):
        s.update(m, StepResult.from_fused(m, sampled[:, :1], tables))
    assert snapshot(s) == before and s.kv_cache_manager.lent_block_ids == set(m.fused.lent_block_ids.tolist())
    s.update(m, StepResult.from_fused(m, sampled, tables))
    assert not s.kv_cache_manager.lent_block_ids


def test_fused_decode_outputs_equal_single_steps():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    results = []
    for multi in (0, 3, 7):
        s = make_scheduler(40, block_size=2, max_model_len=40)
        for i, p in enumerate(prompts):
            s.add_request(req(f"r{i}", p, max_tokens=25, stop=(5,) if i == 1 else ()))
        model = FakeModel(40, 2)
        checker = Checker(s, model)
        outputs = {}
        while s.has_unfinished_requests():
            m = s.schedule_fused_decode(multi) if multi else None
            if m is None:
                plan = s.schedule()
                checker.check_plan(plan)
                finished = s.update(plan, model.step(plan))
            else:
                stops = [s.get_request(rid).stop_ids for rid in m.request_ids]
                finished = s.update(m, StepResult.from_fused(m, *model.fused_decode(m, stops)))
            checker.check()
            outputs.update({r.request_id: r.output_token_ids for r in finished})
        results.append(outputs)
    assert results[0] == results[1] == results[2]
    assert results[0]["r0"] == reference_outputs(req("r0", prompts[0], max_tokens=25), 40)


def test_simulate_device_pops_rule():
    # two seqs, block size 2: seq 0 has 2 tokens (needs a block at once), seq 1 has 1 token
    tables = np.array([[7, 0, 0], [8, 0, 0]], np.int32)
    out, slots, popped = simulate_device_pops(tables, np.array([2, 1]), np.array([20, 21, 22]),
                                              np.array([3, 3]), 2)
    assert popped == 3
    np.testing.assert_array_equal(out, [[7, 20, 22], [8, 21, 0]])
    np.testing.assert_array_equal(slots, [[40, 17], [41, 42], [44, 43]])
    assert tables[0, 1] == 0, "input not mutated"
    with pytest.raises(ValueError, match="ran dry"):
        simulate_device_pops(tables, np.array([2, 1]), np.array([20, 21]), np.array([3, 3]), 2)
    with pytest.raises(ValueError, match="row"):
        simulate_device_pops(tables[:, :1], np.array([2, 1]), np.array([20, 21]), np.array([1, 1]), 2)


def test_one_fused_decode_in_flight_at_a_time_and_cancel_returns_the_loan():
    s = decoding_scheduler()
    before = snapshot(s)
    m = s.schedule_fused_decode(4)
    with pytest.raises(RuntimeError, match="in flight"):
        s.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        s.schedule_fused_decode(4)
    s.cancel(m)
    assert snapshot(s) == before and not s.kv_cache_manager.lent_block_ids
    with pytest.raises(RuntimeError, match="not the one in flight"):
        s.update(m, StepResult.from_fused(m, np.zeros((4, 3), np.int32), m.block_tables))
    m2 = s.schedule_fused_decode(4)
    tables, _, _ = simulate_device_pops(m2.block_tables, m2.fused.seq_lens, m2.fused.lent_block_ids,
                                        m2.fused.max_new_tokens, 4)
    s.update(m2, StepResult.from_fused(m2, np.zeros((4, 3), np.int32), tables))
    s.schedule()
