"""Multi-head latent attention (MLA, DeepSeek V2/V3) over a paged latent cache, in Pallas compiled through Triton:
decode (`mla_paged_attention_gpu`) and ragged prefill/decode (`ragged_mla_paged_attention_gpu`), one kernel.

The cache holds per token one row `[c_kv (R) | k_rope (Dr)]` of `kv_pages [num_blocks, block_size, R + Dr]`,
shared by every query head: head h scores token t as scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])
and its output is sum_t softmax_t c_kv[t] (`R` wide; the caller applies W_UV). Decode is the ragged kernel on
tiles of one query token (tile s = sequence s, at position lengths[s] - 1), plus split-K.

Grid (tile, head block, split). Program (t, b, p)
  * loads `block_q` query tokens of its tile times `block_h` heads (rows = block_q * block_h, row r = token
    r // block_h, head b * block_h + r % block_h; padding heads and tokens masked): every page it loads serves
    all those heads, which is MLA's bandwidth win over GQA (one latent row per token instead of K and V per KV
    head), so heads are packed as far as the float32 accumulator `[rows, R]` fits in registers
    (`default_block_h`),
  * walks its split's share of the pages the tile can see (positions < min(kv_len, last row's position + 1):
    pages past that are never loaded, their table entries never read), `pages_per_iter` pages per iteration
    through the block table. R + Dr (576 in DeepSeek V3) is no power of two, so each page tile is loaded as
    two masked power-of-two slices, the latent columns [0, R) and the rope columns [R, R + Dr), and the score
    is the sum of two dots; the value tile is the latent slice itself,
  * keeps an exact float32 online softmax (m, z, u), causal inside the tile.
With one split it writes the normalised output; with several ("flash-decoding", the decode default when
sequences x head blocks are too few to fill the GPU) each split of a tile's page range, sized from its own
length, writes its partial (m, z, u) and `merge.merge_and_finalize` combines them exactly in float32.

8-bit pages (int8 / float8_e4m3fn) come with one scale per token, `kv_scales [num_blocks, block_size]`: both
slices are loaded as 8-bit, their token's scale with the same mask, and dequantized in registers into q's
dtype, `values.astype(float32) * scale`, before the dots.

Not yet compiled or timed on a GPU here: exported for platform "cuda" (tests/kernels/test_mla_lowering.py) and
run in the Pallas interpreter.
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
from pallas_kernels.gpu.paged_attention import default_num_splits
from pallas_kernels.merge import finalize, merge_and_finalize

_META = 5  # tile metadata columns: table row, first query row, rows, first position, kv length
# Float32 accumulator elements (rows x padded R) a program keeps in registers: 64 per thread at 8 warps.
_MAX_ACC_ELEMENTS = 128 * 128
_MAX_ROWS = 128


def default_block_h(num_heads: int, rank: int, block_q: int = 1) -> int:
    """Heads per program (a power of two): all of them while the float32 accumulator `[block_q * heads,
    next_pow2(R)]` stays within _MAX_ACC_ELEMENTS (32 heads at R = 512 for decode), and enough for
    block_q * heads >= tiles.MIN_DOT_DIM rows (tl.dot; padding heads are masked)."""
    rows = max(tiles.MIN_DOT_DIM, min(_MAX_ROWS, _MAX_ACC_ELEMENTS // tiles.padded_head_dim(rank)))
    heads = min(tiles.next_pow2(num_heads), max(1, rows // block_q))
    return int(max(heads, tiles.next_pow2(tiles.cdiv(tiles.MIN_DOT_DIM, block_q))))


def default_num_warps(rows: int, rank: int) -> int:
    """4 warps, or 8 for accumulators of 128 x 128 float32 elements and more."""
    return 8 if rows * tiles.padded_head_dim(rank) >= _MAX_ACC_ELEMENTS else 4


def _gather_latent_tile(table_ref, kv_ref, scales_ref, *, seq, first_page, page_end, token_end,
                        pages_per_iter: int, block_size: int, rank: int, rope_dim: int, dtype):
    """One tile of `pages_per_iter` pages through the block table: (c `[tile, next_pow2(R)]`, k_rope
    `[tile, next_pow2(Dr)]` in `dtype`, valid `[tile]`, pos `[tile]`). Slots past token_end, padded block slots
    and padded columns are never read (masked loads: zeros), so a NaN there cannot leak in."""
    block_pad = tiles.next_pow2(block_size)
    t = jnp.arange(pages_per_iter * block_pad, dtype=jnp.int32)
    page = first_page + t // block_pad  # logical page of each tile row
    offset = t % block_pad
    page_ok = page < page_end
    pos = page * block_size + offset
    valid = page_ok & (pos < token_end)
    if block_pad != block_size:  # static: only padded blocks need the slot test
        valid = valid & (offset < block_size)
    physical = plgpu.load(table_ref.at[seq, page], mask=page_ok, other=0)
    # A float fill for float pages: Triton casts the fill to the page dtype, and has no int -> fp8 cast.
    fill = 0.0 if jnp.issubdtype(kv_ref.dtype, jnp.floating) else 0
    parts = []
    for start, width in ((0, rank), (rank, rope_dim)):  # static: the latent slice, then the rope slice
        d = jnp.arange(tiles.padded_head_dim(width), dtype=jnp.int32)
        mask = valid[:, None] & (d < width)[None, :]
        parts.append(plgpu.load(kv_ref.at[physical[:, None], offset[:, None], start + d[None, :]], mask=mask,
                                other=fill))
    c, k_rope = parts
    if scales_ref is not None:
        scales = plgpu.load(scales_ref.at[physical, offset], mask=valid, other=0).astype(jnp.float32)[:, None]
        c = c.astype(jnp.float32) * scales
        k_rope = k_rope.astype(jnp.float32) * scales
    return c.astype(dtype), k_rope.astype(dtype), valid, pos


def _mla_kernel(meta_ref, table_ref, ql_ref, qr_ref, kv_ref, *refs, scale: float, num_heads: int, block_h: int,
                block_q: int, rank: int, rope_dim: int, block_size: int, pages_per_iter: int, num_splits: int,
                quantized: bool):
    """meta_ref [num_tiles, 5]; table_ref [num_seqs, max_blocks_per_seq]; ql_ref [tokens, num_heads, R];
    qr_ref [tokens, num_heads, Dr]; kv_ref [num_blocks, block_size, R + Dr]; with 8-bit pages refs starts with
    scales [num_blocks, block_size]. Outputs: o [tokens, num_heads, R] (one split) or m, z [num_splits, tokens,
    num_heads] and u [num_splits, tokens, num_heads, R] float32."""
    scales_ref, out_refs = (refs[0], refs[1:]) if quantized else (None, refs)
    tile, head_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = meta_ref[tile, 0]
    row0 = meta_ref[tile, 1]
    num_rows = meta_ref[tile, 2]
    pos0 = meta_ref[tile, 3]
    kv_len = meta_ref[tile, 4]

    rows = block_q * block_h
    r = jnp.arange(rows, dtype=jnp.int32)
    token = r // block_h  # query token of each row within the tile
    head = head_block * block_h + r % block_h
    row_ok = (token < num_rows) & (head < num_heads)
    q_pos = pos0 + token
    dl = jnp.arange(tiles.padded_head_dim(rank), dtype=jnp.int32)
    dr = jnp.arange(tiles.padded_head_dim(rope_dim), dtype=jnp.int32)
    io_mask = row_ok[:, None] & (dl < rank)[None, :]
    io_idx = ((row0 + token)[:, None], head[:, None], dl[None, :])
    q_latent = plgpu.load(ql_ref.at[io_idx], mask=io_mask, other=0)
    q_rope = plgpu.load(qr_ref.at[(row0 + token)[:, None], head[:, None], dr[None, :]],
                        mask=row_ok[:, None] & (dr < rope_dim)[None, :], other=0)

    # Keys any row of this tile may see: positions [0, kv_end). This split's page range is sized from them and
    # rounded to whole tiles.
    kv_end = jnp.where(num_rows > 0, jnp.clip(pos0 + num_rows, 0, kv_len), 0)
    num_pages = tiles.cdiv(kv_end, block_size)
    pages_per_split = tiles.cdiv(tiles.cdiv(num_pages, num_splits), pages_per_iter) * pages_per_iter
    page_lo = split * pages_per_split
    page_hi = jnp.minimum(page_lo + pages_per_split, num_pages)
    num_iters = tiles.cdiv(jnp.maximum(page_hi - page_lo, 0), pages_per_iter)
    precision = tiles.dot_precision(q_latent.dtype)

    def body(i, carry):
        c, k_rope, valid, kv_pos = _gather_latent_tile(
            table_ref, kv_ref, scales_ref, seq=seq, first_page=page_lo + i * pages_per_iter, page_end=page_hi,
            token_end=kv_end, pages_per_iter=pages_per_iter, block_size=block_size, rank=rank,
            rope_dim=rope_dim, dtype=q_latent.dtype)
        s = (plgpu.dot(q_latent, c, trans_b=True, precision=precision)
             + plgpu.dot(q_rope, k_rope, trans_b=True, precision=precision)) * scale
        mask = valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        return C.online_softmax_update(s, c, mask, carry)

    m, z, u = lax.fori_loop(0, num_iters, body, C.init_carry(rows, dl.shape[0]))
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[io_idx], finalize(z, u, o_ref.dtype), mask=io_mask)
    else:
        m_ref, z_ref, u_ref = out_refs
        stat_idx = (split, row0 + token, head)
        plgpu.store(m_ref.at[stat_idx], m, mask=row_ok)
        plgpu.store(z_ref.at[stat_idx], z, mask=row_ok)
        plgpu.store(u_ref.at[(split, *io_idx)], u, mask=io_mask)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "block_q", "pages_per_iter",
                                             "num_splits", "num_warps", "num_stages"))
def _mla_call(meta, q_latent, q_rope, kv_pages, block_tables, kv_scales, *, scale: float, interpret: bool,
              block_h: int, block_q: int, pages_per_iter: int, num_splits: int, num_warps: int, num_stages: int):
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    kernel = functools.partial(
        _mla_kernel, scale=scale, num_heads=num_heads, block_h=block_h, block_q=block_q, rank=rank,
        rope_dim=rope_dim, block_size=kv_pages.shape[1], pages_per_iter=pages_per_iter, num_splits=num_splits,
        quantized=kv_scales is not None)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype)
    else:
        stats = jax.ShapeDtypeStruct((num_splits, num_tokens, num_heads), jnp.float32)
        out_shape = (stats, stats, jax.ShapeDtypeStruct((num_splits, *q_latent.shape), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(meta.shape[0], tiles.cdiv(num_heads, block_h), num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"mla_paged_attention_q{block_q}_h{block_h}_s{num_splits}_p{pages_per_iter}"
             + tiles.variant_suffix(None, None, kv_pages.dtype),
    )(meta, block_tables, q_latent, q_rope, kv_pages, *(() if kv_scales is None else (kv_scales,)))
    if num_splits == 1:
        return out
    m, z, u = out
    return merge_and_finalize(m, z, u, axis=0, dtype=q_latent.dtype)


def _check_tiles(block_h: int | None, block_q: int, pages_per_iter: int | None, block_size: int) -> None:
    V.check_pow2_option("block_h", block_h)
    if block_h is not None and block_q * block_h < tiles.MIN_DOT_DIM:
        raise ValueError(f"block_q * block_h must be >= {tiles.MIN_DOT_DIM} (tl.dot), got block_q={block_q}, "
                         f"block_h={block_h}")
    C.check_pages_per_iter(pages_per_iter, block_size)


def _run(meta, q_latent, q_rope, kv_pages, block_tables, kv_scales, *, scale, interpret, block_h, block_q,
         pages_per_iter, num_splits, num_warps, num_stages):
    rank = q_latent.shape[-1]
    if pages_per_iter is None:  # tiles are sized by the latent slice, the wide one
        pages_per_iter = C.default_pages_per_iter(kv_pages.shape[1], block_tables.shape[1], rank, q_latent.dtype)
    if num_splits is None:
        num_splits = default_num_splits(meta.shape[0], tiles.cdiv(q_latent.shape[1], block_h),
                                        block_tables.shape[1], pages_per_iter)
    if num_warps is None:
        num_warps = default_num_warps(block_q * block_h, rank)
    return _mla_call(meta, q_latent, q_rope, kv_pages, block_tables, kv_scales, scale=scale,
                     interpret=C.resolve_interpret(interpret), block_h=int(block_h), block_q=int(block_q),
                     pages_per_iter=int(pages_per_iter), num_splits=int(num_splits), num_warps=int(num_warps),
                     num_stages=int(num_stages))


def _empty(q_latent, kv_pages, block_tables) -> bool:
    return 0 in (q_latent.shape[0], block_tables.shape[0], block_tables.shape[1], kv_pages.shape[0])


def mla_paged_attention_gpu(q_latent, q_rope, kv_pages, block_tables, lengths, *, scale: float,
                            interpret: bool | None, block_h: int | None, pages_per_iter: int | None,
                            num_splits: int | None, num_warps: int | None, num_stages: int,
                            kv_scales: jax.Array | None = None) -> jax.Array:
    """The GPU MLA decode kernel behind `pallas_kernels.mla_paged_attention(..., target="gpu")`, which has
    already validated shapes, dtypes, scale and the tuning ints. Checks the GPU tile rules, fills in the defaults
    (`default_block_h`, `gpu._common.default_pages_per_iter`, `default_num_splits` over head blocks,
    `default_num_warps`) and runs the kernel on one-token tiles."""
    _check_tiles(block_h, 1, pages_per_iter, kv_pages.shape[1])
    if _empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    meta = tiles.decode_metadata(lengths, block_tables.shape[1] * kv_pages.shape[1])
    return _run(meta, q_latent, q_rope, kv_pages, block_tables, kv_scales, scale=scale, interpret=interpret,
                block_h=block_h or default_block_h(q_latent.shape[1], q_latent.shape[2]), block_q=1,
                pages_per_iter=pages_per_iter, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def ragged_mla_paged_attention_gpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, *, scale: float,
                                   interpret: bool | None, block_q: int | None, block_h: int | None,
                                   pages_per_iter: int | None, num_warps: int | None, num_stages: int,
                                   kv_scales: jax.Array | None = None) -> jax.Array:
    """The GPU ragged MLA kernel behind `pallas_kernels.ragged_mla_paged_attention(..., target="gpu")`, which
    has already validated shapes, dtypes, scale and the tuning ints. Checks the GPU tile rules, fills in the
    defaults (`default_block_h`, then `tiles.default_block_q` with block_h heads per token: rows = block_q *
    block_h within the same accumulator bound) and runs the kernel, one split per tile."""
    num_tokens, num_heads, rank = q_latent.shape
    V.check_pow2_option("block_q", block_q)
    _check_tiles(block_h, block_q or 1, pages_per_iter, kv_pages.shape[1])
    if _empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    if block_h is None:
        block_h = default_block_h(num_heads, rank, block_q or 1)
    if block_q is None:
        block_q = tiles.default_block_q(num_tokens, block_tables.shape[0], block_h, rank)
    meta = tiles.tile_metadata(kv_lens, cu_q_lens, num_tokens, block_q, block_tables.shape[1] * kv_pages.shape[1])
    return _run(meta, q_latent, q_rope, kv_pages, block_tables, kv_scales, scale=scale, interpret=interpret,
                block_h=block_h, block_q=block_q, pages_per_iter=pages_per_iter, num_splits=1, num_warps=num_warps,
                num_stages=num_stages)
