"""Builders of paged MLA (latent attention) inputs for the kernel tests, and their hypothesis strategies.

As in `cases`: each sequence's logical blocks are scattered over a larger pool in random order, and with
`poison` everything a kernel must not read is NaN (slots past a sequence's length, pool blocks no sequence
uses) or garbage (block-table entries past the used pages: -1 or far out of range). `quantized` turns a case's
pages into 8-bit pages with one scale per token, keeping the poison (NaN scales and values).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallas_kernels.quant import quantize_kv
from tests.kernels.cases import DTYPES, boundary_lengths


@dataclasses.dataclass
class MLACase:
    q_latent: jax.Array  # [rows, num_heads, R]
    q_rope: jax.Array  # [rows, num_heads, Dr]
    kv_pages: jax.Array  # [num_blocks, block_size, R + Dr]
    block_tables: jax.Array  # i32[num_seqs, max_blocks]
    lengths: jax.Array  # decode: lengths; ragged: kv_lens
    cu_q_lens: jax.Array | None = None
    kv_scales: jax.Array | None = None  # [num_blocks, block_size], with 8-bit pages

    def scales(self) -> dict:
        """The scale keyword of a call: empty for float pages."""
        return {} if self.kv_scales is None else dict(kv_scales=self.kv_scales)

    def decode_args(self):
        return self.q_latent, self.q_rope, self.kv_pages, self.block_tables, self.lengths

    def ragged_args(self):
        return self.q_latent, self.q_rope, self.kv_pages, self.block_tables, self.lengths, self.cu_q_lens


def scatter_tables(rng: np.random.Generator, num_seqs: int, max_blocks: int, num_blocks: int) -> np.ndarray:
    """Random block tables: sequence s's logical blocks in distinct random physical blocks of the pool."""
    return rng.permutation(num_blocks).astype(np.int32)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)


def build(rng: np.random.Generator, *, num_q_rows: int, num_heads: int, rank: int, rope_dim: int, block_size: int,
          max_blocks: int, kv_lens, extra_blocks: int = 2, dtype: str = "float32", poison: bool = True,
          cu_q_lens=None) -> MLACase:
    """A case whose sequence s holds kv_lens[s] tokens in a random subset of a pool of
    num_seqs * max_blocks + extra_blocks blocks, with standard-normal latents, rope keys and queries."""
    kv_lens = np.asarray(kv_lens, np.int32)
    num_seqs = len(kv_lens)
    num_blocks = num_seqs * max_blocks + extra_blocks
    pages = rng.standard_normal((num_blocks, block_size, rank + rope_dim)).astype(np.float32)
    tables = scatter_tables(rng, num_seqs, max_blocks, num_blocks).copy()
    if poison:
        used = np.zeros((num_blocks, block_size), bool)
        for s, n in enumerate(kv_lens):
            for pos in range(int(n)):
                used[tables[s, pos // block_size], pos % block_size] = True
        pages[~used] = np.nan
        bad_ids = np.array([-1, num_blocks + 1000, 2**30], np.int32)
        for s, n in enumerate(kv_lens):  # table entries past the used pages: garbage
            first_unused = -(-int(n) // block_size)
            tables[s, first_unused:] = rng.choice(bad_ids, max_blocks - first_unused)
    q_latent = rng.standard_normal((num_q_rows, num_heads, rank)).astype(np.float32)
    q_rope = rng.standard_normal((num_q_rows, num_heads, rope_dim)).astype(np.float32)
    dt = DTYPES[dtype]
    return MLACase(jnp.asarray(q_latent, dt), jnp.asarray(q_rope, dt), jnp.asarray(pages, dt), jnp.asarray(tables),
                   jnp.asarray(kv_lens), None if cu_q_lens is None else jnp.asarray(cu_q_lens, jnp.int32))


def quantized(case: MLACase, dtype, scale_dtype=jnp.float32) -> MLACase:
    """The case with 8-bit pages (`quantize_kv` of its float pages, one scale per token over the whole latent +
    rope row) and `scale_dtype` scales. Poisoned slots keep poison: a NaN scale, and NaN (fp8) or -128 (int8:
    outside the symmetric range quantize_kv writes) values."""
    pages = np.asarray(case.kv_pages, np.float32)
    bad = np.isnan(pages).any(axis=-1)  # [num_blocks, block_size]
    values, scales = quantize_kv(jnp.asarray(np.where(bad[..., None], 0.0, pages)), dtype)
    poison_value = np.nan if jnp.dtype(dtype) == jnp.float8_e4m3fn else -128
    return dataclasses.replace(case, kv_pages=jnp.where(bad[..., None], jnp.asarray(poison_value, values.dtype),
                                                        values),
                               kv_scales=jnp.where(bad, jnp.nan, scales).astype(scale_dtype))


def ragged_layout(rng: np.random.Generator, kv_lens, max_extra_rows: int = 2):
    """(cu_q_lens, num_tokens) for sequences of these kv lengths: each q_len in [0, kv_len] (decode tokens,
    whole prefills, chunks over a cached prefix and empty sequences alike), plus up to max_extra_rows padding
    rows past cu_q_lens[-1]."""
    q_lens = [int(rng.integers(0, n + 1)) if rng.random() < 0.7 else min(1, n) for n in kv_lens]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return cu, int(cu[-1]) + int(rng.integers(0, max_extra_rows + 1))


# ---- hypothesis strategies -------------------------------------------------------------------------------

HEADS = (3, 16, 1, 5, 8, 2, 12)
RANKS = (24, 64, 16, 37, 128, 48)  # powers of two and not (padded inside the GPU kernel)
ROPE_DIMS = (8, 16, 64, 12, 32)
NUM_SEQS = (3, 2, 1, 4)


@st.composite
def mla_params(draw, block_sizes=(8, 16, 4, 5, 12), max_blocks=(3, 2, 4, 1), dtypes=("float32", "bfloat16"),
               ranks=RANKS, rope_dims=ROPE_DIMS, heads=HEADS):
    """Shapes and lengths of one case: R, Dr, heads, block size, table width and per-sequence lengths (mostly at
    or next to a block boundary, 0 and 1 included), dtype and the seed of its values."""
    block_size = draw(st.sampled_from(block_sizes))
    width = draw(st.sampled_from(max_blocks))
    num_seqs = draw(st.sampled_from(NUM_SEQS))
    return dict(seed=draw(st.integers(0, 2**32 - 1)), num_heads=draw(st.sampled_from(heads)),
                rank=draw(st.sampled_from(ranks)), rope_dim=draw(st.sampled_from(rope_dims)), block_size=block_size,
                max_blocks=width, lengths=draw(boundary_lengths(num_seqs, block_size, width)),
                dtype=draw(st.sampled_from(dtypes)))


def decode_case(p, poison: bool = True) -> MLACase:
    rng = np.random.default_rng(p["seed"])
    return build(rng, num_q_rows=len(p["lengths"]), num_heads=p["num_heads"], rank=p["rank"],
                 rope_dim=p["rope_dim"], block_size=p["block_size"], max_blocks=p["max_blocks"],
                 kv_lens=p["lengths"], dtype=p["dtype"], poison=poison)


def ragged_case(p, poison: bool = True) -> MLACase:
    rng = np.random.default_rng(p["seed"])
    cu, num_tokens = ragged_layout(rng, p["lengths"])
    return build(rng, num_q_rows=num_tokens, num_heads=p["num_heads"], rank=p["rank"], rope_dim=p["rope_dim"],
                 block_size=p["block_size"], max_blocks=p["max_blocks"], kv_lens=p["lengths"], dtype=p["dtype"],
                 poison=poison, cu_q_lens=cu)
