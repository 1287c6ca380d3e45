"""DeepSeek sparse attention (DSA, V3.2) on NVIDIA GPUs in Pallas compiled through Triton: the lightning indexer's
scores over paged indexer keys (`ragged_indexer_scores_gpu`, decode through one-token tiles) and MLA attention
over each query row's selected positions (`sparse_mla_attention_gpu`).

Indexer. The cache holds one key per token, `index_pages [num_blocks, block_size, D]` (D = index_head_dim, in the
latent pages' blocks: same block table), shared by all indexer heads. Query row i scores position t as
    s[t] = scale * sum_h w[i, h] * relu(q_I[i, h] . k_I[t]),
causal (t <= its position, t < kv_len), -inf elsewhere. Grid (tile, chunk): a tile is `block_q` consecutive
query tokens of one sequence (`tiles.tile_metadata`), a chunk `pages_per_iter` consecutive logical pages; program
(t, c) loads its tile's queries as `block_q * next_pow2(H)` rows (row r = token r // H', head r % H'), gathers the
chunk's keys through the block table (pages past the tile's last visible position are never loaded, their table
entries never read: masked loads), and computes relu(Q K^T) `[rows, tile]` in one dot. The per-head weighted sum
is a second dot, Sel @ relu(Q K^T) with Sel[m, r] = scale * w[r] where row r belongs to token m (float32 at full
precision): no reshape inside the kernel, one pass over the keys for every head and token of the tile. Every
program writes its `[block_q, tile]` block of the float32 score rows, -inf where invisible, so the output
`[tokens, max_blocks_per_seq * block_size]` is fully written (a chunk wholly past the tile's context reads nothing
but still runs its dots on zeros: the output is O(max_context) per row anyway).

Sparse MLA. The wrapper turns each row's selected positions into physical slots through the block table
(`tiles.selected_slots`: position p -> block_tables[s, p // block_size] * block_size + p % block_size, -1 for
none or a position the row does not see). Grid (row, head block): program (i, b) holds `block_h` heads of row i
and walks its `top_k` slots `block_k` at a time: each step loads the selected page rows as two masked power-of-two
slices (latent [0, R), rope [R, R + Dr), as `gpu.mla`), scores them with two dots and keeps the exact float32
online softmax (max, weight sum, value sum) of `_common`. Slots -1 are never loaded; a row selecting nothing
gives zeros. Cost O(top_k) per row, whatever the context. With several splits (a third grid dimension, the default
when rows x head blocks are too few to fill the GPU, as in decode) each split takes its share of the steps and
writes its partial (m, z, u), merged exactly by `merge.merge_and_finalize`.

8-bit keys or latent pages (int8 / float8_e4m3fn, one float scale per token) are loaded as 8-bit and dequantized
in registers into q's dtype. Exported for platform "cuda" (tests/kernels/test_sparse_lowering.py) and run in the
Pallas interpreter; not yet compiled or timed on a GPU here.
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
from pallas_kernels.gpu.mla import default_block_h, default_num_warps
from pallas_kernels.gpu.paged_attention import default_num_splits
from pallas_kernels.merge import finalize, merge_and_finalize

DEFAULT_BLOCK_K = 64  # selected positions per step of the sparse kernel


def _fill(ref) -> float | int:
    # A float fill for float pages: Triton casts the fill to the page dtype, and has no int -> fp8 cast.
    return 0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0


def index_heads_padded(num_heads: int, block_q: int) -> int:
    """Rows per query token in the indexer kernel: next_pow2(index_n_heads), raised so that block_q tokens make at
    least tiles.MIN_DOT_DIM rows (tl.dot; padding heads have weight 0)."""
    return max(tiles.next_pow2(num_heads), tiles.next_pow2(tiles.cdiv(tiles.MIN_DOT_DIM, block_q)))


def _indexer_kernel(meta_ref, table_ref, q_ref, w_ref, k_ref, *refs, scale: float, num_heads: int, head_dim: int,
                    heads_pad: int, block_q: int, block_size: int, pages_per_iter: int, max_context: int,
                    quantized: bool):
    """meta_ref [num_tiles, 5]; table_ref [num_seqs, max_blocks]; q_ref [tokens, H, D]; w_ref f32[tokens, H];
    k_ref [num_blocks, block_size, D]; with 8-bit keys refs starts with scales [num_blocks, block_size]. Output
    o_ref f32[tokens, max_context]."""
    scales_ref, (o_ref,) = (refs[0], refs[1:]) if quantized else (None, refs)
    tile, chunk = pl.program_id(0), pl.program_id(1)
    seq = meta_ref[tile, 0]
    row0 = meta_ref[tile, 1]
    num_rows = meta_ref[tile, 2]
    pos0 = meta_ref[tile, 3]
    kv_len = meta_ref[tile, 4]

    rows = block_q * heads_pad
    r = jnp.arange(rows, dtype=jnp.int32)
    token = r // heads_pad
    head = r % heads_pad
    row_ok = (token < num_rows) & (head < num_heads)
    d = jnp.arange(tiles.padded_head_dim(head_dim), dtype=jnp.int32)
    q = plgpu.load(q_ref.at[(row0 + token)[:, None], head[:, None], d[None, :]],
                   mask=row_ok[:, None] & (d < head_dim)[None, :], other=0)
    w = plgpu.load(w_ref.at[row0 + token, head], mask=row_ok, other=0.0)

    # The keys any row of this tile sees: positions [0, kv_end).
    kv_end = jnp.where(num_rows > 0, jnp.clip(pos0 + num_rows, 0, kv_len), 0)
    block_pad = tiles.next_pow2(block_size)
    t = jnp.arange(pages_per_iter * block_pad, dtype=jnp.int32)
    page = chunk * pages_per_iter + t // block_pad
    offset = t % block_pad
    pos = page * block_size + offset
    in_table = pos < max_context
    if block_pad != block_size:  # static: only padded blocks need the slot test
        in_table = in_table & (offset < block_size)
    valid = in_table & (pos < kv_end)
    page_ok = page < tiles.cdiv(kv_end, block_size)
    physical = plgpu.load(table_ref.at[seq, page], mask=page_ok, other=0)
    k = plgpu.load(k_ref.at[physical[:, None], offset[:, None], d[None, :]],
                   mask=valid[:, None] & (d < head_dim)[None, :], other=_fill(k_ref))
    if scales_ref is not None:
        k_scales = plgpu.load(scales_ref.at[physical, offset], mask=valid, other=0).astype(jnp.float32)
        k = (k.astype(jnp.float32) * k_scales[:, None]).astype(q.dtype)

    s = jnp.maximum(plgpu.dot(q, k, trans_b=True, precision=tiles.dot_precision(q.dtype)), 0.0)  # [rows, tile]
    out_rows = max(tiles.MIN_DOT_DIM, block_q)
    m = jnp.arange(out_rows, dtype=jnp.int32)
    select = jnp.where(token[None, :] == m[:, None], (w * scale)[None, :], 0.0)  # [out_rows, rows] float32
    scores = plgpu.dot(select, s, precision=lax.Precision.HIGHEST)  # [out_rows, tile]
    visible = valid[None, :] & (pos[None, :] <= (pos0 + m)[:, None])
    plgpu.store(o_ref.at[(row0 + m)[:, None], pos[None, :]], jnp.where(visible, scores, tiles.NEG_INF),
                mask=(m < num_rows)[:, None] & in_table[None, :])


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "pages_per_iter", "num_warps",
                                             "num_stages"))
def _indexer_call(meta, q_index, weights, index_pages, block_tables, index_scales, *, scale: float, interpret: bool,
                  block_q: int, pages_per_iter: int, num_warps: int, num_stages: int):
    num_tokens, num_heads, head_dim = q_index.shape
    block_size = index_pages.shape[1]
    max_blocks = block_tables.shape[1]
    heads_pad = index_heads_padded(num_heads, block_q)
    kernel = functools.partial(
        _indexer_kernel, scale=scale, num_heads=num_heads, head_dim=head_dim, heads_pad=heads_pad, block_q=block_q,
        block_size=block_size, pages_per_iter=pages_per_iter, max_context=max_blocks * block_size,
        quantized=index_scales is not None)
    return pl.pallas_call(
        kernel,
        grid=(meta.shape[0], tiles.cdiv(max_blocks, pages_per_iter)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, max_blocks * block_size), jnp.float32),
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"indexer_scores_q{block_q}_h{heads_pad}_p{pages_per_iter}"
             + tiles.variant_suffix(None, None, index_pages.dtype),
    )(meta, block_tables, q_index, weights, index_pages, *(() if index_scales is None else (index_scales,)))


def ragged_indexer_scores_gpu(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, *, scale: float,
                              interpret: bool | None, block_q: int | None, pages_per_iter: int | None,
                              num_warps: int | None, num_stages: int,
                              index_scales: jax.Array | None = None) -> jax.Array:
    """The GPU indexer kernel behind `pallas_kernels.ragged_indexer_scores(..., target="gpu")` (and, with
    `cu_q_lens=None`, `indexer_scores`: one-token tiles), which has already validated shapes, dtypes, scale and
    the tuning ints. Checks the GPU tile rules, fills in the defaults (`block_q` from the mean query length with
    block_q * next_pow2(H) rows within 128, `gpu._common.default_pages_per_iter` over index_head_dim, 4 warps)
    and runs the kernel."""
    num_tokens, num_heads, head_dim = q_index.shape
    block_size = index_pages.shape[1]
    V.check_pow2_option("block_q", block_q)
    C.check_pages_per_iter(pages_per_iter, block_size)
    max_context = block_tables.shape[1] * block_size
    if 0 in (num_tokens, block_tables.shape[0], block_tables.shape[1], index_pages.shape[0]):
        return jnp.full((num_tokens, max_context), tiles.NEG_INF, jnp.float32)
    if cu_q_lens is None:
        block_q = 1
        meta = tiles.decode_metadata(kv_lens, max_context)
    else:
        if block_q is None:
            block_q = tiles.default_block_q(num_tokens, block_tables.shape[0], tiles.next_pow2(num_heads), head_dim)
        meta = tiles.tile_metadata(kv_lens, cu_q_lens, num_tokens, block_q, max_context)
    if pages_per_iter is None:
        pages_per_iter = C.default_pages_per_iter(block_size, block_tables.shape[1], head_dim, q_index.dtype)
    return _indexer_call(meta, q_index, weights, index_pages, block_tables, index_scales, scale=scale,
                         interpret=C.resolve_interpret(interpret), block_q=int(block_q),
                         pages_per_iter=int(pages_per_iter), num_warps=int(num_warps or 4),
                         num_stages=int(num_stages))


def _sparse_kernel(slots_ref, ql_ref, qr_ref, kv_ref, *refs, scale: float, num_heads: int, block_h: int,
                   block_k: int, top_k: int, rank: int, rope_dim: int, block_size: int, num_splits: int,
                   steps_per_split: int, quantized: bool):
    """slots_ref i32[rows, top_k] (physical slots, -1 = none); ql_ref [rows, H, R]; qr_ref [rows, H, Dr]; kv_ref
    [num_blocks, block_size, R + Dr]; with 8-bit pages refs starts with scales [num_blocks, block_size]. Outputs:
    o [rows, H, R] (one split) or m, z [num_splits, rows, H] and u [num_splits, rows, H, R] float32."""
    scales_ref, out_refs = (refs[0], refs[1:]) if quantized else (None, refs)
    row, head_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head = head_block * block_h + jnp.arange(block_h, dtype=jnp.int32)
    head_ok = head < num_heads
    dl = jnp.arange(tiles.padded_head_dim(rank), dtype=jnp.int32)
    dr = jnp.arange(tiles.padded_head_dim(rope_dim), dtype=jnp.int32)
    io_idx = (row, head[:, None], dl[None, :])
    io_mask = head_ok[:, None] & (dl < rank)[None, :]
    q_latent = plgpu.load(ql_ref.at[io_idx], mask=io_mask, other=0)
    q_rope = plgpu.load(qr_ref.at[row, head[:, None], dr[None, :]],
                        mask=head_ok[:, None] & (dr < rope_dim)[None, :], other=0)
    precision = tiles.dot_precision(q_latent.dtype)

    # This split's steps of block_k slots: [first_step, first_step + num_steps).
    first_step = split * steps_per_split
    num_steps = jnp.clip(tiles.cdiv(top_k, block_k) - first_step, 0, steps_per_split)

    def body(i, carry):
        j = (first_step + i) * block_k + jnp.arange(block_k, dtype=jnp.int32)
        slot = plgpu.load(slots_ref.at[row, j], mask=j < top_k, other=-1)
        valid = slot >= 0
        safe = jnp.where(valid, slot, 0)
        block, offset = lax.div(safe, block_size), lax.rem(safe, block_size)
        parts = []
        for start, width, d in ((0, rank, dl), (rank, rope_dim, dr)):  # static: the latent, then the rope slice
            parts.append(plgpu.load(kv_ref.at[block[:, None], offset[:, None], start + d[None, :]],
                                    mask=valid[:, None] & (d < width)[None, :], other=_fill(kv_ref)))
        c, k_rope = parts
        if scales_ref is not None:
            scales = plgpu.load(scales_ref.at[block, offset], mask=valid, other=0).astype(jnp.float32)[:, None]
            c, k_rope = c.astype(jnp.float32) * scales, k_rope.astype(jnp.float32) * scales
        c, k_rope = c.astype(q_latent.dtype), k_rope.astype(q_latent.dtype)
        s = (plgpu.dot(q_latent, c, trans_b=True, precision=precision)
             + plgpu.dot(q_rope, k_rope, trans_b=True, precision=precision)) * scale
        return C.online_softmax_update(s, c, valid[None, :], carry)

    m, z, u = lax.fori_loop(0, num_steps, body, C.init_carry(block_h, dl.shape[0]))
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[io_idx], finalize(z, u, o_ref.dtype), mask=io_mask)
    else:
        m_ref, z_ref, u_ref = out_refs
        plgpu.store(m_ref.at[split, row, head], m, mask=head_ok)
        plgpu.store(z_ref.at[split, row, head], z, mask=head_ok)
        plgpu.store(u_ref.at[(split, *io_idx)], u, mask=io_mask)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "block_k", "num_splits", "num_warps",
                                             "num_stages"))
def _sparse_call(slots, q_latent, q_rope, kv_pages, kv_scales, *, scale: float, interpret: bool, block_h: int,
                 block_k: int, num_splits: int, num_warps: int, num_stages: int):
    num_rows, num_heads, rank = q_latent.shape
    kernel = functools.partial(
        _sparse_kernel, scale=scale, num_heads=num_heads, block_h=block_h, block_k=block_k, top_k=slots.shape[1],
        rank=rank, rope_dim=q_rope.shape[-1], block_size=kv_pages.shape[1], num_splits=num_splits,
        steps_per_split=tiles.cdiv(tiles.cdiv(slots.shape[1], block_k), num_splits),
        quantized=kv_scales is not None)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype)
    else:
        stats = jax.ShapeDtypeStruct((num_splits, num_rows, num_heads), jnp.float32)
        out_shape = (stats, stats, jax.ShapeDtypeStruct((num_splits, *q_latent.shape), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(num_rows, tiles.cdiv(num_heads, block_h), num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"sparse_mla_attention_h{block_h}_k{block_k}_s{num_splits}"
             + tiles.variant_suffix(None, None, kv_pages.dtype),
    )(slots, q_latent, q_rope, kv_pages, *(() if kv_scales is None else (kv_scales,)))
    if num_splits == 1:
        return out
    m, z, u = out
    return merge_and_finalize(m, z, u, axis=0, dtype=q_latent.dtype)


def sparse_mla_attention_gpu(q_latent, q_rope, kv_pages, slots, *, scale: float, interpret: bool | None,
                             block_h: int | None, block_k: int | None, num_splits: int | None,
                             num_warps: int | None, num_stages: int,
                             kv_scales: jax.Array | None = None) -> jax.Array:
    """The GPU sparse MLA kernel behind `pallas_kernels.sparse_mla_paged_attention` /
    `ragged_sparse_mla_paged_attention` (target "gpu"), which have validated the arguments and turned the selected
    positions into physical `slots` i32[rows, top_k] (`tiles.selected_slots`). Checks the GPU tile rules
    (block_h and block_k powers of two >= 16: tl.dot), fills in the defaults (`gpu.mla.default_block_h`,
    DEFAULT_BLOCK_K, `default_num_splits` over rows x head blocks and the top_k / block_k steps,
    `gpu.mla.default_num_warps`) and runs the kernel."""
    C.check_dot_tiles(block_h=block_h, block_k=block_k)
    if 0 in (q_latent.shape[0], kv_pages.shape[0]):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    num_heads, rank = q_latent.shape[1], q_latent.shape[2]
    block_h = block_h or default_block_h(num_heads, rank)
    block_k = block_k or DEFAULT_BLOCK_K
    steps = tiles.cdiv(slots.shape[1], block_k)
    if num_splits is None:
        num_splits = default_num_splits(q_latent.shape[0], tiles.cdiv(num_heads, block_h), steps, 1)
    return _sparse_call(slots, q_latent, q_rope, kv_pages, kv_scales, scale=scale,
                        interpret=C.resolve_interpret(interpret), block_h=int(block_h), block_k=int(block_k),
                        num_splits=int(min(num_splits, steps)),
                        num_warps=int(num_warps or default_num_warps(block_h, rank)), num_stages=int(num_stages))
