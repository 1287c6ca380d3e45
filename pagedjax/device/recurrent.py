"""Recurrent-state layers over paged state snapshots (`RecurrentState` pages, `StatePages`): backend dispatch of
`pallas_kernels`' gated delta rule and causal conv1d, as `pagedjax.device.attention` dispatches attention.

backend "pallas": the kernels (Triton on GPU, Mosaic on TPU, interpret mode elsewhere: tests only);
backend "xla":    their XLA paths (`pallas_kernels.gated_delta_rule_xla`, `causal_conv1d_xla`), the CPU engine's.

Both read and write the snapshots under `pallas_kernels.recurrent`'s contract: a sequence starts from the state in
the block of its first position's predecessor (zeros at position 0) and leaves the state after every position
that ends a block, and after its last token of the step, in that position's block of its state group's table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pagedjax.device.attention import AttentionMetadata


def gated_delta_rule(q: jax.Array,  # [T, Hk, Dk]
                     k: jax.Array,  # [T, Hk, Dk]
                     v: jax.Array,  # [T, Hv, Dv]
                     g: jax.Array,  # f32 [T, Hv], log decay
                     beta: jax.Array,  # f32 [T, Hv]
                     state_pages: jax.Array,  # f32 [num_blocks, Hv, Dk, Dv]
                     meta: AttentionMetadata, *, block_size: int, backend: str,
                     use_qk_l2norm: bool = True) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule of a step (`pallas_kernels.gated_delta_rule`): (out `[T, Hv, Dv]` in q's dtype, the
    state pages with this step's snapshots written). `meta`: the layer's state group's metadata."""
    args = (q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state_pages, meta.block_tables, meta.kv_lens,
            meta.cu_q_lens)
    if backend == "pallas":
        return pallas_kernels.gated_delta_rule(*args, block_size=block_size, use_qk_l2norm=use_qk_l2norm,
                                               interpret=None)
    if backend == "xla":
        return pallas_kernels.gated_delta_rule_xla(*args, block_size=block_size, use_qk_l2norm=use_qk_l2norm)
    raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")


def causal_conv1d(x: jax.Array,  # [T, C]
                  weight: jax.Array,  # [C, K]
                  conv_pages: jax.Array,  # f32 [num_blocks, C, K - 1]
                  meta: AttentionMetadata, *, block_size: int, backend: str,
                  activation: str | None = None) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise conv1d of a step (`pallas_kernels.causal_conv1d`) over conv states kept in the pages'
    dtype (float32 snapshots: x is taken in it, exactly for 16-bit x): (out `[T, C]` in x's dtype, the pages with
    this step's snapshots written)."""
    xs = x.astype(conv_pages.dtype)
    args = (xs, weight, conv_pages, meta.block_tables, meta.kv_lens, meta.cu_q_lens)
    if backend == "pallas":
        out, conv_pages = pallas_kernels.causal_conv1d(*args, block_size=block_size, activation=activation,
                                                       interpret=None)
    elif backend == "xla":
        out, conv_pages = pallas_kernels.causal_conv1d_xla(*args, block_size=block_size, activation=activation)
    else:
        raise ValueError(f"backend must be resolved to 'pallas' or 'xla', got {backend!r}")
    return out.astype(x.dtype), conv_pages
