"""What every attention kind's dense reference and XLA path share: a ragged step's token layout, which keys a query
sees, its query tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """For each query row: (sequence id, position, valid). Rows at or past cu_q_lens[-1] are invalid."""
    num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = (t >= cu_q_lens[0]) & (t < cu_q_lens[-1])
    seq = jnp.clip(seq, 0, num_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, valid


def visible(kv_pos, pos, kv_len, sliding_window: int | None, last=None):
    """Which keys a query at `pos` sees: causal (or up to `last`, its attend_until bound, where that is later),
    inside the context, and inside its window (relative to its own position)."""
    keep = (kv_pos <= (pos if last is None else jnp.maximum(pos, last))) & (kv_pos < kv_len)
    if sliding_window is not None:
        keep = keep & (kv_pos > pos - sliding_window)
    return keep


def query_tiles(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, q_tile: int):
    """Cut each sequence's queries into tiles of `q_tile` consecutive rows.

    Returns (tile_seq [NT], rows [NT, q_tile] query row of each tile slot, valid [NT, q_tile],
    pos [NT, q_tile] position of each row, token_slot [num_tokens] flat tile slot of each query row).
    NT = cdiv(num_tokens, q_tile) + num_seqs bounds sum(cdiv(q_len, q_tile)) statically.
    """
    num_seqs = kv_lens.shape[0]
    num_tiles = -(-num_tokens // q_tile) + num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    tiles_end = jnp.cumsum((q_lens + q_tile - 1) // q_tile)
    tiles_start = jnp.concatenate([jnp.zeros((1,), tiles_end.dtype), tiles_end[:-1]])
    j = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.clip(jnp.searchsorted(tiles_end, j, side="right"), 0, num_seqs - 1).astype(jnp.int32)
    rows = (cu_q_lens[tile_seq] + (j - tiles_start[tile_seq]) * q_tile)[:, None] + jnp.arange(q_tile)[None, :]
    valid = (j < tiles_end[-1])[:, None] & (rows < cu_q_lens[tile_seq + 1][:, None])
    pos = (kv_lens[tile_seq] - q_lens[tile_seq])[:, None] + rows - cu_q_lens[tile_seq][:, None]
    seq, _, _ = token_layout(cu_q_lens, kv_lens, num_tokens)
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    token_slot = (tiles_start[seq] + local // q_tile) * q_tile + local % q_tile
    return tile_seq, rows, valid, pos, token_slot
