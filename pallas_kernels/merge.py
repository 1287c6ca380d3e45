"""Exact merge of partial attention results.

A partial result over a subset B of the keys is the triple
    m = max_{j in B} s_j,    z = sum_{j in B} exp(s_j - m),    u = sum_{j in B} exp(s_j - m) v_j
(an empty subset is m = -inf, z = 0, u = 0). Partials over disjoint subsets merge exactly:
    m = max_b m_b,    z = sum_b exp(m_b - m) z_b,    u = sum_b exp(m_b - m) u_b,
and the attention output over the union is o = u / z. The order of merging does not matter, and the
result is the same (up to float rounding) as one softmax over all keys. The kernels' split-K path
("flash-decoding") computes one partial per split and merges them here, in float32.

Worked example (PagedAttention): block a gives m = ln 2, z = 1.5, u = [0.5, 2]; block b gives m = ln 4,
z = 1.75, u = [4.25, 4.75]; merged z = 2.5, u = [4.5, 5.75], o = [1.8, 2.3].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Partial(NamedTuple):
    """A partial softmax-attention result: m `[...]`, z `[...]`, u `[..., head_dim]` (float32)."""

    m: jax.Array
    z: jax.Array
    u: jax.Array


def merge_partials(m: jax.Array, z: jax.Array, u: jax.Array, axis: int = 0) -> Partial:
    """Merges partials stacked along `axis` of m and z (and the same axis of u, which has one more
    trailing dimension). Returns the merged Partial, in float32. Empty partials (m = -inf) contribute
    nothing; if all are empty the result is empty too (m = -inf, z = 0, u = 0)."""
    m = jnp.asarray(m, jnp.float32)
    z = jnp.asarray(z, jnp.float32)
    u = jnp.asarray(u, jnp.float32)
    axis = axis % m.ndim
    m_max = jnp.max(m, axis=axis)
    m_safe = jnp.where(jnp.isneginf(m_max), 0.0, m_max)
    w = jnp.exp(m - jnp.expand_dims(m_safe, axis))  # 0 for empty partials, never NaN
    z_out = jnp.sum(w * z, axis=axis)
    u_out = jnp.sum(jnp.expand_dims(w, -1) * u, axis=axis)
    return Partial(m_max, z_out, u_out)


def merge_two(a: Partial, b: Partial) -> Partial:
    """Merges two partials of the same shape."""
    return merge_partials(jnp.stack([a.m, b.m]), jnp.stack([a.z, b.z]), jnp.stack([a.u, b.u]), axis=0)


def finalize(z: jax.Array, u: jax.Array, dtype=None) -> jax.Array:
    """Attention output o = u / z; zeros where z == 0 (nothing attended), never NaN."""
    z = jnp.asarray(z, jnp.float32)
    u = jnp.asarray(u, jnp.float32)
    has = (z > 0)[..., None]
    o = jnp.where(has, u / jnp.where(has, z[..., None], 1.0), 0.0)
    return o if dtype is None else o.astype(dtype)


def merge_and_finalize(m: jax.Array, z: jax.Array, u: jax.Array, axis: int = 0, dtype=None) -> jax.Array:
    """`finalize(merge_partials(...))`: the attention output over the union of the partials' keys."""
    merged = merge_partials(m, z, u, axis=axis)
    return finalize(merged.z, merged.u, dtype)
