"""Functional block allocation on device, so that N decode steps run in one jitted loop.

Before a fused decode, the host lends a stack of free blocks. Each step, every active sequence whose next
token starts a new block (its length is a multiple of block_size) pops the next block from the stack, in
sequence order, and the step's slot mapping follows. The functions are pure, so they compose with
`lax.fori_loop`/`scan`; afterwards the host reads the block tables back to see which lent blocks were used.

The same pop rule, in numpy, is `pagedjax.core` 's reconciliation contract: `block_tables` row s gains blocks
in the order it popped them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PageState(NamedTuple):
    """block_tables: int32 `[num_seqs, max_blocks]`; seq_lens: int32 `[num_seqs]` tokens in the cache;
    free_blocks: int32 `[stack_size]` the lent stack, front first, padded at the end with -1 (an id no pop
    accepts, so a host that lends too few blocks gets `overflow`, never a write into another request's
    block); num_popped: int32 `[]` blocks taken from it so far;
    overflow: bool `[]` set if an active sequence got no slot (the stack ran dry or its table row is full:
    the host lent too few blocks or too narrow a table; never expected)."""

    block_tables: jax.Array
    seq_lens: jax.Array
    free_blocks: jax.Array
    num_popped: jax.Array
    overflow: jax.Array


def init_page_state(block_tables: jax.Array, seq_lens: jax.Array, free_blocks: jax.Array) -> PageState:
    return PageState(jnp.asarray(block_tables, jnp.int32), jnp.asarray(seq_lens, jnp.int32),
                     jnp.asarray(free_blocks, jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), bool))


def append_tokens(state: PageState, active: jax.Array, block_size: int) -> tuple[PageState, jax.Array]:
    """Reserve one slot for the next token of every active sequence.

    active: bool `[num_seqs]`. Returns the new state and the slot mapping int32 `[num_seqs]` (-1 where
    inactive or where no block could be had).
    """
    num_seqs, max_blocks = state.block_tables.shape
    num_lent = state.free_blocks.shape[0]
    lens = state.seq_lens
    logical = lens // block_size
    room = logical < max_blocks
    wanted = active
    active = active & room
    needs = active & (lens % block_size == 0)
    stack_index = state.num_popped + jnp.cumsum(needs.astype(jnp.int32)) - 1
    new_block = state.free_blocks[jnp.clip(stack_index, 0, max(num_lent - 1, 0))] if num_lent else \
        jnp.full((num_seqs,), -1, jnp.int32)
    got = needs & (stack_index < num_lent) & (new_block >= 0)
    rows = jnp.arange(num_seqs)
    col = jnp.minimum(logical, max_blocks - 1)
    tables = state.block_tables.at[rows, col].set(jnp.where(got, new_block, state.block_tables[rows, col]))
    writes = active & (got | ~needs)
    slot = jnp.where(writes, tables[rows, col] * block_size + lens % block_size, -1)
    new_state = PageState(
        block_tables=tables,
        seq_lens=lens + writes.astype(jnp.int32),
        free_blocks=state.free_blocks,
        num_popped=state.num_popped + jnp.sum(got.astype(jnp.int32)),
        overflow=state.overflow | jnp.any(needs & ~got) | jnp.any(wanted & ~room),
    )
    return new_state, slot.astype(jnp.int32)
