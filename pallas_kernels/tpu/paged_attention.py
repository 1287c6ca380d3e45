"""Decode attention over a paged KV cache on TPU (Pallas Mosaic): one query token per sequence.

Grid (num_seqs, num_kv_heads, num_splits), every dimension parallel. Program (s, h, p)
  * receives its query block through the Pallas pipeline: all query heads of KV head h at once (GQA
    packing: each KV page is read once per KV head), padded with zero rows to a whole native tile
    (8 rows for float32, 16 for bfloat16) by the wrapper,
  * reads lengths[s] and sequence s's block-table row from SMEM (scalar prefetch: DMA addresses are
    scalars, computed before any vector work),
  * copies its pages HBM -> VMEM itself (`PageChunks`): the cache stays in HBM (memory space ANY, never
    blocked or copied whole), `pages_per_iter` pages per chunk into one of two VMEM slots, the next
    chunk's DMAs started before the current chunk is computed on; pages at or past the split's end are
    never copied,
  * keeps an exact float32 online softmax (m, z, u).
Split p of sequence s covers a page range sized from lengths[s] (as on GPU); with a sliding window W the
ranges cover only the pages from the one holding lengths[s] - W on, and a soft cap c turns scores into
c * tanh(s / c). With one split the program
writes the normalised output; with several it writes its partial (m, z, u) and `merge.merge_and_finalize`
combines them exactly in float32. On a TPU the grid runs sequentially on each TensorCore, so one split is
the default: splits only help a two-core (megacore) chip when num_seqs * num_kv_heads is tiny.

Sinks (one logit per query head, gpt-oss) are joined once into the (m, z, u) of all of a query's keys
(`merge.join_sink`): with one split by the program, from a `[rows, 1]` float32 VMEM block beside q's (the sinks
of its KV head's query heads, laid out as q's rows); with several after the merge of the splits' partials.
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
from pallas_kernels.merge import join_sink, merge_and_finalize
from pallas_kernels.tpu import _common as T
from pallas_kernels.tpu.page_chunks import PageChunks


def _decode_kernel(lengths_ref, tables_ref, q_ref, *refs, scale: float, num_splits: int, max_blocks_per_seq: int,
                   sliding_window: int | None, logits_soft_cap: float | None, sinks: bool):
    """lengths_ref i32[num_seqs] and tables_ref i32[num_seqs * max_blocks_per_seq] (SMEM); q_ref
    [rows, head_dim] (VMEM block); with sinks (one split only) sinks_ref f32[rows, 1] (VMEM block: row r's sink);
    k_hbm/v_hbm [num_kv_heads, num_blocks, block_size, head_dim] (HBM). Outputs (VMEM blocks): o [rows, head_dim]
    (one split) or m, z [rows, 1] and u [rows, head_dim] float32. Scratch: k_buf/v_buf [2, pages_per_iter *
    block_size, head_dim], sems DMA [2, 2]."""
    if sinks:
        sinks_ref, k_hbm, v_hbm, *out_refs, k_buf, v_buf, sems = refs
    else:
        k_hbm, v_hbm, *out_refs, k_buf, v_buf, sems = refs
    seq, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size = k_hbm.shape[2]
    tokens = k_buf.shape[1]  # per chunk
    pages_per_iter = tokens // block_size

    length = jnp.clip(lengths_ref[seq], 0, max_blocks_per_seq * block_size)
    num_pages = T.cdiv(length, block_size)
    # The query sits at position length - 1: a window keeps positions [length - W, length); pages wholly
    # before it are no split's (never copied, their table entries never read).
    token_start = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    first_page = 0 if sliding_window is None else lax.div(token_start, block_size)
    # This split's page range, sized from this sequence's (window's) page count and rounded to whole chunks.
    pages_per_split = T.cdiv(T.cdiv(num_pages - first_page, num_splits), pages_per_iter) * pages_per_iter
    page_lo = first_page + split * pages_per_split
    page_hi = jnp.minimum(page_lo + pages_per_split, num_pages)
    num_chunks = T.cdiv(jnp.maximum(page_hi - page_lo, 0), pages_per_iter)
    token_end = jnp.minimum(length, page_hi * block_size)  # tokens past it are not this split's

    q = q_ref[...]
    rows, head_dim = q.shape

    def step(k, v, first_pos, carry):
        score_pos = first_pos + lax.broadcasted_iota(jnp.int32, (rows, tokens), 1)
        value_pos = first_pos + lax.broadcasted_iota(jnp.int32, (tokens, head_dim), 0)
        score_ok = score_pos < token_end
        value_ok = value_pos < token_end
        if sliding_window is not None:
            score_ok = score_ok & (score_pos >= token_start)
            value_ok = value_ok & (value_pos >= token_start)
        return T.online_softmax_step(q, k, v, score_ok, value_ok, carry, scale=scale,
                                     logits_soft_cap=logits_soft_cap)

    chunks = PageChunks(tables_ref, ((k_hbm, (head,), k_buf), (v_hbm, (head,), v_buf)), sems,
                        table_row=seq * max_blocks_per_seq, first_page=page_lo, page_end=page_hi,
                        block_size=block_size)
    m, z, u = chunks.fold(num_chunks, step, T.init_carry(rows, head_dim))
    if num_splits == 1:
        (o_ref,) = out_refs
        if sinks:
            _, z, u = join_sink(m, z, u, sinks_ref[...])
        o_ref[...] = T.finalize_rows(z, u, o_ref.dtype)
    else:
        m_ref, z_ref, u_ref = out_refs
        m_ref[...] = m
        z_ref[...] = z
        u_ref[...] = u


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_splits", "pages_per_iter", "sliding_window",
                                             "logits_soft_cap"))
def _paged_attention(q, k_pages, v_pages, block_tables, lengths, sinks, *, scale: float, interpret, num_splits: int,
                     pages_per_iter: int, sliding_window: int | None, logits_soft_cap: float | None):
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    max_blocks_per_seq = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    rows = T.round_up(group, T.sublane_rows(q.dtype))
    q_rows = jnp.pad(q.reshape(num_seqs, num_kv_heads, group, head_dim),
                     ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [num_seqs, num_kv_heads, rows, head_dim]

    def block(last: int):  # one program's [rows, last] block of a [num_splits?, num_seqs, num_kv_heads, ...] array
        return pl.BlockSpec((None, None, rows, last), lambda s, h, p, *_: (s, h, 0, 0))

    def split_block(last: int):
        return pl.BlockSpec((None, None, None, rows, last), lambda s, h, p, *_: (p, s, h, 0, 0))

    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_rows.shape, q.dtype)
        out_specs = block(head_dim)
    else:
        stats = jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, rows, 1), jnp.float32)
        out_shape = (stats, stats,
                     jax.ShapeDtypeStruct((num_splits, num_seqs, num_kv_heads, rows, head_dim), jnp.float32))
        out_specs = (split_block(1), split_block(1), split_block(head_dim))
    if sinks is None or num_splits > 1:  # several splits join the sinks after their merge
        sink_inputs, sink_specs = (), []
    else:  # each program's query heads' sinks, as its q rows: [num_kv_heads, rows, 1] (padding rows 0, dropped)
        sink_inputs = (jnp.pad(sinks.reshape(num_kv_heads, group), ((0, 0), (0, rows - group)))[:, :, None],)
        sink_specs = [pl.BlockSpec((None, rows, 1), lambda s, h, p, *_: (h, 0, 0))]
    buf = pltpu.VMEM((2, pages_per_iter * block_size, head_dim), k_pages.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[block(head_dim), *sink_specs, pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2))],
    )
    kernel = functools.partial(_decode_kernel, scale=scale, num_splits=num_splits,
                               max_blocks_per_seq=max_blocks_per_seq, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, sinks=bool(sink_inputs))
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=T.compiler_params(3),
        name=f"paged_attention_tpu_decode_s{num_splits}_p{pages_per_iter}"
             + tiles.variant_suffix(sliding_window, logits_soft_cap, k_pages.dtype, sinks=bool(sink_inputs)),
    )(lengths, block_tables.reshape(-1), q_rows, *sink_inputs, k_pages, v_pages)
    if num_splits == 1:
        return out[:, :, :group].reshape(q.shape)
    m, z, u = out
    m = m[:, :, :, :group, 0].reshape(num_splits, num_seqs, num_q_heads)
    z = z[:, :, :, :group, 0].reshape(num_splits, num_seqs, num_q_heads)
    u = u[:, :, :, :group].reshape(num_splits, num_seqs, num_q_heads, head_dim)
    return merge_and_finalize(m, z, u, axis=0, dtype=q.dtype, sinks=sinks)


def paged_attention_tpu(q, k_pages, v_pages, block_tables, lengths, *, scale: float, interpret,
                        num_splits: int | None, pages_per_iter: int | None, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """The TPU decode kernel behind `pallas_kernels.paged_attention(..., target="tpu")`, which has already
    validated shapes, dtypes, scale and variants (sinks included). Checks the TPU rules (dtype, block size,
    tuning, no 8-bit pages), fills in the defaults (one split; `default_pages_per_iter`, over the window's pages
    with a window) and runs the kernel."""
    num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
    max_blocks_per_seq = block_tables.shape[1]
    T.check_variants(k_pages)
    T.check_dtype(q.dtype)
    T.check_block_size(block_size, q.dtype)
    T.check_pages_per_iter(pages_per_iter)
    V.check_positive_option("num_splits", num_splits)
    if q.shape[0] == 0 or max_blocks_per_seq == 0 or num_blocks == 0:
        return jnp.zeros(q.shape, q.dtype)
    if pages_per_iter is None:
        walked_pages = tiles.window_pages(sliding_window, 1, max_blocks_per_seq, block_size)
        pages_per_iter = T.default_pages_per_iter(block_size, walked_pages, head_dim, q.dtype)
    return _paged_attention(q, k_pages, v_pages, block_tables, lengths, sinks, scale=scale,
                            interpret=T.resolve_interpret(interpret), num_splits=int(num_splits or 1),
                            pages_per_iter=int(pages_per_iter), sliding_window=sliding_window,
                            logits_soft_cap=logits_soft_cap)
