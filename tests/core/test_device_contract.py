"""The host's mirror of the device pop rule (`simulate_device_pops`) agrees with the device's own
`pagedjax.device.page_state.append_tokens`, on the very plans `schedule_fused_decode` makes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core.step_plan import simulate_device_pops
from pagedjax.core.step_result import StepResult
from tests.core.test_scheduler import make_scheduler, req

jnp = pytest.importorskip("jax.numpy")
page_state = pytest.importorskip("pagedjax.device.page_state")


@settings(max_examples=10)
@given(block_size=st.sampled_from([1, 2, 4]), prompts=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       num_steps=st.integers(2, 6), data=st.data())
def test_host_mirror_matches_device_append_tokens(block_size, prompts, num_steps, data):
    s = make_scheduler(64, block_size=block_size, max_model_len=32)
    for i, p in enumerate(prompts):
        s.add_request(req(f"r{i}", [i + 1] * p, max_tokens=20))
    plan = s.schedule()
    s.update(plan, np.zeros(plan.num_seqs))
    m = s.schedule_fused_decode(num_steps)
    assert m is not None
    n = m.num_seqs
    active_steps = np.array(data.draw(st.lists(st.integers(0, num_steps), min_size=n, max_size=n)))
    active_steps = np.minimum(active_steps, m.fused.max_new_tokens)
    host_tables, host_slots, host_popped = simulate_device_pops(
        m.block_tables, m.fused.seq_lens, m.fused.lent_block_ids, active_steps, block_size)

    state = page_state.init_page_state(m.block_tables, m.fused.seq_lens, m.fused.lent_block_ids)
    for step in range(host_slots.shape[0]):
        state, slots = page_state.append_tokens(state, jnp.asarray(active_steps > step), block_size)
        np.testing.assert_array_equal(np.asarray(slots), host_slots[step])
    assert not bool(state.overflow)
    assert int(state.num_popped) == host_popped
    np.testing.assert_array_equal(np.asarray(state.block_tables), host_tables)
    ran = np.arange(num_steps)[:, None] < active_steps[None, :]
    s.update(m, StepResult.from_fused(m, np.where(ran, 0, -1), host_tables))
    assert [r.num_output_tokens for r in s.running] == (1 + active_steps).tolist()
    assert not s.kv_cache_manager.lent_block_ids
