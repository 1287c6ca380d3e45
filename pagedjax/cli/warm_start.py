"""Cold or warm start: JAX's persistent compilation cache for a run (`--compile-cache DIR`, `--no-compile-cache`).

The cache is set up before anything is loaded or compiled: JAX's cache is one setting per process, and a
program compiled while it is off is never written to it. While the run goes on, JAX's monitoring events count
the programs compiled with the cache on and those of them loaded from it: all of them loaded is a warm start,
none a cold one. `--no-compile-cache` turns JAX's cache off for the rest of the process, whatever
`$PAGEDJAX_COMPILE_CACHE` or `$JAX_COMPILATION_CACHE_DIR` say.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedjax.cli.args import PROG

# JAX's monitoring events: a compilation that looks in the persistent cache, and one that finds its program there.
LOOKUP_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclass
class CompileCache:
    """The persistent compilation cache of a run: its folder (None: off) and what the run found in it."""

    folder: Path | None
    lookups: int = 0  # programs compiled while the cache was on (looked up in it)
    hits: int = 0  # of which loaded from it instead of compiled

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def engine_arg(self) -> str | bool:
        """`LLMEngine(compile_cache=...)`: the folder already in use, or False."""
        return str(self.folder) if self.folder is not None else False

    @property
    def start(self) -> str:
        """'off', 'cold', 'warm', 'partly warm' (some programs loaded, others compiled), or 'no compilation'
        (every program was already in this process's memory)."""
        if self.folder is None:
            return "off"
        if self.lookups == 0:
            return "no compilation"
        if self.hits == self.lookups:
            return "warm"
        return "cold" if self.hits == 0 else "partly warm"

    def describe(self) -> str:
        """The statistics table's text: e.g. 'warm start: 7 of 7 programs loaded from /tmp/cache'."""
        if self.folder is None:
            return "off: every program compiled"
        if self.lookups == 0:
            return f"on, {self.folder}: nothing compiled"
        return f"{self.start} start: {self.hits:,} of {self.lookups:,} programs loaded from {self.folder}"

    def on_event(self, event: str, **kwargs) -> None:
        if event == LOOKUP_EVENT:
            self.lookups += 1
        elif event == HIT_EVENT:
            self.hits += 1


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


@contextmanager
def compile_cache(args: argparse.Namespace) -> Iterator[CompileCache]:
    """JAX's compilation cache set up as the arguments ask (call it before anything compiles); counts what the
    run compiles and loads while the block runs."""
    import jax
    from jax import monitoring

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
    cache = CompileCache(folder)
    listener = cache.on_event
    monitoring.register_event_listener(listener)
    try:
        yield cache
    finally:
        monitoring.unregister_event_listener(listener)
