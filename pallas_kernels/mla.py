"""Multi-head latent attention (MLA) over one latent page array: the entry points, their references, XLA paths and
argument checks.

One page array `kv_pages [num_blocks, block_size, R + Dr]` holds each token's latent c_kv (R) then its shared
rotary key k_rope (Dr); every query head attends to the same entries. With the up-projections absorbed by
the caller (q_latent[h] = W_UK[h] q_nope[h]) head h's score against token t is
    scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t]) = scale * ([q_latent | q_rope][h] . kv_pages[t])
and its output, in latent space, is sum_t softmax_t c_kv[t] (the caller applies W_UV). Both the references
and the XLA paths score the whole page row against [q_latent | q_rope] at once and keep the first R columns
of the weighted sum: one contraction each way, no slice of the gathered pages.

`mla_attention_dense_reference` is MLA without weight absorption (keys and values expanded per head): the
oracle of the absorption algebra.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _validate as V
from pallas_kernels.dense import HIGHEST, chunked_partial, default_q_tile, fold, query_tiles, token_layout, visible
from pallas_kernels.dispatch import resolve_target
from pallas_kernels.gpu.mla import mla_paged_attention_gpu, ragged_mla_paged_attention_gpu
from pallas_kernels.quant import dequantize_kv, is_quantized
from pallas_kernels.tpu.mla import mla_paged_attention_tpu, ragged_mla_paged_attention_tpu


def mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_splits: int | None = None,
    block_h: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Multi-head latent attention (MLA, DeepSeek V2/V3) decode, one query token per sequence, over a paged
    latent cache, with the up-projections absorbed by the caller.

    Head h's score against token t is `scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])` and its output
    is `sum_t softmax_t c_kv[t]` (in latent space: the caller applies W_UV). q_latent = W_UK[h] q_nope[h].

    Args:
      q_latent: `[num_seqs, num_heads, R]` (R = kv_lora_rank, 512 in DeepSeek V3), float32, bfloat16 or
        float16.
      q_rope: `[num_seqs, num_heads, Dr]` (the rotary part, 64 in DeepSeek V3), q_latent's dtype.
      kv_pages: `[num_blocks, block_size, R + Dr]`: per token its latent c_kv, then its rotary key k_rope,
        shared by all heads. q's dtype, or int8 / float8_e4m3fn with `kv_scales`.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`; entries past `cdiv(lengths[s], block_size)` are
        never read and may hold anything.
      lengths: int32 `[num_seqs]`: tokens cached per sequence (clipped to the table's capacity). Slots at or
        past the length are never read.
      scale: multiplies the scores, required (DeepSeek: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times
        the YaRN mscale^2 where used): a static Python float.
      kv_scales: with 8-bit pages (and only then), `[num_blocks, block_size]` float32 or bfloat16, one per
        token: the attended rows are `kv_pages.astype(float32) * kv_scales[..., None]` (`quant.quantize_kv`
        makes them), dequantized in the kernel.
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform, interpreted
        elsewhere (for "tpu": Pallas's TPU interpret mode; a `pltpu.InterpretParams` sets its options).
      target: "gpu" (Triton), "tpu" (Mosaic: float32 or bfloat16, block_size a multiple of 8 for float32 and
        of 16 for bfloat16, no 8-bit pages) or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      num_splits: context splits per sequence (flash-decoding, merged exactly), a positive int; `None`: on GPU
        enough programs to fill it (`default_num_splits` over sequences x head blocks), on TPU 1.
      block_h: query heads per program; each program reads its sequence's pages once for all of them. GPU: a
        power of two >= 16 (tl.dot; padding heads are masked), `None` = all heads up to a float32 accumulator
        of 128 x 128 elements (32 heads at R = 512, see `gpu.mla.default_block_h`). TPU: any positive int,
        `None` = all heads.
      pages_per_iter: pages per inner-loop iteration (GPU: a power of two with `pages_per_iter *
        next_pow2(block_size) >= 16`; TPU: pages per double-buffered DMA chunk, any positive int); `None`
        sizes the tile from the latent width (`gpu._common.default_pages_per_iter` /
        `tpu._common.default_pages_per_iter`).
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4, or 8 for accumulators of
        128 x 128 float32 elements and more.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      `[num_seqs, num_heads, R]` in q's dtype; zeros for sequences of length 0.

    Raises:
      ValueError: on malformed arguments (ranks, R + Dr != kv_pages.shape[-1], dtypes, scales with float pages
        or none with 8-bit pages, non-int32 tables) or tuning values.
    """
    target = resolve_target(target, interpret)
    num_seqs = q_latent.shape[0] if getattr(q_latent, "ndim", 0) == 3 else None
    validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales, num_q_rows=num_seqs)
    V.check_vector("lengths", lengths, num_seqs)
    scale = check_mla_scale(scale)
    V.check_positive_option("num_splits", num_splits)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return mla_paged_attention_tpu(q_latent, q_rope, kv_pages, block_tables, lengths, scale=scale,
                                       interpret=interpret, num_splits=num_splits, block_h=block_h,
                                       pages_per_iter=pages_per_iter)
    return mla_paged_attention_gpu(q_latent, q_rope, kv_pages, block_tables, lengths, scale=scale,
                                   interpret=interpret, block_h=block_h, pages_per_iter=pages_per_iter,
                                   num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                                   kv_scales=kv_scales)


def ragged_mla_paged_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    kv_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float,
    kv_scales: jax.Array | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    block_q: int | None = None,
    block_h: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
) -> jax.Array:
    """Causal multi-head latent attention (MLA, absorbed) of ragged query chunks (prefill chunks and decode
    tokens of many sequences) over a paged latent cache; the conventions of `ragged_paged_attention` with the
    layout and scores of `mla_paged_attention`.

    Args:
      q_latent: `[total_q_tokens, num_heads, R]`, float32, bfloat16 or float16; sequence s owns rows
        `cu_q_lens[s]:cu_q_lens[s + 1]`, rows at or past `cu_q_lens[-1]` are padding and get zeros.
      q_rope: `[total_q_tokens, num_heads, Dr]`, q_latent's dtype.
      kv_pages: `[num_blocks, block_size, R + Dr]` (latent, then rope) in q's dtype or int8 / float8_e4m3fn
        with `kv_scales`, already holding the new tokens' rows.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`.
      kv_lens: int32 `[num_seqs]`: context length of each sequence *including* its query tokens (clipped to
        the table's capacity). Query i of sequence s sits at position `kv_lens[s] - q_len[s] + i` and attends
        to positions <= its own.
      cu_q_lens: int32 `[num_seqs + 1]`, non-decreasing, cu_q_lens[0] = 0; sequences with q_len 0 are allowed.
      scale, kv_scales, interpret, target, block_h, pages_per_iter, num_warps, num_stages: as for
        `mla_paged_attention` (GPU block_h: a power of two with block_q * block_h >= 16).
      block_q: query tokens per tile, a power of two; `None` picks one from the mean query length, with
        block_q * block_h rows within the accumulator bound on GPU (`tiles.default_block_q`) and within 256
        rows on TPU.

    Returns:
      `[total_q_tokens, num_heads, R]` in q's dtype.

    Raises:
      ValueError: on malformed arguments or tuning values, as `mla_paged_attention`.
    """
    target = resolve_target(target, interpret)
    validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales)
    num_seqs = block_tables.shape[0]
    V.check_vector("kv_lens", kv_lens, num_seqs)
    V.check_vector("cu_q_lens", cu_q_lens, num_seqs + 1)
    scale = check_mla_scale(scale)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return ragged_mla_paged_attention_tpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens,
                                              scale=scale, interpret=interpret, block_q=block_q, block_h=block_h,
                                              pages_per_iter=pages_per_iter)
    return ragged_mla_paged_attention_gpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens,
                                          scale=scale, interpret=interpret, block_q=block_q, block_h=block_h,
                                          pages_per_iter=pages_per_iter, num_warps=num_warps,
                                          num_stages=num_stages, kv_scales=kv_scales)


def validate_mla(q_latent: jax.Array, q_rope: jax.Array, kv_pages: jax.Array, block_tables: jax.Array, kv_scales,
                 num_q_rows: int | None = None) -> tuple[int, int, bool]:
    """Checks the arguments common to the MLA entry points (`mla_paged_attention`,
    `ragged_mla_paged_attention`); returns (kv_lora_rank R, rope dim Dr, quantized).

    q_latent `[tokens, num_heads, R]` and q_rope `[tokens, num_heads, Dr]` share one float dtype; kv_pages
    `[num_blocks, block_size, R + Dr]` (latent first, then rope) is in that dtype, or int8 / float8_e4m3fn with
    kv_scales `[num_blocks, block_size]` float32 or bfloat16 (and only then)."""
    for name, x in (("q_latent", q_latent), ("q_rope", q_rope), ("kv_pages", kv_pages),
                    ("block_tables", block_tables)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q_latent.ndim != 3:
        raise ValueError(f"q_latent must be 3-D [tokens, num_heads, kv_lora_rank], got shape {q_latent.shape}")
    if q_rope.ndim != 3:
        raise ValueError(f"q_rope must be 3-D [tokens, num_heads, rope_dim], got shape {q_rope.shape}")
    if q_rope.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"q_latent and q_rope must agree on [tokens, num_heads], got {q_latent.shape} and "
                         f"{q_rope.shape}")
    if kv_pages.ndim != 3:
        raise ValueError(f"kv_pages must be 3-D [num_blocks, block_size, kv_lora_rank + rope_dim], got shape "
                         f"{kv_pages.shape}")
    if jnp.dtype(q_latent.dtype) != jnp.dtype(q_rope.dtype):
        raise ValueError(f"q_latent and q_rope must share one dtype, got {q_latent.dtype} and {q_rope.dtype}")
    if jnp.dtype(q_latent.dtype) not in V.SUPPORTED_DTYPES:
        raise ValueError(f"q's dtype must be one of float32, bfloat16, float16; got {q_latent.dtype}")
    quantized = is_quantized(kv_pages.dtype)
    if not quantized and jnp.dtype(kv_pages.dtype) != jnp.dtype(q_latent.dtype):
        raise ValueError(f"kv_pages must be in q's dtype ({q_latent.dtype}) or int8 / float8_e4m3fn, got "
                         f"{kv_pages.dtype}")
    num_heads, rank, rope_dim = q_latent.shape[1], q_latent.shape[2], q_rope.shape[2]
    num_blocks, block_size, width = kv_pages.shape
    if num_heads < 1:
        raise ValueError(f"need at least one head, got num_heads={num_heads}")
    if rank < 1 or rope_dim < 1:
        raise ValueError(f"kv_lora_rank and rope_dim must be >= 1, got {rank} and {rope_dim}")
    if width != rank + rope_dim:
        raise ValueError(f"kv_pages' last dimension ({width}) must be kv_lora_rank + rope_dim = {rank} + {rope_dim} "
                         f"(q_latent.shape[-1] + q_rope.shape[-1])")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    V.check_int32("block_tables", block_tables, 2)
    if num_q_rows is not None and block_tables.shape[0] != num_q_rows:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but there are {num_q_rows} sequences")
    V.check_token_scales("kv_scales", "kv_pages", kv_pages, kv_scales)
    return rank, rope_dim, quantized


def check_mla_scale(scale) -> float:
    """MLA's scale is required (1 / sqrt(qk_nope_dim + rope_dim) in DeepSeek: not derivable from the latent
    shapes) and a static Python float."""
    if scale is None or isinstance(scale, bool):
        raise ValueError(f"scale must be given as a Python float (DeepSeek: 1 / sqrt(qk_nope_head_dim + "
                         f"qk_rope_head_dim)), got {scale!r}")
    return V.resolve_scale(scale, 1)


def gather_latent(kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
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


def _latent_fold(q, kv, keep, prior=None, *, scale: float, compute_dtype):
    """The (m, z, u) partial of `latent_attention`'s scores (`dense.fold`), u over the whole page row; with `prior`,
    merged with it."""
    # Slots no query row reads may hold anything (NaN included): select them away, never multiply them by zero.
    kv = jnp.where(jnp.any(keep, axis=1)[..., None], kv, jnp.zeros((), compute_dtype))
    s = jnp.einsum("nthw,nlw->nthl", q.astype(compute_dtype), kv, precision=HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    s = jnp.where(keep[:, :, None, :], s, -jnp.inf)
    return fold(s, lambda p: jnp.einsum("nthl,nlw->nthw", p.astype(compute_dtype), kv, precision=HIGHEST,
                                        preferred_element_type=jnp.float32), prior)


def _finalized(z, u, rank: int):
    return jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)[..., :rank]


def latent_attention(q, kv, keep, *, scale: float, rank: int, compute_dtype):
    """q `[N, T, H, R + Dr]` ([q_latent | q_rope]), kv `[N, L, R + Dr]` in compute_dtype, keep bool `[N, T, L]`
    -> `[N, T, H, R]` float32: T query rows of H heads per gathered row of pages."""
    _, z, u = _latent_fold(q, kv, keep, scale=scale, compute_dtype=compute_dtype)
    return _finalized(z, u, rank)


def _latent_partial(q, kv_pages, kv_scales, tables, keep, prior=None, *, scale: float):
    """`_latent_fold` over the pages `tables` `[N, P]`, gathered here in q's dtype: `dense.chunked_partial`'s
    step."""
    compute_dtype = jnp.dtype(q.dtype)
    kv = gather_latent(kv_pages, kv_scales, tables, compute_dtype)  # [N, L, R + Dr]
    return _latent_fold(q, kv, keep, prior, scale=scale, compute_dtype=compute_dtype)


def _latent_chunks(q, kv_pages, kv_scales, tables, keep_at, longest, *, scale: float, rank: int, kv_chunk: int):
    """The XLA paths' latent attention of query tiles q `[N, T, H, R + Dr]` over their pages `tables` `[N, P]`,
    `kv_chunk` positions at a time (`dense.chunked_partial`) -> `[N, T, H, R]` float32."""
    _, z, u = chunked_partial(functools.partial(_latent_partial, q, scale=scale), (kv_pages, kv_scales), tables,
                              keep_at, longest=longest, kv_chunk=kv_chunk, block_size=kv_pages.shape[1])
    return _finalized(z, u, rank)


@functools.partial(jax.jit, static_argnames=("scale", "compute_dtype", "kv_chunk"))
def _mla_decode(q_latent, q_rope, kv_pages, block_tables, lengths, kv_scales, *, scale, compute_dtype,
                kv_chunk=None):
    """kv_chunk None: the whole table in one masked softmax (the reference); else `_latent_chunks`."""
    block_size = kv_pages.shape[1]
    max_len = block_tables.shape[1] * block_size
    lengths = jnp.clip(lengths, 0, max_len)
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[:, None].astype(compute_dtype)
    keep_at = lambda kv_pos: (kv_pos[None, :] < lengths[:, None])[:, None, :]  # [N, 1, L]
    if kv_chunk is not None:
        o = _latent_chunks(q, kv_pages, kv_scales, block_tables, keep_at, jnp.max(lengths), scale=scale,
                           rank=q_latent.shape[-1], kv_chunk=kv_chunk)
        return o[:, 0].astype(q_latent.dtype)
    kv = gather_latent(kv_pages, kv_scales, block_tables, compute_dtype)
    keep = keep_at(jnp.arange(max_len, dtype=jnp.int32))
    o = latent_attention(q, kv, keep, scale=scale, rank=q_latent.shape[-1], compute_dtype=compute_dtype)
    return o[:, 0].astype(q_latent.dtype)


def mla_empty(q_latent, kv_pages, block_tables) -> bool:
    """No query rows, sequences, table entries or pool blocks: nothing to gather (the result is all zeros)."""
    return 0 in (q_latent.shape[0], block_tables.shape[0], block_tables.shape[1], kv_pages.shape[0])


def mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, num_q_rows=None) -> float:
    validate_mla(q_latent, q_rope, kv_pages, block_tables, kv_scales, num_q_rows)
    return check_mla_scale(scale)


def mla_paged_attention_reference(q_latent: jax.Array,  # [num_seqs, num_heads, R]
                                  q_rope: jax.Array,  # [num_seqs, num_heads, Dr]
                                  kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                                  block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                  lengths: jax.Array,  # i32[num_seqs]
                                  *, scale: float,
                                  kv_scales: jax.Array | None = None) -> jax.Array:  # [num_blocks, block_size]
    """Dense float32 reference of `pallas_kernels.mla_paged_attention` (gathers the whole table, then masks):
    the absorbed MLA definition. Returns `[num_seqs, num_heads, R]` in q's dtype; zeros for length 0."""
    scale = mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, q_latent.shape[0])
    V.check_vector("lengths", lengths, q_latent.shape[0])
    if mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _mla_decode(q_latent, q_rope, kv_pages, block_tables, lengths, kv_scales, scale=scale,
                       compute_dtype=jnp.float32)


def mla_paged_attention_xla(q_latent: jax.Array,  # [num_seqs, num_heads, R]
                            q_rope: jax.Array,  # [num_seqs, num_heads, Dr]
                            kv_pages: jax.Array,  # [num_blocks, block_size, R + Dr]
                            block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                            lengths: jax.Array,  # i32[num_seqs]
                            *, scale: float,
                            kv_scales: jax.Array | None = None,  # [num_blocks, block_size]
                            kv_chunk: int = 128) -> jax.Array:
    """XLA gather path for MLA decode: same contract as `mla_paged_attention`; each sequence's pages are gathered
    `kv_chunk` positions (whole pages) at a time, up to the longest sequence, in q's dtype (8-bit pages dequantized
    into it right after the gather), shared by all heads, each chunk's partial folded into the running one exactly
    with float32 accumulation (`dense.chunked_partial`): `[num_seqs, kv_chunk, R + Dr]` gathered at a time."""
    V.check_positive_int("kv_chunk", kv_chunk)
    scale = mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale, q_latent.shape[0])
    V.check_vector("lengths", lengths, q_latent.shape[0])
    if mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _mla_decode(q_latent, q_rope, kv_pages, block_tables, lengths, kv_scales, scale=scale,
                       compute_dtype=jnp.dtype(q_latent.dtype), kv_chunk=kv_chunk)


@functools.partial(jax.jit, static_argnames=("scale",))
def _ragged_mla_reference(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales, *, scale):
    num_tokens = q_latent.shape[0]
    max_len = block_tables.shape[1] * kv_pages.shape[1]
    kv_lens = jnp.clip(kv_lens, 0, max_len)  # as the kernels clip them (`tiles.tile_metadata`)
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, num_tokens)
    keep = valid[:, None] & visible(jnp.arange(max_len, dtype=jnp.int32)[None, :], pos[:, None],
                                     kv_lens[seq][:, None], None)
    kv = gather_latent(kv_pages, kv_scales, block_tables[seq], jnp.float32)  # one copy per query row
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[:, None]
    o = latent_attention(q, kv, keep[:, None], scale=scale, rank=q_latent.shape[-1], compute_dtype=jnp.float32)
    return o[:, 0].astype(q_latent.dtype)


def check_ragged(q_latent, block_tables, kv_lens, cu_q_lens) -> None:
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
    scale = mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale)
    check_ragged(q_latent, block_tables, kv_lens, cu_q_lens)
    if mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _ragged_mla_reference(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales,
                                 scale=scale)


@functools.partial(jax.jit, static_argnames=("scale", "q_tile", "kv_chunk"))
def _ragged_mla_xla(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales, *, scale, q_tile,
                    kv_chunk):
    num_tokens, num_heads, rank = q_latent.shape
    max_len = block_tables.shape[1] * kv_pages.shape[1]
    tq = max(1, min(q_tile, num_tokens))
    kv_lens = jnp.clip(kv_lens, 0, max_len)
    tile_seq, rows, valid, pos, token_slot = query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    num_tiles = tile_seq.shape[0]
    keep_at = lambda kv_pos: valid[:, :, None] & visible(kv_pos, pos[:, :, None], kv_lens[tile_seq][:, None, None],
                                                          None)  # [NT, tq, L]
    q = jnp.concatenate([q_latent, q_rope], axis=-1)[jnp.clip(rows, 0, num_tokens - 1)]  # [NT, tq, H, R + Dr]
    o = _latent_chunks(q, kv_pages, kv_scales, block_tables[tile_seq], keep_at, jnp.max(kv_lens), scale=scale,
                       rank=rank, kv_chunk=kv_chunk)
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
                                   q_tile: int | None = None, kv_chunk: int = 128) -> jax.Array:
    """XLA gather path for ragged MLA: same contract as `ragged_mla_paged_attention`, pages in q's dtype (8-bit
    pages dequantized into it right after the gather), float32 accumulation. Each sequence's queries are cut
    into tiles of `q_tile` consecutive rows (a decode token is a tile of its own; None: `dense.default_q_tile` of
    the step's rows and sequences), at most `dense.num_query_tiles` of them, each computed, and each tile walks
    its sequence's pages `kv_chunk` positions at a time, up to the step's longest context, for all its rows and
    heads (`dense.chunked_partial`): `[num_tiles, kv_chunk, R + Dr]` gathered at a time."""
    if q_tile is None:
        q_tile = default_q_tile(q_latent.shape[0], block_tables.shape[0])
    V.check_positive_int("q_tile", q_tile)
    V.check_positive_int("kv_chunk", kv_chunk)
    scale = mla_validated(q_latent, q_rope, kv_pages, block_tables, kv_scales, scale)
    check_ragged(q_latent, block_tables, kv_lens, cu_q_lens)
    if mla_empty(q_latent, kv_pages, block_tables):
        return jnp.zeros(q_latent.shape, q_latent.dtype)
    return _ragged_mla_xla(q_latent, q_rope, kv_pages, block_tables, kv_lens, cu_q_lens, kv_scales, scale=scale,
                           q_tile=q_tile, kv_chunk=kv_chunk)


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
