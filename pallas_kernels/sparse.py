"""DeepSeek sparse attention (DSA): the indexer's scores and MLA over each row's selected positions: the entry points,
their references, XLA paths and argument checks.

Per layer the cache holds, beside the latent pages, one indexer key per token, `index_pages [num_blocks,
block_size, index_head_dim]` in the same blocks (same block table), shared by every indexer head, optionally
8-bit with one float scale per token (`index_scales [num_blocks, block_size]`). A query row with indexer
queries q_I `[index_n_heads, index_head_dim]` and per-head weights w `[index_n_heads]` scores position t as
    s[t] = scale * sum_h w[h] * relu(q_I[h] . k_I[t])
for the positions it sees (t <= its position, t < kv_len) and -inf elsewhere; `topk.top_k_positions` keeps the
top index_topk; the sparse MLA attends (absorbed, as `ragged_mla_paged_attention`) to exactly those positions.

The references score and attend densely; the XLA paths `*_xla` gather keys once per query tile and only the
selected latent rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _validate as V
from pallas_kernels import tiles
from pallas_kernels.dense import HIGHEST, query_tiles, visible
from pallas_kernels.dispatch import resolve_target
from pallas_kernels.gpu.sparse import ragged_indexer_scores_gpu, sparse_mla_attention_gpu
from pallas_kernels.mla import (
    check_mla_scale,
    check_ragged,
    gather_latent,
    latent_attention,
    mla_empty,
    mla_validated,
    validate_mla,
)
from pallas_kernels.quant import dequantize_kv, is_quantized
from pallas_kernels.tiles import sparse_slots
from pallas_kernels.tpu.sparse import ragged_indexer_scores_tpu, sparse_mla_attention_tpu


def _indexer(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, *, scale, index_scales, interpret,
             target, block_q, pages_per_iter, num_warps, num_stages) -> jax.Array:
    """Validates an indexer call once (decode when cu_q_lens is None) and dispatches it."""
    target = resolve_target(target, interpret)
    decode = cu_q_lens is None
    num_rows = q_index.shape[0] if decode and getattr(q_index, "ndim", 0) == 3 else None
    validate_indexer(q_index, weights, index_pages, block_tables, index_scales, num_q_rows=num_rows)
    if decode:
        V.check_vector("lengths", kv_lens, q_index.shape[0])
    else:
        V.check_vector("kv_lens", kv_lens, block_tables.shape[0])
        V.check_vector("cu_q_lens", cu_q_lens, block_tables.shape[0] + 1)
    scale = check_indexer_scale(scale)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return ragged_indexer_scores_tpu(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens,
                                         scale=scale, interpret=interpret, block_q=block_q,
                                         pages_per_iter=pages_per_iter)
    return ragged_indexer_scores_gpu(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                                     interpret=interpret, block_q=block_q, pages_per_iter=pages_per_iter,
                                     num_warps=num_warps, num_stages=num_stages, index_scales=index_scales)


def indexer_scores(
    q_index: jax.Array,
    weights: jax.Array,
    index_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    index_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """The lightning indexer of DeepSeek sparse attention (V3.2) for decode: one query row per sequence, at position
    lengths[s] - 1, scored against every cached indexer key of its sequence.

    `s[t] = scale * sum_h weights[s, h] * relu(q_index[s, h] . k_I[t])` for t < lengths[s], -inf elsewhere; k_I[t]
    is the indexer key of position t, read through the block table.

    Args:
      q_index: `[num_seqs, index_n_heads, index_head_dim]`, float32, bfloat16 or float16.
      weights: float32 `[num_seqs, index_n_heads]`, the per-head weights (DeepSeek V3.2: W_w x / sqrt(n_heads)).
      index_pages: `[num_blocks, block_size, index_head_dim]`: one key per token, shared by all indexer heads, in
        the latent pages' blocks (same block table); q_index's dtype, or int8 / float8_e4m3fn with `index_scales`.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`; entries past `cdiv(lengths[s], block_size)` are never
        read and may hold anything.
      lengths: int32 `[num_seqs]`: tokens cached per sequence (clipped to the table's capacity); slots at or past
        the length are never read.
      scale: multiplies every score, required (DeepSeek V3.2: 1 / sqrt(index_head_dim)): a static Python float.
      index_scales: with 8-bit keys (and only then), `[num_blocks, block_size]` float32 or bfloat16, one per token:
        the keys are `index_pages.astype(float32) * index_scales[..., None]` (`quant.quantize_kv` makes them).
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform, interpreted elsewhere
        (for "tpu": Pallas's TPU interpret mode; a `pltpu.InterpretParams` sets its options).
      target: "gpu" (Triton), "tpu" (Mosaic: float32 or bfloat16, block_size a multiple of 8 for float32 and of
        16 for bfloat16, no 8-bit keys) or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      pages_per_iter: pages per program (the grid is sequences x chunks of pages). GPU: a power of two with
        `pages_per_iter * next_pow2(block_size) >= 16`; TPU: any positive int. `None` sizes the chunk from
        index_head_dim (`gpu._common.default_pages_per_iter` / `tpu._common.default_pages_per_iter`).
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      float32 `[num_seqs, max_blocks_per_seq * block_size]`: each row's scores over its table's positions, -inf
      where it sees nothing. 4 bytes per (row, position): 32 MiB for 512 rows over a 16k context, the scale of the
      engine's steps; `top_k_positions` selects on it.

    Raises:
      ValueError: on malformed arguments (ranks, weights' shape or dtype, index_head_dim mismatch, scales with
        float keys or none with 8-bit keys, non-int32 tables) or tuning values.
    """
    return _indexer(q_index, weights, index_pages, block_tables, lengths, None, scale=scale,
                    index_scales=index_scales, interpret=interpret, target=target, block_q=None,
                    pages_per_iter=pages_per_iter, num_warps=num_warps, num_stages=num_stages)


def ragged_indexer_scores(
    q_index: jax.Array,
    weights: jax.Array,
    index_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float,
    index_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_q: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """The lightning indexer of DeepSeek sparse attention (V3.2) for ragged query chunks (prefill chunks and decode
    tokens), causal; the conventions of `ragged_mla_paged_attention` with the scores of `indexer_scores`.

    Args:
      q_index: `[total_q_tokens, index_n_heads, index_head_dim]`; sequence s owns rows `cu_q_lens[s]:cu_q_lens[s +
        1]`; rows at or past `cu_q_lens[-1]` are padding (all -inf).
      weights: float32 `[total_q_tokens, index_n_heads]`.
      index_pages, index_scales, block_tables, scale, interpret, target, pages_per_iter, num_warps, num_stages: as
        for `indexer_scores`.
      kv_lens: int32 `[num_seqs]`: context length of each sequence *including* its query tokens (clipped to the
        table's capacity). Query i of sequence s sits at position `kv_lens[s] - q_len[s] + i` and scores the
        positions <= its own.
      cu_q_lens: int32 `[num_seqs + 1]`, non-decreasing, cu_q_lens[0] = 0; sequences with q_len 0 are allowed.
      block_q: query tokens per program (each program reads its chunk of keys once for all of them), a power of
        two; `None` = the mean query length rounded up to a power of two, at most 128 / next_pow2(index_n_heads)
        on GPU (`tiles.default_block_q`) and 256 / index_n_heads on TPU (`tpu.sparse.default_block_q`).

    Returns:
      float32 `[total_q_tokens, max_blocks_per_seq * block_size]`, -inf where a row sees nothing.

    Raises:
      ValueError: on malformed arguments or tuning values, as `indexer_scores`.
    """
    return _indexer(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                    index_scales=index_scales, interpret=interpret, target=target, block_q=block_q,
                    pages_per_iter=pages_per_iter, num_warps=num_warps, num_stages=num_stages)


def _sparse(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, *, scale, kv_scales, interpret,
            target, block_h, block_k, num_splits, num_warps, num_stages) -> jax.Array:
    """Validates a sparse MLA call once (decode when cu_q_lens is None), turns the selected positions into physical
    slots through the block table, and dispatches."""
    target = resolve_target(target, interpret)
    decode = cu_q_lens is None
    num_rows = q_latent.shape[0] if decode and getattr(q_latent, "ndim", 0) == 3 else None
    validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales, num_q_rows=num_rows)
    if decode:
        V.check_vector("lengths", kv_lens, q_latent.shape[0])
    else:
        V.check_vector("kv_lens", kv_lens, block_tables.shape[0])
        V.check_vector("cu_q_lens", cu_q_lens, block_tables.shape[0] + 1)
    validate_selection(indices, q_latent.shape[0])
    scale = check_mla_scale(scale)
    V.check_positive_option("num_splits", num_splits)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if 0 in (q_latent.shape[0], *block_tables.shape, kv_pages.shape[0]):  # nothing selectable: all zeros
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    slots = sparse_slots(indices, block_tables, kv_lens, cu_q_lens, block_size=kv_pages.shape[1])
    if target == "tpu":
        return sparse_mla_attention_tpu(q_latent, q_rope, kv_pages, slots, scale=scale, interpret=interpret,
                                        block_h=block_h, block_k=block_k, num_splits=num_splits)
    return sparse_mla_attention_gpu(q_latent, q_rope, kv_pages, slots, scale=scale, interpret=interpret,
                                    block_h=block_h, block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                                    num_stages=num_stages, kv_scales=kv_scales)


def sparse_mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    indices: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_h: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Sparse multi-head latent attention (DeepSeek V3.2) for decode: the absorbed MLA of `mla_paged_attention`
    over exactly the positions each sequence's query selected.

    Args:
      q_latent, q_rope, kv_pages, kv_scales, block_tables, lengths, scale: as for `mla_paged_attention`.
      indices: int32 `[num_seqs, top_k]`: the positions each query attends to (`top_k_positions` of the indexer's
        scores), -1 for none. Position p is read at block_tables[s, p // block_size], offset p % block_size; an
        entry the query does not see (negative, or >= lengths[s]) selects nothing. The selected positions of a row
        must be distinct (top-k's are): a repeated one would be counted twice.
      interpret, target: as for `mla_paged_attention` (TPU: float32 or bfloat16, any block_size, no 8-bit pages).
      block_h: query heads per program (each program gathers its row's selected page rows once for all of them).
        GPU: a power of two >= 16 (tl.dot; padding heads are masked), `None` = all heads up to a float32
        accumulator of 128 x 128 elements (`gpu.mla.default_block_h`). TPU: any positive int, `None` = all heads.
      block_k: selected positions gathered per step. GPU: a power of two >= 16, `None` = 64
        (`gpu.sparse.DEFAULT_BLOCK_K`); TPU: any positive int (one row DMA each, double-buffered), `None` = 128.
      num_splits: splits of each row's selection (flash-decoding: each split walks its share of the top_k / block_k
        steps, partials merged exactly), a positive int (at most the step count is used); `None`: on GPU enough
        programs to fill it (`default_num_splits` over rows x head blocks), on TPU 1.
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4, or 8 for accumulators of
        128 x 128 float32 elements and more.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      `[num_seqs, num_heads, R]` in q's dtype; zeros for a query that selects nothing (never NaN).

    Raises:
      ValueError: on malformed arguments (those of `mla_paged_attention`, indices not int32 `[num_seqs, top_k]`
        with top_k >= 1) or tuning values.
    """
    return _sparse(q_latent, q_rope, kv_pages, block_tables, lengths, None, indices, scale=scale,
                   kv_scales=kv_scales, interpret=interpret, target=target, block_h=block_h, block_k=block_k,
                   num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def ragged_sparse_mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    indices: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_h: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Sparse multi-head latent attention (DeepSeek V3.2) of ragged query chunks: the absorbed MLA of
    `ragged_mla_paged_attention` with each query row attending to exactly its selected positions.

    Args:
      q_latent, q_rope, kv_pages, kv_scales, block_tables, kv_lens, cu_q_lens, scale: as for
        `ragged_mla_paged_attention` (query i of sequence s at position kv_lens[s] - q_len[s] + i; rows past
        cu_q_lens[-1] are padding and get zeros).
      indices: int32 `[total_q_tokens, top_k]`, -1 for none; an entry the row does not see (negative, past its
        position or >= kv_lens[s]) selects nothing. Distinct per row, as for `sparse_mla_paged_attention`.
      interpret, target, block_h, block_k, num_splits, num_warps, num_stages: as for
        `sparse_mla_paged_attention`.

    Returns:
      `[total_q_tokens, num_heads, R]` in q's dtype; zeros for rows selecting nothing. With every visible position
      selected (index_topk >= the context) it equals `ragged_mla_paged_attention`.

    Raises:
      ValueError: on malformed arguments or tuning values, as `sparse_mla_paged_attention`.
    """
    return _sparse(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, scale=scale,
                   kv_scales=kv_scales, interpret=interpret, target=target, block_h=block_h, block_k=block_k,
                   num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def validate_indexer(q_index: jax.Array, weights: jax.Array, index_pages: jax.Array, block_tables: jax.Array,
                     index_scales, num_q_rows: int | None = None) -> tuple[int, int, bool]:
    """Checks the arguments common to the indexer-score entry points (`indexer_scores`, `ragged_indexer_scores`);
    returns (index_n_heads, index_head_dim, quantized).

    q_index `[rows, index_n_heads, index_head_dim]` in a float dtype; weights `[rows, index_n_heads]` float32;
    index_pages `[num_blocks, block_size, index_head_dim]` (one key per token, shared by every indexer head) in
    q_index's dtype, or int8 / float8_e4m3fn with index_scales `[num_blocks, block_size]` float32 or bfloat16
    (and only then)."""
    for name, x in (("q_index", q_index), ("weights", weights), ("index_pages", index_pages),
                    ("block_tables", block_tables)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q_index.ndim != 3:
        raise ValueError(f"q_index must be 3-D [tokens, index_n_heads, index_head_dim], got shape {q_index.shape}")
    if weights.ndim != 2 or tuple(weights.shape) != tuple(q_index.shape[:2]):
        raise ValueError(f"weights must have shape [tokens, index_n_heads] = {tuple(q_index.shape[:2])}, got "
                         f"{tuple(weights.shape)}")
    if jnp.dtype(weights.dtype) != jnp.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")
    if index_pages.ndim != 3:
        raise ValueError(f"index_pages must be 3-D [num_blocks, block_size, index_head_dim], got shape "
                         f"{index_pages.shape}")
    if jnp.dtype(q_index.dtype) not in V.SUPPORTED_DTYPES:
        raise ValueError(f"q_index's dtype must be one of float32, bfloat16, float16; got {q_index.dtype}")
    quantized = is_quantized(index_pages.dtype)
    if not quantized and jnp.dtype(index_pages.dtype) != jnp.dtype(q_index.dtype):
        raise ValueError(f"index_pages must be in q_index's dtype ({q_index.dtype}) or int8 / float8_e4m3fn, got "
                         f"{index_pages.dtype}")
    num_heads, head_dim = q_index.shape[1], q_index.shape[2]
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"need index_n_heads >= 1 and index_head_dim >= 1, got {num_heads} and {head_dim}")
    if index_pages.shape[2] != head_dim:
        raise ValueError(f"index_pages' last dimension ({index_pages.shape[2]}) must be index_head_dim = {head_dim} "
                         f"(q_index.shape[-1])")
    if index_pages.shape[1] < 1:
        raise ValueError(f"block_size must be >= 1, got {index_pages.shape[1]}")
    V.check_int32("block_tables", block_tables, 2)
    if num_q_rows is not None and block_tables.shape[0] != num_q_rows:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but there are {num_q_rows} sequences")
    V.check_token_scales("index_scales", "index_pages", index_pages, index_scales)
    return num_heads, head_dim, quantized


def check_indexer_scale(scale) -> float:
    """The indexer's scale is required (DeepSeek V3.2: 1 / sqrt(index_head_dim), with the weights already
    carrying index_n_heads ** -0.5) and a static Python float."""
    if scale is None or isinstance(scale, bool):
        raise ValueError(f"scale must be given as a Python float (DeepSeek V3.2: 1 / sqrt(index_head_dim)), "
                         f"got {scale!r}")
    return V.resolve_scale(scale, 1)


def validate_selection(indices, num_rows: int) -> int:
    """The selected positions of the sparse attention entry points: int32 `[rows, top_k]` with rows = the query
    rows and top_k >= 1; returns top_k."""
    if not hasattr(indices, "shape") or not hasattr(indices, "dtype"):
        raise ValueError(f"indices must be an int32 array, got {type(indices).__name__}")
    V.check_int32("indices", indices, 2)
    if indices.shape[0] != num_rows:
        raise ValueError(f"indices must have one row per query row ({num_rows}), got shape {indices.shape}")
    if indices.shape[1] < 1:
        raise ValueError(f"indices must select at least one position per row (top_k >= 1), got shape "
                         f"{indices.shape}")
    return indices.shape[1]


@functools.partial(jax.jit, static_argnames=("scale",))
def _indexer_reference(q_index, weights, index_pages, block_tables, kv_lens, cu_q_lens, index_scales, *, scale):
    num_tokens = q_index.shape[0]
    max_len = block_tables.shape[1] * index_pages.shape[1]
    table_rows, ends = tiles.row_metadata(kv_lens, cu_q_lens, num_tokens, max_len)
    k = gather_latent(index_pages, index_scales, block_tables[table_rows], jnp.float32)  # one copy per query row
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
    tile_seq, rows, valid, pos, token_slot = query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    num_tiles = tile_seq.shape[0]
    keep = valid[:, :, None] & visible(jnp.arange(max_len, dtype=jnp.int32), pos[:, :, None],
                                        kv_lens[tile_seq][:, None, None], None)  # [NT, tq, L]
    dtype = jnp.dtype(q_index.dtype)
    k = gather_latent(index_pages, index_scales, block_tables[tile_seq], dtype)  # [NT, L, D], once per tile
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
    validate_indexer(q_index, weights, index_pages, block_tables, index_scales, num_rows)
    if cu_q_lens is None:
        V.check_vector("lengths", kv_lens, q_index.shape[0])
    else:
        check_ragged(q_index, block_tables, kv_lens, cu_q_lens)
    return check_indexer_scale(scale)


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
    kv = gather_latent(kv_pages, kv_scales, block_tables[table_rows], jnp.float32)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[:, None]
    o = latent_attention(q, kv, selected[:, None], scale=scale, rank=q_latent.shape[-1], compute_dtype=jnp.float32)
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
    o = latent_attention(q, g, ok[:, None], scale=scale, rank=q_latent.shape[-1], compute_dtype=dtype)
    return o[:, 0].astype(q_latent.dtype)


def _sparse_checked(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales, scale):
    """Validates a sparse MLA call (decode when cu_q_lens is None); returns the scale."""
    num_rows = q_latent.shape[0] if cu_q_lens is None and getattr(q_latent, "ndim", 0) == 3 else None
    scale = mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, num_rows)
    if cu_q_lens is None:
        V.check_vector("lengths", kv_lens, q_latent.shape[0])
    else:
        check_ragged(q_latent, block_tables, kv_lens, cu_q_lens)
    validate_selection(indices, q_latent.shape[0])
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
    if mla_empty(q_latent, kv_pages, block_tables):
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
    if mla_empty(q_latent, kv_pages, block_tables):
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
    if mla_empty(q_latent, kv_pages, block_tables):
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
    if mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _sparse_xla(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, indices, kv_scales,
                       scale=scale)
