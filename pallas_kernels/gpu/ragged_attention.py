"""Ragged paged attention: chunked-prefill and decode tokens of many sequences in one call, in Pallas.

The wrapper cuts each sequence's query rows into tiles of `block_q` tokens (a tile never spans two
sequences) with a few cheap jnp ops on the `[num_seqs + 1]` metadata, and the rows past cu_q_lens[-1]
(padding added by a caller that buckets shapes) into tiles of a virtual empty sequence, so every output
row is written by exactly one program. The grid is (tile, KV head); the number of tiles is a static upper
bound, and tiles beyond the real count do nothing.

Program (t, h) loads its tile's `block_q` query tokens times all query heads of KV head h (GQA packing:
`block_q * group` rows, padded to powers of two and >= 16 rows), then walks the sequence's pages from 0
up to the last position any of its rows may see (a dynamic trip count: pages past that are never read),
`pages_per_iter` pages per iteration through the block table, with a causal mask and an online softmax in
float32.

Variants (static): with a sliding window W a tile's walk starts at the page holding pos0 - W + 1 (pos0: its
first row's position; no row sees anything earlier), so pages wholly before every row's window are never
loaded nor their table entries read, and each row masks keys at or before its own position - W; a soft cap
c turns scores into c * tanh(s / c) in the online-softmax step; 8-bit pages are loaded as 8-bit with their
per-token scales and dequantized in registers into q's dtype. With `attend_until` (bidirectional spans) the
wrapper adds each tile slot's last visible position and each tile's walk end (`tiles.tile_bounds`): the walk
reaches the largest bound of any row of the tile, and each row masks keys past its own bound. With sinks (one
logit per query head, gpt-oss) each row joins its head's sink into its (m, z, u) after the walk, before the
division (`merge.join_sink`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _validate as V
from pallas_kernels import tiles
from pallas_kernels.gpu import _common as C
from pallas_kernels.merge import finalize, join_sink


def _ragged_kernel(meta_ref, table_ref, q_ref, k_ref, v_ref, *refs, scale: float, group: int,
                   group_pad: int, block_q: int, head_dim: int, block_size: int, pages_per_iter: int,
                   sliding_window: int | None, logits_soft_cap: float | None, quantized: bool, attend_until: bool,
                   sinks: bool):
    """meta_ref [num_tiles, 5]; table_ref [num_seqs, max_blocks_per_seq]; q_ref/o_ref [total_q_tokens,
    num_q_heads, head_dim]; k_ref/v_ref [num_kv_heads, num_blocks, block_size, head_dim]; refs = (k_scales,
    v_scales [num_kv_heads, num_blocks, block_size]) with 8-bit pages, then (last [num_tiles, block_q], ends
    [num_tiles]) with attend_until (`tiles.tile_bounds`), then sinks f32[num_q_heads] with sinks, then o_ref."""
    inputs = iter(refs[:-1])
    scale_refs = (next(inputs), next(inputs)) if quantized else None
    bound_refs = (next(inputs), next(inputs)) if attend_until else None
    sinks_ref = next(inputs) if sinks else None
    o_ref = refs[-1]
    tile = pl.program_id(0)
    head = pl.program_id(1)
    seq = meta_ref[tile, 0]
    row0 = meta_ref[tile, 1]
    num_rows = meta_ref[tile, 2]
    pos0 = meta_ref[tile, 3]
    kv_len = meta_ref[tile, 4]
    dim_pad = tiles.padded_head_dim(head_dim)
    rows = block_q * group_pad

    r = jnp.arange(rows, dtype=jnp.int32)
    token = r // group_pad  # query token of each row within the tile
    g = r % group_pad  # query head within the group
    d = jnp.arange(dim_pad, dtype=jnp.int32)
    row_ok = (token < num_rows) & (g < group)
    io_mask = row_ok[:, None] & (d < head_dim)[None, :]
    io_idx = ((row0 + token)[:, None], (head * group + g)[:, None], d[None, :])
    q = plgpu.load(q_ref.at[io_idx], mask=io_mask, other=0)
    q_pos = pos0 + token

    # Keys any row of this tile may see: positions [kv_start, kv_end); with a window W the first row (at pos0)
    # sees nothing before pos0 - W + 1, so the walk starts at that position's page: pages wholly before every
    # row's window are never loaded and their table entries never read. A row sees keys up to q_last: its own
    # position, or with attend_until its bound, which may lie past the tile's last row (kv_end is the largest).
    if attend_until:
        last_ref, ends_ref = bound_refs
        q_last = plgpu.load(last_ref.at[tile, token])
        kv_end = ends_ref[tile]
    else:
        q_last = q_pos
        kv_end = jnp.where(num_rows > 0, jnp.clip(pos0 + num_rows, 0, kv_len), 0)
    num_pages = tiles.cdiv(kv_end, block_size)
    kv_start = None if sliding_window is None else jnp.clip(pos0 - sliding_window + 1, 0, kv_end)
    first_page = 0 if sliding_window is None else kv_start // block_size
    num_iters = tiles.cdiv(num_pages - first_page, pages_per_iter)

    def body(i, carry):
        k, v, valid, kv_pos = C.gather_page_tile(
            table_ref, k_ref, v_ref, seq=seq, head=head, first_page=first_page + i * pages_per_iter,
            page_end=num_pages, token_end=kv_end, pages_per_iter=pages_per_iter, block_size=block_size,
            head_dim=head_dim, token_start=kv_start, scale_refs=scale_refs, dtype=q.dtype)
        mask = valid[None, :] & (kv_pos[None, :] <= q_last[:, None])
        if sliding_window is not None:
            mask = mask & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        return C.online_softmax_step(q, k, v, mask, carry, scale=scale, logits_soft_cap=logits_soft_cap)

    m, z, u = lax.fori_loop(0, num_iters, body, C.init_carry(rows, dim_pad))
    if sinks:  # padding heads (g >= group) load a sink of 0: they are never stored
        _, z, u = join_sink(m, z, u, plgpu.load(sinks_ref.at[head * group + g], mask=g < group, other=0.0))
    plgpu.store(o_ref.at[io_idx], finalize(z, u, o_ref.dtype), mask=io_mask)


@functools.partial(
    jax.jit, static_argnames=("scale", "interpret", "block_q", "pages_per_iter", "num_warps", "num_stages",
                              "sliding_window", "logits_soft_cap"))
def _ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until,
                            sinks, *, scale: float, interpret: bool, block_q: int, pages_per_iter: int, num_warps: int,
                            num_stages: int, sliding_window: int | None, logits_soft_cap: float | None):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    meta = tiles.tile_metadata(kv_lens, cu_q_lens, num_tokens, block_q, block_tables.shape[1] * block_size)
    scales = () if k_scales is None else (k_scales, v_scales)
    bounds = () if attend_until is None else tiles.tile_bounds(meta, attend_until, block_q)
    kernel = functools.partial(
        _ragged_kernel, scale=scale, group=group, group_pad=tiles.next_pow2(group), block_q=block_q,
        head_dim=head_dim, block_size=block_size, pages_per_iter=pages_per_iter, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap, quantized=k_scales is not None, attend_until=attend_until is not None,
        sinks=sinks is not None)
    return pl.pallas_call(
        kernel,
        grid=(meta.shape[0], num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"ragged_paged_attention_q{block_q}_p{pages_per_iter}"
             + tiles.variant_suffix(sliding_window, logits_soft_cap, k_pages.dtype, attend_until is not None,
                                    sinks is not None),
    )(meta, block_tables, q, k_pages, v_pages, *scales, *bounds, *(() if sinks is None else (sinks,)))


def default_num_warps(block_q: int, group: int, head_dim: int) -> int:
    """Triton warps per program: 4, or 8 for query tiles of 128 x 128 float32 accumulator elements and
    more (big tiles need more threads to hold the accumulator)."""
    rows = block_q * tiles.next_pow2(group)
    return 8 if rows * tiles.padded_head_dim(head_dim) >= 128 * 128 else 4


def ragged_paged_attention_gpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, scale: float,
                               interpret: bool | None, block_q: int | None, pages_per_iter: int | None,
                               num_warps: int | None, num_stages: int, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None, k_scales: jax.Array | None = None,
                               v_scales: jax.Array | None = None, attend_until: jax.Array | None = None,
                               sinks: jax.Array | None = None) -> jax.Array:
    """The GPU ragged kernel behind `pallas_kernels.ragged_paged_attention(..., target="gpu")`, which has
    already validated shapes, dtypes, scale, variants (sinks included) and the tuning ints. Checks the GPU tile
    rules (block_q, pages_per_iter), fills in the defaults (`tiles.default_block_q`, `default_pages_per_iter`,
    `default_num_warps`) and runs the kernel."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    num_seqs, max_blocks_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    V.check_pow2_option("block_q", block_q)
    if block_q is not None and block_q * tiles.next_pow2(group) < tiles.MIN_DOT_DIM:
        raise ValueError(f"block_q * next_pow2(group) must be >= {tiles.MIN_DOT_DIM} (tl.dot), got block_q="
                         f"{block_q} with {group} query heads per KV head")
    C.check_pages_per_iter(pages_per_iter, block_size)
    if num_tokens == 0 or num_seqs == 0 or max_blocks_per_seq == 0 or num_blocks == 0:
        return jnp.zeros(q.shape, q.dtype)
    if block_q is None:
        block_q = tiles.default_block_q(num_tokens, num_seqs, group, head_dim)
    if pages_per_iter is None:
        walked_pages = tiles.window_pages(sliding_window, block_q, max_blocks_per_seq, block_size)
        pages_per_iter = C.default_pages_per_iter(block_size, walked_pages, head_dim, q.dtype, max_tokens=64)
    if num_warps is None:
        num_warps = default_num_warps(block_q, group, head_dim)
    return _ragged_paged_attention(
        q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until, sinks, scale=scale,
        interpret=C.resolve_interpret(interpret), block_q=int(block_q), pages_per_iter=int(pages_per_iter),
        num_warps=int(num_warps), num_stages=int(num_stages), sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap)
