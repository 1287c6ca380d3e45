"""Builders of DeepSeek sparse attention (DSA) inputs for the kernel tests: an MLA case (`mla_cases.build`: latent
pages in permuted blocks, NaN-poisoned unused slots, garbage table entries past the used pages) plus, in the same
blocks, one indexer key per token (NaN where the latent slot is poisoned), indexer queries and weights.

Tie-free data: every indexer key has positive entries and head 0's queries are positive with a positive weight, so
every visible position scores a sum with one strictly positive term (the other heads have queries of either sign,
so relu clips some of their terms): scores are distinct almost surely, and `top_k_positions` picks the same set
whatever the tie rule.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant import quantize_kv
from tests.kernels.cases import DTYPES
from tests.kernels.mla_cases import MLACase, build, ragged_layout


@dataclasses.dataclass
class DSACase:
    mla: MLACase
    q_index: jax.Array  # [rows, index_n_heads, index_head_dim]
    weights: jax.Array  # f32[rows, index_n_heads]
    index_pages: jax.Array  # [num_blocks, block_size, index_head_dim]
    index_scales: jax.Array | None = None

    @property
    def decode(self) -> bool:
        return self.mla.cu_q_lens is None

    def meta(self):
        """(block_tables, lengths) for decode, (block_tables, kv_lens, cu_q_lens) for ragged."""
        m = self.mla
        return (m.block_tables, m.lengths) if self.decode else (m.block_tables, m.lengths, m.cu_q_lens)

    def index_args(self):
        return (self.q_index, self.weights, self.index_pages, *self.meta())

    def index_kwargs(self) -> dict:
        return {} if self.index_scales is None else dict(index_scales=self.index_scales)

    def sparse_args(self, indices):
        m = self.mla
        return (m.q_latent, m.q_rope, m.kv_pages, *self.meta(), indices)


def build_dsa(rng: np.random.Generator, *, num_heads: int, rank: int, rope_dim: int, index_heads: int,
              index_dim: int, block_size: int, max_blocks: int, kv_lens, dtype: str = "float32", ragged: bool = True,
              poison: bool = True) -> DSACase:
    cu, num_rows = ragged_layout(rng, kv_lens) if ragged else (None, len(kv_lens))
    mla = build(rng, num_q_rows=num_rows, num_heads=num_heads, rank=rank, rope_dim=rope_dim, block_size=block_size,
                max_blocks=max_blocks, kv_lens=kv_lens, dtype=dtype, poison=poison, cu_q_lens=cu)
    unused = np.isnan(np.asarray(mla.kv_pages, np.float32)).any(axis=-1)  # [num_blocks, block_size]
    keys = np.abs(rng.standard_normal((*unused.shape, index_dim))).astype(np.float32) + 0.1
    keys[unused] = np.nan
    q = rng.standard_normal((num_rows, index_heads, index_dim)).astype(np.float32)
    q[:, 0] = np.abs(q[:, 0]) + 0.1
    w = rng.standard_normal((num_rows, index_heads)).astype(np.float32)
    w[:, 0] = np.abs(w[:, 0]) + 0.5
    dt = DTYPES[dtype]
    return DSACase(mla, jnp.asarray(q, dt), jnp.asarray(w), jnp.asarray(keys, dt))


def quantized_keys(case: DSACase, dtype, scale_dtype=jnp.float32) -> DSACase:
    """The case with 8-bit indexer keys (one scale per token) that keep the poison: NaN scales, and NaN (fp8) or
    -128 (int8) values in unused slots."""
    keys = np.asarray(case.index_pages, np.float32)
    bad = np.isnan(keys).any(axis=-1)
    values, scales = quantize_kv(jnp.asarray(np.where(bad[..., None], 0.0, keys)), dtype)
    poison = np.nan if jnp.dtype(dtype) == jnp.float8_e4m3fn else -128
    return dataclasses.replace(case, index_pages=jnp.where(bad[..., None], jnp.asarray(poison, values.dtype), values),
                               index_scales=jnp.where(bad, jnp.nan, scales).astype(scale_dtype))


def visible_ends(case: DSACase) -> np.ndarray:
    """Per query row, the positions it sees are [0, end) (numpy, from the conventions: decode row s at position
    lengths[s] - 1, ragged query i of sequence s at kv_lens[s] - q_len[s] + i, padding rows see nothing)."""
    lens = np.asarray(case.mla.lengths)
    rows = case.q_index.shape[0]
    if case.decode:
        return lens.copy()
    cu = np.asarray(case.mla.cu_q_lens)
    end = np.zeros(rows, np.int64)
    for s in range(len(lens)):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            end[cu[s] + i] = max(0, min(lens[s] - q_len + i + 1, lens[s]))
    return end


def row_sequences(case: DSACase) -> np.ndarray:
    rows = case.q_index.shape[0]
    if case.decode:
        return np.arange(rows)
    cu = np.asarray(case.mla.cu_q_lens)
    return np.clip(np.searchsorted(cu[1:], np.arange(rows), side="right"), 0, len(cu) - 2)


def mixed_selection(rng: np.random.Generator, case: DSACase, top_k: int) -> jax.Array:
    """Distinct positions per row, i32[rows, top_k] (top_k <= capacity + 3), that mix positions the row sees with
    entries selecting nothing: -1, positions past the row's own (future tokens) and past the table's capacity."""
    cap = case.mla.block_tables.shape[1] * case.mla.kv_pages.shape[1]
    rows = case.q_index.shape[0]
    out = np.stack([rng.permutation(cap + 3)[:top_k] - 1 for _ in range(rows)]).astype(np.int32)
    return jnp.asarray(np.where(rng.random(out.shape) < 0.85, out, -1))
