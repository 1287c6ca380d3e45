"""Pieces shared by the decode and ragged kernels: validation (of the variants too: sliding window, soft cap,
8-bit pages with their scales), tiling arithmetic, the page-tile gather and the online-softmax step.

Nothing here is public API; `paged_attention.py` and `ragged_attention.py` are the entry points.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quant import QUANTIZED_DTYPES, SCALE_DTYPES, is_quantized

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256
# tl.dot on NVIDIA GPUs needs every matmul dimension >= 16.
MIN_DOT_DIM = 16
NEG_INF = float("-inf")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a, b):
    """Ceiling division for Python ints and non-negative traced integers alike."""
    return (a + b - 1) // b


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` picks compiled Triton on GPU and the Pallas interpreter everywhere else."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        return float(scale)
    except TypeError as e:  # a traced value cannot be a static kernel constant
        raise ValueError(f"scale must be a Python float (a static constant), got {scale!r}") from e


def check_pow2_option(name: str, value: int | None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {value!r}")


def check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_positive_option(name: str, value: int | None) -> None:
    """`None` (pick a default) or a positive int."""
    if value is not None:
        check_positive_int(name, value)


def check_pages_per_iter(pages_per_iter: int | None, block_size: int) -> None:
    """`None` (the default) or a power of two whose tile of `pages_per_iter` (padded) blocks has at least
    MIN_DOT_DIM rows (tl.dot)."""
    check_pow2_option("pages_per_iter", pages_per_iter)
    if pages_per_iter is not None and pages_per_iter * next_pow2(block_size) < MIN_DOT_DIM:
        raise ValueError(
            f"pages_per_iter * block_size must be >= {MIN_DOT_DIM} (tl.dot), got {pages_per_iter} pages "
            f"of {block_size} tokens")


def padded_head_dim(head_dim: int) -> int:
    """head_dim as the kernels hold it in registers: a power of two, >= MIN_DOT_DIM (tl.dot). Columns past
    head_dim are masked on load and store."""
    return max(MIN_DOT_DIM, next_pow2(head_dim))


def _check_int32(name: str, x: jax.Array, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {x.shape}")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


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
        if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"q's dtype must be one of float32, bfloat16, float16 (with {k_pages.dtype} pages); "
                             f"got {q.dtype}")
    else:
        dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)}
        if len(dtypes) != 1:
            raise ValueError(
                f"q, k_pages and v_pages must share one dtype (or the pages be int8 / float8_e4m3fn), got "
                f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
        if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {q.dtype}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, head_dim_kv = k_pages.shape
    if head_dim_kv != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of k_pages/v_pages ({head_dim_kv}) differ")
    if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_q_heads < 1:
        raise ValueError(f"need at least one head, got num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_int32("block_tables", block_tables, 2)
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
    names = ", ".join(jnp.dtype(d).name for d in QUANTIZED_DTYPES)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if not quantized:
            if scales is not None:
                raise ValueError(f"{name} is only for 8-bit pages ({names}); k_pages/v_pages are {k_pages.dtype}")
            continue
        if scales is None:
            raise ValueError(f"{name} is required with {k_pages.dtype} pages (one scale per token and KV head)")
        if not hasattr(scales, "shape") or not hasattr(scales, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(scales).__name__}")
        if tuple(scales.shape) != tuple(k_pages.shape[:3]):
            raise ValueError(f"{name} must have shape [num_kv_heads, num_blocks, block_size] = "
                             f"{tuple(k_pages.shape[:3])}, got {tuple(scales.shape)}")
        if jnp.dtype(scales.dtype) not in SCALE_DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {scales.dtype}")
    return quantized


def validate_variants(k_pages: jax.Array, v_pages: jax.Array, *, sliding_window, logits_soft_cap, k_scales,
                      v_scales) -> tuple[int | None, float | None, bool]:
    """Checks the variant arguments; returns (sliding_window, logits_soft_cap, quantized) normalised."""
    return (check_sliding_window(sliding_window), check_soft_cap(logits_soft_cap),
            check_scales(k_pages, v_pages, k_scales, v_scales))


def check_vector(name: str, x: jax.Array, length: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an int32 array, got {type(x).__name__}")
    _check_int32(name, x, 1)
    if x.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {x.shape}")


def default_pages_per_iter(block_size: int, max_blocks_per_seq: int, head_dim: int, dtype,
                           max_tokens: int = 128, tile_bytes: int = 32 * 1024) -> int:
    """Pages gathered per inner-loop iteration (a power of two).

    About `tile_bytes` of K per tile in `dtype`, the dtype the tile is computed in (q's): 128 tokens for bf16
    at head_dim 128, 64 for float32 or head_dim 256; at most `max_tokens` tokens, at least 16 (tl.dot), and
    never more pages than a program walks (rounded up; with a sliding window, the window's page count).
    8-bit pages are dequantized into q's dtype in registers, so their tile is sized by that register
    footprint as well (callers pass q's dtype): their 1-byte loads only shrink the shared memory the
    software pipeline stages, which this bound already keeps small.
    """
    block_pad = next_pow2(block_size)
    dim_pad = padded_head_dim(head_dim)
    tokens = max(MIN_DOT_DIM, min(max_tokens, tile_bytes // (dim_pad * jnp.dtype(dtype).itemsize)))
    pages = max(1, tokens // block_pad)
    pages = min(pages, next_pow2(max(1, max_blocks_per_seq)))
    while pages * block_pad < MIN_DOT_DIM:
        pages *= 2
    return pages


def window_pages(sliding_window: int | None, span: int, max_blocks_per_seq: int, block_size: int) -> int:
    """Static bound on the pages one program walks: all of a table's `max_blocks_per_seq`, or with a window
    the pages that can hold `span` consecutive query positions' windows (`span + W - 1` consecutive
    positions starting anywhere in a page)."""
    if sliding_window is None:
        return max_blocks_per_seq
    return min(max_blocks_per_seq, cdiv(span + sliding_window - 2, block_size) + 1)


def dot_precision(dtype) -> lax.Precision | None:
    # Triton would otherwise run float32 matmuls in TF32 (about 1e-3 relative error).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def gather_page_tile(table_ref, k_ref, v_ref, *, seq, head, first_page, page_end, token_end,
                     pages_per_iter: int, block_size: int, head_dim: int, token_start=None, scale_refs=None,
                     dtype=None):
    """Loads one KV tile of `pages_per_iter` pages through the block table.

    Returns (k, v, valid, pos): k and v are `[pages_per_iter * block_pad, dim_pad]` (zeros where masked),
    valid `[tile]` says which tile rows are real tokens (logical page < page_end, position < token_end and,
    with a `token_start`, position >= token_start), pos `[tile]` their positions in the sequence. Padded
    rows, padded head_dim columns and rows outside [token_start, token_end) are never read from memory
    (masked loads), so a NaN there cannot leak in. Table entries of pages before `first_page` are never read.

    8-bit pages come with `scale_refs` = (k_scales_ref, v_scales_ref) `[num_kv_heads, num_blocks, block_size]`:
    the tile is loaded as 8-bit (a quarter of float32's bytes), its per-token scales with the same mask, and
    dequantized in registers, `(values.astype(float32) * scales)` cast to `dtype` (q's).
    """
    block_pad = next_pow2(block_size)
    dim_pad = padded_head_dim(head_dim)
    t = jnp.arange(pages_per_iter * block_pad, dtype=jnp.int32)
    page = first_page + t // block_pad  # logical page of each tile row
    offset = t % block_pad
    page_ok = page < page_end
    pos = page * block_size + offset
    valid = page_ok & (pos < token_end)
    if token_start is not None:
        valid = valid & (pos >= token_start)
    if block_pad != block_size:  # static: only padded blocks need the slot test
        valid = valid & (offset < block_size)
    physical = plgpu.load(table_ref.at[seq, page], mask=page_ok, other=0)
    d = jnp.arange(dim_pad, dtype=jnp.int32)
    kv_mask = valid[:, None]
    if dim_pad != head_dim:  # static: only padded head_dims need the column test
        kv_mask = kv_mask & (d < head_dim)[None, :]
    idx = (head, physical[:, None], offset[:, None], d[None, :])
    # A float fill for float pages: Triton casts the fill to the page dtype, and has no int -> fp8 cast.
    fill = 0.0 if jnp.issubdtype(k_ref.dtype, jnp.floating) else 0
    k = plgpu.load(k_ref.at[idx], mask=kv_mask, other=fill)
    v = plgpu.load(v_ref.at[idx], mask=kv_mask, other=fill)
    if scale_refs is not None:
        k_scales_ref, v_scales_ref = scale_refs
        scale_idx = (head, physical, offset)
        k_scales = plgpu.load(k_scales_ref.at[scale_idx], mask=valid, other=0).astype(jnp.float32)
        v_scales = plgpu.load(v_scales_ref.at[scale_idx], mask=valid, other=0).astype(jnp.float32)
        k = (k.astype(jnp.float32) * k_scales[:, None]).astype(dtype)
        v = (v.astype(jnp.float32) * v_scales[:, None]).astype(dtype)
    return k, v, valid, pos


def online_softmax_step(q, k, v, mask, carry, *, scale: float, logits_soft_cap: float | None = None):
    """One flash-attention step over a KV tile, exact in float32.

    q `[rows, dim]`, k/v `[tile, dim]` (q's dtype), mask `[rows, tile]` (or broadcastable); carry = (m, z, u)
    with m, z `[rows]` and u `[rows, dim]`, all float32. m is the running max (-inf while nothing was seen),
    z the running sum of exp(s - m), u the running sum of exp(s - m) * v. With `logits_soft_cap` c the
    scaled scores pass through c * tanh(s / c) first (bounded scores: the merge is unchanged).
    """
    m_prev, z_prev, u_prev = carry
    precision = dot_precision(q.dtype)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    s = jnp.where(mask, s, NEG_INF)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    # Rows that have seen nothing yet keep m = -inf; exponentiate against 0 there so no (-inf) - (-inf).
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    z_next = alpha * z_prev + p.sum(axis=-1)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
    u_next = alpha[:, None] * u_prev + pv
    return m_next, z_next, u_next


def init_carry(rows: int, dim_pad: int):
    return (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dim_pad), jnp.float32))


def variant_suffix(sliding_window: int | None, logits_soft_cap: float | None, page_dtype) -> str:
    """Kernel-name suffix naming the variants in use (profiles tell the variants apart)."""
    parts = ["window"] if sliding_window is not None else []
    parts += ["softcap"] if logits_soft_cap is not None else []
    parts += [jnp.dtype(page_dtype).name] if is_quantized(page_dtype) else []
    return "".join(f"_{part}" for part in parts)


def compiler_params(num_warps: int | None, num_stages: int | None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
