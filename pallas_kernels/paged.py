"""Paged attention (MHA / GQA / MQA) over `[num_kv_heads, num_blocks, block_size, head_dim]` K and V pages: the entry
points, their dense references and XLA paths, and their argument checks.

`paged_attention_reference` and `ragged_paged_attention_reference` gather each sequence's pages into
contiguous K/V, mask, and take a float32 softmax: the oracle every kernel test compares against. They
take exactly the kernels' arguments and honour the same contract (length 0 gives zeros, slots past the
length or before a query's window never influence the result, even if they hold NaN).

`paged_attention_xla` and `ragged_paged_attention_xla` are the same math written for speed with XLA (K/V
stay in their dtype, matmuls accumulate in float32, ragged queries in tiles, keys a chunk at a time with the
partials merged exactly: `dense.chunked_partial`): the engine's CPU path and the baseline the kernel benchmark
compares against. With a sliding window both gather only the pages that can hold window positions (a static
count bounded by the window, not the context), so block-table entries of pages wholly before the window are
never read.

Variants, shared by the four reference / XLA functions (and by the kernels):
  * `sliding_window=W`: a query at position p attends to key positions j with p - W < j <= p;
  * `logits_soft_cap=c`: scaled scores s become c * tanh(s / c) before masking and softmax;
  * 8-bit pages (int8 or float8_e4m3fn) with `k_scales`/`v_scales` `[num_kv_heads, num_blocks, block_size]`
    (float32 or bfloat16): the attended values are `pages.astype(float32) * scales[..., None]`, computed
    right after the gather (only gathered pages are dequantized, never the pool);
  * ragged only, `attend_until` int32 `[total_q_tokens]`: query row t at position p attends to key positions
    j <= max(p, attend_until[t]) (and j < kv_len, and j > p - W with a window): bidirectional attention among
    the tokens of a span (an image's), see `pallas_kernels.ragged_paged_attention`;
  * `sinks` float32 `[num_q_heads]` (gpt-oss's attention sinks): query head h's logit sink[h] joins its softmax as
    one more column, after the scale and the soft cap (the sink itself is neither scaled nor capped), and is
    dropped after it: o = sum_j exp(s_j - m) v_j / (exp(sink[h] - m) + sum_j exp(s_j - m)), m = max(sink[h],
    max_j s_j). A query that sees no key gives zeros.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _validate as V
from pallas_kernels import tiles
from pallas_kernels.dense import HIGHEST, chunked_partial, default_q_tile, fold, query_tiles, token_layout, visible
from pallas_kernels.dispatch import resolve_target
from pallas_kernels.gpu.paged_attention import paged_attention_gpu
from pallas_kernels.gpu.ragged_attention import ragged_paged_attention_gpu
from pallas_kernels.merge import Partial, join_sink, merge_two
from pallas_kernels.quant import dequantize_kv, is_quantized
from pallas_kernels.tpu.paged_attention import paged_attention_tpu
from pallas_kernels.tpu.ragged_attention import ragged_paged_attention_tpu


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
    num_splits: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    target: str = "auto",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Decode attention of one query token per sequence over a paged KV cache.

    Args:
      q: `[num_seqs, num_q_heads, head_dim]`, float32, bfloat16 or float16.
      k_pages, v_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`, q's dtype (the layout of JAX's
        own Pallas paged-attention op), or both int8 or both float8_e4m3fn with `k_scales`/`v_scales`.
        `num_q_heads % num_kv_heads == 0` (MHA, GQA, MQA); head_dim a multiple of 16, at most 256; any
        block_size (powers of two are fastest).
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`: logical block j of sequence s lives in
        physical block `block_tables[s, j]`. Entries past `cdiv(lengths[s], block_size)` are never read
        and may hold anything; so are those of pages wholly before a sliding window.
      lengths: int32 `[num_seqs]`: tokens in each sequence's cache (clipped to
        `[0, max_blocks_per_seq * block_size]`). Slots at or past the length are never read.
      scale: multiplies q.k; defaults to `1 / sqrt(head_dim)`. (JAX's op applies no scale.)
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform (GPU for "gpu",
        TPU for "tpu"), interpreted elsewhere. With target "tpu" it is Pallas's TPU interpret mode (DMAs
        and semaphores simulated); a `pltpu.InterpretParams` sets its options.
      num_splits: KV splits per sequence (flash-decoding), a positive int; `None` picks one from the batch
        and table shape (see `default_num_splits`; 1 on TPU). Any count works: no divisibility constraints.
      pages_per_iter: pages gathered per inner-loop iteration. GPU: a power of two with
        `pages_per_iter * next_pow2(block_size) >= 16`; `None` = about 128 tokens per iteration (see
        `gpu._common.default_pages_per_iter`). TPU: pages per double-buffered DMA chunk, any positive int;
        `None` = about 64 KiB of K per chunk (see `tpu._common.default_pages_per_iter`).
      num_warps: Triton warps per program (compiled GPU mode only).
      num_stages: Triton software-pipelining stages (compiled GPU mode only).
      target: "gpu" (Triton kernels), "tpu" (Mosaic kernels: float32 or bfloat16, block_size a multiple
        of 8 for float32 and of 16 for bfloat16), or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      sliding_window: W, an int >= 1: the query (at position lengths[s] - 1) attends to the last W positions
        only. Each sequence's splits are cut over the window's pages; pages before it are never loaded.
      logits_soft_cap: c, a finite float > 0: scaled scores s become c * tanh(s / c) before the softmax.
      k_scales, v_scales: with 8-bit pages (and only then), `[num_kv_heads, num_blocks, block_size]` float32
        or bfloat16: the attended K/V are `pages.astype(float32) * scales[..., None]`, dequantized in
        registers after 8-bit loads (see `pallas_kernels.quant`).
      sinks: float32 `[num_q_heads]`, finite (gpt-oss's attention sinks): head h's softmax gets one more logit,
        sink[h], that takes weight and gives no value (see the module docstring). Joined into each query's (m, z,
        u) once, after the merge of its splits. An array input: new values recompile nothing.

    Returns:
      `[num_seqs, num_q_heads, head_dim]` in q's dtype; zeros for sequences of length 0 (with sinks too).

    Raises:
      ValueError: on malformed arguments or tuning values (shapes, dtypes, non-power-of-two tiles).
      TypeError: on an unknown keyword argument.
    """
    target = resolve_target(target, interpret)
    num_seqs = q.shape[0] if getattr(q, "ndim", 0) == 3 else None
    _, head_dim, _, _, _, _ = validate_qkv(q, k_pages, v_pages, block_tables, num_q_rows=num_seqs)
    V.check_vector("lengths", lengths, num_seqs)
    sliding_window, logits_soft_cap, _ = validate_variants(
        k_pages, v_pages, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scales=k_scales,
        v_scales=v_scales)
    check_sinks(sinks, q.shape[1])
    scale = V.resolve_scale(scale, head_dim)
    V.check_positive_option("num_splits", num_splits)
    V.check_positive_int("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return paged_attention_tpu(q, k_pages, v_pages, block_tables, lengths, scale=scale, interpret=interpret,
                                   num_splits=num_splits, pages_per_iter=pages_per_iter,
                                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
    return paged_attention_gpu(q, k_pages, v_pages, block_tables, lengths, scale=scale, interpret=interpret,
                               num_splits=num_splits, pages_per_iter=pages_per_iter, num_warps=num_warps,
                               num_stages=num_stages, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, k_scales=k_scales, v_scales=v_scales, sinks=sinks)


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    scale: float | None = None,
    interpret: bool | None = None,
    block_q: int | None = None,
    pages_per_iter: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    target: str = "auto",
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    attend_until: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ragged query chunks (prefill chunks and decode tokens) over a paged KV cache.

    Args:
      q: `[total_q_tokens, num_q_heads, head_dim]`, float32, bfloat16 or float16. Sequence s owns rows
        `cu_q_lens[s]:cu_q_lens[s + 1]`; rows at or past `cu_q_lens[-1]` are padding and get zeros.
      k_pages, v_pages: `[num_kv_heads, num_blocks, block_size, head_dim]` in q's dtype (or both int8 or
        both float8_e4m3fn with `k_scales`/`v_scales`), already holding the K/V of the new tokens.
        `num_q_heads % num_kv_heads == 0`; head_dim a multiple of 16, <= 256.
      block_tables: int32 `[num_seqs, max_blocks_per_seq]`.
      kv_lens: int32 `[num_seqs]`: context length of each sequence *including* its query tokens (clipped
        to `[0, max_blocks_per_seq * block_size]`). Query i of sequence s sits at position
        `kv_lens[s] - q_len[s] + i` and attends to positions <= its own; earlier context (prefix-cached
        blocks included) is read through the block table.
      cu_q_lens: int32 `[num_seqs + 1]`, non-decreasing, cu_q_lens[0] = 0. Sequences with q_len 0
        (padding) are allowed.
      scale: multiplies q.k; defaults to `1 / sqrt(head_dim)`.
      interpret: run the Pallas interpreter; `None` = compiled on the target's own platform (GPU for "gpu",
        TPU for "tpu"), interpreted elsewhere. With target "tpu" it is Pallas's TPU interpret mode (DMAs
        and semaphores simulated); a `pltpu.InterpretParams` sets its options.
      block_q: query tokens per tile, a power of two; on GPU also `block_q * next_pow2(group) >= 16` (group =
        num_q_heads // num_kv_heads); `None` picks one from the mean query length (see `tiles.default_block_q`).
      pages_per_iter: pages gathered per inner-loop iteration. GPU: a power of two with
        `pages_per_iter * next_pow2(block_size) >= 16`; `None` = about 64 tokens per iteration. TPU: pages
        per double-buffered DMA chunk, any positive int; `None` = about 64 KiB of K per chunk.
      num_warps: Triton warps per program (compiled GPU mode only); `None` = 4, or 8 for tiles of 128 x 128
        accumulator elements and more (see `gpu.ragged_attention.default_num_warps`).
      num_stages: Triton software-pipelining stages (compiled GPU mode only).
      target: "gpu" (Triton kernels), "tpu" (Mosaic kernels: float32 or bfloat16, block_size a multiple
        of 8 for float32 and of 16 for bfloat16), or "auto": "tpu" on a TPU backend, "gpu" otherwise.
      sliding_window: W, an int >= 1: a query at position p attends to positions p - W < j <= p only. A
        tile starts its walk at the page of its first row's first visible position: pages before it are
        never loaded and their block-table entries never read (they may hold anything).
      logits_soft_cap: c, a finite float > 0: scaled scores s become c * tanh(s / c) before the softmax.
      k_scales, v_scales: with 8-bit pages (and only then), `[num_kv_heads, num_blocks, block_size]` float32
        or bfloat16: the attended K/V are `pages.astype(float32) * scales[..., None]`, dequantized in
        registers after 8-bit loads (see `pallas_kernels.quant`).
      attend_until: `None` (causal) or int32 `[total_q_tokens]`, a per-row upper bound on visible keys for
        bidirectional spans (Gemma 3 attends bidirectionally among the tokens of one image). Query row t of
        sequence s, at position p, attends to exactly the key positions j with
            j <= max(p, attend_until[t]),   j < kv_lens[s],   and with a window W also j > p - W,
        so a bound at or below p (-1, say) leaves a row causal, and a bound past the context reads nothing past
        kv_lens[s]. The window stays relative to the row's own position. For the tokens of an image at positions
        a..b give each row of it b: that is transformers' Gemma 3 mask (5.x), causal OR same-image on full-
        attention layers and window AND (causal OR same-image) on sliding ones (earlier releases OR'ed same-image
        onto causal-and-window: the same whenever the image is no longer than W). Only keys already in the cache
        are read (j < kv_lens[s]), so every row of an image must be in the call that writes its last key. A
        tile walks pages up to the largest bound of its rows; with every bound <= its row's position the result
        is bit-identical to `None`'s. The MLA and sparse variants take no bounds.
      sinks: float32 `[num_q_heads]`, finite: as for `paged_attention`, one more logit in every query row's
        softmax over the keys it sees (after the walk, before the division); a row that sees no key gets zeros.

    Returns:
      `[total_q_tokens, num_q_heads, head_dim]` in q's dtype.

    Raises:
      ValueError: on malformed arguments or tuning values (shapes, dtypes, non-power-of-two tiles).
      TypeError: on an unknown keyword argument.
    """
    target = resolve_target(target, interpret)
    _, head_dim, _, _, _, _ = validate_qkv(q, k_pages, v_pages, block_tables)
    num_seqs = block_tables.shape[0]
    V.check_vector("kv_lens", kv_lens, num_seqs)
    V.check_vector("cu_q_lens", cu_q_lens, num_seqs + 1)
    sliding_window, logits_soft_cap, _ = validate_variants(
        k_pages, v_pages, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, k_scales=k_scales,
        v_scales=v_scales)
    check_attend_until(attend_until, q.shape[0])
    check_sinks(sinks, q.shape[1])
    scale = V.resolve_scale(scale, head_dim)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    if target == "tpu":
        return ragged_paged_attention_tpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                                          interpret=interpret, block_q=block_q, pages_per_iter=pages_per_iter,
                                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                          attend_until=attend_until, sinks=sinks)
    return ragged_paged_attention_gpu(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale=scale,
                                      interpret=interpret, block_q=block_q, pages_per_iter=pages_per_iter,
                                      num_warps=num_warps, num_stages=num_stages, sliding_window=sliding_window,
                                      logits_soft_cap=logits_soft_cap, k_scales=k_scales, v_scales=v_scales,
                                      attend_until=attend_until, sinks=sinks)


def validate_qkv(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                 num_q_rows: int | None = None) -> tuple[int, int, int, int, int, int]:
    """Checks the common arguments; returns (num_q_heads, head_dim, num_kv_heads, num_blocks, block_size,
    max_blocks_per_seq)."""
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("block_tables", block_tables)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D [tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be 4-D [num_kv_heads, num_blocks, block_size, head_dim], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
    if is_quantized(k_pages.dtype) or is_quantized(v_pages.dtype):
        # 8-bit pages are dequantized inside the kernel; q keeps its own float dtype (and sets the output's).
        if jnp.dtype(k_pages.dtype) != jnp.dtype(v_pages.dtype):
            raise ValueError(f"k_pages and v_pages must share one dtype, got {k_pages.dtype} and {v_pages.dtype}")
        if jnp.dtype(q.dtype) not in V.SUPPORTED_DTYPES:
            raise ValueError(f"q's dtype must be one of float32, bfloat16, float16 (with {k_pages.dtype} pages); "
                             f"got {q.dtype}")
    else:
        dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)}
        if len(dtypes) != 1:
            raise ValueError(
                f"q, k_pages and v_pages must share one dtype (or the pages be int8 / float8_e4m3fn), got "
                f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
        if jnp.dtype(q.dtype) not in V.SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {q.dtype}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, head_dim_kv = k_pages.shape
    if head_dim_kv != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of k_pages/v_pages ({head_dim_kv}) differ")
    if head_dim % 16 or not 16 <= head_dim <= V.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 in [16, {V.MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_q_heads < 1:
        raise ValueError(f"need at least one head, got num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    V.check_int32("block_tables", block_tables, 2)
    if num_q_rows is not None and block_tables.shape[0] != num_q_rows:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but there are {num_q_rows} sequences")
    return num_q_heads, head_dim, num_kv_heads, num_blocks, block_size, block_tables.shape[1]


def check_sliding_window(sliding_window) -> int | None:
    """`None` (no window) or a Python int >= 1 (a static constant: it sizes the kernels' page ranges)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        raise ValueError(f"sliding_window must be None or an int >= 1 (a static constant), got {sliding_window!r}")
    return int(sliding_window)


def check_soft_cap(logits_soft_cap) -> float | None:
    """`None` (no cap) or a finite Python float > 0 (a static constant)."""
    if logits_soft_cap is None:
        return None
    if (isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real)
            or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0):
        raise ValueError(
            f"logits_soft_cap must be None or a finite float > 0 (a static constant), got {logits_soft_cap!r}")
    return float(logits_soft_cap)


def check_scales(k_pages: jax.Array, v_pages: jax.Array, k_scales, v_scales) -> bool:
    """Scales come with 8-bit pages and only with them: both k_scales and v_scales, each
    `[num_kv_heads, num_blocks, block_size]` float32 or bfloat16. Returns whether the pages are quantized."""
    quantized = is_quantized(k_pages.dtype)
    if quantized != is_quantized(v_pages.dtype) or (quantized and k_pages.dtype != v_pages.dtype):
        raise ValueError(f"k_pages and v_pages must share one dtype, got {k_pages.dtype} and {v_pages.dtype}")
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        V.check_token_scales(name, "k_pages/v_pages", k_pages, scales, per_head=True)
    return quantized


def validate_variants(k_pages: jax.Array, v_pages: jax.Array, *, sliding_window, logits_soft_cap, k_scales,
                      v_scales) -> tuple[int | None, float | None, bool]:
    """Checks the variant arguments; returns (sliding_window, logits_soft_cap, quantized) normalised."""
    return (check_sliding_window(sliding_window), check_soft_cap(logits_soft_cap),
            check_scales(k_pages, v_pages, k_scales, v_scales))


def check_sinks(sinks, num_q_heads: int) -> None:
    """`None` (no sinks) or float32 `[num_q_heads]`: one logit per query head that joins each softmax's
    denominator (gpt-oss), an array (traced or not: the kernels take it as an input, so learned sinks change no
    compiled program). Float32 only, so no silent rounding of a bfloat16 parameter happens here: the caller casts.
    Finite: +inf would make every output NaN and -inf or NaN means no sink or a broken one; the check reads the
    values where they are concrete (a traced array cannot be read, its finiteness is the caller's)."""
    if sinks is None:
        return
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise ValueError(f"sinks must be a float32 array [num_q_heads], got {type(sinks).__name__}")
    if tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must have shape [num_q_heads] = ({num_q_heads},), got {tuple(sinks.shape)}")
    if jnp.dtype(sinks.dtype) != jnp.float32:
        raise ValueError(f"sinks must be float32, got {sinks.dtype} (cast a model's parameter with "
                         f".astype(jnp.float32))")
    if not isinstance(sinks, jax.core.Tracer) and not np.isfinite(np.asarray(sinks)).all():
        raise ValueError(f"sinks must be finite, got {np.asarray(sinks).tolist()}")


def check_attend_until(attend_until, num_tokens: int) -> None:
    """`None` (causal) or int32 `[num_tokens]`: one bound per query row of a ragged call (a traced array: the
    bounds change every step, the compiled program does not)."""
    if attend_until is not None:
        V.check_vector("attend_until", attend_until, num_tokens)


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def soft_cap(s: jax.Array, logits_soft_cap: float | None) -> jax.Array:
    """c * tanh(s / c) (Gemma 2's attention soft-capping), or s unchanged without a cap."""
    return s if logits_soft_cap is None else logits_soft_cap * jnp.tanh(s / logits_soft_cap)


def _gather_pages(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """pages `[Hkv, num_blocks, block_size, *rest]`, tables int32 `[N, P]` -> `[N, Hkv, P * block_size, *rest]`.
    Out-of-range table entries are clipped (their slots are masked anyway)."""
    num_kv_heads, num_blocks, block_size, *rest = pages.shape
    n, num_pages = tables.shape
    g = pages[:, jnp.clip(tables, 0, num_blocks - 1)]  # [Hkv, N, P, block_size, *rest]
    return jnp.swapaxes(g.reshape(num_kv_heads, n, num_pages * block_size, *rest), 0, 1)


def _gather_kv(pages: jax.Array, scales: jax.Array | None, tables: jax.Array, dtype) -> jax.Array:
    """The K or V rows of `tables` ([N, P]) as `[N, Hkv, P * block_size, D]` in `dtype`; 8-bit pages are
    dequantized after the gather, so only the gathered pages are ever widened."""
    g = _gather_pages(pages, tables)
    if scales is None:
        return g.astype(dtype)
    return dequantize_kv(g, _gather_pages(scales, tables), dtype)


def _window_tables(block_tables: jax.Array,  # i32[N, max_blocks]
                   first_pos: jax.Array,  # i32[N], first key position any query of the row may see
                   num_pages: int, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The `num_pages` table entries from the page holding first_pos on, and the positions of their slots:
    (tables i32[N, num_pages], positions i32[N, num_pages * block_size]). Table indices past the row are
    clipped to its last entry; their positions are past the capacity, so the caller's mask drops them."""
    max_blocks = block_tables.shape[1]
    logical = (jnp.maximum(first_pos, 0) // block_size)[:, None] + jnp.arange(num_pages, dtype=jnp.int32)
    tables = jnp.take_along_axis(block_tables, jnp.minimum(logical, max_blocks - 1), axis=1)
    pos = logical[:, :, None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
    return tables, pos.reshape(-1, num_pages * block_size)


def _masked_attention(q, k, v, mask, scale: float, logits_soft_cap: float | None, sinks=None, *, compute_dtype,
                      out_dtype):
    """q `[N, Hq, D]`, k/v `[N, Hkv, L, D]` in compute_dtype, mask bool `[N, L]`, sinks f32 `[Hq]` or None ->
    `[N, Hq, D]` in out_dtype."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(n, num_kv_heads, group, head_dim).astype(compute_dtype)
    # Masked slots may hold anything (NaN included): select them away, never multiply them by zero.
    v = jnp.where(mask[:, None, :, None], v, jnp.zeros((), compute_dtype))
    s = jnp.einsum("nkgd,nkld->nkgl", qg, k, precision=HIGHEST, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None, :], soft_cap(s * scale, logits_soft_cap), -jnp.inf)
    if sinks is not None:  # the sink as one more logit column (never masked), dropped after the softmax
        sink_column = jnp.broadcast_to(sinks.reshape(1, num_kv_heads, group, 1), (n, num_kv_heads, group, 1))
        s = jnp.concatenate([s, sink_column], axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    z = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        p = p[..., :-1]
    u = jnp.einsum("nkgl,nkld->nkgd", p.astype(compute_dtype), v, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    o = jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)
    return o.reshape(n, num_q_heads, head_dim).astype(out_dtype)


def _decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, *, scale, sliding_window,
            logits_soft_cap, compute_dtype, bounded: bool, kv_chunk: int | None = None):
    """bounded: with a window, gather only the pages that can hold window positions; without one, walk the table
    `kv_chunk` positions at a time (`dense.chunked_partial`), up to the longest sequence."""
    block_size = k_pages.shape[2]
    num_seqs, max_blocks = block_tables.shape
    lengths = jnp.clip(lengths, 0, max_blocks * block_size)
    num_pages = tiles.window_pages(sliding_window if bounded else None, 1, max_blocks, block_size)
    if bounded and num_pages == max_blocks:  # a decode row is a query tile of one row
        num_q_heads, head_dim = q.shape[1:]
        num_kv_heads = k_pages.shape[0]
        qt = q.reshape(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, 1, head_dim).astype(compute_dtype)
        partial = functools.partial(_tile_partial, qt, scale=_scale(scale, head_dim), logits_soft_cap=logits_soft_cap)
        keep_at = lambda kv_pos: visible(kv_pos, lengths[:, None] - 1, lengths[:, None], sliding_window)[:, None, :]
        m, z, u = chunked_partial(partial, (k_pages, v_pages, k_scales, v_scales), block_tables, keep_at,
                                  longest=jnp.max(lengths), kv_chunk=kv_chunk, block_size=block_size)
        return _tile_output(m, z, u, sinks).reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
    if num_pages < max_blocks:
        tables, pos = _window_tables(block_tables, lengths - sliding_window, num_pages, block_size)
    else:
        tables = block_tables
        pos = jnp.broadcast_to(jnp.arange(max_blocks * block_size, dtype=jnp.int32),
                               (num_seqs, max_blocks * block_size))
    mask = pos < lengths[:, None]
    if sliding_window is not None:  # the query sits at position length - 1
        mask = mask & (pos >= (lengths - sliding_window)[:, None])
    k = _gather_kv(k_pages, k_scales, tables, compute_dtype)
    v = _gather_kv(v_pages, v_scales, tables, compute_dtype)
    return _masked_attention(q, k, v, mask, _scale(scale, q.shape[-1]), logits_soft_cap, sinks,
                             compute_dtype=compute_dtype, out_dtype=q.dtype)


def _nothing_to_attend(q, k_pages, block_tables) -> bool:
    """No query rows, sequences, table entries or pool blocks: every row attends to nothing (zeros)."""
    return 0 in (q.shape[0], block_tables.shape[0], block_tables.shape[1], k_pages.shape[1])


def _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks):
    window, cap, _ = validate_variants(k_pages, v_pages, sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap, k_scales=k_scales, v_scales=v_scales)
    check_sinks(sinks, q.shape[1])
    return dict(sliding_window=window, logits_soft_cap=cap)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap", "compute_dtype",
                                             "bounded", "kv_chunk"))


def _decode_jit(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, **static):
    return _decode(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, **static)


def paged_attention_reference(q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
                              k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                              v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                              block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                              lengths: jax.Array,  # i32[num_seqs]
                              *, scale: float | None = None, sliding_window: int | None = None,
                              logits_soft_cap: float | None = None,
                              k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                              v_scales: jax.Array | None = None,
                              sinks: jax.Array | None = None) -> jax.Array:  # f32[num_q_heads]
    """Dense float32 reference of `pallas_kernels.paged_attention` (gathers the whole table, then masks).

    The query of sequence s sits at position lengths[s] - 1 (lengths clipped to the table's capacity). With
    `sinks` each head's sink is one more logit column of its softmax, dropped after it (the module docstring).
    Returns `[num_seqs, num_q_heads, head_dim]` in q's dtype.
    """
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    return _decode_jit(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, scale=scale,
                       compute_dtype=jnp.float32, bounded=False, **variants)


def paged_attention_xla(q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
                        k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                        v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                        block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                        lengths: jax.Array,  # i32[num_seqs]
                        *, scale: float | None = None, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None,
                        k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                        v_scales: jax.Array | None = None,
                        sinks: jax.Array | None = None,  # f32[num_q_heads]
                        kv_chunk: int = 128) -> jax.Array:
    """XLA gather path for decode: same contract as `paged_attention`, K/V gathered and computed on in q's
    dtype (8-bit pages dequantized into it right after the gather), float32 accumulation.

    Without a window each sequence walks its pages `kv_chunk` positions (whole pages) at a time, up to the longest
    sequence, merging each chunk's partial exactly: `[num_seqs, num_kv_heads, kv_chunk, head_dim]` of gathered K/V
    at a time, never the table's padding. With a window W each sequence gathers only `min(max_blocks_per_seq,
    cdiv(W - 1, block_size) + 1)` pages from the one holding position lengths[s] - W: decode cost is bounded by
    the window, and table entries of pages before it are never read (they may hold anything).
    """
    V.check_positive_int("kv_chunk", kv_chunk)
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    if _nothing_to_attend(q, k_pages, block_tables):
        return jnp.zeros(q.shape, q.dtype)
    return _decode_jit(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks, scale=scale,
                       compute_dtype=jnp.dtype(q.dtype), bounded=True, kv_chunk=kv_chunk, **variants)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "logits_soft_cap"))
def _ragged_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until, sinks,
                      *, scale, sliding_window, logits_soft_cap):
    num_tokens = q.shape[0]
    block_size = k_pages.shape[2]
    max_len = block_tables.shape[1] * block_size
    seq, pos, valid = token_layout(cu_q_lens, kv_lens, num_tokens)
    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    tables = block_tables[seq]
    last = None if attend_until is None else attend_until[:, None]
    mask = valid[:, None] & visible(kv_pos[None, :], pos[:, None], kv_lens[seq][:, None], sliding_window, last)
    k = _gather_kv(k_pages, k_scales, tables, jnp.float32)
    v = _gather_kv(v_pages, v_scales, tables, jnp.float32)
    return _masked_attention(q, k, v, mask, _scale(scale, q.shape[-1]), logits_soft_cap, sinks,
                             compute_dtype=jnp.float32, out_dtype=q.dtype)


def ragged_paged_attention_reference(q: jax.Array,  # [total_q_tokens, num_q_heads, head_dim]
                                     k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                                     v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                                     block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                                     kv_lens: jax.Array,  # i32[num_seqs]
                                     cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                                     *, scale: float | None = None, sliding_window: int | None = None,
                                     logits_soft_cap: float | None = None,
                                     k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                                     v_scales: jax.Array | None = None,
                                     attend_until: jax.Array | None = None,  # i32[total_q_tokens]
                                     sinks: jax.Array | None = None) -> jax.Array:  # f32[num_q_heads]
    """Dense float32 reference of `pallas_kernels.ragged_paged_attention`.

    Query i of sequence s sits at position p = kv_lens[s] - q_len[s] + i and attends to positions <= p (or
    <= max(p, attend_until[row]) with `attend_until`), < kv_lens[s], and > p - W with a window W; with `sinks`
    each head's sink is one more logit column of every row's softmax, dropped after it; rows past cu_q_lens[-1]
    give zeros. Memory: gathers `[total_q_tokens, max_blocks_per_seq * block_size]` keys per KV head.
    """
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    check_attend_until(attend_until, q.shape[0])
    return _ragged_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales,
                             attend_until, sinks, scale=scale, **variants)


def _tile_output(m, z, u, sinks):
    """The attention output u / z of query tiles' merged partial `[NT, Hkv, G, tq, ...]` (zeros where a row attended
    to nothing), each head's sink (f32 `[Hq]` or None) joined once first, into the partial of all a row's pages."""
    if sinks is not None:
        _, z, u = join_sink(m, z, u, sinks.reshape(1, *m.shape[1:3], 1, 1))
    return jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)


def _tile_partial(qt, k_pages, v_pages, k_scales, v_scales, tables, keep, prior=None, *, scale: float,
                  logits_soft_cap: float | None):
    """The (m, z, u) partial of query tiles `qt` `[NT, Hkv, G, tq, D]` over the pages `tables` `[NT, P]`, keep
    bool `[NT, tq, P * block_size]`. m `[NT, Hkv, G, tq, 1]` is the row max (-inf where a row sees nothing), z and
    u the sums of exp(s - m) and exp(s - m) v (m taken as 0 where it is -inf), float32; with `prior`, the partial
    of other keys, the merged partial of both (`dense.fold`)."""
    compute_dtype = jnp.dtype(qt.dtype)
    k = _gather_kv(k_pages, k_scales, tables, compute_dtype)  # [NT, Hkv, L, D]
    v = _gather_kv(v_pages, v_scales, tables, compute_dtype)
    # Slots no row of a tile reads may hold anything (NaN included): select them away.
    v = jnp.where(jnp.any(keep, axis=1)[:, None, :, None], v, jnp.zeros((), v.dtype))
    s = jnp.einsum("nkgtd,nkld->nkgtl", qt.astype(compute_dtype), k, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    s = jnp.where(keep[:, None, None], soft_cap(s * scale, logits_soft_cap), -jnp.inf)
    return fold(s, lambda p: jnp.einsum("nkgtl,nkld->nkgtd", p.astype(v.dtype), v, precision=HIGHEST,
                                        preferred_element_type=jnp.float32), prior)


@functools.partial(jax.jit, static_argnames=("scale", "q_tile", "kv_chunk", "sliding_window", "logits_soft_cap"))
def _ragged_xla(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until, sinks, *,
                scale, q_tile, kv_chunk, sliding_window, logits_soft_cap):
    num_tokens, num_q_heads, head_dim = q.shape
    block_size = k_pages.shape[2]
    max_blocks = block_tables.shape[1]
    tq = max(1, min(q_tile, num_tokens))
    tile_seq, rows, valid, pos, token_slot = query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    num_tiles = tile_seq.shape[0]
    num_kv_heads = k_pages.shape[0]
    # Tiles' rows after their heads (`[NT, Hkv, G, tq, D]`, once, outside the loop over keys): the scores' dot then
    # yields `[.., tq, L]` as it is consumed. With the rows first XLA:CPU ran that dot transposed and transposed its
    # result back in the mask's pass (2.7x slower for tiles of 256 rows, 1.3x for 64).
    qt = q[jnp.clip(rows, 0, num_tokens - 1)].reshape(num_tiles, tq, num_kv_heads, num_q_heads // num_kv_heads,
                                                      head_dim).transpose(0, 2, 3, 1, 4)
    pages = (k_pages, v_pages, k_scales, v_scales)
    partial = functools.partial(_tile_partial, qt, scale=_scale(scale, head_dim), logits_soft_cap=logits_soft_cap)
    last = None if attend_until is None else attend_until[jnp.clip(rows, 0, num_tokens - 1)][:, :, None]
    keep_at = lambda kv_pos: valid[:, :, None] & visible(kv_pos, pos[:, :, None], kv_lens[tile_seq][:, None, None],
                                                          sliding_window, last)  # [NT, tq, L]

    # With a window a tile's rows see positions pos[0] - W + 1 ... pos[0] + tq - 1 at most.
    num_pages = tiles.window_pages(sliding_window, tq, max_blocks, block_size)
    if num_pages < max_blocks:
        tables, kv_pos = _window_tables(block_tables[tile_seq], pos[:, 0] - sliding_window + 1, num_pages,
                                        block_size)
        m, z, u = partial(*pages, tables, keep_at(kv_pos[:, None, :]))  # kv_pos [NT, 1, L]
    else:  # every page, a chunk of keys at a time, up to the step's longest context
        m, z, u = chunked_partial(partial, pages, block_tables[tile_seq], keep_at, longest=jnp.max(kv_lens),
                                  kv_chunk=kv_chunk, block_size=block_size)
    # With attend_until a row may see ahead of those pages, up to its sequence's last position (< pos[0] +
    # num_tokens: a sequence has at most num_tokens query rows): the pages after them, gathered apart and merged
    # exactly, so that the window pages' partial is computed as without attend_until (with every bound at most
    # its row's position the ahead partial is empty, and the merge returns those bits: exp(0) = 1, + 0).
    ahead = tiles.window_pages(sliding_window, num_tokens, max_blocks, block_size) - num_pages
    if attend_until is not None and num_pages < max_blocks and ahead > 0:
        first_ahead = (jnp.maximum(pos[:, 0] - sliding_window + 1, 0) // block_size + num_pages) * block_size
        tables, kv_pos = _window_tables(block_tables[tile_seq], first_ahead, ahead, block_size)
        m_ahead, z_ahead, u_ahead = partial(*pages, tables, keep_at(kv_pos[:, None, :]))
        merged = merge_two(Partial(m[..., 0], z[..., 0], u), Partial(m_ahead[..., 0], z_ahead[..., 0], u_ahead))
        m, z, u = merged.m[..., None], merged.z[..., None], merged.u
    o = _tile_output(m, z, u, sinks)  # [NT, Hkv, G, tq, D]
    o = o.transpose(0, 3, 1, 2, 4).reshape(num_tiles * tq, num_q_heads, head_dim)
    out = o[jnp.clip(token_slot, 0, num_tiles * tq - 1)]
    in_batch = (jnp.arange(num_tokens) >= cu_q_lens[0]) & (jnp.arange(num_tokens) < cu_q_lens[-1])
    return jnp.where(in_batch[:, None, None], out, 0.0).astype(q.dtype)


def ragged_paged_attention_xla(q: jax.Array,  # [total_q_tokens, num_q_heads, head_dim]
                               k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                               v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                               block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                               kv_lens: jax.Array,  # i32[num_seqs]
                               cu_q_lens: jax.Array,  # i32[num_seqs + 1]
                               *, scale: float | None = None, sliding_window: int | None = None,
                               logits_soft_cap: float | None = None,
                               k_scales: jax.Array | None = None,  # [num_kv_heads, num_blocks, block_size]
                               v_scales: jax.Array | None = None, q_tile: int | None = None,
                               kv_chunk: int = 128,
                               attend_until: jax.Array | None = None,  # i32[total_q_tokens]
                               sinks: jax.Array | None = None) -> jax.Array:  # f32[num_q_heads]
    """XLA gather path for ragged attention: same contract as `ragged_paged_attention`, K/V in q's dtype
    (8-bit pages dequantized into it right after the gather), float32 accumulation.

    Each sequence's queries are cut into tiles of `q_tile` consecutive rows (a decode token is a tile of
    its own; None: `dense.default_q_tile` of the step's rows and sequences), at most `dense.num_query_tiles`
    of them, each computed. Without a window each tile walks its sequence's
    pages `kv_chunk` positions (whole pages) at a time, up to the step's longest context, merging each chunk's
    partial exactly (flash attention's loop over keys): a step holds `[num_tiles, num_kv_heads, kv_chunk,
    head_dim]` of gathered K/V at a time, not the whole table's width, and no tile scores the table's padding.
    With a window W a tile gathers only `min(max_blocks_per_seq, cdiv(q_tile + W - 2, block_size) + 1)`
    pages, from the one holding its first row's first visible position: table entries of pages before
    every row's window are never read. With a window and `attend_until` a row may see ahead of those pages, up to
    its sequence's last position: the pages after them, up to `min(max_blocks_per_seq, cdiv(total_q_tokens + W -
    2, block_size) + 1)` in all, are gathered apart and their partial merged exactly (`merge.merge_two`), so
    that with every bound at or below its row's position the result is `None`'s, bit for bit. `sinks` are
    joined into each row's partial of all its pages (`merge.join_sink`) before the division.
    """
    if q_tile is None:
        q_tile = default_q_tile(q.shape[0], block_tables.shape[0], sliding_window)
    V.check_positive_int("q_tile", q_tile)
    V.check_positive_int("kv_chunk", kv_chunk)
    variants = _validated(q, k_pages, v_pages, sliding_window, logits_soft_cap, k_scales, v_scales, sinks)
    check_attend_until(attend_until, q.shape[0])
    if _nothing_to_attend(q, k_pages, block_tables):
        return jnp.zeros(q.shape, q.dtype)
    return _ragged_xla(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, k_scales, v_scales, attend_until,
                       sinks, scale=scale, q_tile=q_tile, kv_chunk=kv_chunk, **variants)
