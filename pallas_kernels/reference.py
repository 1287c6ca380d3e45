"""Dense references for the paged-attention kernels, in plain jax.numpy.

`paged_attention_reference` and `ragged_paged_attention_reference` gather each sequence's pages into
contiguous K/V, mask, and take a float32 softmax: the oracle every kernel test compares against. They
take exactly the kernels' arguments and honour the same contract (length 0 gives zeros, slots past the
length never influence the result, even if they hold NaN).

`paged_attention_xla` and `ragged_paged_attention_xla` are the same math written for speed with XLA (K/V
stay in their dtype, matmuls accumulate in float32): a fast path for CPUs and the baseline the benchmark
compares against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


def _scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _gather_pages(pages: jax.Array, tables: jax.Array) -> jax.Array:
    """pages `[Hkv, num_blocks, block_size, D]`, tables int32 `[N, max_blocks]` -> `[N, Hkv, L, D]`,
    L = max_blocks * block_size. Out-of-range table entries are clipped (they are masked anyway)."""
    num_kv_heads, num_blocks, block_size, head_dim = pages.shape
    n, max_blocks = tables.shape
    g = pages[:, jnp.clip(tables, 0, num_blocks - 1)]  # [Hkv, N, max_blocks, block_size, D]
    return jnp.swapaxes(g.reshape(num_kv_heads, n, max_blocks * block_size, head_dim), 0, 1)


def _masked_attention(q, k, v, mask, scale: float, *, compute_dtype, out_dtype):
    """q `[N, Hq, D]`, k/v `[N, Hkv, L, D]`, mask bool `[N, L]` -> `[N, Hq, D]` in out_dtype."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(n, num_kv_heads, group, head_dim).astype(compute_dtype)
    k = k.astype(compute_dtype)
    # Masked slots may hold anything (NaN included): select them away, never multiply them by zero.
    v = jnp.where(mask[:, None, :, None], v.astype(compute_dtype), jnp.zeros((), compute_dtype))
    s = jnp.einsum("nkgd,nkld->nkgl", qg, k, precision=HIGHEST, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None, :], s * scale, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m)
    z = jnp.sum(p, axis=-1, keepdims=True)
    u = jnp.einsum("nkgl,nkld->nkgd", p.astype(compute_dtype), v, precision=HIGHEST,
                   preferred_element_type=jnp.float32)
    o = jnp.where(z > 0, u / jnp.where(z > 0, z, 1.0), 0.0)
    return o.reshape(n, num_q_heads, head_dim).astype(out_dtype)


def _decode(q, k_pages, v_pages, block_tables, lengths, scale, compute_dtype):
    block_size = k_pages.shape[2]
    k = _gather_pages(k_pages, block_tables)
    v = _gather_pages(v_pages, block_tables)
    pos = jnp.arange(block_tables.shape[1] * block_size, dtype=jnp.int32)
    mask = pos[None, :] < lengths[:, None]
    return _masked_attention(q, k, v, mask, _scale(scale, q.shape[-1]), compute_dtype=compute_dtype,
                             out_dtype=q.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                              lengths: jax.Array, *, scale: float | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.paged_attention`.

    q `[num_seqs, num_q_heads, head_dim]`; k_pages/v_pages `[num_kv_heads, num_blocks, block_size, head_dim]`;
    block_tables int32 `[num_seqs, max_blocks_per_seq]`; lengths int32 `[num_seqs]`.
    Returns `[num_seqs, num_q_heads, head_dim]` in q's dtype.
    """
    return _decode(q, k_pages, v_pages, block_tables, lengths, scale, jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                        lengths: jax.Array, *, scale: float | None = None) -> jax.Array:
    """XLA gather path for decode: same contract as `paged_attention`, K/V gathered in their own dtype
    (`[num_seqs, num_kv_heads, max_blocks_per_seq * block_size, head_dim]` materialised), float32
    accumulation."""
    return _decode(q, k_pages, v_pages, block_tables, lengths, scale, q.dtype)


def _token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """For each query row: (sequence id, position, valid). Rows at or past cu_q_lens[-1] are invalid."""
    num_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = (t >= cu_q_lens[0]) & (t < cu_q_lens[-1])
    seq = jnp.clip(seq, 0, num_seqs - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])
    return seq, pos, valid


def _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale, compute_dtype, chunk):
    num_tokens = q.shape[0]
    block_size = k_pages.shape[2]
    max_len = block_tables.shape[1] * block_size
    scale = _scale(scale, q.shape[-1])
    seq, pos, valid = _token_layout(cu_q_lens, kv_lens, num_tokens)
    kv_pos = jnp.arange(max_len, dtype=jnp.int32)

    def attend(q_c, seq_c, pos_c, valid_c):
        tables = block_tables[seq_c]
        mask = (valid_c[:, None] & (kv_pos[None, :] < kv_lens[seq_c][:, None])
                & (kv_pos[None, :] <= pos_c[:, None]))
        k = _gather_pages(k_pages, tables)
        v = _gather_pages(v_pages, tables)
        return _masked_attention(q_c, k, v, mask, scale, compute_dtype=compute_dtype, out_dtype=q.dtype)

    if chunk is None or chunk >= num_tokens:
        return attend(q, seq, pos, valid)
    # Bound memory: gather K/V for `chunk` query rows at a time.
    pad = -num_tokens % chunk
    padded = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, seq, pos, valid)]
    out = lax.map(lambda xs: attend(*xs), tuple(x.reshape(-1, chunk, *x.shape[1:]) for x in padded))
    return out.reshape(-1, *q.shape[1:])[:num_tokens]


@functools.partial(jax.jit, static_argnames=("scale",))
def ragged_paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                     block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array, *,
                                     scale: float | None = None) -> jax.Array:
    """Dense float32 reference of `pallas_kernels.ragged_paged_attention`.

    q `[total_q_tokens, num_q_heads, head_dim]`; k_pages/v_pages `[num_kv_heads, num_blocks, block_size,
    head_dim]`; block_tables int32 `[num_seqs, max_blocks_per_seq]`; kv_lens int32 `[num_seqs]`;
    cu_q_lens int32 `[num_seqs + 1]`. Query i of sequence s sits at position kv_lens[s] - q_len[s] + i and
    attends to positions <= its own (and < kv_lens[s]); rows past cu_q_lens[-1] give zeros.
    Memory: gathers `[total_q_tokens, max_blocks_per_seq * block_size]` keys per KV head.
    """
    return _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale, jnp.float32, None)


@functools.partial(jax.jit, static_argnames=("scale", "tokens_per_chunk"))
def ragged_paged_attention_xla(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                               kv_lens: jax.Array, cu_q_lens: jax.Array, *, scale: float | None = None,
                               tokens_per_chunk: int | None = 64) -> jax.Array:
    """XLA gather path for ragged attention: same contract as `ragged_paged_attention`, K/V in their own
    dtype, computed `tokens_per_chunk` query rows at a time to bound the gathered memory."""
    return _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, scale, q.dtype, tokens_per_chunk)
