"""Attention over the paged KV cache: backend dispatch between the Pallas kernels and an XLA gather path.

backend "pallas": the kernels in `pallas_kernels` (compiled through Triton on GPU; interpret mode on CPU,
                  which is for tests only: it is far too slow to serve).
backend "xla":    gather each sequence's pages with jnp and compute masked softmax attention in float32.
backend "auto":   "pallas" on GPU, "xla" elsewhere. The engine logs which one it picked.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "pallas", "xla")


class AttentionMetadata(NamedTuple):
    """Where a step's tokens sit in the paged cache (all int32, padded to bucket sizes).

    slot_mapping: `[num_tokens]`, -1 = padding token (not written)
    block_tables: `[num_seqs, max_blocks_per_seq]`
    kv_lens:      `[num_seqs]`, context length including this step's tokens; 0 for padding sequences
    cu_q_lens:    `[num_seqs + 1]`, query offsets; padding sequences have q_len 0
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return backend


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata, *,
                    backend: str, decode_only: bool, scale: float | None = None) -> jax.Array:
    """Attention of a step's queries over the paged cache (the new K/V already written).

    q: `[num_tokens, num_q_heads, head_dim]`; k_pages, v_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`.
    With `decode_only`, token i is the single query of sequence i (num_tokens == num_seqs).
    Returns `[num_tokens, num_q_heads, head_dim]` in q's dtype.
    """
    if backend == "pallas":
        interpret = jax.default_backend() != "gpu"
        if decode_only:
            return pallas_kernels.paged_attention(q, k_pages, v_pages, meta.block_tables, meta.kv_lens,
                                                  scale=scale, interpret=interpret)
        return pallas_kernels.ragged_paged_attention(q, k_pages, v_pages, meta.block_tables, meta.kv_lens,
                                                     meta.cu_q_lens, scale=scale, interpret=interpret)
    if backend == "xla":
        return ragged_attention_xla(q, k_pages, v_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens,
                                    scale=scale, decode_only=decode_only)
    raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")


@functools.partial(jax.jit, static_argnames=("scale", "decode_only", "q_tile"))
def ragged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                         kv_lens: jax.Array, cu_q_lens: jax.Array, *, scale: float | None = None,
                         decode_only: bool = False, q_tile: int = 16) -> jax.Array:
    """XLA gather implementation of ragged paged attention (same contract as the Pallas kernel).

    Query token t of sequence s (cu_q_lens[s] <= t < cu_q_lens[s+1]) sits at position
    kv_lens[s] - q_len[s] + (t - cu_q_lens[s]) and attends to positions <= its own. Tokens past
    cu_q_lens[-1] (padding) and sequences with kv_len 0 give zeros.

    Queries are cut into tiles of `q_tile` consecutive tokens of one sequence (a decode token is a tile of
    its own), and each tile gathers its sequence's pages once: `[num_tiles, kv_heads, max_blocks *
    block_size, head_dim]` with num_tiles <= num_tokens / q_tile + num_seqs, instead of one copy per token.
    With `decode_only` (token i is the single query of sequence i) tiles are sequences.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    ctx = max_blocks * block_size
    scale = head_dim ** -0.5 if scale is None else scale

    if decode_only:
        tq, num_tiles = 1, num_tokens
        tile_seq = jnp.minimum(jnp.arange(num_tiles, dtype=jnp.int32), num_seqs - 1)
        rows = jnp.arange(num_tiles, dtype=jnp.int32)[:, None]  # [NT, 1] token of each row
        row_valid = rows < num_seqs
        pos = kv_lens[tile_seq][:, None] - 1
    else:
        tq = min(q_tile, num_tokens)
        num_tiles = -(-num_tokens // tq) + num_seqs  # static bound on sum(cdiv(q_len, tq))
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        tiles_per_seq = (q_lens + tq - 1) // tq
        tiles_end = jnp.cumsum(tiles_per_seq)
        tiles_start = tiles_end - tiles_per_seq
        j = jnp.arange(num_tiles, dtype=jnp.int32)
        tile_seq = jnp.clip(jnp.searchsorted(tiles_end, j, side="right"), 0, num_seqs - 1).astype(jnp.int32)
        first = cu_q_lens[tile_seq] + (j - tiles_start[tile_seq]) * tq
        rows = first[:, None] + jnp.arange(tq, dtype=jnp.int32)[None, :]  # [NT, tq]
        row_valid = (j < tiles_end[-1])[:, None] & (rows < cu_q_lens[tile_seq + 1][:, None])
        pos = kv_lens[tile_seq][:, None] - q_lens[tile_seq][:, None] + (rows - cu_q_lens[tile_seq][:, None])

    tables = jnp.clip(block_tables[tile_seq], 0, num_blocks - 1)  # [NT, max_blocks]
    k = k_pages[:, tables].reshape(num_kv_heads, num_tiles, ctx, head_dim)
    v = v_pages[:, tables].reshape(num_kv_heads, num_tiles, ctx, head_dim)
    qt = q[jnp.clip(rows, 0, num_tokens - 1)].reshape(num_tiles, tq, num_kv_heads, group, head_dim)
    keep = (jnp.arange(ctx)[None, None, :] <= pos[:, :, None]) & row_valid[:, :, None]  # [NT, tq, ctx]
    s = jnp.einsum("ntkgd,knld->nkgtl", qt.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(keep[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with nothing to attend to
    p = jnp.exp(s - m)  # exp(-inf) = 0 for masked slots
    z = jnp.sum(p, axis=-1, keepdims=True)
    # Slots no row of the tile reads may hold anything, NaN included: select them away (0 * NaN = NaN).
    v = jnp.where(jnp.any(keep, axis=1)[None, :, :, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("nkgtl,knld->nkgtd", p, v)
    o = jnp.where(z > 0, o / jnp.where(z > 0, z, 1.0), 0.0)  # [NT, Hkv, G, tq, D]
    o = o.transpose(0, 3, 1, 2, 4).reshape(num_tiles * tq, num_q_heads, head_dim)
    if decode_only:
        return o.astype(q.dtype)
    # Back to token order: token t is row (t - cu[s]) % tq of tile tiles_start[s] + (t - cu[s]) // tq.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, num_seqs - 1)
    local = t - cu_q_lens[seq]
    flat = (tiles_start[seq] + local // tq) * tq + local % tq
    out = o[jnp.clip(flat, 0, num_tiles * tq - 1)]
    return jnp.where((t < cu_q_lens[-1])[:, None, None], out, 0.0).astype(q.dtype)
