"""int8 x int8 -> int32 matrix products on the CPU through XLA's FFI: `int8_matmul(x, w)` with x `[m, k]`, w `[n, k]`
(both int8, k contiguous) -> int32 `[m, n]`, exact.

XLA:CPU has no integer SIMD dot products (an int8 `dot_general` runs element by element: 0.04 - 0.17x of the
float loops, docs/quantization.md), so on the CPU the product is a small C++ kernel (`int8_matmul.cc`: AVX-512
VNNI or AVX-VNNI dot products where the CPU has them, else a portable loop), compiled on first use with the
machine's own instruction set into `$XDG_CACHE_HOME/pagedjax/native/<key>/` (the key: the source, the jaxlib
version, the compiler flags and the CPU's instruction-set flags, so a cache shared between machines never runs
one machine's build on another) and registered as the FFI target `pagedjax_int8_matmul`.

`int8_matmul_reference` is the same product as an XLA dot: what runs on other platforms (`jax.lax.platform_dependent`
picks the kernel on the CPU only), and on a CPU where the kernel cannot be built or loaded (no C++ compiler, a
read-only cache): that is logged as a warning once, naming the reason; `native_status()` tells which is in use.
Both are exact, so their results are equal bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

logger = logging.getLogger(__name__)

__all__ = ["MAX_K", "NATIVE_MAX_ROWS", "NativeStatus", "build", "int8_matmul", "int8_matmul_reference", "load", "native_call",
           "native_status", "status_for"]

SOURCE = Path(__file__).with_name("int8_matmul.cc")
TARGET = "pagedjax_int8_matmul"
# The kernel's int32 sums are exact for inputs up to this long (each product of a biased byte is at most 255 x 128).
MAX_K = 65536
# `PAGEDJAX_NATIVE=off` keeps every product on XLA (e.g. to compare against the kernel), a path loads that built
# library; unset, the kernel is built for this machine (`status_for`).
ENV = "PAGEDJAX_NATIVE"
_OFF = {"0", "off", "false", "no", "none"}
# Rows past which XLA's own int8 dot (YNNPACK's, for several rows) is as fast or faster than the kernel: `python
# scripts/bench_int8_matmul.py` (156M shapes, an AVX-512 VNNI + AMX Xeon): one row 4.2 - 32x faster natively (XLA
# emits a scalar loop for it), two rows 0.7 - 1.9x, three and more mostly slower.
NATIVE_MAX_ROWS = 1
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


@dataclass(frozen=True)
class NativeStatus:
    """Whether the CPU kernel is in use: `loaded`; `vnni`: it computes with VNNI dot products (else a portable
    loop); `path`: the shared library; `target`: the FFI target it is registered as; `reason`: why it is not
    loaded (None when it is)."""

    loaded: bool
    vnni: bool = False
    path: Path | None = None
    target: str | None = None
    reason: str | None = None


def _cpu_flags() -> str:
    """The CPU's instruction-set flags (Linux), else the machine's name: part of the build's cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedjax" / "native"


def build(folder: Path | None = None, *, flags: tuple[str, ...] = FLAGS, compiler: str | None = None) -> Path:
    """Compile `int8_matmul.cc` (once per key: see the module docstring) and return the shared library's path.
    RuntimeError naming the compiler's complaint when it fails, or when no C++ compiler is found."""
    compiler = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (c++, g++ or $CXX)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, jaxlib.__version__.encode(), " ".join(flags).encode(),
                                     compiler.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    folder = (folder or _cache_dir()) / key
    library = folder / "libpagedjax_int8_matmul.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed: processes building at once never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        proc = subprocess.run([compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        partial.replace(library)
    finally:
        partial.unlink(missing_ok=True)
    return library


def load(library: Path, target: str = TARGET) -> NativeStatus:
    """Load a built kernel (`build`) and register it as the CPU FFI target `target`. OSError when it cannot be
    loaded."""
    lib = ctypes.CDLL(str(library))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.PagedjaxInt8Matmul), platform="cpu")
    return NativeStatus(True, vnni=bool(lib.pagedjax_int8_matmul_vnni()), path=Path(library), target=target)


def status_for(setting: str | None) -> NativeStatus:
    """The kernel `native_status` uses for the setting of `$PAGEDJAX_NATIVE`: unset or empty (build it for this
    machine), off (none) or a built library's path; a kernel that cannot be built or loaded is logged as a
    warning naming the reason, and none is used."""
    setting = (setting or "").strip()
    if setting.lower() in _OFF:
        return NativeStatus(False, reason=f"{ENV}={setting}")
    try:
        status = load(Path(setting) if setting else build())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("int8 products run on XLA's int8 dot (slow on the CPU): the native kernel could not be "
                       "built or loaded: %s", exc)
        return NativeStatus(False, reason=str(exc))
    logger.info("int8 products: native CPU kernel %s (%s)", status.path, "VNNI" if status.vnni else "portable")
    return status


@functools.cache
def native_status() -> NativeStatus:
    """The CPU kernel of this process (`status_for($PAGEDJAX_NATIVE)`), built, loaded and registered once."""
    return status_for(os.environ.get(ENV))


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
