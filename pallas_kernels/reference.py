"""Dense references for the paged-attention kernels, in plain jax.numpy, and the XLA gather paths.

`paged_attention_reference` and `ragged_paged_attention_reference` gather each sequence's pages into
contiguous K/V, mask, and take a float32 softmax: the oracle every kernel test compares against. They
take exactly the kernels' arguments and honour the same contract (length 0 gives zeros, slots past the
length or before a query's window never influence the result, even if they hold NaN).

`paged_attention_xla` and `ragged_paged_attention_xla` are the same math written for speed with XLA (K/V
stay in their dtype, matmuls accumulate in float32, ragged queries in tiles): the engine's CPU path and
the baseline the kernel benchmark compares against. With a sliding window both gather only the pages that
can hold window positions (a static count bounded by the window, not the context), so block-table entries
of pages wholly before the window are never read.

The MLA (multi-head latent attention) counterparts `mla_paged_attention_reference`,
`ragged_mla_paged_attention_reference`, `mla_paged_attention_xla` and `ragged_mla_paged_attention_xla` take one
latent page array (see the MLA section below), and `mla_attention_dense_reference` is MLA without weight
absorption (keys and values expanded per head): the oracle of the absorption algebra.

DeepSeek sparse attention (DSA, V3.2; section at the end): `indexer_scores_reference` /
`ragged_indexer_scores_reference` (the lightning indexer's scores over paged indexer keys) and
`sparse_mla_paged_attention_reference` / `ragged_sparse_mla_paged_attention_reference` (dense MLA masked to each
row's selected positions), with their XLA paths `*_xla` (keys gathered once per query tile; only the selected
latent rows gathered).

Variants, shared by the four GQA functions (and by the kernels):
  * `sliding_window=W`: a query at position p attends to key positions j with p - W < j <= p;
  * `logits_soft_cap=c`: scaled scores s become c * tanh(s / c) before masking and softmax;
  * 8-bit pages (int8 or float8_e4m3fn) with `k_scales`/`v_scales` `[num_kv_heads, num_blocks, block_size]`
    (float32 or bfloat16): the attended values are `pages.astype(float32) * scales[..., None]`, computed
    right after the gather (only gathered pages are dequantized, never the pool);
  * ragged only, `attend_until` int32 `[total_q_tokens]`: query row t at position p attends to key positions
    j <= max(p, attend_until[t]) (and j < kv_len, and j > p - W with a window): bidirectional attention among
    the tokens of a span (an image's), see `pallas_kernels.ragged_paged_attention`;
  * `sinks` float32 `[num_q_heads]` (gpt-oss's attention sinks): query head h's logit sink[h] joins its softmax as
    one more column, after the scale and the soft cap (the sink itself is neither scaled nor capped), and is
    dropped after it: o = sum_j exp(s_j - m) v_j / (exp(sink[h] - m) + sum_j exp(s_j - m)), m = max(sink[h],
    max_j s_j). A query that sees no key gives zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _validate as V
from pallas_kernels import tiles
from pallas_kernels.merge import Partial, join_sink, merge_two
from pallas_kernels.quant import dequantize_kv

HIGHEST = lax.Precision.HIGHEST


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def soft_cap(s: jax.Array, logits_soft_cap: float | None) -> jax.Array:
    """c * tanh(s / c) (Gemma 2's attention soft-capping), or s unchanged without a cap."""
    return s if logits_soft_cap is None else logits_soft_cap * jnp.tanh(s / logits_soft_cap)


def _gather_pages(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """pages `[Hkv, num_blocks, block_size, *rest]`, tables int32 `[N, P]` -> `[N, Hkv, P * block_size, *rest]`.
    Out-of-range table entries are clipped (their slots are masked anyway)."""
    num_kv_heads, num_blocks, block_size, *rest = pages.shape
    n, num_pages = tables.shape
    g = pages[:, jnp.clip(tables, 0, num_blocks - 1)]  # [Hkv, N, P, block_size, *rest]
    return jnp.swapaxes(g.reshape(num_kv_heads, n, num_pages * block_size, *rest), 0, 1)


def _gather_kv(pages: jax.Array, scales: jax.Array | None, tables: jax.Array, dtype) -> jax.Array:
    """The K or V rows of `tables` ([N, P]) as `[N, Hkv, P * block_size, D]` in `dtype`; 8-bit pages are
    dequantized after the gather, so only the gathered pages are ever widened."""
    g = _gather_pages(pages, tables)
    if scales is None:
        return g.astype(dtype)
    return dequantize_kv(g, _gather_pages(scales, tables), dtype)


def _window_tables(block_tables: jax.Array,  # i32[N, max_blocks]
                   first_pos: jax.Array,  # i32[N], first key position any query of the row may see
                   num_pages: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The `num_pages` table entries from the page holding first_pos on, and the positions of their slots:
    (tables i32[N, num_pages], positions i32[N, num_pages * block_size]). Table indices past the row are
    clipped to its last entry; their positions are past the capacity, so the caller's mask drops them."""
    max_blocks = block_tables.shape[1]
    logical = (jnp.maximum(first_pos, 0) // block_size)[:, None] + jnp.arange(num_pages, dtype=jnp.int32)
    tables = jnp.take_along_axis(block_tables, jnp.minimum(logical, max_blocks - 1), axis=1)
    pos = logical[:, :, None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    return tables, pos.reshape(-1, num_pages * block_size)


def _masked_attention(q, k, v, mask, scale: float, logits_soft_cap: float | None, sinks=None, *, compute_dtype,
                      out_dtype):
    """q `[N, Hq, D]`, k/v `[N, Hkv, L, D]` in compute_dtype, mask bool `[N, L]`, sinks f32 `[Hq]` or None ->
    `[N, Hq, D]` in out_dtype."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(n, num_kv_heads, group, head_dim).astype(compute_dtype)
    # Masked slots may hold anything (NaN included): select them away, never multiply them by zero.
    v = jnp.where(mask[:, None, :, None], v, jnp.zeros((), compute_dtype))
    s = jnp.einsum("nkgd,nkld->nkgl", qg, k, precision=HIGHEST, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None, :], soft_cap(s * scale, logits_soft_cap), -jnp.inf)
    if sinks is not None:  # the sink as one more logit column (never masked), dropped after the softmax
        sink_column = jnp.broadcast_to(sinks.reshape(1, num_kv_heads, group, 1), (n, num_kv_heads, group, 1))
        s = jnp.concatenate([s, sink_column], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    z = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    u = jnp.einsum("nkgl,nkld->nkgd", p.astype(compute_dtype), v, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    o = jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)
    return o.reshape(n, num_q_heads, head_dim).astype(out_dtype)


def _decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, *, scale, sliding_window,
            logits_soft_cap, compute_dtype, bounded: bool):
    """bounded: with a window, gather only the pages that can hold window positions."""
    block_size = k_pages.shape[2]
    num_seqs, max_blocks = block_tables.shape
    lengths = jnp.clip(lengths, 0, max_blocks * block_size)
    num_pages = tiles.window_pages(sliding_window if bounded else None, 1, max_blocks, block_size)
    if num_pages < max_blocks:
        tables, pos = _window_tables(block_tables, lengths - sliding_window, num_pages, block_size)
    else:
        tables = block_tables
        pos = jnp.broadcast_to(jnp.arange(max_blocks * block_size, dtype=jnp.int32),
                               (num_seqs, max_blocks * block_size))
    mask = pos < lengths[:, None]
    if sliding_window is not None:  # the query sits at position length - 1
        mask = mask & (pos >= (lengths - sliding_window)[:, None])
    k = _gather_kv(k_pages, k_scales, tables, compute_dtype)
    v = _gather_kv(v_pages, v_scales, tables, compute_dtype)
    return _masked_attention(q, k, v, mask, _scale(scale, q.shape[-1]), logits_soft_cap, sinks,
                             compute_dtype=compute_dtype, out_dtype=q.dtype)


def _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks):
    window, cap, _ = V.validate_variants(k_pages, v_pages, sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap, k_scales=k_scales, v_scales=v_scales)
    V.check_sinks(sinks, q.shape[1])
    return dict(sliding_window=window, logits_soft_cap=cap)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap", "compute_dtype",
                                             "bounded"))
def _decode_jit(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, **static):
    return _decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, **static)


def paged_attention_reference(q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
                              k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                              v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                              block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                              lengths: jax.Array,  # i32[num_seqs]
                              *, scale: float | None = None, sliding_window: int | None = None,
                              logits_soft_cap: float | None = None,
                              k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                              v_scales: jax.Array | None = None,
                              sinks: jax.Array | None = None) -> jax.Array:  # f32[num_q_heads]
    """Dense float32 reference of `pallas_kernels.paged_attention` (gathers the whole table, then masks).

    The query of sequence s sits at position lengths[s] - 1 (lengths clipped to the table's capacity). With
    `sinks` each head's sink is one more logit column of its softmax, dropped after it (the module docstring).
    Returns `[num_seqs, num_q_heads, head_dim]` in q's dtype.
    """
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    return _decode_jit(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, scale=scale,
                       compute_dtype=jnp.float32, bounded=False, **variants)


def paged_attention_xla(q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
                        k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                        v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                        block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                        lengths: jax.Array,  # i32[num_seqs]
                        *, scale: float | None = None, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None,
                        k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                        v_scales: jax.Array | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:  # f32[num_q_heads]
    """XLA gather path for decode: same contract as `paged_attention`, K/V gathered and computed on in q's
    dtype (8-bit pages dequantized into it right after the gather), float32 accumulation.

    Without a window it materialises `[num_seqs, num_kv_heads, max_blocks_per_seq * block_size, head_dim]`.
    With a window W each sequence gathers only `min(max_blocks_per_seq, cdiv(W - 1, block_size) + 1)` pages
    from the one holding position lengths[s] - W: decode cost is bounded by the window, and table entries of
    pages before it are never read (they may hold anything).
    """
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    return _decode_jit(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, scale=scale,
                       compute_dtype=jnp.dtype(q.dtype), bounded=True, **variants)


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


def _visible(kv_pos, pos, kv_len, sliding_window: int | None, last=None):
    """Which keys a query at `pos` sees: causal (or up to `last`, its attend_until bound, where that is later),
    inside the context, and inside its window (relative to its own position)."""
    keep = (kv_pos <= (pos if last is None else jnp.maximum(pos, last))) & (kv_pos < kv_len)
    if sliding_window is not None:
        keep = keep & (kv_pos > pos - sliding_window)
    return keep


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap"))
def _ragged_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until, sinks,
                      *, scale, sliding_window, logits_soft_cap):
    num_tokens = q.shape[0]
    block_size = k_pages.shape[2]
    max_len = block_tables.shape[1] * block_size
    seq, pos, valid = _token_layout(cu_q_lens, kv_lens, num_tokens)
    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    tables = block_tables[seq]
    last = None if attend_until is None else attend_until[:, None]
    mask = valid[:, None] & _visible(kv_pos[None, :], pos[:, None], kv_lens[seq][:, None], sliding_window, last)
    k = _gather_kv(k_pages, k_scales, tables, jnp.float32)
    v = _gather_kv(v_pages, v_scales, tables, jnp.float32)
    return _masked_attention(q, k, v, mask, _scale(scale, q.shape[-1]), logits_soft_cap, sinks,
                             compute_dtype=jnp.float32, out_dtype=q.dtype)


def ragged_paged_attention_reference(q: jax.Array,  # [total_q_tokens, num_q_heads, head_dim]
                                     k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                                     v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                                     block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                     kv_lens: jax.Array,  # i32[num_seqs]
                                     cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                                     *, scale: float | None = None, sliding_window: int | None = None,
                                     logits_soft_cap: float | None = None,
                                     k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                                     v_scales: jax.Array | None = None,
                                     attend_until: jax.Array | None = None,  # i32[total_q_tokens]
                                     sinks: jax.Array | None = None) -> jax.Array:  # f32[num_q_heads]
    """Dense float32 reference of `pallas_kernels.ragged_paged_attention`.

    Query i of sequence s sits at position p = kv_lens[s] - q_len[s] + i and attends to positions <= p (or
    <= max(p, attend_until[row]) with `attend_until`), < kv_lens[s], and > p - W with a window W; with `sinks`
    each head's sink is one more logit column of every row's softmax, dropped after it; rows past cu_q_lens[-1]
    give zeros. Memory: gathers `[total_q_tokens, max_blocks_per_seq * block_size]` keys per KV head.
    """
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    V.check_attend_until(attend_until, q.shape[0])
    return _ragged_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales,
                             attend_until, sinks, scale=scale, **variants)


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


def _tile_partial(q, rows, k_pages, v_pages, k_scales, v_scales, tables, keep, *, scale: float,
                  logits_soft_cap: float | None):
    """The (m, z, u) partial of query tiles over the pages `tables` `[NT, P]`: rows `[NT, tq]` (the query row of
    each tile slot), keep bool `[NT, tq, P * block_size]`. m `[NT, Hkv, G, tq, 1]` is the row max (-inf where a
    row sees nothing), z and u the sums of exp(s - m) and exp(s - m) v (m taken as 0 where it is -inf), float32."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    num_tiles, tq = rows.shape
    compute_dtype = jnp.dtype(q.dtype)
    k = _gather_kv(k_pages, k_scales, tables, compute_dtype)  # [NT, Hkv, L, D]
    v = _gather_kv(v_pages, v_scales, tables, compute_dtype)
    # Slots no row of a tile reads may hold anything (NaN included): select them away.
    v = jnp.where(jnp.any(keep, axis=1)[:, None, :, None], v, jnp.zeros((), v.dtype))
    qt = q[jnp.clip(rows, 0, num_tokens - 1)].reshape(num_tiles, tq, num_kv_heads, num_q_heads // num_kv_heads,
                                                      head_dim)
    s = jnp.einsum("ntkgd,nkld->nkgtl", qt.astype(compute_dtype), k, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    s = jnp.where(keep[:, None, None], soft_cap(s * scale, logits_soft_cap), -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m))
    z = jnp.sum(p, axis=-1, keepdims=True)
    u = jnp.einsum("nkgtl,nkld->nkgtd", p.astype(v.dtype), v, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    return m, z, u


@functools.partial(jax.jit, static_argnames=("scale", "q_tile", "sliding_window", "logits_soft_cap"))
def _ragged_xla(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until, sinks, *,
                scale, q_tile, sliding_window, logits_soft_cap):
    num_tokens, num_q_heads, head_dim = q.shape
    block_size = k_pages.shape[2]
    max_blocks = block_tables.shape[1]
    tq = max(1, min(q_tile, num_tokens))
    tile_seq, rows, valid, pos, token_slot = _query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    num_tiles = tile_seq.shape[0]
    partial = functools.partial(_tile_partial, q, rows, k_pages, v_pages, k_scales, v_scales,
                                scale=_scale(scale, head_dim), logits_soft_cap=logits_soft_cap)

    # With a window a tile's rows see positions pos[0] - W + 1 ... pos[0] + tq - 1 at most.
    num_pages = tiles.window_pages(sliding_window, tq, max_blocks, block_size)
    if num_pages < max_blocks:
        tables, kv_pos = _window_tables(block_tables[tile_seq], pos[:, 0] - sliding_window + 1, num_pages,
                                        block_size)
        kv_pos = kv_pos[:, None, :]  # [NT, 1, L]
    else:
        tables = block_tables[tile_seq]
        kv_pos = jnp.arange(max_blocks * block_size, dtype=jnp.int32)
    last = None if attend_until is None else attend_until[jnp.clip(rows, 0, num_tokens - 1)][:, :, None]
    keep = valid[:, :, None] & _visible(kv_pos, pos[:, :, None], kv_lens[tile_seq][:, None, None],
                                        sliding_window, last)  # [NT, tq, L]
    m, z, u = partial(tables, keep)
    # With attend_until a row may see ahead of those pages, up to its sequence's last position (< pos[0] +
    # num_tokens: a sequence has at most num_tokens query rows): the pages after them, gathered apart and merged
    # exactly, so that the window pages' partial is computed as without attend_until (with every bound at most
    # its row's position the ahead partial is empty, and the merge returns those bits: exp(0) = 1, + 0).
    ahead = tiles.window_pages(sliding_window, num_tokens, max_blocks, block_size) - num_pages
    if attend_until is not None and num_pages < max_blocks and ahead > 0:
        first_ahead = (jnp.maximum(pos[:, 0] - sliding_window + 1, 0) // block_size + num_pages) * block_size
        tables, kv_pos = _window_tables(block_tables[tile_seq], first_ahead, ahead, block_size)
        keep = valid[:, :, None] & _visible(kv_pos[:, None, :], pos[:, :, None], kv_lens[tile_seq][:, None, None],
                                            sliding_window, last)
        m_ahead, z_ahead, u_ahead = partial(tables, keep)
        merged = merge_two(Partial(m[..., 0], z[..., 0], u), Partial(m_ahead[..., 0], z_ahead[..., 0], u_ahead))
        m, z, u = merged.m[..., None], merged.z[..., None], merged.u
    if sinks is not None:  # joined once, into the partial of all the pages a row sees
        _, z, u = join_sink(m, z, u, sinks.reshape(1, *m.shape[1:3], 1, 1))
    o = jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)  # [NT, Hkv, G, tq, D]
    o = o.transpose(0, 3, 1, 2, 4).reshape(num_tiles * tq, num_q_heads, head_dim)
    out = o[jnp.clip(token_slot, 0, num_tiles * tq - 1)]
    in_batch = (jnp.arange(num_tokens) >= cu_q_lens[0]) & (jnp.arange(num_tokens) < cu_q_lens[-1])
    return jnp.where(in_batch[:, None, None], out, 0.0).astype(q.dtype)


def ragged_paged_attention_xla(q: jax.Array,  # [total_q_tokens, num_q_heads, head_dim]
                               k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                               v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                               block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                               kv_lens: jax.Array,  # i32[num_seqs]
                               cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                               *, scale: float | None = None, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None,
                               k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                               v_scales: jax.Array | None = None, q_tile: int = 16,
                               attend_until: jax.Array | None = None,  # i32[total_q_tokens]
                               sinks: jax.Array | None = None) -> jax.Array:  # f32[num_q_heads]
    """XLA gather path for ragged attention: same contract as `ragged_paged_attention`, K/V in q's dtype
    (8-bit pages dequantized into it right after the gather), float32 accumulation.

    Each sequence's queries are cut into tiles of `q_tile` consecutive rows (a decode token is a tile of
    its own) and each tile gathers its sequence's pages once: `[num_tiles, num_kv_heads, max_blocks_per_seq
    * block_size, head_dim]` with num_tiles <= total_q_tokens / q_tile + num_seqs, not one copy per query.
    With a window W a tile gathers only `min(max_blocks_per_seq, cdiv(q_tile + W - 2, block_size) + 1)`
    pages, from the one holding its first row's first visible position: table entries of pages before
    every row's window are never read. With a window and `attend_until` a row may see ahead of those pages, up to
    its sequence's last position: the pages after them, up to `min(max_blocks_per_seq, cdiv(total_q_tokens + W -
    2, block_size) + 1)` in all, are gathered apart and their partial merged exactly (`merge.merge_two`), so
    that with every bound at or below its row's position the result is `None`'s, bit for bit. `sinks` are
    joined into each row's partial of all its pages (`merge.join_sink`) before the division.
    """
    V.check_positive_int("q_tile", q_tile)
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    V.check_attend_until(attend_until, q.shape[0])
    return _ragged_xla(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until,
                       sinks, scale=scale, q_tile=q_tile, **variants)


# ---- multi-head latent attention (MLA, DeepSeek V2/V3) ------------------------------------------------------
#
# One page array `kv_pages [num_blocks, block_size, R + Dr]` holds each token's latent c_kv (R) then its shared
# rotary key k_rope (Dr); every query head attends to the same entries. With the up-projections absorbed by
# the caller (q_latent[h] = W_UK[h] q_nope[h]) head h's score against token t is
#     scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t]) = scale * ([q_latent | q_rope][h] . kv_pages[t])
# and its output, in latent space, is sum_t softmax_t c_kv[t] (the caller applies W_UV). Both the references
# and the XLA paths score the whole page row against [q_latent | q_rope] at once and keep the first R columns
# of the weighted sum: one contraction each way, no slice of the gathered pages.


def _gather_latent(kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                   kv_scales: jax.Array | None,  # [num_blocks, block_size], with 8-bit pages
                   tables: jax.Array,  # i32[N, P]
                   dtype) -> jax.Array:
    """The page rows of `tables` as `[N, P * block_size, R + Dr]` in `dtype`; 8-bit pages are dequantized after
    the gather (only the gathered pages are widened). Out-of-range table entries are clipped (their slots are
    masked anyway)."""
    num_blocks, block_size, width = kv_pages.shape
    n, num_pages = tables.shape
    idx = jnp.clip(tables, 0, num_blocks - 1)
    g = kv_pages[idx].reshape(n, num_pages * block_size, width)
    if kv_scales is None:
        return g.astype(dtype)
    return dequantize_kv(g, kv_scales[idx].reshape(n, num_pages * block_size), dtype)


def _latent_attention(q, kv, keep, *, scale: float, rank: int, compute_dtype):
    """q `[N, T, H, R + Dr]` ([q_latent | q_rope]), kv `[N, L, R + Dr]` in compute_dtype, keep bool `[N, T, L]`
    -> `[N, T, H, R]` float32: T query rows of H heads per gathered row of pages."""
    # Slots no query row reads may hold anything (NaN included): select them away, never multiply them by zero.
    kv = jnp.where(jnp.any(keep, axis=1)[..., None], kv, jnp.zeros((), compute_dtype))
    s = jnp.einsum("nthw,nlw->nthl", q.astype(compute_dtype), kv, precision=HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    s = jnp.where(keep[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    z = jnp.sum(p, axis=-1, keepdims=True)
    u = jnp.einsum("nthl,nlw->nthw", p.astype(compute_dtype), kv, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    return jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)[..., :rank]


@functools.partial(jax.jit, static_argnames=("scale", "compute_dtype"))
def _mla_decode(q_latent, q_rope, kv_pages, block_tables, lengths, kv_scales, *, scale, compute_dtype):
    block_size = kv_pages.shape[1]
    max_len = block_tables.shape[1] * block_size
    lengths = jnp.clip(lengths, 0, max_len)
    keep = (jnp.arange(max_len, dtype=jnp.int32)[None, :] < lengths[:, None])[:, None, :]  # [N, 1, L]
    kv = _gather_latent(kv_pages, kv_scales, block_tables, compute_dtype)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[:, None]
    o = _latent_attention(q, kv, keep, scale=scale, rank=q_latent.shape[-1], compute_dtype=compute_dtype)
    return o[:, 0].astype(q_latent.dtype)


def _mla_empty(q_latent, kv_pages, block_tables) -> bool:
    """No query rows, sequences, table entries or pool blocks: nothing to gather (the result is all zeros)."""
    return 0 in (q_latent.shape[0], block_tables.shape[0], block_tables.shape[1], kv_pages.shape[0])


def _mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, num_q_rows=None) -> float:
    V.validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales, num_q_rows)
    return V.check_mla_scale(scale)


def mla_paged_attention_reference(q_latent: jax.Array,  # [num_seqs, num_heads, R]
                                  q_rope: jax.Array,  # [num_seqs, num_heads, Dr]
                                  kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                  block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                  lengths: jax.Array,  # i32[num_seqs]
                                  *, scale: float,
                                  kv_scales: jax.Array | None = None) -> jax.Array:  # [num_blocks, block_size]
    """Dense float32 reference of `pallas_kernels.mla_paged_attention` (gathers the whole table, then masks):
    the absorbed MLA definition. Returns `[num_seqs, num_heads, R]` in q's dtype; zeros for length 0."""
    scale = _mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, q_latent.shape[0])
    V.check_vector("lengths", lengths, q_latent.shape[0])
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _mla_decode(q_latent, q_rope, kv_pages, block_tables, lengths, kv_scales, scale=scale,
                       compute_dtype=jnp.float32)


def mla_paged_attention_xla(q_latent: jax.Array,  # [num_seqs, num_heads, R]
                            q_rope: jax.Array,  # [num_seqs, num_heads, Dr]
                            kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                            block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                            lengths: jax.Array,  # i32[num_seqs]
                            *, scale: float,
                            kv_scales: jax.Array | None = None) -> jax.Array:  # [num_blocks, block_size]
    """XLA gather path for MLA decode: same contract as `mla_paged_attention`; the table's pages are gathered once
    per sequence in q's dtype (8-bit pages dequantized into it right after the gather), shared by all heads, and
    scored in one masked softmax with float32 accumulation. Materialises `[num_seqs, max_blocks_per_seq *
    block_size, R + Dr]`: one copy of the latent cache per sequence, not one per head."""
    scale = _mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, q_latent.shape[0])
    V.check_vector("lengths", lengths, q_latent.shape[0])
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _mla_decode(q_latent, q_rope, kv_pages, block_tables, lengths, kv_scales, scale=scale,
                       compute_dtype=jnp.dtype(q_latent.dtype))


@functools.partial(jax.jit, static_argnames=("scale",))
def _ragged_mla_reference(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales, *, scale):
    num_tokens = q_latent.shape[0]
    max_len = block_tables.shape[1] * kv_pages.shape[1]
    kv_lens = jnp.clip(kv_lens, 0, max_len)  # as the kernels clip them (`tiles.tile_metadata`)
    seq, pos, valid = _token_layout(cu_q_lens, kv_lens, num_tokens)
    keep = valid[:, None] & _visible(jnp.arange(max_len, dtype=jnp.int32)[None, :], pos[:, None],
                                     kv_lens[seq][:, None], None)
    kv = _gather_latent(kv_pages, kv_scales, block_tables[seq], jnp.float32)  # one copy per query row
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[:, None]
    o = _latent_attention(q, kv, keep[:, None], scale=scale, rank=q_latent.shape[-1], compute_dtype=jnp.float32)
    return o[:, 0].astype(q_latent.dtype)


def _check_ragged(q_latent, block_tables, kv_lens, cu_q_lens) -> None:
    num_seqs = block_tables.shape[0]
    V.check_vector("kv_lens", kv_lens, num_seqs)
    V.check_vector("cu_q_lens", cu_q_lens, num_seqs + 1)


def ragged_mla_paged_attention_reference(q_latent: jax.Array,  # [total_q_tokens, num_heads, R]
                                         q_rope: jax.Array,  # [total_q_tokens, num_heads, Dr]
                                         kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                         block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                         kv_lens: jax.Array,  # i32[num_seqs]
                                         cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                                         *, scale: float,
                                         kv_scales: jax.Array | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.ragged_mla_paged_attention`: query i of sequence s sits at
    position kv_lens[s] - q_len[s] + i and attends to positions <= its own (and < kv_lens[s]); rows past
    cu_q_lens[-1] give zeros. Memory: gathers `[total_q_tokens, max_blocks_per_seq * block_size, R + Dr]`."""
    scale = _mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale)
    _check_ragged(q_latent, block_tables, kv_lens, cu_q_lens)
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _ragged_mla_reference(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales,
                                 scale=scale)


@functools.partial(jax.jit, static_argnames=("scale", "q_tile"))
def _ragged_mla_xla(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales, *, scale, q_tile):
    num_tokens, num_heads, rank = q_latent.shape
    max_len = block_tables.shape[1] * kv_pages.shape[1]
    tq = max(1, min(q_tile, num_tokens))
    kv_lens = jnp.clip(kv_lens, 0, max_len)
    tile_seq, rows, valid, pos, token_slot = _query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    num_tiles = tile_seq.shape[0]
    keep = valid[:, :, None] & _visible(jnp.arange(max_len, dtype=jnp.int32), pos[:, :, None],
                                        kv_lens[tile_seq][:, None, None], None)  # [NT, tq, L]
    kv = _gather_latent(kv_pages, kv_scales, block_tables[tile_seq], jnp.dtype(q_latent.dtype))  # [NT, L, R + Dr]
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[jnp.clip(rows, 0, num_tokens - 1)]  # [NT, tq, H, R + Dr]
    o = _latent_attention(q, kv, keep, scale=scale, rank=rank, compute_dtype=jnp.dtype(q_latent.dtype))
    out = o.reshape(num_tiles * tq, num_heads, rank)[jnp.clip(token_slot, 0, num_tiles * tq - 1)]
    t = jnp.arange(num_tokens)
    in_batch = (t >= cu_q_lens[0]) & (t < cu_q_lens[-1])
    return jnp.where(in_batch[:, None, None], out, 0.0).astype(q_latent.dtype)


def ragged_mla_paged_attention_xla(q_latent: jax.Array,  # [total_q_tokens, num_heads, R]
                                   q_rope: jax.Array,  # [total_q_tokens, num_heads, Dr]
                                   kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                   block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                   kv_lens: jax.Array,  # i32[num_seqs]
                                   cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                                   *, scale: float, kv_scales: jax.Array | None = None,
                                   q_tile: int = 16) -> jax.Array:
    """XLA gather path for ragged MLA: same contract as `ragged_mla_paged_attention`, pages in q's dtype (8-bit
    pages dequantized into it right after the gather), float32 accumulation. Each sequence's queries are cut
    into tiles of `q_tile` consecutive rows (a decode token is a tile of its own) and each tile gathers its
    sequence's pages once, for all its rows and heads: `[num_tiles, max_blocks_per_seq * block_size, R + Dr]`
    with num_tiles <= total_q_tokens / q_tile + num_seqs."""
    V.check_positive_int("q_tile", q_tile)
    scale = _mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale)
    _check_ragged(q_latent, block_tables, kv_lens, cu_q_lens)
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _ragged_mla_xla(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales, scale=scale,
                           q_tile=q_tile)


def mla_attention_dense_reference(q_nope: jax.Array,  # [T, H, Dn]
                                  q_rope: jax.Array,  # [T, H, Dr]
                                  c_kv: jax.Array,  # [L, R]
                                  k_rope: jax.Array,  # [L, Dr]
                                  w_uk: jax.Array,  # [H, R, Dn]
                                  w_uv: jax.Array,  # [H, R, Dv]
                                  *, scale: float, q_positions: jax.Array | None = None) -> jax.Array:
    """Multi-head latent attention of one sequence WITHOUT weight absorption, in float32: the keys and values
    are expanded per head, K[t, h] = [c_kv[t] W_UK[h] | k_rope[t]] and V[t, h] = c_kv[t] W_UV[h], and the
    queries [q_nope | q_rope] run ordinary causal attention over them. Query i sits at position
    q_positions[i] (default L - T + i) and attends to positions <= its own. Returns `[T, H, Dv]` float32.

    The oracle of the absorption algebra: `mla_paged_attention` / `ragged_mla_paged_attention` on
    q_latent[h] = W_UK[h] q_nope[h], followed by W_UV, must equal it."""
    f32 = jnp.float32
    num_tokens, length = q_nope.shape[0], c_kv.shape[0]
    k_nope = jnp.einsum("lr,hrd->lhd", c_kv.astype(f32), w_uk.astype(f32), precision=HIGHEST)
    v = jnp.einsum("lr,hrd->lhd", c_kv.astype(f32), w_uv.astype(f32), precision=HIGHEST)
    s = (jnp.einsum("thd,lhd->thl", q_nope.astype(f32), k_nope, precision=HIGHEST)
         + jnp.einsum("thd,ld->thl", q_rope.astype(f32), k_rope.astype(f32), precision=HIGHEST)) * scale
    if q_positions is None:
        q_positions = length - num_tokens + jnp.arange(num_tokens)
    keep = jnp.arange(length)[None, :] <= jnp.asarray(q_positions)[:, None]  # [T, L]
    s = jnp.where(keep[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m))
    z = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("thl,lhd->thd", p / jnp.where(z > 0, z, 1.0), v, precision=HIGHEST)
    return o


# ---- DeepSeek sparse attention (DSA, V3.2): the lightning indexer and top-k sparse MLA -------------------------
#
# Per layer the cache holds, beside the latent pages, one indexer key per token, `index_pages [num_blocks,
# block_size, index_head_dim]` in the same blocks (same block table), shared by every indexer head, optionally
# 8-bit with one float scale per token (`index_scales [num_blocks, block_size]`). A query row with indexer
# queries q_I `[index_n_heads, index_head_dim]` and per-head weights w `[index_n_heads]` scores position t as
#     s[t] = scale * sum_h w[h] * relu(q_I[h] . k_I[t])
# for the positions it sees (t <= its position, t < kv_len) and -inf elsewhere; `topk.top_k_positions` keeps the
# top index_topk; the sparse MLA attends (absorbed, as `ragged_mla_paged_attention`) to exactly those positions.


@functools.partial(jax.jit, static_argnames=("scale",))
def _indexer_reference(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, index_scales, *, scale):
    num_tokens = q_index.shape[0]
    max_len = block_tables.shape[1] * index_pages.shape[1]
    table_rows, ends = tiles.row_metadata(kv_lens, cu_q_lens, num_tokens, max_len)
    k = _gather_latent(index_pages, index_scales, block_tables[table_rows], jnp.float32)  # one copy per query row
    s = jnp.einsum("rhd,rld->rhl", q_index.astype(jnp.float32), k, precision=HIGHEST)
    # A slot no row sees may hold anything (NaN included): it only ever reaches its own column, masked below.
    s = jnp.einsum("rh,rhl->rl", weights, jnp.maximum(s, 0.0), precision=HIGHEST) * scale
    keep = jnp.arange(max_len, dtype=jnp.int32)[None, :] < ends[:, None]
    return jnp.where(keep, s, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "q_tile"))
def _indexer_xla(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, index_scales, *, scale, q_tile):
    num_tokens, num_heads, _ = q_index.shape
    max_len = block_tables.shape[1] * index_pages.shape[1]
    tq = max(1, min(q_tile, num_tokens))
    kv_lens = jnp.clip(kv_lens, 0, max_len)
    tile_seq, rows, valid, pos, token_slot = _query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    num_tiles = tile_seq.shape[0]
    keep = valid[:, :, None] & _visible(jnp.arange(max_len, dtype=jnp.int32), pos[:, :, None],
                                        kv_lens[tile_seq][:, None, None], None)  # [NT, tq, L]
    dtype = jnp.dtype(q_index.dtype)
    k = _gather_latent(index_pages, index_scales, block_tables[tile_seq], dtype)  # [NT, L, D], once per tile
    k = jnp.where(jnp.any(keep, axis=1)[..., None], k, jnp.zeros((), dtype))
    safe_rows = jnp.clip(rows, 0, num_tokens - 1)
    qt, wt = q_index[safe_rows], weights[safe_rows]  # [NT, tq, H, D], [NT, tq, H]

    def head(h, acc):  # one head at a time: [NT, tq, L] live, never [NT, tq, H, L]
        s = jnp.einsum("ntd,nld->ntl", qt[:, :, h], k, precision=HIGHEST, preferred_element_type=jnp.float32)
        return acc + wt[:, :, h, None] * jnp.maximum(s, 0.0)

    s = lax.fori_loop(0, num_heads, head, jnp.zeros(keep.shape, jnp.float32)) * scale
    s = jnp.where(keep, s, -jnp.inf).reshape(num_tiles * tq, max_len)
    out = s[jnp.clip(token_slot, 0, num_tiles * tq - 1)]
    t = jnp.arange(num_tokens)
    in_batch = (t >= cu_q_lens[0]) & (t < cu_q_lens[-1])
    return jnp.where(in_batch[:, None], out, -jnp.inf)


def _indexer_checked(q_index, weights, index_pages, block_tables, index_scales, scale, kv_lens, cu_q_lens):
    """Validates an indexer call (decode when cu_q_lens is None); returns the scale."""
    num_rows = q_index.shape[0] if cu_q_lens is None and getattr(q_index, "ndim", 0) == 3 else None
    V.validate_indexer(q_index, weights, index_pages, block_tables, index_scales, num_rows)
    if cu_q_lens is None:
        V.check_vector("lengths", kv_lens, q_index.shape[0])
    else:
        _check_ragged(q_index, block_tables, kv_lens, cu_q_lens)
    return V.check_indexer_scale(scale)


def _no_keys(q_index, index_pages, block_tables) -> jax.Array | None:
    """With no rows, sequences, table entries or pool blocks nothing is visible: every score is -inf."""
    if 0 in (q_index.shape[0], block_tables.shape[0], block_tables.shape[1], index_pages.shape[0]):
        return jnp.full((q_index.shape[0], block_tables.shape[1] * index_pages.shape[1]), -jnp.inf, jnp.float32)
    return None


def _decode_cu(num_seqs: int) -> jax.Array:
    """cu_q_lens of a decode batch: one query row per sequence, at position lengths[s] - 1."""
    return jnp.arange(num_seqs + 1, dtype=jnp.int32)


def indexer_scores_reference(q_index: jax.Array,  # [num_seqs, index_n_heads, index_head_dim]
                             weights: jax.Array,  # f32[num_seqs, index_n_heads]
                             index_pages: jax.Array,  # [num_blocks, block_size, index_head_dim]
                             block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                             lengths: jax.Array,  # i32[num_seqs]
                             *, scale: float,
                             index_scales: jax.Array | None = None) -> jax.Array:  # [num_blocks, block_size]
    """Dense float32 reference of `pallas_kernels.indexer_scores` (decode: the query of sequence s at position
    lengths[s] - 1): `[num_seqs, max_blocks_per_seq * block_size]` float32, s[t] = scale * sum_h w[h] *
    relu(q_I[h] . k_I[t]) for t < lengths[s], -inf elsewhere."""
    scale = _indexer_checked(q_index, weights, index_pages, block_tables, index_scales, scale, lengths, None)
    empty = _no_keys(q_index, index_pages, block_tables)
    if empty is not None:
        return empty
    return _indexer_reference(q_index, weights, index_pages, block_tables, lengths, None, index_scales, scale=scale)


def ragged_indexer_scores_reference(q_index: jax.Array,  # [total_q_tokens, index_n_heads, index_head_dim]
                                    weights: jax.Array,  # f32[total_q_tokens, index_n_heads]
                                    index_pages: jax.Array,  # [num_blocks, block_size, index_head_dim]
                                    block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                    kv_lens: jax.Array,  # i32[num_seqs]
                                    cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                                    *, scale: float, index_scales: jax.Array | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.ragged_indexer_scores`: query i of sequence s sits at position
    kv_lens[s] - q_len[s] + i and scores the positions <= its own (and < kv_lens[s]); every other entry, and
    every entry of a padding row past cu_q_lens[-1], is -inf. Returns `[total_q_tokens, max_blocks_per_seq *
    block_size]` float32. Memory: gathers `[total_q_tokens, max_blocks_per_seq * block_size, index_head_dim]`."""
    scale = _indexer_checked(q_index, weights, index_pages, block_tables, index_scales, scale, kv_lens, cu_q_lens)
    empty = _no_keys(q_index, index_pages, block_tables)
    if empty is not None:
        return empty
    return _indexer_reference(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, index_scales,
                              scale=scale)


def indexer_scores_xla(q_index: jax.Array,  # [num_seqs, index_n_heads, index_head_dim]
                       weights: jax.Array,  # f32[num_seqs, index_n_heads]
                       index_pages: jax.Array,  # [num_blocks, block_size, index_head_dim]
                       block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                       lengths: jax.Array,  # i32[num_seqs]
                       *, scale: float, index_scales: jax.Array | None = None) -> jax.Array:
    """XLA gather path of `pallas_kernels.indexer_scores`: `ragged_indexer_scores_xla` on one-row tiles."""
    scale = _indexer_checked(q_index, weights, index_pages, block_tables, index_scales, scale, lengths, None)
    empty = _no_keys(q_index, index_pages, block_tables)
    if empty is not None:
        return empty
    return _indexer_xla(q_index, weights, index_pages, block_tables, lengths, _decode_cu(lengths.shape[0]),
                        index_scales, scale=scale, q_tile=1)


def ragged_indexer_scores_xla(q_index: jax.Array,  # [total_q_tokens, index_n_heads, index_head_dim]
                              weights: jax.Array,  # f32[total_q_tokens, index_n_heads]
                              index_pages: jax.Array,  # [num_blocks, block_size, index_head_dim]
                              block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                              kv_lens: jax.Array,  # i32[num_seqs]
                              cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                              *, scale: float, index_scales: jax.Array | None = None,
                              q_tile: int = 16) -> jax.Array:
    """XLA gather path of `pallas_kernels.ragged_indexer_scores` (the engine's CPU path): keys in q's dtype (8-bit
    keys dequantized into it right after the gather), float32 accumulation. Each sequence's queries are cut into
    tiles of `q_tile` rows, each tile gathers its sequence's keys once (`[num_tiles, max_blocks_per_seq *
    block_size, index_head_dim]`), and the heads are summed one at a time, so the float32 scores live as
    `[num_tiles, q_tile, max_context]`, never with a head axis."""
    V.check_positive_int("q_tile", q_tile)
    scale = _indexer_checked(q_index, weights, index_pages, block_tables, index_scales, scale, kv_lens, cu_q_lens)
    empty = _no_keys(q_index, index_pages, block_tables)
    if empty is not None:
        return empty
    return _indexer_xla(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, index_scales, scale=scale,
                        q_tile=q_tile)


@functools.partial(jax.jit, static_argnames=("scale",))
def _sparse_reference(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales, *, scale):
    num_rows = q_latent.shape[0]
    max_len = block_tables.shape[1] * kv_pages.shape[1]
    table_rows, ends = tiles.row_metadata(kv_lens, cu_q_lens, num_rows, max_len)
    valid = (indices >= 0) & (indices < ends[:, None])
    # Dense: the selection as a mask over every position (column max_len collects the entries selecting nothing).
    selected = jnp.zeros((num_rows, max_len + 1), bool).at[
        jnp.arange(num_rows)[:, None], jnp.where(valid, indices, max_len)].set(True)[:, :max_len]
    kv = _gather_latent(kv_pages, kv_scales, block_tables[table_rows], jnp.float32)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[:, None]
    o = _latent_attention(q, kv, selected[:, None], scale=scale, rank=q_latent.shape[-1], compute_dtype=jnp.float32)
    return o[:, 0].astype(q_latent.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def _sparse_xla(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales, *, scale):
    num_rows = q_latent.shape[0]
    num_blocks, block_size, width = kv_pages.shape
    table_rows, ends = tiles.row_metadata(kv_lens, cu_q_lens, num_rows, block_tables.shape[1] * block_size)
    slots = tiles.selected_slots(indices, block_tables, table_rows, ends, block_size)
    ok = slots >= 0
    safe = jnp.where(ok, slots, 0)
    dtype = jnp.dtype(q_latent.dtype)
    g = kv_pages.reshape(num_blocks * block_size, width)[safe]  # [rows, top_k, R + Dr]: the selected rows only
    if kv_scales is None:
        g = g.astype(dtype)
    else:
        g = dequantize_kv(g, kv_scales.reshape(-1)[safe], dtype)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[:, None]
    o = _latent_attention(q, g, ok[:, None], scale=scale, rank=q_latent.shape[-1], compute_dtype=dtype)
    return o[:, 0].astype(q_latent.dtype)


def _sparse_checked(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales, scale):
    """Validates a sparse MLA call (decode when cu_q_lens is None); returns the scale."""
    num_rows = q_latent.shape[0] if cu_q_lens is None and getattr(q_latent, "ndim", 0) == 3 else None
    scale = _mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, num_rows)
    if cu_q_lens is None:
        V.check_vector("lengths", kv_lens, q_latent.shape[0])
    else:
        _check_ragged(q_latent, block_tables, kv_lens, cu_q_lens)
    V.validate_selection(indices, q_latent.shape[0])
    return scale


def sparse_mla_paged_attention_reference(q_latent: jax.Array,  # [num_seqs, num_heads, R]
                                         q_rope: jax.Array,  # [num_seqs, num_heads, Dr]
                                         kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                         block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                         lengths: jax.Array,  # i32[num_seqs]
                                         indices: jax.Array,  # i32[num_seqs, top_k]
                                         *, scale: float, kv_scales: jax.Array | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.sparse_mla_paged_attention` (decode): the absorbed MLA of
    `mla_paged_attention_reference` masked to each row's selected positions. Returns `[num_seqs, num_heads, R]`
    in q's dtype."""
    scale = _sparse_checked(q_latent, q_rope, kv_pages, block_tables, lengths, None, indices, kv_scales, scale)
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _sparse_reference(q_latent, q_rope, kv_pages, block_tables, lengths, None, indices, kv_scales,
                             scale=scale)


def ragged_sparse_mla_paged_attention_reference(q_latent: jax.Array,  # [total_q_tokens, num_heads, R]
                                                q_rope: jax.Array,  # [total_q_tokens, num_heads, Dr]
                                                kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                                block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                                kv_lens: jax.Array,  # i32[num_seqs]
                                                cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                                                indices: jax.Array,  # i32[total_q_tokens, top_k]
                                                *, scale: float, kv_scales: jax.Array | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.ragged_sparse_mla_paged_attention`: every row gathers its whole
    table, masks it to its selected positions (those it may see: < min(position + 1, kv_len); the rest select
    nothing) and runs the masked softmax of `ragged_mla_paged_attention_reference`. A row selecting nothing, and
    every padding row, gives zeros. With every visible position selected it equals that reference."""
    scale = _sparse_checked(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales,
                            scale)
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _sparse_reference(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales,
                             scale=scale)


def sparse_mla_paged_attention_xla(q_latent: jax.Array,  # [num_seqs, num_heads, R]
                                   q_rope: jax.Array,  # [num_seqs, num_heads, Dr]
                                   kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                   block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                   lengths: jax.Array,  # i32[num_seqs]
                                   indices: jax.Array,  # i32[num_seqs, top_k]
                                   *, scale: float, kv_scales: jax.Array | None = None) -> jax.Array:
    """XLA gather path of `pallas_kernels.sparse_mla_paged_attention`, as `ragged_sparse_mla_paged_attention_xla`."""
    scale = _sparse_checked(q_latent, q_rope, kv_pages, block_tables, lengths, None, indices, kv_scales, scale)
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _sparse_xla(q_latent, q_rope, kv_pages, block_tables, lengths, None, indices, kv_scales, scale=scale)


def ragged_sparse_mla_paged_attention_xla(q_latent: jax.Array,  # [total_q_tokens, num_heads, R]
                                          q_rope: jax.Array,  # [total_q_tokens, num_heads, Dr]
                                          kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                          block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                          kv_lens: jax.Array,  # i32[num_seqs]
                                          cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                                          indices: jax.Array,  # i32[total_q_tokens, top_k]
                                          *, scale: float, kv_scales: jax.Array | None = None) -> jax.Array:
    """XLA gather path of `pallas_kernels.ragged_sparse_mla_paged_attention` (the engine's CPU path): the selected
    positions become physical slots through the block table (`tiles.selected_slots`) and only those rows are
    gathered, `[total_q_tokens, top_k, R + Dr]` in q's dtype (8-bit pages dequantized right after the gather):
    cost O(top_k) per row whatever the context. Float32 accumulation."""
    scale = _sparse_checked(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales,
                            scale)
    if _mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _sparse_xla(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales,
                       scale=scale)
