"""Builders of paged-attention inputs for the kernel tests (numpy, then jnp).

Every case scatters each sequence's logical blocks over a larger pool in random order, and can poison
everything a kernel must not read with NaN: slots past a sequence's length, pool blocks no sequence uses,
and block-table entries past the used pages (set to -1 or to a block id far out of range). With a sliding
window the slots before every query's window are NaN too, and the table entries of pages wholly before it
garbage. `quantized` turns a case's pages into 8-bit pages with scales, keeping the poison (NaN scales).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from pallas_kernels.quant import quantize_kv

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Tolerances against the float32 reference, by dtype.
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2),
       "float16": dict(rtol=5e-3, atol=5e-3)}


@dataclasses.dataclass
class Case:
    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    block_tables: jax.Array
    lengths: jax.Array  # decode: lengths; ragged: kv_lens
    cu_q_lens: jax.Array | None = None
    k_scales: jax.Array | None = None  # with 8-bit pages
    v_scales: jax.Array | None = None

    def scales(self) -> dict:
        """The scale keywords of a kernel call: empty for float pages."""
        return {} if self.k_scales is None else dict(k_scales=self.k_scales, v_scales=self.v_scales)

    def decode_args(self):
        return self.q, self.k_pages, self.v_pages, self.block_tables, self.lengths

    def ragged_args(self):
        return self.q, self.k_pages, self.v_pages, self.block_tables, self.lengths, self.cu_q_lens


def _pool(rng, num_kv_heads, num_blocks, block_size, head_dim):
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))


def build(rng: np.random.Generator, *, num_q_rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
          block_size: int, max_blocks: int, kv_lens, extra_blocks: int = 2, dtype: str = "float32",
          poison: bool = True, cu_q_lens=None, sliding_window: int | None = None) -> Case:
    """A case whose sequence s holds kv_lens[s] tokens in a random subset of a pool of
    num_seqs * max_blocks + extra_blocks blocks. With a `sliding_window` W, the slots before position
    kv_len - q_len - W + 1 (the first any query of the sequence sees; q_len 1 without cu_q_lens) are poisoned
    too, and the table entries of pages wholly before it are garbage."""
    kv_lens = np.asarray(kv_lens, np.int32)
    num_seqs = len(kv_lens)
    q_lens = np.ones(num_seqs, np.int64) if cu_q_lens is None else np.diff(np.asarray(cu_q_lens, np.int64))
    first_seen = np.zeros(num_seqs, np.int64)
    if sliding_window is not None:
        first_seen = np.maximum(kv_lens - q_lens - sliding_window + 1, 0)
    num_blocks = num_seqs * max_blocks + extra_blocks
    k, v = _pool(rng, num_kv_heads, num_blocks, block_size, head_dim)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = perm[: num_seqs * max_blocks].reshape(num_seqs, max_blocks).copy()
    if poison:
        used = np.zeros((num_blocks, block_size), bool)
        for s, n in enumerate(kv_lens):
            for pos in range(int(first_seen[s]), int(n)):
                used[tables[s, pos // block_size], pos % block_size] = True
        k[:, ~used] = np.nan
        v[:, ~used] = np.nan
        bad_ids = np.array([-1, num_blocks + 1000, 2**30], np.int32)
        for s, n in enumerate(kv_lens):  # table entries past the used pages (and before the window): garbage
            first_unused = -(-int(n) // block_size)
            tables[s, first_unused:] = rng.choice(bad_ids, max_blocks - first_unused)
            first_used = int(first_seen[s]) // block_size
            tables[s, :first_used] = rng.choice(bad_ids, first_used)
    q = rng.standard_normal((num_q_rows, num_q_heads, head_dim)).astype(np.float32)
    dt = DTYPES[dtype]
    return Case(jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(tables),
                jnp.asarray(kv_lens), None if cu_q_lens is None else jnp.asarray(cu_q_lens, jnp.int32))


def quantized(case: Case, dtype, scale_dtype=jnp.float32, q_dtype: str = "float32") -> Case:
    """The case with 8-bit pages (`quantize_kv` of its float pages) and `scale_dtype` scales, q in q_dtype.
    Poisoned (NaN) slots keep poison: a NaN scale, and NaN (fp8) or -128 (int8: outside the symmetric
    range quantize_kv writes) values."""
    out = {}
    for name in ("k", "v"):
        pages = np.asarray(getattr(case, f"{name}_pages"), np.float32)
        bad = np.isnan(pages).any(axis=-1)  # [Hkv, num_blocks, block_size]
        values, scales = quantize_kv(jnp.asarray(np.where(bad[..., None], 0.0, pages)), dtype)
        poison_value = np.nan if jnp.dtype(dtype) == jnp.float8_e4m3fn else -128
        out[f"{name}_pages"] = jnp.where(bad[..., None], jnp.asarray(poison_value, values.dtype), values)
        out[f"{name}_scales"] = jnp.where(bad, jnp.nan, scales).astype(scale_dtype)
    return dataclasses.replace(case, q=case.q.astype(DTYPES[q_dtype]), **out)


def relocate(rng: np.random.Generator, case: Case) -> Case:
    """The same logical cache moved to other physical blocks (pool permuted, tables rewritten)."""
    num_blocks = case.k_pages.shape[1]
    new_of_old = rng.permutation(num_blocks).astype(np.int32)
    old_of_new = np.argsort(new_of_old)
    tables = np.asarray(case.block_tables)
    in_range = (tables >= 0) & (tables < num_blocks)
    new_tables = np.where(in_range, new_of_old[np.clip(tables, 0, num_blocks - 1)], tables)
    scales = {name: getattr(case, name)[:, old_of_new] for name in ("k_scales", "v_scales")
              if getattr(case, name) is not None}
    return dataclasses.replace(case, k_pages=case.k_pages[:, old_of_new], v_pages=case.v_pages[:, old_of_new],
                               block_tables=jnp.asarray(new_tables, jnp.int32), **scales)


def assert_close(actual, expected, dtype: str):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert np.isfinite(actual).all(), "kernel output has NaN/inf"
    np.testing.assert_allclose(actual, expected, **TOL[dtype])


# ---- hypothesis strategies -------------------------------------------------------------------------------


def examples(n: int) -> int:
    """n examples per 25 of the profile's: 0.6 n under the default "ci" profile (15), 8 n under "dev" (200)."""
    return max(1, n * settings.default.max_examples // 25)


HEAD_DIMS = (16, 64, 80, 96, 128, 256)


# Weighted choices (repeated entries) for strategies that must reach the interesting cases in the few
# draws of the "ci" profile. sampled_from tries (and shrinks towards) its first entry, so that one is
# interesting too.
KV_HEADS = (2, 4, 2, 3, 4, 2, 3, 1)  # 7 in 8 several KV heads
GROUPS = (3, 2, 7, 4, 5, 1, 8, 3)  # query heads per KV head: half of them 3, 5 or 7 (Qwen2-7B: 7)


@st.composite
def gqa_heads(draw, max_q_heads: int = 28):
    """(num_q_heads, num_kv_heads): MHA, MQA and GQA, mostly on several KV heads and with groups of
    3, 5 or 7 query heads (padded inside the kernels)."""
    num_kv_heads = draw(st.sampled_from(KV_HEADS))
    group = draw(st.sampled_from(GROUPS))
    while num_kv_heads > 1 and num_kv_heads * group > max_q_heads:  # keep the interpreter fast
        num_kv_heads -= 1
    return num_kv_heads * group, num_kv_heads


@st.composite
def boundary_lengths(draw, num_seqs: int, block_size: int, max_blocks: int):
    """Sequence lengths, four in five at or next to a block boundary (k * block_size + {-1, 0, 1}:
    0, 1, bs - 1, bs, bs + 1, ..., the table's capacity), the rest anywhere in [0, capacity]."""
    cap = block_size * max_blocks
    lengths = []
    for _ in range(num_seqs):
        if draw(st.sampled_from(("edge", "edge", "any", "edge", "edge"))) == "edge":
            k = draw(st.sampled_from(range(max_blocks, -1, -1)))  # full tables first: several pages
            lengths.append(min(cap, max(0, k * block_size + draw(st.sampled_from((1, -1, 0))))))
        else:
            lengths.append(draw(st.integers(0, cap)))
    return lengths


def is_near_block_edge(length: int, block_size: int) -> bool:
    """length > 0 and within one token of a multiple of block_size."""
    return length > 0 and min(length % block_size, -length % block_size) <= 1


@contextlib.contextmanager
def abstract_gpu():
    """On JAX versions that need one (0.11+), an abstract H200 so Triton lowering works without a GPU."""
    if hasattr(jax.sharding, "AbstractDevice") and hasattr(jax.sharding, "use_abstract_mesh"):
        try:
            device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
            mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
        except TypeError:  # an AbstractMesh without abstract_device: nothing to set
            yield
            return
        with jax.sharding.use_abstract_mesh(mesh):
            yield
    else:
        yield
