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

An attention sink (gpt-oss: a learned logit per query head that joins the softmax's denominator and carries no
value) is the partial of one key of score `sink` and value zero, m = sink, z = 1, u = 0: `join_sink` merges it
into the merged partial of all keys, once, right before `finalize` (o = u / (z + exp(sink - m)) at the common
max m). With the example's keys and a sink of ln 2.5: z = 2.5 + 2.5 / 4, o = [1.44, 1.84].
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


def join_sink(m: jax.Array, z: jax.Array, u: jax.Array, sink: jax.Array) -> Partial:
    """The partial (m, z, u) merged with the sink's: one key of score `sink` and value 0 (m = sink, z = 1, u = 0).

    m, z `[...]` (or `[..., 1]`, the TPU kernels' 2-D rows) and u `[..., D]`, float32; sink float32, broadcastable
    against m. Elementwise, so the kernels call it on their registers as well as the wrappers on merged splits:
    m' = max(m, sink), z' = exp(m - m') z + exp(sink - m'), u' = exp(m - m') u. An empty partial (m = -inf) gives
    z' = 1, u' = 0 (attending to nothing but the sink: output zeros); a sink of -inf leaves the partial's
    z / u as they were (an empty partial stays empty: z' = 0)."""
    m_next = jnp.maximum(m, sink)
    m_safe = jnp.where(jnp.isneginf(m_next), 0.0, m_next)  # sink and partial both empty: no (-inf) - (-inf)
    alpha = jnp.exp(m - m_safe)
    z_next = alpha * z + jnp.exp(sink - m_safe)
    u_next = (alpha if alpha.ndim == u.ndim else alpha[..., None]) * u
    return Partial(m_next, z_next, u_next)


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


def merge_and_finalize(m: jax.Array, z: jax.Array, u: jax.Array, axis: int = 0, dtype=None,
                       sinks: jax.Array | None = None) -> jax.Array:
    """`finalize(merge_partials(...))`: the attention output over the union of the partials' keys. With `sinks`
    (float32, broadcastable against the merged m: one logit per query head) each is joined once, after the
    merge (`join_sink`)."""
    merged = merge_partials(m, z, u, axis=axis)
    if sinks is not None:
        merged = join_sink(*merged, jnp.asarray(sinks, jnp.float32))
    return finalize(merged.z, merged.u, dtype)
