"""The functional on-device allocator against a plain-Python model of the same pop rule."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pagedjax.device.page_state import append_tokens, init_page_state


def _python_model(tables, lens, stack, active_steps, block_size):
    tables, lens, popped, slots_per_step = [list(r) for r in tables], list(lens), 0, []
    for active in active_steps:
        slots = []
        for s, a in enumerate(active):
            if not a:
                slots.append(-1)
                continue
            if lens[s] % block_size == 0:
                tables[s][lens[s] // block_size] = stack[popped]
                popped += 1
            slots.append(tables[s][lens[s] // block_size] * block_size + lens[s] % block_size)
            lens[s] += 1
        slots_per_step.append(slots)
    return tables, lens, popped, slots_per_step


@given(st.data())
def test_append_tokens_matches_python_model(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_seqs = data.draw(st.integers(1, 4), label="num_seqs")
    num_steps = data.draw(st.integers(1, 6), label="num_steps")
    lens = data.draw(st.lists(st.integers(0, 6), min_size=num_seqs, max_size=num_seqs), label="lens")
    active_steps = data.draw(st.lists(st.lists(st.booleans(), min_size=num_seqs, max_size=num_seqs),
                                      min_size=num_steps, max_size=num_steps), label="active")
    max_blocks = -(-(max(lens) + num_steps) // block_size) + 1
    # Existing blocks are 100 + ...; lent ones 500 + ... so a mix-up shows.
    tables = np.zeros((num_seqs, max_blocks), np.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // block_size)):
            tables[s, b] = 100 + 10 * s + b
    stack = np.arange(500, 500 + num_seqs * num_steps, dtype=np.int32)

    exp_tables, exp_lens, exp_popped, exp_slots = _python_model(tables, lens, stack, active_steps, block_size)

    step = jax.jit(append_tokens, static_argnums=2)
    state = init_page_state(tables, np.array(lens, np.int32), stack)
    for t, active in enumerate(active_steps):
        state, slots = step(state, jnp.array(active), block_size)
        np.testing.assert_array_equal(np.asarray(slots), exp_slots[t])
    np.testing.assert_array_equal(np.asarray(state.block_tables), np.array(exp_tables))
    np.testing.assert_array_equal(np.asarray(state.seq_lens), exp_lens)
    assert int(state.num_popped) == exp_popped
    assert not bool(state.overflow)


def test_overflow_when_stack_runs_dry():
    state = init_page_state(np.zeros((2, 2), np.int32), np.array([0, 0], np.int32), np.array([7], np.int32))
    state, slots = append_tokens(state, jnp.array([True, True]), 4)
    assert list(np.asarray(slots)) == [28, -1]
    assert bool(state.overflow)
    assert list(np.asarray(state.seq_lens)) == [1, 0]


def test_overflow_when_table_row_is_full():
    state = init_page_state(np.array([[3]], np.int32), np.array([2], np.int32), np.array([7], np.int32))
    state, slots = append_tokens(state, jnp.array([True]), 2)
    assert list(np.asarray(slots)) == [-1] and bool(state.overflow)
