"""Dense references for the paged-attention kernels, in plain jax.numpy.

`paged_attention_reference` and `ragged_paged_attention_reference` gather each sequence's pages into
contiguous K/V, mask, and take a float32 softmax: the oracle every kernel test compares against. They
take exactly the kernels' arguments and honour the same contract (length 0 gives zeros, slots past the
length never influence the result, even if they hold NaN).

`paged_attention_xla` and `ragged_paged_attention_xla` are the same math written for speed with XLA (K/V
stay in their dtype, matmuls accumulate in float32, ragged queries in tiles): the engine's CPU path and
the baseline the kernel benchmark compares against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _gather_pages(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """pages `[Hkv, num_blocks, block_size, D]`, tables int32 `[N, max_blocks]` -> `[N, Hkv, L, D]`,
    L = max_blocks * block_size. Out-of-range table entries are clipped (they are masked anyway)."""
    num_kv_heads, num_blocks, block_size, head_dim = pages.shape
    n, max_blocks = tables.shape
    g = pages[:, jnp.clip(tables, 0, num_blocks - 1)]  # [Hkv, N, max_blocks, block_size, D]
    return jnp.swapaxes(g.reshape(num_kv_heads, n, max_blocks * block_size, head_dim), 0, 1)


def _masked_attention(q, k, v, mask, scale: float, *, compute_dtype, out_dtype):
    """q `[N, Hq, D]`, k/v `[N, Hkv, L, D]`, mask bool `[N, L]` -> `[N, Hq, D]` in out_dtype."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(n, num_kv_heads, group, head_dim).astype(compute_dtype)
    k = k.astype(compute_dtype)
    # Masked slots may hold anything (NaN included): select them away, never multiply them by zero.
    v = jnp.where(mask[:, None, :, None], v.astype(compute_dtype), jnp.zeros((), compute_dtype))
    s = jnp.einsum("nkgd,nkld->nkgl", qg, k, precision=HIGHEST, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None, :], s * scale, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    z = jnp.sum(p, axis=-1, keepdims=True)
    u = jnp.einsum("nkgl,nkld->nkgd", p.astype(compute_dtype), v, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    o = jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)
    return o.reshape(n, num_q_heads, head_dim).astype(out_dtype)


def _decode(q, k_pages, v_pages, block_tables, lengths, scale, compute_dtype):
    block_size = k_pages.shape[2]
    k = _gather_pages(k_pages, block_tables)
    v = _gather_pages(v_pages, block_tables)
    pos = jnp.arange(block_tables.shape[1] * block_size, dtype=jnp.int32)
    mask = pos[None, :] < lengths[:, None]
    return _masked_attention(q, k, v, mask, _scale(scale, q.shape[-1]), compute_dtype=compute_dtype,
                             out_dtype=q.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                              lengths: jax.Array, *, scale: float | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.paged_attention`.

    q `[num_seqs, num_q_heads, head_dim]`; k_pages/v_pages `[num_kv_heads, num_blocks, block_size, head_dim]`;
    block_tables int32 `[num_seqs, max_blocks_per_seq]`; lengths int32 `[num_seqs]`.
    Returns `[num_seqs, num_q_heads, head_dim]` in q's dtype.
    """
    return _decode(q, k_pages, v_pages, block_tables, lengths, scale, jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                        lengths: jax.Array, *, scale: float | None = None) -> jax.Array:
    """XLA gather path for decode: same contract as `paged_attention`, K/V gathered in their own dtype
    (`[num_seqs, num_kv_heads, max_blocks_per_seq * block_size, head_dim]` materialised), float32
    accumulation."""
    return _decode(q, k_pages, v_pages, block_tables, lengths, scale, q.dtype)


def _token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """For each query row: (sequence id, position, valid). Rows at or past cu_q_lens[-1] are invalid."""
    num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = (t >= cu_q_lens[0]) & (t < cu_q_lens[-1])
    seq = jnp.clip(seq, 0, num_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, valid


def _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale, compute_dtype):
    num_tokens = q.shape[0]
    block_size = k_pages.shape[2]
    max_len = block_tables.shape[1] * block_size
    scale = _scale(scale, q.shape[-1])
    seq, pos, valid = _token_layout(cu_q_lens, kv_lens, num_tokens)
    kv_pos = jnp.arange(max_len, dtype=jnp.int32)

    def attend(q_c, seq_c, pos_c, valid_c):
        tables = block_tables[seq_c]
        mask = (valid_c[:, None] & (kv_pos[None, :] < kv_lens[seq_c][:, None])
                & (kv_pos[None, :] <= pos_c[:, None]))
        k = _gather_pages(k_pages, tables)
        v = _gather_pages(v_pages, tables)
        return _masked_attention(q_c, k, v, mask, scale, compute_dtype=compute_dtype, out_dtype=q.dtype)

    return attend(q, seq, pos, valid)


@functools.partial(jax.jit, static_argnames=("scale",))
def ragged_paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                     block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array, *,
                                     scale: float | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.ragged_paged_attention`.

    q `[total_q_tokens, num_q_heads, head_dim]`; k_pages/v_pages `[num_kv_heads, num_blocks, block_size,
    head_dim]`; block_tables int32 `[num_seqs, max_blocks_per_seq]`; kv_lens int32 `[num_seqs]`;
    cu_q_lens int32 `[num_seqs + 1]`. Query i of sequence s sits at position kv_lens[s] - q_len[s] + i and
    attends to positions <= its own (and < kv_lens[s]); rows past cu_q_lens[-1] give zeros.
    Memory: gathers `[total_q_tokens, max_blocks_per_seq * block_size]` keys per KV head.
    """
    return _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale, jnp.float32)


def _query_tiles(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int, q_tile: int):
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
    seq, _, _ = _token_layout(cu_q_lens, kv_lens, num_tokens)
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    token_slot = (tiles_start[seq] + local // q_tile) * q_tile + local % q_tile
    return tile_seq, rows, valid, pos, token_slot


@functools.partial(jax.jit, static_argnames=("scale", "q_tile"))
def ragged_paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                               kv_lens: jax.Array, cu_q_lens: jax.Array, *, scale: float | None = None,
                               q_tile: int = 16) -> jax.Array:
    """XLA gather path for ragged attention: same contract as `ragged_paged_attention`, K/V in their own
    dtype, float32 accumulation.

    Each sequence's queries are cut into tiles of `q_tile` consecutive rows (a decode token is a tile of
    its own) and each tile gathers its sequence's pages once: `[num_tiles, num_kv_heads, max_blocks_per_seq
    * block_size, head_dim]` with num_tiles <= total_q_tokens / q_tile + num_seqs, not one copy per query.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    scale = _scale(scale, head_dim)
    tq = max(1, min(q_tile, num_tokens))
    tile_seq, rows, valid, pos, token_slot = _query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    num_tiles = tile_seq.shape[0]

    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    keep = valid[:, :, None] & (kv_pos <= pos[:, :, None]) & (kv_pos < kv_lens[tile_seq][:, None, None])
    k = _gather_pages(k_pages, block_tables[tile_seq])  # [NT, Hkv, L, D]
    v = _gather_pages(v_pages, block_tables[tile_seq])
    # Slots no row of a tile reads may hold anything (NaN included): select them away.
    v = jnp.where(jnp.any(keep, axis=1)[:, None, :, None], v, jnp.zeros((), v.dtype))
    qt = q[jnp.clip(rows, 0, num_tokens - 1)].reshape(num_tiles, tq, num_kv_heads, group, head_dim)
    s = jnp.einsum("ntkgd,nkld->nkgtl", qt.astype(k.dtype), k, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    s = jnp.where(keep[:, None, None], s * scale, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    z = jnp.sum(p, axis=-1, keepdims=True)
    u = jnp.einsum("nkgtl,nkld->nkgtd", p.astype(v.dtype), v, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    o = jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)  # [NT, Hkv, G, tq, D]
    o = o.transpose(0, 3, 1, 2, 4).reshape(num_tiles * tq, num_q_heads, head_dim)
    out = o[jnp.clip(token_slot, 0, num_tiles * tq - 1)]
    in_batch = (jnp.arange(num_tokens) >= cu_q_lens[0]) & (jnp.arange(num_tokens) < cu_q_lens[-1])
    return jnp.where(in_batch[:, None, None], out, 0.0).astype(q.dtype)
