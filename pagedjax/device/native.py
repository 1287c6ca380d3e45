"""Native CPU kernels (C++ sources beside their wrappers, called from jit through XLA's FFI): compiled on first use
with the machine's own instruction set into `$XDG_CACHE_HOME/pagedjax/native/<key>/`, the key a digest of the
source, the jaxlib version, the compiler, its flags and the CPU's instruction-set flags, so a cache shared between
machines never runs one machine's build on another.

    build(source)            -> the shared library's path (built once per key)
    build_somewhere(source)  -> the same, in a temporary folder where the cache cannot be written
    is_off(setting)          -> whether `$PAGEDJAX_NATIVE` turns every native kernel off (each wrapper then uses
                                its XLA form, logged)

Wrappers: `pagedjax.device.int8_matmul` (int8 / int4 products), `pagedjax.device.cpu_attention` (paged decode
attention).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

__all__ = ["ENV", "FLAGS", "build", "build_somewhere", "cache_dir", "cpu_flags", "is_off"]

# `PAGEDJAX_NATIVE=off` keeps every native kernel's work on XLA (e.g. to compare against them).
ENV = "PAGEDJAX_NATIVE"
_OFF = {"0", "off", "false", "no", "none"}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


def is_off(setting: str | None) -> bool:
    """Whether a value of `$PAGEDJAX_NATIVE` turns the native kernels off (0, off, false, no, none)."""
    return (setting or "").strip().lower() in _OFF


def cpu_flags() -> str:
    """The CPU's instruction-set flags (Linux), else the machine's name: part of a build's cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() + platform.processor()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedjax" / "native"


def build(source: Path, folder: Path | None = None, *, flags: tuple[str, ...] = FLAGS,
          compiler: str | None = None) -> Path:
    """Compile `source` (once per key: see the module docstring) into `folder` (default `cache_dir()`) and return
    the shared library's path, `libpagedjax_<source's stem>.so`. RuntimeError naming the compiler's complaint when
    it fails, or when no C++ compiler is found."""
    compiler = compiler or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (c++, g++ or $CXX)")
    key = hashlib.sha256(b"\0".join([source.read_bytes(), jaxlib.__version__.encode(), " ".join(flags).encode(),
                                     compiler.encode(), cpu_flags().encode()])).hexdigest()[:16]
    folder = (folder or cache_dir()) / key
    library = folder / f"libpagedjax_{source.stem}.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed: processes building at once never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        proc = subprocess.run([compiler, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(partial)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        partial.replace(library)
    finally:
        partial.unlink(missing_ok=True)
    return library


def build_somewhere(source: Path) -> Path:
    """`build` into the cache folder or, where that cannot be written (a read-only home), into a temporary folder of
    this process (built again by the next one; logged)."""
    try:
        return build(source)
    except OSError as exc:
        folder = Path(tempfile.mkdtemp(prefix="pagedjax-native-"))
        logger.info("the native kernels' cache folder cannot be written (%s): %s built in %s instead", exc,
                    source.name, folder)
        return build(source, folder)
