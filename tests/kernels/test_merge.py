"""The exact (m, z, u) merge: the PagedAttention worked example and its algebra."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import Partial, finalize, merge_and_finalize, merge_two
from tests.kernels.cases import examples

pytestmark = pytest.mark.kernels

LN2, LN4 = math.log(2.0), math.log(4.0)
BLOCK_A = Partial(jnp.float32(LN2), jnp.float32(1.5), jnp.asarray([0.5, 2.0], jnp.float32))
BLOCK_B = Partial(jnp.float32(LN4), jnp.float32(1.75), jnp.asarray([4.25, 4.75], jnp.float32))


def _partial(s, v):
    """The partial of logits s [n] and values v [n, d] (n may be 0)."""
    if len(s) == 0:
        return Partial(jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros(v.shape[-1], jnp.float32))
    m = s.max()
    w = np.exp(s - m)
    return Partial(jnp.float32(m), jnp.float32(w.sum()), jnp.asarray(w @ v, jnp.float32))


def test_worked_example_block_summaries():
    s = np.log(np.array([1.0, 2.0, 3.0, 4.0]))  # q.k / sqrt(d) of the example
    v = np.array([[1, 0], [0, 2], [3, 1], [2, 4]], np.float64)
    for got, want in ((_partial(s[:2], v[:2]), BLOCK_A), (_partial(s[2:], v[2:]), BLOCK_B)):
        np.testing.assert_allclose(float(got.m), float(want.m), rtol=1e-6)
        np.testing.assert_allclose(float(got.z), float(want.z), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(got.u), np.asarray(want.u), rtol=1e-6)


def test_worked_example_merge():
    merged = merge_two(BLOCK_A, BLOCK_B)
    np.testing.assert_allclose(float(merged.m), LN4, rtol=1e-7)
    np.testing.assert_allclose(float(merged.z), 2.5, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(merged.u), [4.5, 5.75], rtol=1e-7)
    np.testing.assert_allclose(np.asarray(finalize(merged.z, merged.u)), [1.8, 2.3], rtol=1e-7)
    stacked = merge_and_finalize(jnp.stack([BLOCK_B.m, BLOCK_A.m]), jnp.stack([BLOCK_B.z, BLOCK_A.z]),
                                 jnp.stack([BLOCK_B.u, BLOCK_A.u]))
    np.testing.assert_allclose(np.asarray(stacked), [1.8, 2.3], rtol=1e-7)


def test_empty_partials_contribute_nothing_and_all_empty_is_zero():
    empty = Partial(jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros(2, jnp.float32))
    merged = merge_two(merge_two(empty, BLOCK_A), merge_two(BLOCK_B, empty))
    np.testing.assert_allclose(np.asarray(finalize(merged.z, merged.u)), [1.8, 2.3], rtol=1e-7)
    nothing = merge_two(empty, empty)
    assert float(nothing.m) == -np.inf and float(nothing.z) == 0.0
    out = finalize(nothing.z, nothing.u, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@settings(max_examples=examples(60))
@given(st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_any_partition_merges_to_the_full_softmax(n, parts, seed):
    rng = np.random.default_rng(seed)
    s = rng.standard_normal(n) * 4
    v = rng.standard_normal((n, 3))
    cuts = np.sort(rng.integers(0, n + 1, parts - 1))  # empty pieces allowed
    pieces = [_partial(s[a:b], v[a:b]) for a, b in zip(np.r_[0, cuts], np.r_[cuts, n], strict=True)]
    order = rng.permutation(len(pieces))
    m = jnp.stack([pieces[i].m for i in order])
    z = jnp.stack([pieces[i].z for i in order])
    u = jnp.stack([pieces[i].u for i in order])
    w = np.exp(s - s.max())
    np.testing.assert_allclose(np.asarray(merge_and_finalize(m, z, u)), (w / w.sum()) @ v, rtol=1e-5, atol=1e-6)


def test_merge_along_another_axis():
    m = jnp.stack([BLOCK_A.m, BLOCK_B.m])[None, :]  # [1, 2]
    z = jnp.stack([BLOCK_A.z, BLOCK_B.z])[None, :]
    u = jnp.stack([BLOCK_A.u, BLOCK_B.u])[None, :]  # [1, 2, 2]
    np.testing.assert_allclose(np.asarray(merge_and_finalize(m, z, u, axis=1)), [[1.8, 2.3]], rtol=1e-7)
