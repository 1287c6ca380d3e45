"""8-bit KV pages: one scale per token and KV head, absmax / qmax.

A quantized layer of the cache is `pages` int8 or float8_e4m3fn `[num_kv_heads, num_blocks, block_size, head_dim]`
plus `scales` float32 `[num_kv_heads, num_blocks, block_size]` in the same paged layout (a slot's scale moves
with its values). The value a kernel attends over is `pages.astype(float32) * scales[..., None]`: every kernel,
reference and XLA path dequantizes exactly that way, so quantization error comes from `quantize_kv` alone.

MLA latent pages use the same two functions unchanged: `quantize_kv(kv_pages, dtype)` of `kv_pages
[num_blocks, block_size, R + Dr]` (or of one new row `[R + Dr]` per token) gives the 8-bit pages and their
`kv_scales [num_blocks, block_size]`, one scale per token over its whole latent + rope row (the MLA kernels'
layout: latent and rope of a token share one scale); `dequantize_kv(pages, kv_scales)` reads them back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Largest magnitude each 8-bit format holds: int8 keeps [-127, 127] (symmetric), e4m3fn's largest finite is 448.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
QUANTIZED_DTYPES = tuple(QMAX)
SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def is_quantized(dtype) -> bool:
    return jnp.dtype(dtype) in QMAX


def quantize_kv(x: jax.Array,  # [..., head_dim], any float dtype
                dtype) -> tuple[jax.Array, jax.Array]:
    """`x` as (`values` in `dtype` (int8 or float8_e4m3fn) `[..., head_dim]`, `scales` float32 `[...]`).

    scale = absmax over head_dim / qmax, so the largest entry maps to +-qmax; an all-zero vector gets scale 0
    and values 0 (dequantizing to exact zeros, never 0/0). Non-finite inputs are not supported.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in QMAX:
        raise ValueError(f"quantize_kv: dtype must be int8 or float8_e4m3fn, got {dtype}")
    xf = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(xf), axis=-1) / QMAX[dtype]
    inv = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
    y = jnp.clip(xf * inv[..., None], -QMAX[dtype], QMAX[dtype])
    if dtype == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype), scales


def dequantize_kv(values: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    """`values * scales[..., None]` in `dtype` (computed in float32)."""
    return (values.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]).astype(dtype)
