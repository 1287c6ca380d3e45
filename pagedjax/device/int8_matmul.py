"""Products of int8 activations on the CPU through XLA's FFI: `int8_matmul(x, w)` with x `[m, k]`, w `[n, k]` (both
int8, k contiguous) -> int32 `[m, n]`, exact; and `int4_matmul(x, w, scale, group_size)`, w int4 in groups (the
nibble planes of `pagedjax.model.layers.quant.pack_int4`) -> float32 `[m, n]`, each group's integer sum exact.

XLA:CPU has no integer SIMD dot products for one row (an int8 `dot_general` of one row runs element by element:
0.03 - 0.2x of the kernel below; several rows go to YNNPACK's int8 kernels, as fast or faster) and no fast form
of int4 groups at all, so on the CPU these are a small C++ kernel (`int8_matmul.cc`: AVX-512 VNNI or AVX-VNNI dot
products where the CPU has them, else AVX2's byte products, else a portable loop; `NativeStatus.isa` says which),
compiled on first use with the machine's own instruction set (`pagedjax.device.native`) and registered as the FFI
targets `pagedjax_int8_matmul` and `pagedjax_int8_matmul_int4`.

`int8_matmul_reference` (`int4_matmul_reference`) is the same product in XLA: what runs on other platforms
(`jax.lax.platform_dependent` picks the kernel on the CPU only), past `NATIVE_MAX_ROWS` rows of int8 weights, and
on a CPU where the kernel cannot be built or loaded (no C++ compiler, a read-only cache): that is logged as a
warning once, naming the reason; `native_status()` tells which is in use. int8's are exact, so their results are
equal bit for bit; int4's sum their groups' scaled integers in another order (equal to float32 rounding).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.config.quant import int8_activation_groups
from pagedjax.device import native

logger = logging.getLogger(__name__)

__all__ = ["MAX_K", "NATIVE_MAX_ROWS", "NativeStatus", "build", "check_int4_group", "int4_matmul",
           "int4_matmul_reference", "int8_matmul", "int8_matmul_reference", "load", "native_call", "native_int4_call",
           "native_status", "status_for"]

SOURCE = Path(__file__).with_name("int8_matmul.cc")
TARGET = "pagedjax_int8_matmul"  # int4 weights: TARGET + INT4 (a target of that name is registered with each)
INT4 = "_int4"
# The kernel's int32 sums are exact for inputs up to this long (each product of a biased byte is at most 255 x 128).
MAX_K = 65536
# `PAGEDJAX_NATIVE=off` keeps every product on XLA (e.g. to compare against the kernel), a path loads that built
# library; unset, the kernel is built for this machine (`status_for`).
ENV = native.ENV
# Rows past which XLA's own int8 dot (YNNPACK's, for several rows) is as fast or faster than the kernel: `python
# scripts/bench_int8_matmul.py` (156M shapes, an AVX-512 VNNI + AMX Xeon): one row 4.2 - 32x faster natively (XLA
# emits a scalar loop for it), two rows 0.7 - 1.9x, three and more mostly slower.
NATIVE_MAX_ROWS = 1
FLAGS = native.FLAGS


@dataclass(frozen=True)
class NativeStatus:
    """Whether the CPU kernel is in use: `loaded`; `isa`: the instructions it computes with ("avx512-vnni",
    "avx-vnni", "avx2" or "portable"); `path`: the shared library; `target`: the FFI target it is registered as;
    `reason`: why it is not loaded (None when it is)."""

    loaded: bool
    isa: str | None = None
    path: Path | None = None
    target: str | None = None
    reason: str | None = None


def build(folder: Path | None = None, *, flags: tuple[str, ...] = FLAGS, compiler: str | None = None) -> Path:
    """Compile `int8_matmul.cc` (`native.build`: once per key, see the module docstring) and return the shared
    library's path. RuntimeError naming the compiler's complaint when it fails, or when no C++ compiler is found."""
    return native.build(SOURCE, folder, flags=flags, compiler=compiler)


def load(library: Path, target: str = TARGET) -> NativeStatus:
    """Load a built kernel (`build`) and register it as the CPU FFI targets `target` (int8 weights) and `target` +
    `INT4` (int4 weights). OSError when it cannot be loaded."""
    lib = ctypes.CDLL(str(library))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.PagedjaxInt8Matmul), platform="cpu")
    jax.ffi.register_ffi_target(target + INT4, jax.ffi.pycapsule(lib.PagedjaxInt4Matmul), platform="cpu")
    lib.pagedjax_int8_matmul_isa.restype = ctypes.c_char_p
    return NativeStatus(True, isa=lib.pagedjax_int8_matmul_isa().decode(), path=Path(library), target=target)


def status_for(setting: str | None) -> NativeStatus:
    """The kernel `native_status` uses for the setting of `$PAGEDJAX_NATIVE`: unset or empty (build it for this
    machine), off (none) or a built library's path; a kernel that cannot be built or loaded is logged as a
    warning naming the reason, and none is used."""
    setting = (setting or "").strip()
    if native.is_off(setting):
        return NativeStatus(False, reason=f"{ENV}={setting}")
    try:
        status = load(Path(setting) if setting else native.build_somewhere(SOURCE))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("int8 products run on XLA's int8 dot (slow on the CPU): the native kernel could not be "
                       "built or loaded: %s", exc)
        return NativeStatus(False, reason=str(exc))
    logger.info("int8 products: native CPU kernel %s (%s)", status.path, status.isa)
    return status


@functools.cache
def _process_status() -> NativeStatus:
    return status_for(os.environ.get(ENV))


_STATUS_LOCK = threading.Lock()  # the engine's thread and its compile thread may both trace a first product


def native_status() -> NativeStatus:
    """The CPU kernel of this process (`status_for($PAGEDJAX_NATIVE)`), built, loaded and registered once."""
    with _STATUS_LOCK:
        return _process_status()


def int8_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """x int8 `[m, k]` times w int8 `[n, k]` -> int32 `[m, n]` (contracting k), as an XLA dot."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def native_call(target: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The kernel registered as `target` on x int8 `[m, k]` and w int8 `[n, k]` -> int32 `[m, n]` (CPU only; under
    `vmap` one call per batch element)."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.int32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w)


def int8_matmul(x: jax.Array, w: jax.Array, *, native_max_rows: int = NATIVE_MAX_ROWS) -> jax.Array:
    """x int8 `[m, k]` times w int8 `[n, k]` -> int32 `[m, n]`, exact: the native kernel on the CPU for up to
    `native_max_rows` rows (module docstring), else `int8_matmul_reference` (the same integers). ValueError for
    other shapes or dtypes, or k over `MAX_K`."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"int8_matmul: x [m, k] and w [n, k] with the same k expected, got {x.shape} and {w.shape}")
    if x.dtype != jnp.int8 or w.dtype != jnp.int8:
        raise ValueError(f"int8_matmul: int8 operands expected, got {x.dtype} and {w.dtype}")
    if x.shape[1] > MAX_K:
        raise ValueError(f"int8_matmul: k = {x.shape[1]} is over {MAX_K}, past which the int32 sums could overflow")
    status = native_status()
    if not status.loaded or x.shape[0] > native_max_rows:
        return int8_matmul_reference(x, w)
    return jax.lax.platform_dependent(x, w, cpu=functools.partial(native_call, status.target),
                                      default=int8_matmul_reference)


def check_int4_group(group_size: int) -> None:
    """ValueError unless the kernel's vectors of 64 packed bytes tile int4 groups of `group_size` inputs
    (`pagedjax.config.quant.int8_activation_groups`: groups of 8, 16, 32, 64 or a multiple of 128)."""
    if not int8_activation_groups(group_size):
        raise ValueError(f"int8 activations with int4 weights take groups of 8, 16, 32, 64 or a multiple of 128 "
                         f"inputs (the kernel's 64-byte vectors tile them), got {group_size}")


def _int4_args(x: jax.Array, w: jax.Array, scale: jax.Array, group_size: int) -> None:
    if x.ndim != 2 or w.ndim != 2 or scale.ndim != 2 or x.shape[1] != 2 * w.shape[1] or \
            scale.shape != (w.shape[0], x.shape[1] // group_size) or x.shape[1] % group_size:
        raise ValueError(f"int4_matmul: x [m, k], w [n, k / 2] and scale [n, k / {group_size}] expected, got "
                         f"{x.shape}, {w.shape} and {scale.shape}")
    if x.dtype != jnp.int8 or w.dtype != jnp.uint8 or scale.dtype != jnp.float32:
        raise ValueError(f"int4_matmul: int8 x, uint8 w and float32 scale expected, got {x.dtype}, {w.dtype} and "
                         f"{scale.dtype}")
    if x.shape[1] > MAX_K:
        raise ValueError(f"int4_matmul: k = {x.shape[1]} is over {MAX_K}, past which the int32 sums could overflow")
    check_int4_group(group_size)


def int4_matmul_reference(x: jax.Array, w: jax.Array, scale: jax.Array, group_size: int) -> jax.Array:
    """`int4_matmul` in XLA: each plane's nibbles sign-extended, an exact int32 sum per (row, channel, group), then
    the groups' scaled sum in float32."""
    m, k = x.shape
    n = w.shape[0]
    groups, gh = k // group_size, group_size // 2
    low = ((w & 0x0F) ^ 8).astype(jnp.int8) - 8  # [n, k / 2]: the low plane's signed weights
    high = ((w >> 4) ^ 8).astype(jnp.int8) - 8
    halves = x.reshape(m, groups, 2, gh)  # each group's first and second halves: the two planes' inputs
    acc = sum(jnp.einsum("mgj,ngj->mng", halves[:, :, plane], ws.reshape(n, groups, gh),
                         preferred_element_type=jnp.int32)
              for plane, ws in ((0, low), (1, high)))  # i32[m, n, groups]
    return jnp.sum(acc.astype(jnp.float32) * scale[None], axis=-1)


def int4_matmul(x: jax.Array, w: jax.Array, scale: jax.Array, group_size: int) -> jax.Array:
    """x int8 `[m, k]` times int4 weights w uint8 `[n, k / 2]` (`pack_int4`'s nibble planes) with float32 `scale`
    `[n, k / group_size]` -> float32 `[m, n]` = sum over groups of scale x the group's exact integer sum: the
    native kernel on the CPU for every row count (XLA has no fast form of it), `int4_matmul_reference` elsewhere.
    ValueError for other shapes, dtypes or groups (`check_int4_group`), or k over `MAX_K`."""
    _int4_args(x, w, scale, group_size)
    status = native_status()
    if not status.loaded:
        return int4_matmul_reference(x, w, scale, group_size)
    return jax.lax.platform_dependent(
        x, w, scale, cpu=functools.partial(native_int4_call, status.target + INT4, group_size=group_size),
        default=functools.partial(int4_matmul_reference, group_size=group_size))


def native_int4_call(target: str, x: jax.Array, w: jax.Array, scale: jax.Array, *, group_size: int) -> jax.Array:
    """The int4 kernel registered as `target` (`native_call`'s int8 target + `INT4`) on x int8 `[m, k]`, w uint8
    `[n, k / 2]` and scale float32 `[n, k / group_size]` -> float32 `[m, n]` (CPU only)."""
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x, w, scale, group_size=np.int64(group_size))
