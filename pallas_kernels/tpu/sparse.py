"""DeepSeek sparse attention (DSA, V3.2) on TPU (Pallas Mosaic): the lightning indexer's scores over paged
indexer keys (`ragged_indexer_scores_tpu`, decode through one-token tiles) and MLA attention over each query row's
selected positions (`sparse_mla_attention_tpu`). The GPU kernels' counterparts (`gpu.sparse` states the math).

Indexer. Grid (tile, chunk), both parallel: a tile is `block_q` consecutive query tokens of one sequence
(`tiles.tile_metadata`, scalar-prefetched with the block tables), a chunk `pages_per_iter` consecutive logical
pages. The wrapper lays out each tile's queries as a tile-aligned `[rows, D]` block (row r = head r // block_q,
token r % block_q, zero rows up to a whole native tile) and its weights, times the scale, as one `[1, rows]` lane
row. Program (t, c) copies its chunk's pages HBM -> VMEM (`PageChunks`; nothing when the chunk lies past the
tile's last visible position: those table entries are never read), computes relu(Q K^T) `[rows, tokens]` on the
matrix unit and the per-head weighted sum as a second float32 matmul, Sel @ relu(Q K^T) with Sel `[8k, rows]`
built from the weight row and iotas (no sublane reshape), and writes its `[block_q, tokens]` block of the score
rows, -inf where invisible. Stale VMEM rows (slots past the length) only reach their own score column, which is
masked.

Sparse MLA. The wrapper turns the selected positions into physical slots through the block table
(`tiles.selected_slots`, -1 for none) and pads them to whole steps of `block_k`. Grid (row, head block, split), all
parallel. Program (i, b, p) copies row i's slots HBM -> SMEM (one DMA), then walks its split's share of them
`block_k` at a time, double-buffered: each slot is one row DMA `kv_pages[slot // block_size, slot % block_size]`
`[1, R + Dr]` into its row of the VMEM step buffer, and a slot selecting nothing copies a zero row instead, so
every buffer row is a real token or zeros (no stale VMEM reaches the P @ V product) and every wait is one row's
bytes. Scores and values are the whole page row against `[q_latent | q_rope]` (as `tpu.mla`); the exact float32
online softmax of `_common`; a row selecting nothing gives zeros. With several splits each writes its partial
(m, z, u), merged exactly by `merge.merge_and_finalize`; one split is the default.

Float32 and bfloat16; the indexer needs the TPU block-size rule (whole pages are DMA'd), the sparse MLA any block
size (single rows are). 8-bit keys or pages are not supported on TPU (a ValueError, as for the other TPU kernels).
Exported for platform "tpu" and run in Pallas's TPU interpret mode; not yet compiled or timed on a TPU (in
particular the single-row DMAs into bfloat16 VMEM tiles, which pack two rows per sublane, are unproven there).
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

DEFAULT_BLOCK_K = 128  # selected positions per step: a score matrix of 128 lanes
MAX_INDEXER_ROWS = 256  # default query rows (block_q x index_n_heads) per indexer program


def _check(q_dtype, pages, pages_name: str) -> None:
    if is_quantized(pages.dtype):
        raise ValueError(f"target 'tpu' does not support 8-bit ({jnp.dtype(pages.dtype).name}) {pages_name}; use "
                         f"target 'gpu' or float32/bfloat16 pages")
    T.check_dtype(q_dtype)


def _indexer_kernel(meta_ref, tables_ref, q_ref, w_ref, k_hbm, o_ref, k_buf, sems, *, block_q: int,
                    max_blocks_per_seq: int):
    """meta_ref i32[num_tiles * 5], tables_ref i32[num_seqs * max_blocks] (SMEM); q_ref [rows, D] and w_ref
    f32[1, rows] (VMEM blocks of the tile); k_hbm [num_blocks, block_size, D] (HBM). Output o_ref f32[out_rows,
    tokens] (VMEM block: this tile's rows x this chunk's positions). Scratch k_buf [2, tokens, D], sems DMA
    [1, 2]."""
    tile, chunk = pl.program_id(0), pl.program_id(1)
    block_size = k_hbm.shape[1]
    tokens = k_buf.shape[1]
    pages_per_iter = tokens // block_size
    seq = meta_ref[tile * T.META]
    num_rows = meta_ref[tile * T.META + 2]
    pos0 = meta_ref[tile * T.META + 3]
    kv_len = meta_ref[tile * T.META + 4]
    kv_end = jnp.where(num_rows > 0, jnp.clip(pos0 + num_rows, 0, kv_len), 0)
    page_lo = chunk * pages_per_iter
    page_hi = jnp.minimum(page_lo + pages_per_iter, T.cdiv(kv_end, block_size))

    q = q_ref[...]
    rows = q.shape[0]
    out_rows = o_ref.shape[0]
    # Sel[m, r] = scale * w[r] where row r is token m's (block_q is a power of two: token = r & (block_q - 1)).
    token = lax.broadcasted_iota(jnp.int32, (out_rows, rows), 1) & (block_q - 1)
    select = jnp.where(token == lax.broadcasted_iota(jnp.int32, (out_rows, rows), 0), w_ref[...], 0.0)
    q_pos = pos0 + lax.broadcasted_iota(jnp.int32, (out_rows, tokens), 0)

    def step(k, first_pos, carry):
        del carry
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=tiles.dot_precision(q.dtype),
                            preferred_element_type=jnp.float32)  # [rows, tokens]
        scores = lax.dot_general(select, jnp.maximum(s, 0.0), (((1,), (0,)), ((), ())),
                                 precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        key_pos = first_pos + lax.broadcasted_iota(jnp.int32, (out_rows, tokens), 1)
        return jnp.where((key_pos <= q_pos) & (key_pos < kv_len), scores, tiles.NEG_INF)

    chunks = PageChunks(tables_ref, ((k_hbm, (), k_buf),), sems, table_row=seq * max_blocks_per_seq,
                        first_page=page_lo, page_end=page_hi, block_size=block_size)
    any_visible = (page_lo < page_hi).astype(jnp.int32)  # one chunk per program, or none
    o_ref[...] = chunks.fold(any_visible, step, jnp.full((out_rows, tokens), tiles.NEG_INF, jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "pages_per_iter"))
def _indexer_call(meta, q_index, weights, index_pages, block_tables, *, scale: float, interpret, block_q: int,
                  pages_per_iter: int):
    num_tokens, num_heads, head_dim = q_index.shape
    block_size = index_pages.shape[1]
    max_blocks = block_tables.shape[1]
    num_tiles = meta.shape[0]
    used = num_heads * block_q
    rows = T.round_up(used, T.sublane_rows(q_index.dtype))
    out_rows = T.round_up(block_q, T.SUBLANES)
    tokens = pages_per_iter * block_size
    num_chunks = tiles.cdiv(max_blocks, pages_per_iter)
    tile_rows, slot_of_token = T.tile_rows(meta, num_tokens, block_q)
    q = q_index[tile_rows].transpose(0, 2, 1, 3).reshape(num_tiles, used, head_dim)  # row = head * block_q + token
    q = jnp.pad(q, ((0, 0), (0, rows - used), (0, 0)))
    real = jnp.arange(block_q)[None, :] < meta[:, 2:3]
    w = jnp.where(real[:, :, None], weights[tile_rows], 0.0) * scale  # padding tokens weigh nothing
    w = jnp.pad(w.transpose(0, 2, 1).reshape(num_tiles, 1, used), ((0, 0), (0, 0), (0, rows - used)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_tiles, num_chunks),
        in_specs=[pl.BlockSpec((None, rows, head_dim), lambda t, c, *_: (t, 0, 0)),
                  pl.BlockSpec((None, 1, rows), lambda t, c, *_: (t, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, None, out_rows, tokens), lambda t, c, *_: (t, c, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2, tokens, head_dim), index_pages.dtype), pltpu.SemaphoreType.DMA((1, 2))],
    )
    out = pl.pallas_call(
        functools.partial(_indexer_kernel, block_q=block_q, max_blocks_per_seq=max_blocks),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_chunks, out_rows, tokens), jnp.float32),
        interpret=interpret,
        compiler_params=T.compiler_params(2),
        name=f"indexer_scores_tpu_q{block_q}_p{pages_per_iter}",
    )(meta.reshape(-1), block_tables.reshape(-1), q, w, index_pages)
    out = out[:, :, :block_q].transpose(0, 2, 1, 3).reshape(num_tiles * block_q, num_chunks * tokens)
    return out[slot_of_token, : max_blocks * block_size]


def default_block_q(num_tokens: int, num_seqs: int, num_heads: int) -> int:
    """Query tokens per indexer tile: the mean query length rounded up to a power of two, with at most
    MAX_INDEXER_ROWS rows (block_q x index_n_heads) per program (and at least one token)."""
    mean = tiles.cdiv(max(1, num_tokens), max(1, num_seqs))
    cap = max(1, tiles.next_pow2(MAX_INDEXER_ROWS // num_heads + 1) // 2)  # the power of two <= rows / heads
    return int(min(tiles.next_pow2(mean), cap))


def ragged_indexer_scores_tpu(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, *, scale: float,
                              interpret, block_q: int | None, pages_per_iter: int | None) -> jax.Array:
    """The TPU indexer kernel behind `pallas_kernels.ragged_indexer_scores(..., target="tpu")` (and, with
    `cu_q_lens=None`, `indexer_scores`: one-token tiles), which has already validated shapes, dtypes and scale.
    Checks the TPU rules, fills in the defaults (`default_block_q`, `tpu._common.default_pages_per_iter` over
    index_head_dim) and runs the kernel."""
    _check(q_index.dtype, index_pages, "indexer keys (index_scales)")
    T.check_block_size(index_pages.shape[1], q_index.dtype)  # whole pages are DMA'd
    V.check_pow2_option("block_q", block_q)
    T.check_pages_per_iter(pages_per_iter)
    num_tokens, num_heads, head_dim = q_index.shape
    block_size = index_pages.shape[1]
    max_context = block_tables.shape[1] * block_size
    if 0 in (num_tokens, block_tables.shape[0], block_tables.shape[1], index_pages.shape[0]):
        return jnp.full((num_tokens, max_context), tiles.NEG_INF, jnp.float32)
    if cu_q_lens is None:
        block_q = 1
        meta = tiles.decode_metadata(kv_lens, max_context)
    else:
        block_q = block_q or default_block_q(num_tokens, block_tables.shape[0], num_heads)
        meta = tiles.tile_metadata(kv_lens, cu_q_lens, num_tokens, block_q, max_context)
    if pages_per_iter is None:
        pages_per_iter = T.default_pages_per_iter(block_size, block_tables.shape[1], head_dim, q_index.dtype)
    return _indexer_call(meta, q_index, weights, index_pages, block_tables, scale=scale,
                         interpret=T.resolve_interpret(interpret), block_q=int(block_q),
                         pages_per_iter=int(pages_per_iter))


def _sparse_kernel(mask_ref, q_ref, slots_hbm, kv_hbm, zero_hbm, *refs, scale: float, partials: bool,
                   steps_per_split: int):
    """mask_ref i32[total_steps, 1, block_k] (VMEM: this row's slots, -1 = none, as lanes for the score mask);
    q_ref [rows, R + Dr] (VMEM block: [q_latent | q_rope] of block_h heads); slots_hbm i32[num_rows, total_steps *
    block_k], kv_hbm [num_blocks, block_size, R + Dr] and zero_hbm [1, R + Dr] (HBM). Outputs (VMEM blocks): o
    [rows, R + Dr] or (`partials`: several splits, or a caller merging them itself) m, z [rows, 1] and u [rows,
    R + Dr] float32. Scratch: slots_smem i32[total_steps
    * block_k], kv_buf [2, block_k, R + Dr], sems DMA [3] (two buffer slots, the slot-list copy)."""
    *out_refs, slots_smem, kv_buf, sems = refs
    row, split = pl.program_id(0), pl.program_id(2)
    block_size = kv_hbm.shape[1]
    total_steps, _, block_k = mask_ref.shape
    # This split's steps: [first_step, first_step + num_steps).
    first_step = split * steps_per_split
    num_steps = jnp.clip(total_steps - first_step, 0, steps_per_split)
    slots_copy = pltpu.make_async_copy(slots_hbm.at[row], slots_smem, sems.at[2])
    slots_copy.start()
    slots_copy.wait()

    def start(step, buf):
        def one(j, carry):
            slot = slots_smem[step * block_k + j]
            dst = kv_buf.at[buf, pl.ds(j, 1)]

            @pl.when(slot >= 0)
            def _():
                src = kv_hbm.at[lax.div(slot, block_size), pl.ds(lax.rem(slot, block_size), 1)]
                pltpu.make_async_copy(src, dst, sems.at[buf]).start()

            @pl.when(slot < 0)  # nothing selected: a zero row, so the buffer never holds stale data
            def _():
                pltpu.make_async_copy(zero_hbm, dst, sems.at[buf]).start()

            return carry

        lax.fori_loop(0, block_k, one, 0)

    def wait(buf):
        def one(j, carry):  # every copy is one row's bytes, whichever its source
            pltpu.make_async_copy(zero_hbm, kv_buf.at[buf, pl.ds(j, 1)], sems.at[buf]).wait()
            return carry

        lax.fori_loop(0, block_k, one, 0)

    q = q_ref[...]
    rows, width = q.shape

    @pl.when(num_steps > 0)
    def _():
        start(first_step, 0)

    def body(i, carry):
        buf = lax.rem(i, 2)

        @pl.when(i + 1 < num_steps)
        def _():
            start(first_step + i + 1, 1 - buf)

        wait(buf)
        kv = kv_buf[buf]
        return T.online_softmax_step(q, kv, kv, mask_ref[first_step + i] >= 0, None, carry, scale=scale)

    m, z, u = lax.fori_loop(0, num_steps, body, T.init_carry(rows, width))
    if not partials:
        (o_ref,) = out_refs
        o_ref[...] = T.finalize_rows(z, u, o_ref.dtype)
    else:
        m_ref, z_ref, u_ref = out_refs
        m_ref[...] = m
        z_ref[...] = z
        u_ref[...] = u


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "block_k", "num_splits", "partials"))
def _sparse_call(slots, q_latent, q_rope, kv_pages, *, scale: float, interpret, block_h: int, block_k: int,
                 num_splits: int, partials: bool = False):
    """The kernel's output: `[rows, H, R]`, or with `partials` each split's (m, z `[splits, rows, H]`, u `[splits,
    rows, H, R]`) unmerged (a caller merging more partials: DeepSeek V4's window and entries)."""
    num_rows, num_heads, rank = q_latent.shape
    width = kv_pages.shape[2]
    num_steps = tiles.cdiv(slots.shape[1], block_k)
    slots = jnp.pad(slots, ((0, 0), (0, num_steps * block_k - slots.shape[1])), constant_values=-1)
    head_blocks = tiles.cdiv(num_heads, block_h)
    rows = T.round_up(block_h, T.sublane_rows(q_latent.dtype))
    q = jnp.concatenate([q_latent, q_rope], axis=-1)
    q = jnp.pad(q, ((0, 0), (0, head_blocks * block_h - num_heads), (0, 0)))
    q = jnp.pad(q.reshape(num_rows, head_blocks, block_h, width), ((0, 0), (0, 0), (0, rows - block_h), (0, 0)))
    def block(last: int):  # one program's [rows, last] block of a [num_rows, head_blocks, rows, last] array
        return pl.BlockSpec((None, None, rows, last), lambda i, b, p: (i, b, 0, 0))

    def split_block(last: int):
        return pl.BlockSpec((None, None, None, rows, last), lambda i, b, p: (p, i, b, 0, 0))

    unmerged = partials or num_splits > 1
    if not unmerged:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = block(width)
    else:
        stats = jax.ShapeDtypeStruct((num_splits, num_rows, head_blocks, rows, 1), jnp.float32)
        out_shape = (stats, stats, jax.ShapeDtypeStruct((num_splits, *q.shape), jnp.float32))
        out_specs = (split_block(1), split_block(1), split_block(width))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=0,
        grid=(num_rows, head_blocks, num_splits),
        in_specs=[pl.BlockSpec((None, num_steps, 1, block_k), lambda i, b, p: (i, 0, 0, 0)), block(width),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs,
        scratch_shapes=[pltpu.SMEM((num_steps * block_k,), jnp.int32),
                        pltpu.VMEM((2, block_k, width), kv_pages.dtype), pltpu.SemaphoreType.DMA((3,))],
    )
    kernel = functools.partial(_sparse_kernel, scale=scale, partials=unmerged,
                               steps_per_split=tiles.cdiv(num_steps, num_splits))
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=T.compiler_params(3),
        name=f"sparse_mla_attention_tpu_h{block_h}_k{block_k}_s{num_splits}",
    )(slots.reshape(num_rows, num_steps, 1, block_k), q, slots, kv_pages, jnp.zeros((1, width), kv_pages.dtype))

    def untile(x):  # [..., num_rows, head_blocks, rows, last] -> [..., num_rows, num_heads, last]
        lead, last = x.shape[:-4], x.shape[-1]
        return x[..., :block_h, :].reshape(*lead, num_rows, head_blocks * block_h, last)[..., :num_heads, :]

    if not unmerged:
        return untile(out)[..., :rank]
    m, z, u = out
    if partials:
        return untile(m)[..., 0], untile(z)[..., 0], untile(u)[..., :rank]
    return merge_and_finalize(untile(m)[..., 0], untile(z)[..., 0], untile(u)[..., :rank], axis=0,
                              dtype=q_latent.dtype)


def slot_attention_partials_tpu(q, pages, slots, *, scale: float, interpret, block_h: int | None,
                                block_k: int | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sparse kernel as attention over physical `slots` i32[rows, n] (-1 none) of `pages [num_blocks,
    rows_per_block, D]` whose rows are key and value alike (DeepSeek V4's K = V; MLA's latent with no rotary part),
    returning each row's unmerged float32 partial: (m, z `[rows, H]`, u `[rows, H, D]`), for a caller merging it
    with others (`pallas_kernels.compressed`: the window's and the entries'). One split; any rows per block."""
    _check(q.dtype, pages, "pages")
    V.check_positive_option("block_h", block_h)
    V.check_positive_option("block_k", block_k)
    m, z, u = _sparse_call(slots, q, q[..., :0], pages, scale=scale, interpret=T.resolve_interpret(interpret),
                           block_h=int(block_h or q.shape[1]), block_k=int(block_k or DEFAULT_BLOCK_K), num_splits=1,
                           partials=True)
    return m[0], z[0], u[0]


def sparse_mla_attention_tpu(q_latent, q_rope, kv_pages, slots, *, scale: float, interpret, block_h: int | None,
                             block_k: int | None, num_splits: int | None) -> jax.Array:
    """The TPU sparse MLA kernel behind `pallas_kernels.sparse_mla_paged_attention` /
    `ragged_sparse_mla_paged_attention` (target "tpu"), which have validated the arguments and turned the selected
    positions into physical `slots` i32[rows, top_k] (`tiles.selected_slots`). Checks the TPU rules, fills in the
    defaults (all heads per program, DEFAULT_BLOCK_K, one split: a TPU core runs the grid sequentially) and runs
    the kernel."""
    _check(q_latent.dtype, kv_pages, "MLA pages (kv_scales)")  # any block_size: rows are DMA'd one by one
    V.check_positive_option("block_h", block_h)
    V.check_positive_option("block_k", block_k)
    if 0 in (q_latent.shape[0], kv_pages.shape[0]):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    block_k = block_k or DEFAULT_BLOCK_K
    return _sparse_call(slots, q_latent, q_rope, kv_pages, scale=scale, interpret=T.resolve_interpret(interpret),
                        block_h=int(block_h or q_latent.shape[1]), block_k=int(block_k),
                        num_splits=int(min(num_splits or 1, tiles.cdiv(slots.shape[1], block_k))))
