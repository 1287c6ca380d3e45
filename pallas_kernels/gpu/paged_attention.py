"""Decode attention over a paged KV cache (one query token per sequence), in Pallas.

Grid: (num_seqs, num_kv_heads, num_splits). Program (s, h, p)
  * loads every query head of KV head h at once (GQA packing: each KV page is read once per KV head, not
    once per query head; the group's rows are padded to >= 16 for tl.dot, padding rows are masked),
  * walks its share of sequence s's pages, `pages_per_iter` pages per iteration, gathering them through
    the block table with masked loads; the trip count is computed from lengths[s], so no page past the
    sequence's length is touched,
  * keeps an online softmax (m, z, u) in float32.
With one split the program writes the normalised output. With several ("flash-decoding"), sequence s's
pages are cut into `num_splits` contiguous ranges *sized from its own length* (every split of a sequence
does about the same work, whatever the table width), each program writes its partial (m, z, u), and
`merge.merge_and_finalize` combines them exactly in float32.

Non-power-of-two sizes (head_dim 80 or 96, odd group sizes, any block_size) are padded to powers of two
inside the kernel only, with masked loads and stores: the KV cache is never copied or padded.

Variants (static, one compiled kernel per combination):
  * sliding window W: the query (position lengths[s] - 1) sees positions [lengths[s] - W, lengths[s]). The
    splits are cut over the pages from the one holding lengths[s] - W on (sized from that range, and the
    default split count and tile from the window's page count), so pages wholly before the window are never
    loaded and their block-table entries never read; slots of the first page before the window are masked
    on load;
  * soft cap c: scores become c * tanh(s / c) inside the online-softmax step (bounded scores; the exact
    (m, z, u) merge is unchanged);
  * 8-bit pages: K/V tiles are loaded as int8 / float8_e4m3fn with their per-token scales (the same masked
    loads) and dequantized in registers into q's dtype before the matmuls;
  * sinks (one logit per query head in each softmax's denominator, gpt-oss): joined once into the (m, z, u) of
    all of a query's keys (`merge.join_sink`): by the program itself with one split, after the merge of the
    splits' partials with several (a split sees only part of the keys; the sink belongs to their union).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import tiles
from pallas_kernels.gpu import _common as C
from pallas_kernels.merge import finalize, join_sink, merge_and_finalize

# Split-K targets about this many programs in flight: a few waves on a 132-SM H100/H200.
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 64


def default_num_splits(num_seqs: int, num_kv_heads: int, max_blocks_per_seq: int, pages_per_iter: int) -> int:
    """Number of KV splits per (sequence, KV head).

    The grid must be static, so the count comes from static shapes: enough programs to fill the GPU
    (num_seqs * num_kv_heads * splits ~ _TARGET_PROGRAMS), but never more splits than the longest possible
    sequence has tiles. The split *boundaries* are then computed in the kernel from each sequence's actual
    length, so short sequences in a wide table are split as evenly as long ones.
    """
    num_tiles = tiles.cdiv(max(1, max_blocks_per_seq), pages_per_iter)
    want = tiles.cdiv(_TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    return int(max(1, min(want, num_tiles, _MAX_SPLITS)))


def _decode_kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, *refs, scale: float, group: int,
                   rows: int, head_dim: int, block_size: int, pages_per_iter: int, num_splits: int,
                   max_blocks_per_seq: int, sliding_window: int | None, logits_soft_cap: float | None,
                   quantized: bool, sinks: bool):
    """q_ref [num_seqs, num_q_heads, head_dim]; k_ref/v_ref [num_kv_heads, num_blocks, block_size, head_dim];
    table_ref [num_seqs, max_blocks_per_seq]; lengths_ref [num_seqs]; refs: with 8-bit pages k_scales/v_scales
    [num_kv_heads, num_blocks, block_size], with sinks (one split only) sinks f32[num_q_heads], then the outputs:
    o [num_seqs, num_q_heads, head_dim] (one split) or m, z [num_splits, num_seqs, num_q_heads] and u
    [num_splits, num_seqs, num_q_heads, head_dim] float32 (several)."""
    num_in = (2 if quantized else 0) + (1 if sinks else 0)
    scale_refs = refs[:2] if quantized else None
    sinks_ref = refs[num_in - 1] if sinks else None
    out_refs = refs[num_in:]
    seq = pl.program_id(0)
    head = pl.program_id(1)
    split = pl.program_id(2)
    dim_pad = tiles.padded_head_dim(head_dim)

    length = jnp.clip(lengths_ref[seq], 0, max_blocks_per_seq * block_size)
    num_pages = tiles.cdiv(length, block_size)
    # The query sits at position length - 1: a window keeps positions [length - W, length), and pages wholly
    # before it are no split's (never loaded, their table entries never read).
    window_start = None if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    first_page = 0 if sliding_window is None else window_start // block_size
    # This split's page range, sized from this sequence's (window's) page count and rounded to whole tiles.
    pages_per_split = tiles.cdiv(tiles.cdiv(num_pages - first_page, num_splits), pages_per_iter) * pages_per_iter
    page_lo = first_page + split * pages_per_split
    page_hi = jnp.minimum(page_lo + pages_per_split, num_pages)
    num_iters = tiles.cdiv(jnp.maximum(page_hi - page_lo, 0), pages_per_iter)

    r = jnp.arange(rows, dtype=jnp.int32)
    d = jnp.arange(dim_pad, dtype=jnp.int32)
    q_heads = head * group + r
    row_mask = (r < group)[:, None] & (d < head_dim)[None, :]
    q = plgpu.load(q_ref.at[seq, q_heads[:, None], d[None, :]], mask=row_mask, other=0)

    def body(i, carry):
        k, v, valid, _ = C.gather_page_tile(
            table_ref, k_ref, v_ref, seq=seq, head=head, first_page=page_lo + i * pages_per_iter,
            page_end=page_hi, token_end=length, pages_per_iter=pages_per_iter, block_size=block_size,
            head_dim=head_dim, token_start=window_start, scale_refs=scale_refs, dtype=q.dtype)
        return C.online_softmax_step(q, k, v, valid[None, :], carry, scale=scale, logits_soft_cap=logits_soft_cap)

    m, z, u = lax.fori_loop(0, num_iters, body, C.init_carry(rows, dim_pad))

    if num_splits == 1:
        (o_ref,) = out_refs
        if sinks:  # padding rows (r >= group) load a sink of 0: they are never stored
            _, z, u = join_sink(m, z, u, plgpu.load(sinks_ref.at[q_heads], mask=r < group, other=0.0))
        o = finalize(z, u, o_ref.dtype)
        plgpu.store(o_ref.at[seq, q_heads[:, None], d[None, :]], o, mask=row_mask)
    else:
        m_ref, z_ref, u_ref = out_refs
        plgpu.store(m_ref.at[split, seq, q_heads], m, mask=r < group)
        plgpu.store(z_ref.at[split, seq, q_heads], z, mask=r < group)
        plgpu.store(u_ref.at[split, seq, q_heads[:, None], d[None, :]], u, mask=row_mask)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "num_splits", "pages_per_iter", "num_warps", "num_stages",
                     "sliding_window", "logits_soft_cap"))
def _paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, *, scale: float,
                     interpret: bool, num_splits: int, pages_per_iter: int, num_warps: int, num_stages: int,
                     sliding_window: int | None, logits_soft_cap: float | None):
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    max_blocks_per_seq = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    kernel = functools.partial(
        _decode_kernel, scale=scale, group=group, rows=max(tiles.MIN_DOT_DIM, tiles.next_pow2(group)),
        head_dim=head_dim, block_size=block_size, pages_per_iter=pages_per_iter, num_splits=num_splits,
        max_blocks_per_seq=max_blocks_per_seq, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        quantized=k_scales is not None, sinks=sinks is not None and num_splits == 1)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((num_splits, num_seqs, num_q_heads), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_seqs, num_q_heads), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_seqs, num_q_heads, head_dim), jnp.float32),
        )
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"paged_attention_decode_s{num_splits}_p{pages_per_iter}"
             + tiles.variant_suffix(sliding_window, logits_soft_cap, k_pages.dtype,
                                    sinks=sinks is not None and num_splits == 1),
    )(lengths, block_tables, q, k_pages, v_pages, *(() if k_scales is None else (k_scales, v_scales)),
      *(() if sinks is None or num_splits > 1 else (sinks,)))
    if num_splits == 1:
        return out
    m, z, u = out
    return merge_and_finalize(m, z, u, axis=0, dtype=q.dtype, sinks=sinks)


def paged_attention_gpu(q, k_pages, v_pages, block_tables, lengths, *, scale: float, interpret: bool | None,
                        num_splits: int | None, pages_per_iter: int | None, num_warps: int, num_stages: int,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                        sinks: jax.Array | None = None) -> jax.Array:
    """The GPU decode kernel behind `pallas_kernels.paged_attention(..., target="gpu")`, which has already
    validated shapes, dtypes, scale, variants (sinks included) and the tuning ints. Checks the GPU tile rule
    (pages_per_iter), fills in the defaults (`default_pages_per_iter`, `default_num_splits`, over the window's
    pages with a window) and runs the kernel."""
    num_seqs = q.shape[0]
    num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
    max_blocks_per_seq = block_tables.shape[1]
    C.check_pages_per_iter(pages_per_iter, block_size)
    if num_seqs == 0 or max_blocks_per_seq == 0 or num_blocks == 0:
        return jnp.zeros(q.shape, q.dtype)
    # A program walks at most the window's pages: tiles and splits are sized from that, not the table.
    walked_pages = tiles.window_pages(sliding_window, 1, max_blocks_per_seq, block_size)
    if pages_per_iter is None:
        pages_per_iter = C.default_pages_per_iter(block_size, walked_pages, head_dim, q.dtype)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, walked_pages, pages_per_iter)
    return _paged_attention(
        q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, scale=scale,
        interpret=C.resolve_interpret(interpret), num_splits=int(num_splits), pages_per_iter=int(pages_per_iter),
        num_warps=int(num_warps), num_stages=int(num_stages), sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap)
