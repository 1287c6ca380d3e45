"""Argument checks shared by every kind's entry points, platform-free (no Triton, no Mosaic): dtypes, head_dim,
int32 tables and vectors, 8-bit scales per token, the scale and the tuning options' ints (the kernels use these
too). Each kind's own checks sit beside its entry points (`paged.validate_qkv`, `mla.validate_mla`,
`sparse.validate_indexer`, `recurrent.validate_gated_delta_rule`, ...). Nothing here is public API.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from pallas_kernels.quant import QUANTIZED_DTYPES, SCALE_DTYPES, is_quantized

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256


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


def check_int32(name: str, x: jax.Array, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {x.shape}")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def check_vector(name: str, x: jax.Array, length: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an int32 array, got {type(x).__name__}")
    check_int32(name, x, 1)
    if x.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {x.shape}")


def check_token_scales(name: str, pages_name: str, pages: jax.Array, scales, *, per_head: bool = False) -> None:
    """One scale per token (`per_head`: per token and KV head), `[num_blocks, block_size]` (`[num_kv_heads,
    num_blocks, block_size]`) float32 or bfloat16, with 8-bit `pages` (and only then)."""
    names = ", ".join(jnp.dtype(d).name for d in QUANTIZED_DTYPES)
    if not is_quantized(pages.dtype):
        if scales is not None:
            raise ValueError(f"{name} is only for 8-bit pages ({names}); {pages_name} are {pages.dtype}")
        return
    if scales is None:
        raise ValueError(f"{name} is required with {pages.dtype} pages (one scale per token"
                         f"{' and KV head' if per_head else ''})")
    if not hasattr(scales, "shape") or not hasattr(scales, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(scales).__name__}")
    dims = ("num_kv_heads", "num_blocks", "block_size") if per_head else ("num_blocks", "block_size")
    want = tuple(pages.shape[:len(dims)])
    if tuple(scales.shape) != want:
        raise ValueError(f"{name} must have shape [{', '.join(dims)}] = {want}, got {tuple(scales.shape)}")
    if jnp.dtype(scales.dtype) not in SCALE_DTYPES:
        raise ValueError(f"{name} must be float32 or bfloat16, got {scales.dtype}")


def check_top_k(k) -> int:
    """top_k: a Python int >= 1 (a static constant: it sizes the selection)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be an int >= 1 (a static constant), got {k!r}")
    return int(k)

