"""Top-k selection of the lightning indexer's scores (DeepSeek sparse attention): `top_k_positions`, and
`top_k_positions_and_ties`, which also tells the rows whose cut-off fell between equal scores.

The indexer kernels materialise each query row's scores over the whole table width, `[rows, max_blocks_per_seq *
block_size]` float32 (-inf where the row sees nothing): 4 bytes per (row, position), 32 MiB for a step of 512
query rows over a 16k context, which is the scale of the engine's steps (a decode batch, or one prefill chunk).
On those rows XLA's `lax.top_k` selects exactly, on every backend; a streaming selection inside the kernel
would only matter for steps whose score rows no longer fit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _validate as V


@functools.partial(jax.jit, static_argnames=("k",))
def _top_k(scores, *, k: int):
    rows, width = scores.shape
    kept = min(k, width)
    if kept == 0:
        return jnp.full((rows, k), -1, jnp.int32)
    values, positions = lax.top_k(scores, kept)
    positions = jnp.where(jnp.isneginf(values), -1, positions).astype(jnp.int32)
    return jnp.pad(positions, ((0, 0), (0, k - kept)), constant_values=-1)


@functools.partial(jax.jit, static_argnames=("k",))
def _top_k_and_ties(scores, *, k: int):
    rows, width = scores.shape
    if k >= width:  # every visible position is kept: no cut-off to tie at
        return _top_k(scores, k=k), jnp.zeros((rows,), bool)
    values, positions = lax.top_k(scores, k + 1)  # the first one left out decides a tie
    kept = jnp.where(jnp.isneginf(values), -1, positions)[:, :k].astype(jnp.int32)
    # The (k+1)-th score as a reduction of the values, and the tie as its count among them (the k-th equals it
    # when it appears twice): reading the values at column k (a slice past the prefix the positions use) made
    # XLA:CPU sort whole rows instead of its TopK, 30x slower on a 16k-token row (scripts/bench_sparse.py).
    last = jnp.min(values, axis=1)
    ties = (jnp.sum(values == last[:, None], axis=1) >= 2) & ~jnp.isneginf(last)
    return kept, ties


def _check_scores(scores) -> None:
    if not hasattr(scores, "shape") or not hasattr(scores, "dtype"):
        raise ValueError(f"scores must be a float32 array, got {type(scores).__name__}")
    if scores.ndim != 2:
        raise ValueError(f"scores must be 2-D [rows, max_context], got shape {scores.shape}")
    if jnp.dtype(scores.dtype) != jnp.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")


def top_k_positions_and_ties(scores: jax.Array,  # f32[rows, max_context]
                             k: int) -> tuple[jax.Array, jax.Array]:
    """(`top_k_positions(scores, k)`, bool `[rows]`: the row's k-th highest visible score equals its (k+1)-th, so
    that which of the tied positions it keeps is the tie rule's (the lower position), not the scores'). One
    `lax.top_k` of k + 1 instead of k, and a count over those k + 1 values: the selection costs what
    `top_k_positions` does (`scripts/bench_sparse.py`, its "top-k" and "+ ties" columns)."""
    _check_scores(scores)
    return _top_k_and_ties(scores, k=V.check_top_k(k))


def top_k_positions(scores: jax.Array,  # f32[rows, max_context]
                    k: int) -> jax.Array:
    """The k positions of each row with the highest scores, int32 `[rows, k]`, highest first.

    Entries scoring -inf (positions a row does not see) are never selected: a row with fewer than k visible
    positions is padded with -1 (so is every column past the width when k > max_context). Tie rule: of equal
    scores the lower position wins (`lax.top_k`'s order), so the selection is a function of the scores alone.
    Scores must not be NaN.
    """
    _check_scores(scores)
    return _top_k(scores, k=V.check_top_k(k))
