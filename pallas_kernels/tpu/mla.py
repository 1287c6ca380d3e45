"""Multi-head latent attention (MLA, DeepSeek V2/V3) over a paged latent cache on TPU (Pallas Mosaic): decode
(`mla_paged_attention_tpu`) and ragged prefill/decode (`ragged_mla_paged_attention_tpu`), one kernel.

The cache holds per token one row `[c_kv (R) | k_rope (Dr)]` of `kv_pages [num_blocks, block_size, R + Dr]`,
shared by every query head. The score of head h against token t, scale * (q_latent[h] . c_kv[t] + q_rope[h] .
k_rope[t]), is one dot of `[q_latent | q_rope][h]` with the whole page row, so the wrapper concatenates the
query parts and the kernel never slices a page: a chunk of pages is the key matrix and the value matrix at
once (one DMA per page, not a K and a V copy), and the value product runs over all R + Dr columns; the wrapper
keeps the first R (the latent output). On the matrix unit that costs Dr / R more work (12.5% at 512 / 64),
and it keeps R + Dr (576) free of any lane-alignment rule: VMEM rows are whole 128-lane tiles anyway.

Tiles as in the ragged GQA kernel (`tiles.tile_metadata`; decode is tiles of one query token,
`tiles.decode_metadata`): the wrapper gathers each tile's `block_q` tokens times `block_h` heads into a
tile-aligned `[rows, R + Dr]` block (row r = head r // block_q, token r % block_q; zero rows up to a whole
native tile) and scatters the results back; q-sized copies, the cache is never copied. Grid (tile, head block,
split), all parallel. Program (t, b, p) reads its tile's metadata and its sequence's block-table row from SMEM
(scalar prefetch), copies its split's share of the pages the tile can see HBM -> VMEM itself
(`PageChunks`, double-buffered; pages past the last visible position are never copied), and keeps an exact
float32 online softmax, causal inside the tile. With several splits each writes its partial (m, z, u), merged
exactly by `merge.merge_and_finalize`; one split is the default (a TPU core runs the grid sequentially).

All heads share each page, so by default one program holds all of a tile's heads (`block_h` = num_heads) and
every page is copied once per tile: the whole point of MLA's layout. 8-bit pages are not supported on TPU
(as for the GQA kernels: the per-token scales would need a relayout per chunk and 32-row 8-bit VMEM tiles);
the entry points raise a ValueError. Exported for platform "tpu" and run in Pallas's TPU interpret mode;
not yet compiled or timed on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _validate as V
from pallas_kernels import tiles
from pallas_kernels.merge import merge_and_finalize
from pallas_kernels.quant import is_quantized
from pallas_kernels.tpu import _common as T
from pallas_kernels.tpu.page_chunks import PageChunks

# Default query rows (block_q x block_h) per program: the float32 accumulator [rows, R + Dr] stays within about
# 640 KiB of VMEM at R + Dr = 576 (a whole 640-lane row each), with the score matrix of a chunk beside it.
MAX_DEFAULT_ROWS = 256


def _mla_kernel(meta_ref, tables_ref, q_ref, kv_hbm, *refs, scale: float, block_q: int, num_splits: int,
                max_blocks_per_seq: int):
    """meta_ref i32[num_tiles * 5] and tables_ref i32[num_seqs * max_blocks_per_seq] (SMEM); q_ref [rows, R + Dr]
    (VMEM block: [q_latent | q_rope] of block_h heads x block_q tokens); kv_hbm [num_blocks, block_size, R + Dr]
    (HBM). Outputs (VMEM blocks): o [rows, R + Dr] (one split) or m, z [rows, 1] and u [rows, R + Dr] float32.
    Scratch: kv_buf [2, pages_per_iter * block_size, R + Dr], sems DMA [1, 2]."""
    *out_refs, kv_buf, sems = refs
    tile, split = pl.program_id(0), pl.program_id(2)
    block_size = kv_hbm.shape[1]
    tokens = kv_buf.shape[1]  # per chunk
    pages_per_iter = tokens // block_size
    seq = meta_ref[tile * T.META]
    num_rows = meta_ref[tile * T.META + 2]
    pos0 = meta_ref[tile * T.META + 3]
    kv_len = meta_ref[tile * T.META + 4]

    # Keys any row of this tile may see: positions [0, kv_end); this split's page range is sized from them and
    # rounded to whole chunks.
    kv_end = jnp.where(num_rows > 0, jnp.clip(pos0 + num_rows, 0, kv_len), 0)
    num_pages = T.cdiv(kv_end, block_size)
    pages_per_split = T.cdiv(T.cdiv(num_pages, num_splits), pages_per_iter) * pages_per_iter
    page_lo = split * pages_per_split
    page_hi = jnp.minimum(page_lo + pages_per_split, num_pages)
    num_chunks = T.cdiv(jnp.maximum(page_hi - page_lo, 0), pages_per_iter)
    token_end = jnp.minimum(kv_end, page_hi * block_size)  # tokens past it are not this split's

    q = q_ref[...]
    rows, width = q.shape
    # block_q is a power of two: the token of row r is r & (block_q - 1), no vector division.
    q_pos = pos0 + (lax.broadcasted_iota(jnp.int32, (rows, tokens), 0) & (block_q - 1))

    def step(kv, first_pos, carry):
        key_pos = first_pos + lax.broadcasted_iota(jnp.int32, (rows, tokens), 1)
        value_pos = first_pos + lax.broadcasted_iota(jnp.int32, (tokens, width), 0)
        score_ok = (key_pos < token_end) & (key_pos <= q_pos)
        # The chunk is the keys and the values: stale or past-the-length rows are zeroed before P @ V.
        return T.online_softmax_step(q, kv, kv, score_ok, value_pos < token_end, carry, scale=scale)

    chunks = PageChunks(tables_ref, ((kv_hbm, (), kv_buf),), sems, table_row=seq * max_blocks_per_seq,
                        first_page=page_lo, page_end=page_hi, block_size=block_size)
    m, z, u = chunks.fold(num_chunks, step, T.init_carry(rows, width))
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = T.finalize_rows(z, u, o_ref.dtype)
    else:
        m_ref, z_ref, u_ref = out_refs
        m_ref[...] = m
        z_ref[...] = z
        u_ref[...] = u


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "block_q", "pages_per_iter",
                                             "num_splits"))
def _mla_call(meta, q_latent, q_rope, kv_pages, block_tables, *, scale: float, interpret, block_h: int,
              block_q: int, pages_per_iter: int, num_splits: int):
    num_tokens, num_heads, rank = q_latent.shape
    _, block_size, width = kv_pages.shape
    num_tiles = meta.shape[0]
    head_blocks = tiles.cdiv(num_heads, block_h)
    used = block_h * block_q
    rows = T.round_up(used, T.sublane_rows(q_latent.dtype))
    tile_rows, slot_of_token = T.tile_rows(meta, num_tokens, block_q)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)
    q = jnp.pad(q, ((0, 0), (0, head_blocks * block_h - num_heads), (0, 0)))[tile_rows]  # [tiles, block_q, H', W]
    q = q.reshape(num_tiles, block_q, head_blocks, block_h, width).transpose(0, 2, 3, 1, 4)
    q = jnp.pad(q.reshape(num_tiles, head_blocks, used, width), ((0, 0), (0, 0), (0, rows - used), (0, 0)))

    def block(last: int):  # one program's [rows, last] block of a [tiles, head_blocks, rows, last] array
        return pl.BlockSpec((None, None, rows, last), lambda t, b, p, *_: (t, b, 0, 0))

    def split_block(last: int):
        return pl.BlockSpec((None, None, None, rows, last), lambda t, b, p, *_: (p, t, b, 0, 0))

    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = block(width)
    else:
        stats = jax.ShapeDtypeStruct((num_splits, num_tiles, head_blocks, rows, 1), jnp.float32)
        out_shape = (stats, stats, jax.ShapeDtypeStruct((num_splits, *q.shape), jnp.float32))
        out_specs = (split_block(1), split_block(1), split_block(width))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_tiles, head_blocks, num_splits),
        in_specs=[block(width), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((2, pages_per_iter * block_size, width), kv_pages.dtype),
                        pltpu.SemaphoreType.DMA((1, 2))],
    )
    kernel = functools.partial(_mla_kernel, scale=scale, block_q=block_q, num_splits=num_splits,
                               max_blocks_per_seq=block_tables.shape[1])
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=T.compiler_params(3),
        name=f"mla_paged_attention_tpu_q{block_q}_h{block_h}_s{num_splits}_p{pages_per_iter}",
    )(meta.reshape(-1), block_tables.reshape(-1), q, kv_pages)

    def untile(x):  # [..., tiles, head_blocks, rows, last] -> [..., num_tokens, num_heads, last]
        lead, last = x.shape[:-4], x.shape[-1]
        x = x[..., :used, :].reshape(*lead, num_tiles, head_blocks, block_h, block_q, last)
        x = jnp.moveaxis(x, -2, -4).reshape(*lead, num_tiles * block_q, head_blocks * block_h, last)
        return x[..., slot_of_token, :num_heads, :]

    if num_splits == 1:
        return untile(out)[..., :rank]
    m, z, u = out
    return merge_and_finalize(untile(m)[..., 0], untile(z)[..., 0], untile(u)[..., :rank], axis=0,
                              dtype=q_latent.dtype)


def _check(q_latent, kv_pages, block_h, pages_per_iter) -> None:
    """The TPU rules: float32 / bfloat16, the block-size rule, no 8-bit pages, positive tuning ints."""
    if is_quantized(kv_pages.dtype):
        raise ValueError(f"target 'tpu' does not support 8-bit ({jnp.dtype(kv_pages.dtype).name}) MLA pages "
                         f"(kv_scales); use target 'gpu' or float32/bfloat16 pages")
    T.check_dtype(q_latent.dtype)
    T.check_block_size(kv_pages.shape[1], q_latent.dtype)
    V.check_positive_option("block_h", block_h)
    T.check_pages_per_iter(pages_per_iter)


def _empty(q_latent, kv_pages, block_tables) -> bool:
    return 0 in (q_latent.shape[0], block_tables.shape[0], block_tables.shape[1], kv_pages.shape[0])


def _run(meta, q_latent, q_rope, kv_pages, block_tables, *, scale, interpret, block_h, block_q, pages_per_iter,
         num_splits):
    if pages_per_iter is None:
        pages_per_iter = T.default_pages_per_iter(kv_pages.shape[1], block_tables.shape[1], kv_pages.shape[2],
                                                  q_latent.dtype)
    return _mla_call(meta, q_latent, q_rope, kv_pages, block_tables, scale=scale,
                     interpret=T.resolve_interpret(interpret), block_h=int(block_h), block_q=int(block_q),
                     pages_per_iter=int(pages_per_iter), num_splits=int(num_splits))


def mla_paged_attention_tpu(q_latent, q_rope, kv_pages, block_tables, lengths, *, scale: float, interpret,
                            num_splits: int | None, block_h: int | None, pages_per_iter: int | None) -> jax.Array:
    """The TPU MLA decode kernel behind `pallas_kernels.mla_paged_attention(..., target="tpu")`, which has
    already validated shapes, dtypes and scale. Checks the TPU rules, fills in the defaults (one split, all heads
    per program, `tpu._common.default_pages_per_iter` over the page width) and runs the kernel on one-token
    tiles."""
    _check(q_latent, kv_pages, block_h, pages_per_iter)
    V.check_positive_option("num_splits", num_splits)
    if _empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    meta = tiles.decode_metadata(lengths, block_tables.shape[1] * kv_pages.shape[1])
    return _run(meta, q_latent, q_rope, kv_pages, block_tables, scale=scale, interpret=interpret,
                block_h=block_h or q_latent.shape[1], block_q=1, pages_per_iter=pages_per_iter,
                num_splits=num_splits or 1)


def default_block_q(num_tokens: int, num_seqs: int, block_h: int) -> int:
    """Query tokens per tile on TPU: the mean query length rounded up to a power of two, with at most
    MAX_DEFAULT_ROWS rows (block_q x block_h) per program (and at least one token)."""
    mean = tiles.cdiv(max(1, num_tokens), max(1, num_seqs))
    cap = max(1, tiles.next_pow2(MAX_DEFAULT_ROWS // block_h + 1) // 2)  # the power of two <= rows / block_h
    return int(min(tiles.next_pow2(mean), cap))


def ragged_mla_paged_attention_tpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, *, scale: float,
                                   interpret, block_q: int | None, block_h: int | None,
                                   pages_per_iter: int | None) -> jax.Array:
    """The TPU ragged MLA kernel behind `pallas_kernels.ragged_mla_paged_attention(..., target="tpu")`, which
    has already validated shapes, dtypes and scale. Checks the TPU rules, fills in the defaults (all heads per
    program, `default_block_q`, `tpu._common.default_pages_per_iter`) and runs the kernel, one split per tile."""
    _check(q_latent, kv_pages, block_h, pages_per_iter)
    V.check_pow2_option("block_q", block_q)
    if _empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    num_tokens, num_heads, _ = q_latent.shape
    block_h = block_h or num_heads
    block_q = block_q or default_block_q(num_tokens, block_tables.shape[0], block_h)
    meta = tiles.tile_metadata(kv_lens, cu_q_lens, num_tokens, block_q, block_tables.shape[1] * kv_pages.shape[1])
    return _run(meta, q_latent, q_rope, kv_pages, block_tables, scale=scale, interpret=interpret, block_h=block_h,
                block_q=block_q, pages_per_iter=pages_per_iter, num_splits=1)
