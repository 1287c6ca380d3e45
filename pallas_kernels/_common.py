"""Pieces shared by the decode and ragged kernels: validation, tiling arithmetic, the online-softmax step.

Nothing here is public API; `paged_attention.py` and `ragged_attention.py` are the entry points.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

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
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)}
    if len(dtypes) != 1:
        raise ValueError(
            f"q, k_pages and v_pages must share one dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
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


def check_vector(name: str, x: jax.Array, length: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an int32 array, got {type(x).__name__}")
    _check_int32(name, x, 1)
    if x.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {x.shape}")


def default_pages_per_iter(block_size: int, max_blocks_per_seq: int, head_dim: int, dtype,
                           max_tokens: int = 128, tile_bytes: int = 32 * 1024) -> int:
    """Pages gathered per inner-loop iteration (a power of two).

    About `tile_bytes` of K per tile (so K and V tiles, double-buffered, stay well inside shared memory:
    128 tokens for bf16 at head_dim 128, 64 for float32 or head_dim 256), at most `max_tokens` tokens,
    at least 16 tokens (tl.dot), and never more pages than a sequence can have (rounded up).
    """
    block_pad = next_pow2(block_size)
    dim_pad = padded_head_dim(head_dim)
    tokens = max(MIN_DOT_DIM, min(max_tokens, tile_bytes // (dim_pad * jnp.dtype(dtype).itemsize)))
    pages = max(1, tokens // block_pad)
    pages = min(pages, next_pow2(max(1, max_blocks_per_seq)))
    while pages * block_pad < MIN_DOT_DIM:
        pages *= 2
    return pages


def dot_precision(dtype) -> lax.Precision | None:
    # Triton would otherwise run float32 matmuls in TF32 (about 1e-3 relative error).
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def gather_page_tile(table_ref, k_ref, v_ref, *, seq, head, first_page, page_end, token_end,
                     pages_per_iter: int, block_size: int, head_dim: int):
    """Loads one KV tile of `pages_per_iter` pages through the block table.

    Returns (k, v, valid, pos): k and v are `[pages_per_iter * block_pad, dim_pad]` (zeros where masked),
    valid `[tile]` says which tile rows are real tokens (logical page < page_end and position < token_end),
    pos `[tile]` their positions in the sequence. Padded rows and padded head_dim columns are never read
    from memory (masked loads), so a NaN there cannot leak in.
    """
    block_pad = next_pow2(block_size)
    dim_pad = padded_head_dim(head_dim)
    t = jnp.arange(pages_per_iter * block_pad, dtype=jnp.int32)
    page = first_page + t // block_pad  # logical page of each tile row
    offset = t % block_pad
    page_ok = page < page_end
    pos = page * block_size + offset
    valid = page_ok & (pos < token_end)
    if block_pad != block_size:  # static: only padded blocks need the slot test
        valid = valid & (offset < block_size)
    physical = plgpu.load(table_ref.at[seq, page], mask=page_ok, other=0)
    d = jnp.arange(dim_pad, dtype=jnp.int32)
    kv_mask = valid[:, None]
    if dim_pad != head_dim:  # static: only padded head_dims need the column test
        kv_mask = kv_mask & (d < head_dim)[None, :]
    idx = (head, physical[:, None], offset[:, None], d[None, :])
    k = plgpu.load(k_ref.at[idx], mask=kv_mask, other=0)
    v = plgpu.load(v_ref.at[idx], mask=kv_mask, other=0)
    return k, v, valid, pos


def online_softmax_step(q, k, v, mask, carry, *, scale: float):
    """One flash-attention step over a KV tile, exact in float32.

    q `[rows, dim]`, k/v `[tile, dim]`, mask `[rows, tile]` (or broadcastable); carry = (m, z, u) with
    m, z `[rows]` and u `[rows, dim]`, all float32. m is the running max (-inf while nothing was seen),
    z the running sum of exp(s - m), u the running sum of exp(s - m) * v.
    """
    m_prev, z_prev, u_prev = carry
    precision = dot_precision(q.dtype)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
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


def compiler_params(num_warps: int | None, num_stages: int | None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
