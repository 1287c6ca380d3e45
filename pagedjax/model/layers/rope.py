"""Rotary position embeddings (RoPE) of the built-in decoders, in Hugging Face's convention (rotate halves,
`rotate_half`), so that q/k weights load without permutation.

A layer's rotation is a `RoPE`: head_dim, base and scaling (`ModelConfig.rope_scaling`), static and hashable, so
it can be an attribute of the attention module; its arrays are computed with numpy while tracing. `layer_rope`
picks each layer's: with `ModelConfig.rope_local_theta`, the layers with a sliding window (Gemma 3's local layers)
rotate by that base, unscaled.

DeepSeek's rotary dims (`pagedjax.model.families.deepseek`) are YaRN-scaled ("yarn", `pagedjax.model.layers.yarn`) and
may pair adjacent dims (`interleaved`): their rotation de-interleaves the input first, so its output holds the
rotated pairs in the halves layout. A dot product of two vectors rotated alike is unchanged by that permutation,
so queries and keys (cached keys too) only need to share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config import ModelConfig
from pagedjax.model.layers.yarn import yarn_attention_factor, yarn_inv_freq


@dataclass(frozen=True)
class RoPE:
    """Rotation by `theta ** (-2i / head_dim)` per position, scaled as `scaling` (ModelConfig.rope_scaling pairs,
    or None) says. `interleaved`: frequency i rotates the pair of dims (2i, 2i + 1) instead of (i, i + d/2); the
    output is then in the halves layout (the module docstring)."""

    head_dim: int
    theta: float
    scaling: tuple | None = None
    interleaved: bool = False

    def inv_freq(self) -> np.ndarray:
        """Inverse frequencies `[head_dim // 2]` (float32), with "linear", "llama3", "longrope" or "yarn"
        scaling."""
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = dict(self.scaling or ())
        kind = rs.get("rope_type", rs.get("type", "default"))
        if kind == "default":
            pass
        elif kind == "linear":
            inv_freq = inv_freq / float(rs["factor"])
        elif kind == "llama3":
            factor = float(rs["factor"])
            low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
            old_len = float(rs["original_max_position_embeddings"])
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
            inv_freq = np.where(medium, smoothed, scaled)
        elif kind == "longrope":  # within the original context: the short factors (`ROPE_SCALING_PARAMS`)
            inv_freq = inv_freq / np.asarray(rs["short_factor"], np.float64)
        elif kind == "yarn":
            inv_freq = yarn_inv_freq(d, self.theta, rs)
        else:
            raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, longrope, "
                             "yarn)")
        return inv_freq.astype(np.float32)

    def attention_factor(self) -> float:
        """What cos and sin are multiplied by: LongRoPE's `attention_factor`, YaRN's (`yarn_attention_factor`),
        else 1."""
        rs = dict(self.scaling or ())
        if rs.get("rope_type", rs.get("type")) == "yarn":
            return yarn_attention_factor(rs)
        return float(rs.get("attention_factor", 1.0))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotate `x [..., heads, head_dim]` by `positions [...]`."""
        freqs = positions.astype(jnp.float32)[..., None] * self.inv_freq()  # [..., D/2]
        emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., 1, D]
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        factor = self.attention_factor()
        if factor != 1.0:  # scaled in float32 before rounding, as transformers does
            cos, sin = cos * factor, sin * factor
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        if self.interleaved:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin


def layer_rope(cfg: ModelConfig, layer_index: int) -> RoPE:
    """Layer `layer_index`'s rotation: rope_theta and rope_scaling, or, for a layer with a sliding window when
    `rope_local_theta` is set, rope_local_theta unscaled."""
    windowed = cfg.sliding_windows is not None and cfg.sliding_windows[layer_index] is not None
    if cfg.rope_local_theta is not None and windowed:
        return RoPE(cfg.head_dim, cfg.rope_local_theta)
    return RoPE(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
