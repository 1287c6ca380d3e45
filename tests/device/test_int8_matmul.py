"""The CPU int8 x int8 -> int32 kernel (`pagedjax.device.int8_matmul`) against numpy's exact integer product:
random shapes (k around the kernel's 64- and 32-byte vectors, rows and channels around its 4 x 4 tiles, empty
operands), every int8 value on both sides (-128 included); its portable build (no VNNI) the same; the XLA
reference the same; and what happens when it cannot be built or loaded (a warning, the reference)."""

from __future__ import annotations

import functools
import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.device import int8_matmul as im

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler: the kernel cannot be built here")


def _exact(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.int64) @ w.astype(np.int64).T


def _operands(m: int, k: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, (m, k), dtype=np.int8)
    w = rng.integers(-128, 128, (n, k), dtype=np.int8)
    if m and k:  # the extremes, whose products the biased sums must carry exactly
        x[0, :] = -128
        x[-1, 0] = 127
    if n and k:
        w[0, :] = -128
        w[-1, -1] = 127
    return x, w


_SHAPES = dict(m=st.sampled_from([0, 1, 2, 3, 4, 5, 8, 9, 17]),
               k=st.sampled_from([0, 1, 31, 32, 33, 63, 64, 65, 127, 200, 256]),
               n=st.sampled_from([0, 1, 3, 4, 5, 8, 13, 64, 70]))


@functools.cache
def _jitted(target: str | None):
    if target is None:
        return jax.jit(im.int8_matmul)
    return jax.jit(functools.partial(im.native_call, target))


@needs_compiler
@settings(deadline=None)
@given(seed=st.integers(0, 2**16), **_SHAPES)
def test_the_kernel_equals_the_exact_integer_product(m, k, n, seed):
    status = im.native_status()
    assert status.loaded, status.reason
    x, w = _operands(m, k, n, seed)
    got = np.asarray(_jitted(status.target)(jnp.asarray(x), jnp.asarray(w)))
    assert got.dtype == np.int32 and got.shape == (m, n)
    np.testing.assert_array_equal(got, _exact(x, w))


@pytest.mark.parametrize("m", [1, 3])
def test_int8_matmul_takes_the_kernel_for_one_row_and_xla_past_native_max_rows(m):
    x, w = _operands(m, 130, 9, m)
    text = jax.jit(im.int8_matmul).lower(jnp.asarray(x), jnp.asarray(w)).as_text()
    assert (im.TARGET in text) == (m <= im.NATIVE_MAX_ROWS and im.native_status().loaded)
    np.testing.assert_array_equal(np.asarray(_jitted(None)(jnp.asarray(x), jnp.asarray(w))), _exact(x, w))


@needs_compiler
def test_the_portable_build_and_the_xla_reference_equal_it_too(tmp_path):
    """The kernel built without VNNI (the loop a CPU without it runs), registered under a target of its own, and
    the XLA dot, over shapes that cover every tile remainder."""
    library = im.build(tmp_path, flags=tuple(f for f in im.FLAGS if f != "-march=native") + ("-march=x86-64",))
    status = im.load(library, target="pagedjax_int8_matmul_portable_test")
    assert status.loaded and not status.vnni
    for i, (m, k, n) in enumerate([(1, 65, 9), (6, 130, 7), (4, 64, 4), (9, 1, 13), (0, 3, 2), (3, 0, 2)]):
        x, w = _operands(m, k, n, i)
        want = _exact(x, w)
        np.testing.assert_array_equal(np.asarray(_jitted(status.target)(jnp.asarray(x), jnp.asarray(w))), want)
        np.testing.assert_array_equal(np.asarray(im.int8_matmul_reference(jnp.asarray(x), jnp.asarray(w))), want)


@needs_compiler
def test_the_build_is_cached_by_key_and_a_failing_compiler_is_named(tmp_path):
    first = im.build(tmp_path)
    assert im.build(tmp_path) == first and len(list(tmp_path.iterdir())) == 1  # built once, no partial file left
    with pytest.raises(RuntimeError, match="false failed"):
        im.build(tmp_path, flags=("-O0",), compiler=shutil.which("false") or "/bin/false")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [first]  # the failed build left no partial file


def test_a_kernel_that_cannot_load_is_a_warning_and_the_reference_runs(tmp_path, caplog):
    missing = tmp_path / "missing.so"
    with caplog.at_level(logging.WARNING, logger=im.__name__):
        status = im.status_for(str(missing))
    assert not status.loaded and str(missing) in status.reason
    assert "could not be built or loaded" in caplog.text and str(missing) in caplog.text
    assert im.status_for("off") == im.NativeStatus(False, reason=f"{im.ENV}=off")


@pytest.mark.parametrize("x, w, match", [
    (np.zeros((2, 3), np.int8), np.zeros((4, 5), np.int8), "same k"),
    (np.zeros((2, 3, 1), np.int8), np.zeros((4, 3), np.int8), r"\[m, k\]"),
    (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.int8), "int8 operands"),
    (np.zeros((1, im.MAX_K + 1), np.int8), np.zeros((1, im.MAX_K + 1), np.int8), "overflow"),
])
def test_bad_operands_are_refused(x, w, match):
    with pytest.raises(ValueError, match=match):
        im.int8_matmul(jnp.asarray(x), jnp.asarray(w))
