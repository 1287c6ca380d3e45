"""torch's LayerNorm (mean and variance over the last axis, affine), as the DeepSeek V3.2 indexer and the vision
towers use it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class LayerNorm(nnx.Module):
    """torch's LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias, in float32, rounded
    once to x's dtype (parameters named as transformers')."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        centered = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)
