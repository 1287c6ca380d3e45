"""What every attention kind's dense reference and XLA path share: a ragged step's token layout, which keys a query
sees, its query tiles, and the XLA paths' loop over chunks of keys (flash attention written in XLA).
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


def default_q_tile(num_tokens: int, num_seqs: int, sliding_window: int | None = None) -> int:
    """Rows per query tile of the paged XLA path for a step of `num_tokens` query rows over `num_seqs` sequences:
    the largest power of two from 16 to 256 with num_seqs * q_tile <= num_tokens / 2 (the unused tiles, which are
    computed too, then add at most half the step's rows) and, with a sliding window W, q_tile <= W / 4 (a tile's
    rows see its window's q_tile + W - 1 positions: bigger tiles would score many keys no row sees), else 16.
    Bigger tiles make the scores' and values' dots bigger: `python scripts/bench_xla_tiles.py` times them."""
    q_tile = 16
    while (q_tile < 256 and 2 * num_seqs * (2 * q_tile) <= num_tokens
           and (sliding_window is None or 4 * (2 * q_tile) <= sliding_window)):
        q_tile *= 2
    return q_tile


def num_query_tiles(num_tokens: int, num_seqs: int, q_tile: int) -> int:
    """The most tiles of `q_tile` rows that `num_seqs` sequences of `num_tokens` query rows in all can take: k of
    them holding rows take sum(cdiv(n_i, q_tile)) = sum((n_i - 1) // q_tile) + k <= (num_tokens - k) // q_tile + k
    tiles, which grows with k, so k = min(num_seqs, num_tokens) bounds it (at least one tile). Every tile up to
    the bound is computed, used or not: a step of one sequence in tiles of a power of two dividing its rows
    computes no padding row."""
    k = min(num_seqs, num_tokens)
    return max(1, (num_tokens - k) // q_tile + k)


def query_tiles(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, q_tile: int):
    """Cut each sequence's queries into tiles of `q_tile` consecutive rows.

    Returns (tile_seq [NT], rows [NT, q_tile] query row of each tile slot, valid [NT, q_tile],
    pos [NT, q_tile] position of each row, token_slot [num_tokens] flat tile slot of each query row).
    NT = `num_query_tiles(num_tokens, num_seqs, q_tile)` bounds sum(cdiv(q_len, q_tile)) statically.
    """
    num_seqs = kv_lens.shape[0]
    num_tiles = num_query_tiles(num_tokens, num_seqs, q_tile)
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


def fold(s: jax.Array, value_sum, prior=None):
    """The partial (m, z, u) of masked float32 scores `s` `[..., L]` (-inf where a row does not see the key):
    m `[..., 1]` the row max (-inf where it sees nothing), z the sum of exp(s - m) (m taken as 0 where it is
    -inf), u = value_sum(exp(s - m)) `[..., D]`. With `prior`, the partial (m, z, u) of other keys, returns the
    merged partial of both (`merge.merge_partials`'s rule, the new keys weighted at the common max directly):
    exp(-inf) = 0, so an empty prior adds nothing, and keys a row does not see leave its prior's bits as they
    were (x 1, + 0)."""
    m = jnp.max(s, axis=-1, keepdims=True)
    if prior is not None:
        m = jnp.maximum(m, prior[0])
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m_safe)
    z = jnp.sum(p, axis=-1, keepdims=True)
    u = value_sum(p)
    if prior is not None:
        kept = jnp.exp(prior[0] - m_safe)
        z, u = kept * prior[1] + z, kept * prior[2] + u
    return m, z, u


def chunked_partial(partial, pages, tables, keep_at, *, longest, kv_chunk: int, block_size: int):
    """The merged (m, z, u) of `partial(*pages, tables, keep, prior)` over the pages `tables` `[N, P]`: flash
    attention's loop over keys, `kv_chunk` positions (whole pages, at least one) at a time, up to `longest` (traced:
    the longest context among the rows). Each chunk's keep mask comes from `keep_at(kv_pos)`, kv_pos its slots'
    positions, and is folded into the running partial (`fold`'s prior). Chunks sit at fixed positions and a chunk a
    row sees nothing of leaves its partial's bits unchanged, so a row's result does not depend on the other rows
    of its step or on how far the table is padded."""
    num_pages = tables.shape[1]
    chunk_pages = max(1, kv_chunk // block_size)
    chunks = -(-num_pages // chunk_pages)
    # Padding entries point at page 0; their positions are past every row's context, so keep_at drops them.
    tables = jnp.pad(tables, ((0, 0), (0, chunks * chunk_pages - num_pages)))
    slots = jnp.arange(chunk_pages * block_size, dtype=jnp.int32)

    def step(c, merged):
        # The pages pass a barrier with the loop counter: otherwise XLA moves a conversion of the gathered pages
        # (a bfloat16 dot's operands widened on the CPU) in front of the gather and out of the loop, widening the
        # whole pool once per call instead of a chunk per iteration.
        *pool, _ = jax.lax.optimization_barrier((*pages, c))
        chunk = jax.lax.dynamic_slice_in_dim(tables, c * chunk_pages, chunk_pages, axis=1)
        return partial(*pool, chunk, keep_at(c * chunk_pages * block_size + slots), merged)

    m, z, u = jax.eval_shape(partial, *pages, tables[:, :chunk_pages], keep_at(slots))
    empty = (jnp.full(m.shape, -jnp.inf, jnp.float32), jnp.zeros(z.shape, jnp.float32), jnp.zeros(u.shape, jnp.float32))
    num_chunks = jnp.minimum((longest + chunk_pages * block_size - 1) // (chunk_pages * block_size), chunks)
    return jax.lax.fori_loop(0, num_chunks, step, empty)
