"""Token sampling on device: greedy, temperature, top-k, top-p, with per-request seeds.

Each row's random key depends only on its request's seed and on how many tokens it has generated, so the
same seed gives the same output whatever else is in the batch (and whether decode runs 1 or N steps a call).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingMetadata(NamedTuple):
    """Per-row sampling parameters, `[num_seqs]` each.

    temperature: f32, 0 = greedy; top_k: i32, <= 0 = off; top_p: f32, 1 = off;
    seed_hi, seed_lo: u32 halves of a 64-bit seed; step: i32, tokens generated so far by the row's request.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed_hi: jax.Array
    seed_lo: jax.Array
    step: jax.Array

    @staticmethod
    def from_lists(temperature, top_k, top_p, seeds, steps) -> SamplingMetadata:
        seeds = np.asarray(seeds, dtype=np.uint64)
        return SamplingMetadata(
            temperature=np.asarray(temperature, np.float32),
            top_k=np.asarray(top_k, np.int32),
            top_p=np.asarray(top_p, np.float32),
            seed_hi=(seeds >> np.uint64(32)).astype(np.uint32),
            seed_lo=(seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32),
            step=np.asarray(steps, np.int32),
        )


def _row_key(seed_hi: jax.Array, seed_lo: jax.Array, step: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed_hi), seed_lo)
    return jax.random.fold_in(key, step)


def filter_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf.

    logits: `[num_seqs, vocab]` float32. The most likely token always survives.
    """
    vocab = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly more likely tokens
    keep &= (mass_before < top_p[:, None]) | (rank == 0)
    filtered_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
    # Scatter back to vocabulary order.
    return jnp.zeros_like(scaled).at[jnp.arange(scaled.shape[0])[:, None], order].set(filtered_sorted)


def sample(logits: jax.Array, meta: SamplingMetadata) -> jax.Array:
    """Pick one token per row. logits `[num_seqs, vocab]` -> int32 `[num_seqs]`."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw() -> jax.Array:
        filtered = filter_logits(logits, meta.temperature, meta.top_k, meta.top_p)
        keys = jax.vmap(_row_key)(meta.seed_hi, meta.seed_lo, meta.step)
        sampled = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(meta.temperature > 0, sampled, greedy)

    # An all-greedy batch skips the vocabulary sort.
    return jax.lax.cond(jnp.any(meta.temperature > 0), draw, lambda: greedy)
