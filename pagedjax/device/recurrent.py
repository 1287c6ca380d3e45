"""Recurrent-state layers over paged state snapshots (`RecurrentState` pages, `StatePages`): backend dispatch of
`pallas_kernels`' gated delta rule, Mamba-2 SSD scan and causal conv1d, as `pagedjax.device.attention` dispatches
attention.

backend "pallas": the kernels (Triton on GPU, Mosaic on TPU, interpret mode elsewhere: tests only);
backend "xla":    their XLA paths (`pallas_kernels.gated_delta_rule_xla`, `mamba2_ssd_xla`, `causal_conv1d_xla`),
                  the CPU engine's.

Both read and write the snapshots under `pallas_kernels.recurrent`'s contract: a sequence starts from the state in
the block of its first position's predecessor (zeros at position 0) and leaves the state after every position
that ends a block, and after its last token of the step, in that position's block of its state group's table.

Decode-only steps (`decode_only`: row s is sequence s's one token) hold sequences that take no token: padding rows
and, in the fused decode loop (`pagedjax.runner.runner`), sequences that stopped, which keep q_len 1 there
(cu_q_lens = arange) with kv_len 0. The contract wants q_len <= kv_len: with q_len 1 and kv_len 0 a kernel would
read and write the state "after position -1", in a block of its table (the XLA path: its first, often a cached
prefix snapshot that a later request hits). So such
steps go to the kernels compacted (`live_rows`): the live sequences' rows first, every other sequence q_len 0
(it reads and writes nothing), and the outputs back in row order (zeros for the others).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pagedjax.device.attention import AttentionMetadata


def live_rows(meta: AttentionMetadata, num_rows: int) -> tuple[AttentionMetadata, jax.Array]:
    """A decode-only step's metadata with only its live sequences (kv_len >= 1) taking a row, and the row order
    that puts their rows first (a permutation of `num_rows`, = sequences): `x[order]` are the kernels' rows,
    `out.at[order].set(kernel_out)` the step's."""
    live = meta.kv_lens > 0
    order = jnp.argsort(~live, stable=True).astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(live.astype(jnp.int32))])
    return meta._replace(cu_q_lens=cu), order[:num_rows]


def unpermute(out: jax.Array, order: jax.Array) -> jax.Array:
    return jnp.zeros_like(out).at[order].set(out)


def gated_delta_rule(q: jax.Array,  # [T, Hk, Dk]
                     k: jax.Array,  # [T, Hk, Dk]
                     v: jax.Array,  # [T, Hv, Dv]
                     g: jax.Array,  # f32 [T, Hv], log decay
                     beta: jax.Array,  # f32 [T, Hv]
                     state_pages: jax.Array,  # f32 [num_blocks, Hv, Dk, Dv]
                     meta: AttentionMetadata, *, block_size: int, backend: str, decode_only: bool = False,
                     use_qk_l2norm: bool = True) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule of a step (`pallas_kernels.gated_delta_rule`): (out `[T, Hv, Dv]` in q's dtype, the
    state pages with this step's snapshots written). `meta`: the layer's state group's metadata; `decode_only`:
    the step is one token per sequence (module docstring: its idle sequences)."""
    g, beta = g.astype(jnp.float32), beta.astype(jnp.float32)
    order = None
    if decode_only:
        meta, order = live_rows(meta, q.shape[0])
        q, k, v, g, beta = (x[order] for x in (q, k, v, g, beta))
    args = (q, k, v, g, beta, state_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens)
    if backend == "pallas":
        out, state_pages = pallas_kernels.gated_delta_rule(*args, block_size=block_size,
                                                           use_qk_l2norm=use_qk_l2norm, interpret=None)
    elif backend == "xla":
        out, state_pages = pallas_kernels.gated_delta_rule_xla(*args, block_size=block_size,
                                                               use_qk_l2norm=use_qk_l2norm)
    else:
        raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")
    return (out if order is None else unpermute(out, order)), state_pages


def mamba2_ssd(x: jax.Array,  # [T, H, P]
               dt: jax.Array,  # f32 [T, H], after bias, softplus and clamp
               A: jax.Array,  # f32 [H]
               B: jax.Array,  # [T, G, N]
               C: jax.Array,  # [T, G, N]
               state_pages: jax.Array,  # f32 [num_blocks, H, P, N]
               meta: AttentionMetadata, *, block_size: int, backend: str, decode_only: bool = False,
               D: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:  # f32 [H]
    """Mamba-2's SSD scan of a step (`pallas_kernels.mamba2_ssd`): (y `[T, H, P]` in x's dtype, the state pages with
    this step's snapshots written); `meta` and `decode_only` as for `gated_delta_rule`."""
    dt, A = dt.astype(jnp.float32), A.astype(jnp.float32)
    D = None if D is None else D.astype(jnp.float32)
    order = None
    if decode_only:
        meta, order = live_rows(meta, x.shape[0])
        x, dt, B, C = (a[order] for a in (x, dt, B, C))
    args = (x, dt, A, B, C, state_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens)
    if backend == "pallas":
        out, state_pages = pallas_kernels.mamba2_ssd(*args, block_size=block_size, D=D, interpret=None)
    elif backend == "xla":
        out, state_pages = pallas_kernels.mamba2_ssd_xla(*args, block_size=block_size, D=D)
    else:
        raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")
    return (out if order is None else unpermute(out, order)), state_pages


def causal_conv1d(x: jax.Array,  # [T, C]
                  weight: jax.Array,  # [C, K]
                  conv_pages: jax.Array,  # f32 [num_blocks, C, K - 1]
                  meta: AttentionMetadata, *, block_size: int, backend: str, decode_only: bool = False,
                  activation: str | None = None, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise conv1d of a step (`pallas_kernels.causal_conv1d`) over conv states kept in the pages'
    dtype (float32 snapshots: x is taken in it, exactly for 16-bit x): (out `[T, C]` in x's dtype, the pages with
    this step's snapshots written); `bias` `[C]` or None; `decode_only` as for `gated_delta_rule`."""
    xs = x.astype(conv_pages.dtype)
    order = None
    if decode_only:
        meta, order = live_rows(meta, x.shape[0])
        xs = xs[order]
    args = (xs, weight, conv_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens)
    if backend == "pallas":
        out, conv_pages = pallas_kernels.causal_conv1d(*args, block_size=block_size, bias=bias,
                                                       activation=activation, interpret=None)
    elif backend == "xla":
        out, conv_pages = pallas_kernels.causal_conv1d_xla(*args, block_size=block_size, bias=bias,
                                                           activation=activation)
    else:
        raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")
    return (out if order is None else unpermute(out, order)).astype(x.dtype), conv_pages
