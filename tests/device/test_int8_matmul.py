"""The CPU kernels of int8 activations (`pagedjax.device.int8_matmul`) against numpy: int8 weights (the exact
integer product: random shapes, k around the kernel's 64- and 32-byte vectors, rows and channels around its 4 x 4
tiles, empty operands, every int8 value on both sides, -128 included) and int4 weights in groups (every group size
the kernel takes, every nibble, its float32 sum of exact group sums); the portable build (no VNNI) and the XLA
references the same; what happens when the kernel cannot be built or loaded (a warning, the reference)."""

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
from pagedjax.device import native

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


def _int4_operands(m: int, groups: int, n: int, group: int, seed: int):
    """x int8 `[m, k]`, the packed weights, float32 scales, and numpy's result (float64 sum of each group's exact
    integer sum times its scale)."""
    from pagedjax.model.layers.quant import pack_int4

    rng = np.random.default_rng(seed)
    k = groups * group
    q = rng.integers(-8, 8, (n, k), dtype=np.int8)
    x = rng.integers(-128, 128, (m, k), dtype=np.int8)
    scale = rng.uniform(0.0, 2.0, (n, groups)).astype(np.float32)
    sums = (x.astype(np.int64).reshape(m, 1, groups, group) * q.astype(np.int64).reshape(1, n, groups, group)).sum(-1)
    want = (sums * scale[None].astype(np.float64)).sum(-1)
    packed = np.asarray(pack_int4(jnp.asarray(q), group)) if n else np.zeros((0, k // 2), np.uint8)
    return x, packed, scale, want


@functools.cache
def _int4_jitted(target: str | None, group: int):
    if target is None:
        return jax.jit(functools.partial(im.int4_matmul, group_size=group))
    return jax.jit(functools.partial(im.native_int4_call, target, group_size=group))


def _check_int4(fn, m, groups, n, group, seed):
    x, packed, scale, want = _int4_operands(m, groups, n, group, seed)
    got = np.asarray(fn(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(scale)))
    assert got.dtype == np.float32 and got.shape == (m, n)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * max(1.0, np.abs(want).max(initial=0.0)))


@needs_compiler
@settings(deadline=None)
@given(seed=st.integers(0, 2**16), m=st.sampled_from([0, 1, 2, 4, 5, 9]), groups=st.sampled_from([1, 2, 3, 5]),
       n=st.sampled_from([0, 1, 4, 7]), group=st.sampled_from([8, 16, 32, 64, 128, 256, 384]))
def test_the_int4_kernel_equals_the_sum_of_exact_group_sums(m, groups, n, group, seed):
    status = im.native_status()
    assert status.loaded, status.reason
    _check_int4(_int4_jitted(status.target + im.INT4, group), m, groups, n, group, seed)


@needs_compiler
@pytest.mark.parametrize("m, k, n", [(1, 1024, 1030), (5, 520, 333)])
def test_products_split_over_the_thread_pool_equal_numpy(m, k, n):
    """Past 128K multiply-adds the channels are split in chunks over XLA's intra-op threads (the hypothesis shapes
    stay mostly below): channel counts that are no multiple of a chunk or a 4-channel tile."""
    status = im.native_status()
    x, w = _operands(m, k, n, 7)
    np.testing.assert_array_equal(np.asarray(_jitted(status.target)(jnp.asarray(x), jnp.asarray(w))), _exact(x, w))
    _check_int4(_int4_jitted(status.target + im.INT4, 64), m, k // 64, n, 64, 7)


@needs_compiler
def test_the_portable_build_and_the_xla_reference_equal_it_too(tmp_path):
    """The kernel built without VNNI (the loop a CPU without it runs), registered under a target of its own, and
    the XLA dot, over shapes that cover every tile remainder."""
    library = im.build(tmp_path, flags=tuple(f for f in im.FLAGS if f != "-march=native") + ("-march=x86-64",))
    status = im.load(library, target="pagedjax_int8_matmul_portable_test")
    assert status.loaded and status.isa == "portable"
    for i, (m, k, n) in enumerate([(1, 65, 9), (6, 130, 7), (4, 64, 4), (9, 1, 13), (0, 3, 2), (3, 0, 2)]):
        x, w = _operands(m, k, n, i)
        want = _exact(x, w)
        np.testing.assert_array_equal(np.asarray(_jitted(status.target)(jnp.asarray(x), jnp.asarray(w))), want)
        np.testing.assert_array_equal(np.asarray(im.int8_matmul_reference(jnp.asarray(x), jnp.asarray(w))), want)
    for i, (m, groups, n, group) in enumerate([(1, 3, 5, 32), (5, 2, 6, 128), (2, 1, 3, 8), (0, 1, 2, 16)]):
        _check_int4(_int4_jitted(status.target + im.INT4, group), m, groups, n, group, i)
        _check_int4(functools.partial(im.int4_matmul_reference, group_size=group), m, groups, n, group, i)
        _check_int4(_int4_jitted(None, group), m, groups, n, group, i)  # the kernel this process loaded


@needs_compiler
@pytest.mark.parametrize("march, isa, needs", [("haswell", "avx2", "avx2"), ("alderlake", "avx-vnni", "avx_vnni")])
def test_the_256_bit_builds_equal_numpy_for_activations_in_the_quantizers_range(tmp_path, march, isa, needs):
    """A Haswell-class build (AVX2, no VNNI: int8 weights through vpmaddubsw, exact for x in [-127, 127], what
    `quantize_rows` makes, and every weight, -128 included) and an Alder Lake one (AVX-VNNI, 256 bits, no
    AVX-512); int4 groups too, every group size the kernel takes. On this CPU where it has their instructions."""
    if needs not in native.cpu_flags().split():
        pytest.skip(f"this CPU has no {needs}")
    library = im.build(tmp_path, flags=tuple(f for f in im.FLAGS if f != "-march=native") + (f"-march={march}",))
    status = im.load(library, target=f"pagedjax_int8_matmul_{march}_test")
    assert status.isa == isa
    for i, (m, k, n) in enumerate([(1, 65, 9), (6, 130, 7), (4, 64, 4), (9, 1, 13), (3, 1024, 300)]):
        x, w = _operands(m, k, n, i)
        x = np.maximum(x, -127)
        got = np.asarray(_jitted(status.target)(jnp.asarray(x), jnp.asarray(w)))
        np.testing.assert_array_equal(got, _exact(x, w))
    for i, (m, groups, n, group) in enumerate([(1, 3, 5, 32), (5, 2, 6, 128), (2, 3, 3, 8), (3, 1, 70, 384),
                                               (1, 4, 9, 16), (2, 2, 5, 64)]):
        _check_int4(_int4_jitted(status.target + im.INT4, group), m, groups, n, group, i)


@needs_compiler
def test_the_build_is_cached_by_key_and_a_failing_compiler_is_named(tmp_path):
    first = im.build(tmp_path)
    assert im.build(tmp_path) == first and len(list(tmp_path.iterdir())) == 1  # built once, no partial file left
    with pytest.raises(RuntimeError, match="false failed"):
        im.build(tmp_path, flags=("-O0",), compiler=shutil.which("false") or "/bin/false")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [first]  # the failed build left no partial file


@needs_compiler
def test_a_read_only_cache_folder_builds_in_a_temporary_one(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    home.write_text("")  # a file where the cache folder would be: it cannot be made (as root, too)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.setattr(im, "load", lambda library, target=im.TARGET: im.NativeStatus(True, path=library))
    status = im.status_for(None)
    assert status.loaded and status.path.is_file() and home not in status.path.parents, status


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


@pytest.mark.parametrize("shapes, dtypes, group, match", [
    (((2, 96), (3, 48), (3, 2)), ("int8", "uint8", "float32"), 48, "groups of 8, 16, 32, 64 .* got 48"),
    (((2, 64), (3, 16), (3, 2)), ("int8", "uint8", "float32"), 32, r"w \[n, k / 2\]"),
    (((2, 64), (3, 32), (3, 4)), ("int8", "uint8", "float32"), 32, r"scale \[n, k / 32\]"),
    (((2, 64), (3, 32), (3, 2)), ("int8", "int8", "float32"), 32, "uint8 w"),
    (((2, 64), (3, 32), (3, 2)), ("int8", "uint8", "bfloat16"), 32, "float32 scale"),
])
def test_bad_int4_operands_are_refused(shapes, dtypes, group, match):
    with pytest.raises(ValueError, match=match):
        im.int4_matmul(*(jnp.zeros(s, d) for s, d in zip(shapes, dtypes, strict=True)), group)
