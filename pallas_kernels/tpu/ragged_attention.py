"""Ragged paged attention on TPU (Pallas Mosaic): chunked-prefill and decode tokens of many sequences in one
call.

Tiles as on GPU (`tiles.tile_metadata`): each sequence's query rows are cut into tiles of
`block_q` tokens, the rows past cu_q_lens[-1] into tiles of an empty padding segment, every row in exactly
one tile. A TPU block must start at a multiple of its own size, and a tile starts anywhere, so the wrapper
gathers each tile's rows into a tile-aligned array (`[num_tiles, num_kv_heads, rows, head_dim]`, rows =
group x block_q head-major, zero-padded to a whole native tile) and scatters the results back: both are
q-sized (the KV cache is never copied), and the kernel's q and o blocks are plain pipelined VMEM blocks.

Grid (tile, KV head), both parallel. Program (t, h) reads its tile's (sequence, row count, first position,
kv length) from SMEM (scalar prefetch, with the block tables), then walks the sequence's pages from 0 (with a
sliding window W: from the page of its first row's position - W + 1) up to the last position any of its rows
may see, `pages_per_iter` pages per double-buffered DMA chunk
(`PageChunks`: pages past that are never copied), with a causal mask and an exact float32 online softmax.

With `attend_until` (bidirectional spans) the wrapper adds each tile's walk end (`tiles.tile_bounds`: the largest
bound of any of its rows, which may lie past its last row) as a third scalar-prefetch array, and each query row's
last visible position as a `[rows, 1]` int32 VMEM block beside q's (laid out as q's rows), which the score mask
compares against instead of the row's position. With sinks (one logit per query head, gpt-oss) each program gets
its KV head's query heads' sinks as a `[rows, 1]` float32 VMEM block laid out as q's rows and joins them into its
(m, z, u) after the walk, before the division (`merge.join_sink`).
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
from pallas_kernels.merge import join_sink
from pallas_kernels.tpu import _common as T
from pallas_kernels.tpu.page_chunks import PageChunks


def _ragged_kernel(meta_ref, tables_ref, *refs, scale: float, block_q: int, max_blocks_per_seq: int,
                   sliding_window: int | None, logits_soft_cap: float | None, attend_until: bool, sinks: bool):
    """meta_ref i32[num_tiles * 5] and tables_ref i32[num_seqs * max_blocks_per_seq] (SMEM); refs = (q_ref,
    k_hbm, v_hbm, o_ref, k_buf, v_buf, sems), with attend_until (ends_ref, q_ref, last_ref, k_hbm, ...), with sinks
    sinks_ref after q_ref (and last_ref). ends_ref i32[num_tiles] (SMEM); q_ref/o_ref [rows, head_dim], last_ref
    i32[rows, 1] and sinks_ref f32[rows, 1] (VMEM blocks; row r is query head r // block_q of the group, token
    r % block_q of the tile); k_hbm/v_hbm [num_kv_heads, num_blocks, block_size, head_dim] (HBM). Scratch:
    k_buf/v_buf [2, pages_per_iter * block_size, head_dim], sems DMA [2, 2]."""
    refs = iter(refs)
    ends_ref = next(refs) if attend_until else None
    q_ref = next(refs)
    last_ref = next(refs) if attend_until else None
    sinks_ref = next(refs) if sinks else None
    k_hbm, v_hbm, o_ref, k_buf, v_buf, sems = refs
    tile, head = pl.program_id(0), pl.program_id(1)
    block_size = k_hbm.shape[2]
    tokens = k_buf.shape[1]  # per chunk
    seq = meta_ref[tile * T.META]
    num_rows = meta_ref[tile * T.META + 2]
    pos0 = meta_ref[tile * T.META + 3]
    kv_len = meta_ref[tile * T.META + 4]
    # Keys any row of this tile may see: positions [kv_start, kv_end); with a window W the first row (at pos0)
    # sees nothing before pos0 - W + 1, so pages wholly before that are never copied. With attend_until kv_end
    # is the largest bound of the tile's rows, which may lie past its last row.
    if attend_until:
        kv_end = ends_ref[tile]
    else:
        kv_end = jnp.where(num_rows > 0, jnp.clip(pos0 + num_rows, 0, kv_len), 0)
    num_pages = T.cdiv(kv_end, block_size)
    kv_start = 0 if sliding_window is None else jnp.clip(pos0 - sliding_window + 1, 0, kv_end)
    first_page = 0 if sliding_window is None else lax.div(kv_start, block_size)
    num_chunks = T.cdiv(num_pages - first_page, tokens // block_size)

    q = q_ref[...]
    rows, head_dim = q.shape
    # block_q is a power of two: the token of row r is r & (block_q - 1), no vector division.
    q_pos = pos0 + (lax.broadcasted_iota(jnp.int32, (rows, tokens), 0) & (block_q - 1))
    q_last = last_ref[...] if attend_until else q_pos  # each row's bound ([rows, 1]), or its position

    def step(k, v, first_pos, carry):
        key_pos = first_pos + lax.broadcasted_iota(jnp.int32, (rows, tokens), 1)
        value_pos = first_pos + lax.broadcasted_iota(jnp.int32, (tokens, head_dim), 0)
        score_ok = (key_pos < kv_end) & (key_pos <= q_last)
        value_ok = value_pos < kv_end
        if sliding_window is not None:
            score_ok = score_ok & (key_pos > q_pos - sliding_window)
            value_ok = value_ok & (value_pos >= kv_start)
        return T.online_softmax_step(q, k, v, score_ok, value_ok, carry, scale=scale,
                                     logits_soft_cap=logits_soft_cap)

    chunks = PageChunks(tables_ref, ((k_hbm, (head,), k_buf), (v_hbm, (head,), v_buf)), sems,
                        table_row=seq * max_blocks_per_seq, first_page=first_page, page_end=num_pages,
                        block_size=block_size)
    m, z, u = chunks.fold(num_chunks, step, T.init_carry(rows, head_dim))
    if sinks:
        _, z, u = join_sink(m, z, u, sinks_ref[...])
    o_ref[...] = T.finalize_rows(z, u, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "pages_per_iter", "sliding_window",
                                             "logits_soft_cap"))
def _ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, attend_until, sinks, *,
                            scale: float, interpret, block_q: int, pages_per_iter: int, sliding_window: int | None,
                            logits_soft_cap: float | None):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    max_blocks_per_seq = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    meta = tiles.tile_metadata(kv_lens, cu_q_lens, num_tokens, block_q, max_blocks_per_seq * block_size)
    num_tiles = meta.shape[0]
    used = group * block_q
    rows = T.round_up(used, T.sublane_rows(q.dtype))
    tile_rows, slot_of_token = T.tile_rows(meta, num_tokens, block_q)
    q_tiles = q[tile_rows].reshape(num_tiles, block_q, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 3, 1, 4).reshape(num_tiles, num_kv_heads, used, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - used), (0, 0)))  # [num_tiles, Hkv, rows, D]

    block = pl.BlockSpec((None, None, rows, head_dim), lambda t, h, *_: (t, h, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    if attend_until is None:
        prefetch, q_inputs, q_specs = (), (q_tiles,), [block]
    else:
        last, ends = tiles.tile_bounds(meta, attend_until, block_q)  # [num_tiles, block_q], [num_tiles]
        # Each row's bound in q's row layout (head-major, token r % block_q); padding rows' outputs are dropped.
        last = jnp.broadcast_to(last[:, None, :], (num_tiles, group, block_q)).reshape(num_tiles, used)
        last = jnp.pad(last, ((0, 0), (0, rows - used)))[:, :, None]  # [num_tiles, rows, 1]
        prefetch, q_inputs = (ends,), (q_tiles, last)
        q_specs = [block, pl.BlockSpec((None, rows, 1), lambda t, h, *_: (t, 0, 0))]
    if sinks is not None:  # row r of a program is query head h * group + r // block_q: [num_kv_heads, rows, 1]
        row_sinks = jnp.repeat(sinks.reshape(num_kv_heads, group), block_q, axis=1)
        q_inputs += (jnp.pad(row_sinks, ((0, 0), (0, rows - used)))[:, :, None],)
        q_specs = [*q_specs, pl.BlockSpec((None, rows, 1), lambda t, h, *_: (h, 0, 0))]
    buf = pltpu.VMEM((2, pages_per_iter * block_size, head_dim), k_pages.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2 + len(prefetch),
        grid=(num_tiles, num_kv_heads),
        in_specs=[*q_specs, hbm, hbm],
        out_specs=block,
        scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2))],
    )
    kernel = functools.partial(_ragged_kernel, scale=scale, block_q=block_q, max_blocks_per_seq=max_blocks_per_seq,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                               attend_until=attend_until is not None, sinks=sinks is not None)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        interpret=interpret,
        compiler_params=T.compiler_params(2),
        name=f"ragged_paged_attention_tpu_q{block_q}_p{pages_per_iter}"
             + tiles.variant_suffix(sliding_window, logits_soft_cap, k_pages.dtype, attend_until is not None,
                                    sinks is not None),
    )(meta.reshape(-1), block_tables.reshape(-1), *prefetch, *q_inputs, k_pages, v_pages)
    out = out[:, :, :used].reshape(num_tiles, num_kv_heads, group, block_q, head_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_tiles * block_q, num_q_heads, head_dim)
    return out[slot_of_token]


def ragged_paged_attention_tpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, *, scale: float, interpret,
                               block_q: int | None, pages_per_iter: int | None, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None, attend_until: jax.Array | None = None,
                               sinks: jax.Array | None = None) -> jax.Array:
    """The TPU ragged kernel behind `pallas_kernels.ragged_paged_attention(..., target="tpu")`, which has
    already validated shapes, dtypes, scale and variants (sinks included). Checks the TPU rules (dtype, block
    size, tuning, no 8-bit pages), fills in the defaults (`default_block_q`, `default_pages_per_iter`) and runs
    the kernel."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    num_seqs, max_blocks_per_seq = block_tables.shape
    T.check_variants(k_pages)
    T.check_dtype(q.dtype)
    T.check_block_size(block_size, q.dtype)
    V.check_pow2_option("block_q", block_q)
    T.check_pages_per_iter(pages_per_iter)
    if num_tokens == 0 or num_seqs == 0 or max_blocks_per_seq == 0 or num_blocks == 0:
        return jnp.zeros(q.shape, q.dtype)
    if block_q is None:
        block_q = tiles.default_block_q(num_tokens, num_seqs, num_q_heads // num_kv_heads, head_dim)
    if pages_per_iter is None:
        walked_pages = tiles.window_pages(sliding_window, block_q, max_blocks_per_seq, block_size)
        pages_per_iter = T.default_pages_per_iter(block_size, walked_pages, head_dim, q.dtype)
    return _ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, attend_until, sinks,
                                   scale=scale, interpret=T.resolve_interpret(interpret), block_q=int(block_q),
                                   pages_per_iter=int(pages_per_iter), sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap)
