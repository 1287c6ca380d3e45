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


def test_short_lent_stack_as_the_runner_pads_it_overflows_instead_of_writing_block_0():
    """The runner pads the lent stack to a bucket size. Padding used to be block id 0, which the device popped
    as if it were lent (writing into whatever block 0 held, with `overflow` False); it is -1 now."""
    from pagedjax.device.sampling import SamplingMetadata
    from pagedjax.runner.inputs import pad_fused_decode

    block_size = 4
    # Three sequences, each at a block boundary, so each pops a block; the host lends only one.
    inputs = pad_fused_decode(
        tokens=np.array([1, 2, 3], np.int32), block_tables=np.array([[7, 0], [8, 0], [9, 0]], np.int32),
        seq_lens=np.array([4, 4, 4], np.int32), lent_blocks=np.array([5], np.int32),
        sampling=SamplingMetadata.from_lists([0.0] * 3, [0] * 3, [1.0] * 3, [0] * 3, [0] * 3),
        stop_ids=[[], [], []], max_new=np.array([1, 1, 1], np.int32), num_steps=1, block_size=block_size)
    assert inputs.lent_blocks.shape[0] > 1 and (inputs.lent_blocks[1:] == -1).all()
    state = init_page_state(inputs.block_tables, inputs.seq_lens, inputs.lent_blocks)
    active = jnp.asarray(inputs.max_new > 0)
    state, slots = jax.jit(append_tokens, static_argnums=2)(state, active, block_size)
    assert bool(state.overflow)
    slots = np.asarray(slots)
    assert slots[0] == 5 * block_size + 0  # the one real lent block
    assert (slots[1:3] == -1).all()  # no slot at all, least of all in block 0
    assert int(state.num_popped) == 1
    np.testing.assert_array_equal(np.asarray(state.block_tables)[:3, 1], [5, 0, 0])


def test_pad_fused_decode_refuses_more_lent_blocks_than_can_be_popped():
    """One sequence pops at most cdiv(num_steps, block_size) blocks: lending more is a host bug, said loudly."""
    import pytest

    from pagedjax.device.sampling import SamplingMetadata
    from pagedjax.runner.inputs import pad_fused_decode

    with pytest.raises(ValueError, match="at most 1"):
        pad_fused_decode(tokens=np.array([1], np.int32), block_tables=np.zeros((1, 2), np.int32),
                         seq_lens=np.array([4], np.int32), lent_blocks=np.array([5, 6], np.int32),
                         sampling=SamplingMetadata.from_lists([0.0], [0], [1.0], [0], [0]), stop_ids=[[]],
                         max_new=np.array([4], np.int32), num_steps=4, block_size=4)
