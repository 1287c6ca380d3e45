"""Paged decode attention on the CPU through XLA's FFI: `paged_decode(q, k_pages, v_pages, block_tables, lengths,
scale=...)`, `pallas_kernels.paged_attention`'s contract without its variants (no sliding window, soft cap, 8-bit
pages or sinks), float32 or bfloat16.

XLA's form (`pallas_kernels.paged_attention_xla`) gathers each chunk of a sequence's pages into a buffer and reads
it again for the scores' and the values' batched dots, small ones that XLA:CPU runs far from the memory's speed; the
C++ kernel (`cpu_attention.cc`, built for this machine by `pagedjax.device.native`) reads each page of the pool once,
scores it against all the query heads of its KV head while it is in cache and folds it into the running softmax
exactly in float32. `python scripts/bench_cpu_attention.py` measures both.

`jax.lax.platform_dependent` picks the kernel on the CPU only (a program exported for a GPU holds the Pallas kernel
instead: the engine's "pallas" backend never calls this); `supports(...)` says which calls it takes
(`pagedjax.device.attention` sends the others to XLA's form). Where the kernel cannot be built or loaded (no C++
compiler, `PAGEDJAX_NATIVE=off`) every call is XLA's, logged once as a warning naming the reason; `status()` tells.
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

import pallas_kernels
from pagedjax.device import native
from pallas_kernels.paged import validate_qkv

logger = logging.getLogger(__name__)

__all__ = ["DTYPES", "TARGET", "AttentionStatus", "load", "native_call", "paged_decode", "status", "status_for",
           "supports"]

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "pagedjax_paged_decode"
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
LANES = 16  # the kernel's vectors: head_dim must be a multiple
MAX_GROUP = 256  # query heads per KV head the kernel holds


@dataclass(frozen=True)
class AttentionStatus:
    """Whether the CPU kernel is in use: `loaded`; `path`: its shared library; `target`: the FFI target it is
    registered as; `reason`: why it is not loaded (None when it is)."""

    loaded: bool
    path: Path | None = None
    target: str | None = None
    reason: str | None = None


def load(library: Path, target: str = TARGET) -> AttentionStatus:
    """Load a built kernel (`native.build(SOURCE)`) and register it as the CPU FFI target `target`. OSError when it
    cannot be loaded."""
    lib = ctypes.CDLL(str(library))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.PagedjaxPagedDecode), platform="cpu")
    return AttentionStatus(True, path=Path(library), target=target)


def status_for(setting: str | None) -> AttentionStatus:
    """The kernel `status` uses for the setting of `$PAGEDJAX_NATIVE`: off (none), else built for this machine; a
    kernel that cannot be built or loaded is logged as a warning naming the reason, and none is used."""
    if native.is_off(setting):
        return AttentionStatus(False, reason=f"{native.ENV}={setting.strip()}")
    try:
        result = load(native.build_somewhere(SOURCE))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("paged decode attention runs on XLA's gather path (slower on the CPU): the native kernel could "
                       "not be built or loaded: %s", exc)
        return AttentionStatus(False, reason=str(exc))
    logger.info("paged decode attention: native CPU kernel %s", result.path)
    return result


@functools.cache
def _process_status() -> AttentionStatus:
    return status_for(os.environ.get(native.ENV))


_STATUS_LOCK = threading.Lock()  # the engine's thread and its compile thread may both trace a first step


def status() -> AttentionStatus:
    """The CPU kernel of this process (`status_for($PAGEDJAX_NATIVE)`), built, loaded and registered once."""
    with _STATUS_LOCK:
        return _process_status()


def supports(q: jax.Array, k_pages: jax.Array, *, sliding_window=None, logits_soft_cap=None, k_scales=None,
             sinks=None) -> bool:
    """Whether the kernel takes this call: no variant, float32 or bfloat16 queries and pages of the same dtype, a
    head_dim that is a multiple of 16 and at most 256 query heads per KV head. Says nothing of whether it is
    loaded (`status`)."""
    if any(x is not None for x in (sliding_window, logits_soft_cap, k_scales, sinks)):
        return False
    if q.ndim != 3 or k_pages.ndim != 4 or q.dtype not in DTYPES or k_pages.dtype != q.dtype:
        return False
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[0]
    return (head_dim % LANES == 0 and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= MAX_GROUP)


def native_call(target: str, q, k_pages, v_pages, block_tables, lengths, *, scale: float):
    """The kernel registered as `target` (`load`) on `paged_decode`'s arguments, `scale` given (CPU only; no checks:
    `paged_decode` is the entry point)."""
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")(
        q, k_pages, v_pages, block_tables, lengths, scale=np.float32(scale))


def paged_decode(q: jax.Array,  # [num_seqs, num_q_heads, head_dim]
                 k_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                 v_pages: jax.Array,  # [num_kv_heads, num_blocks, block_size, head_dim]
                 block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                 lengths: jax.Array,  # i32[num_seqs]
                 *, scale: float | None = None) -> jax.Array:
    """`pallas_kernels.paged_attention_xla(q, k_pages, v_pages, block_tables, lengths, scale=scale)` (its checks,
    its result to float32 rounding), by the native kernel on the CPU where it is loaded. ValueError for arguments
    the kernels refuse (`pallas_kernels.paged.validate_qkv`), lengths that are not int32 `[num_seqs]`, or a call
    `supports` refuses (another dtype, more than 256 query heads per KV head)."""
    validate_qkv(q, k_pages, v_pages, block_tables, num_q_rows=q.shape[0] if q.ndim == 3 else None)
    if lengths.shape != (q.shape[0],) or lengths.dtype != jnp.int32:
        raise ValueError(f"paged_decode: lengths must be int32 [{q.shape[0]}], got "
                         f"{lengths.dtype}{list(lengths.shape)}")
    if not supports(q, k_pages):
        raise ValueError(f"paged_decode: float32 or bfloat16 q and pages of one dtype, head_dim a multiple of {LANES} "
                         f"and at most {MAX_GROUP} query heads per KV head expected, got q {q.dtype}{list(q.shape)} "
                         f"and pages {k_pages.dtype}{list(k_pages.shape)}")
    xla = functools.partial(pallas_kernels.paged_attention_xla, scale=scale)
    if scale is None:
        scale = 1.0 / float(np.sqrt(q.shape[-1]))
    loaded = status()
    if not loaded.loaded or 0 in q.shape[:1] + k_pages.shape[1:2] + block_tables.shape[1:]:
        return xla(q, k_pages, v_pages, block_tables, lengths)
    # XLA's form is the default branch, traced (so its checks run) but not compiled for the CPU.
    return jax.lax.platform_dependent(q, k_pages, v_pages, block_tables, lengths,
                                      cpu=functools.partial(native_call, loaded.target, scale=scale), default=xla)
