"""Cold or warm start: JAX's persistent compilation cache for a run (`--compile-cache DIR`, `--no-compile-cache`).

The cache is set up before anything is loaded or compiled: JAX's cache is one setting per process, and a
program compiled while it is off is never written to it. What the run found in it is counted one way, the
engine's: its step programs, compiled or loaded from the cache (`EngineStats.compilations`, `programs_loaded`);
all of them loaded is a warm start, none a cold one. `--no-compile-cache` turns JAX's cache off for the rest of
the process, whatever `$PAGEDJAX_COMPILE_CACHE` or `$JAX_COMPILATION_CACHE_DIR` say.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedjax.cli.args import PROG


@dataclass(frozen=True)
class CompileCache:
    """The persistent compilation cache of a run: its folder (None: off)."""

    folder: Path | None

    @property
    def engine_arg(self) -> str | bool:
        """`LLMEngine(compile_cache=...)`: the folder already in use, or False."""
        return str(self.folder) if self.folder is not None else False

    def start(self, programs: int, loaded: int) -> str:
        """'off', 'cold', 'warm', 'partly warm' (some programs loaded, others compiled), or 'no compilation',
        given the step programs the engine obtained and how many of them it loaded from the cache."""
        if self.folder is None:
            return "off"
        if programs == 0:
            return "no compilation"
        if loaded == programs:
            return "warm"
        return "cold" if loaded == 0 else "partly warm"

    def describe(self, programs: int, loaded: int) -> str:
        """The statistics table's text: e.g. 'warm start: 7 of 7 step programs loaded from /tmp/cache'."""
        if self.folder is None:
            return "off: every program compiled"
        if programs == 0:
            return f"on, {self.folder}: no step program compiled"
        return f"{self.start(programs, loaded)} start: {loaded:,} of {programs:,} step programs loaded from " \
               f"{self.folder}"


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


@contextmanager
def compile_cache(args: argparse.Namespace) -> Iterator[CompileCache]:
    """JAX's compilation cache set up as the arguments ask (call it before anything compiles), for the block."""
    import jax

    from pagedjax.compile_cache import enable_compile_cache

    if args.no_compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        folder = None
    else:
        folder = enable_compile_cache(args.compile_cache)  # None: it could not create the folder (logged)
        if not jax.config.jax_enable_compilation_cache:  # turned off earlier in this process
            folder = None
        elif folder is not None and args.compile_cache is not None and not _same_folder(folder, args.compile_cache):
            print(f"{PROG}: warning: JAX's compilation cache is already set to {folder} ($JAX_COMPILATION_CACHE_DIR, "
                  f"or earlier in this process); --compile-cache {args.compile_cache} is not used", file=sys.stderr)
    yield CompileCache(folder)
