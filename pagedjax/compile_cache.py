"""JAX's persistent compilation cache, on by default for the engine, the CLI and the benchmarks.

Compiling a step dominates a short run on a CPU (seconds per step shape); a compiled program written to disk
loads in milliseconds the next time the same program is built, in this process or a later one. The folder
is, in order: the `path` given, `$PAGEDJAX_COMPILE_CACHE`, or `$XDG_CACHE_HOME/pagedjax/jax` (default
`~/.cache/pagedjax/jax`), kept under 2 GiB (least recently used programs go first). Setting
`PAGEDJAX_COMPILE_CACHE=off` (or passing `enabled=False`) turns it off.

JAX's cache is one setting per process: if the application already chose a folder
(`jax_compilation_cache_dir`), that choice is kept.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

ENV = "PAGEDJAX_COMPILE_CACHE"
MAX_BYTES = 2 * 2**30  # least recently used programs are evicted past this (JAX's own LRU)
_OFF = {"0", "off", "false", "no", "none", ""}


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedjax" / "jax"


def enable_compile_cache(path: str | os.PathLike | None = None, *, enabled: bool = True) -> Path | None:
    """Point JAX's persistent compilation cache at a folder (see the module docstring); returns the folder
    in use, or None when the cache is off. Every program is cached, however fast it compiled."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    env = os.environ.get(ENV)
    if not enabled or (path is None and env is not None and env.strip().lower() in _OFF):
        return None
    folder = Path(path) if path is not None else Path(env) if env else default_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only home must not stop the engine: it only compiles every time
        logger.warning("compile cache disabled: cannot create %s (%s)", folder, exc)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    logger.info("JAX compilation cache: %s", folder)
    return folder


def cache_note() -> str:
    """What a compile now means for later runs, for a progress line: "first run; cached afterwards" while JAX's
    persistent compilation cache is on, else that every run compiles."""
    if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
        return "first run; cached afterwards"
    return "the compile cache is off: every run compiles"
