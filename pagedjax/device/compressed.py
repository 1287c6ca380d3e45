"""DeepSeek V4's compressed attention over its pages (`SharedKVWindow`, `CompressedEntries`, `CompressorState`):
backend dispatch of `pallas_kernels.compressed` and the writes of a step's window vectors and closed entries.

The compressor's snapshots follow the recurrent states' contract (`pagedjax.device.recurrent`), idle rows of a
decode-only step included: they go to the compressor compacted (`live_rows`), so that a row that takes no token
reads and writes no snapshot.

backend "pallas": the Pallas kernels: attention `pallas_kernels.compressed_attention` (Triton on a GPU, the DSA
kernel's slot attention on a TPU), the indexer's scores V3.2's indexer kernel (`compressed_index_scores`: each
query row a sequence of its own), the compressor `pallas_kernels.compress`.
backend "xla": every part's XLA path, the CPU engine's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pagedjax.device.attention import AttentionMetadata
from pagedjax.device.recurrent import live_rows, unpermute
from pallas_kernels import compressed as kernels
from pallas_kernels import compressor


def _check_backend(backend: str) -> None:
    if backend not in ("pallas", "xla"):
        raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")


def write_rows(pages: jax.Array,  # [num_blocks, rows_per_block, width]
               values: jax.Array,  # [T, width]
               slots: jax.Array,  # i32[T], -1 = not written
               ) -> jax.Array:
    """pages with values[t] at row slots[t] (flat over blocks) wherever slots[t] >= 0, in the pages' dtype."""
    flat = pages.reshape(-1, pages.shape[-1])
    target = jnp.where(slots >= 0, slots, flat.shape[0])
    return flat.at[target].set(values.astype(pages.dtype), mode="drop").reshape(pages.shape)


def entry_slots(slot_mapping: jax.Array, closes: jax.Array, compress_rate: int) -> jax.Array:
    """i32[T]: the entry row a closing token's window goes to (its token slot / m: entry w sits in the block of its
    positions at row (w m mod block_size) / m), -1 for the other tokens and padding."""
    return jnp.where(closes & (slot_mapping >= 0), slot_mapping // compress_rate, -1)


def compress(kv: jax.Array,  # f32[T, D] or [T, 2D] (CSA's two series)
             gate: jax.Array,  # f32, kv's shape, position bias added
             state_pages: jax.Array,  # f32[num_blocks, P, 3, D]
             meta: AttentionMetadata,  # the state group's
             *, block_size: int, compress_rate: int, backend: str,
             decode_only: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A step's compressor (`pallas_kernels.compress`, or its XLA path): (entries f32 `[T, D]` at the rows that
    close a window, closes bool `[T]`, the state pages with this step's snapshots)."""
    _check_backend(backend)
    order = None
    if decode_only:
        meta, order = live_rows(meta, kv.shape[0])
        kv, gate = kv[order], gate[order]
    run = compressor.compress if backend == "pallas" else compressor.compress_xla
    entries, closes, state_pages = run(kv, gate, state_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens,
                                       compress_rate=compress_rate, block_size=block_size)
    if order is not None:
        entries, closes = unpermute(entries, order), unpermute(closes, order)
    return entries, closes, state_pages


def select_entries(q_index: jax.Array,  # [T, Hi, Di], RoPE applied
                   weights: jax.Array,  # f32[T, Hi], times Hi ** -0.5
                   index_pages: jax.Array,  # [num_blocks, block_size / m, Di], this step's keys written
                   meta: AttentionMetadata,  # the entries' group's
                   *, scale: float, index_topk: int, compress_rate: int,
                   backend: str) -> tuple[jax.Array, jax.Array]:
    """The lightning indexer's choice among the entries each row's position has closed: (int32 `[T, index_topk]`
    entry indices, -1 = none; int32[] rows whose cut-off fell between equal scores, as `sparse_select`)."""
    _check_backend(backend)
    score = kernels.compressed_index_scores if backend == "pallas" else kernels.compressed_index_scores_xla
    scores = score(q_index, weights, index_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens, scale=scale,
                   compress_rate=compress_rate)
    selected, ties = pallas_kernels.top_k_positions_and_ties(scores, index_topk)
    return selected, jnp.sum(ties, dtype=jnp.int32)


def attend(q: jax.Array,  # [T, H, D], RoPE applied
           window_pages: jax.Array,  # [num_blocks, block_size, D], this step's vectors written
           window_meta: AttentionMetadata,
           entry_pages: jax.Array | None,  # [num_blocks, block_size / m, D], this step's entries written
           entry_meta: AttentionMetadata | None,
           selected: jax.Array | None,  # i32[T, k] (CSA) or None (HCA: every closed entry)
           sinks: jax.Array,  # f32[H]
           *, scale: float, sliding_window: int, compress_rate: int | None, backend: str) -> jax.Array:
    """Each row's attention over its window and its (selected) compressed entries in one softmax with its head's
    sink (`pallas_kernels.compressed.compressed_attention`, or its XLA path): `[T, H, D]` in q's dtype."""
    _check_backend(backend)
    entry_tables = None if entry_meta is None else entry_meta.block_tables
    args = (q, window_pages, window_meta.block_tables, entry_pages, entry_tables, window_meta.kv_lens,
            window_meta.cu_q_lens, selected, sinks)
    options = dict(scale=scale, sliding_window=sliding_window, compress_rate=compress_rate)
    if backend == "pallas":
        return kernels.compressed_attention(*args, **options)
    return kernels.compressed_attention_xla(*args, **options)
