"""Builders of recurrent-state steps for the kernel tests (numpy, then jnp): block tables over a permuted pool, ragged
steps, state pools poisoned with NaN wherever the contract forbids a read, and each op's inputs.

A pool holds random states in the blocks a step may read (each sequence's initial block) and NaN in every other
block; block-table entries past a sequence's blocks are garbage (-1, or ids far out of the pool). So an
implementation that reads a block it must not, or writes one it must not, changes a NaN into a number or a number
into something else, and the comparison with the reference's pages (which leave every unwritten block as it was)
fails.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Against the float64 reference: float32 to ~1e-5 relative; bfloat16 outputs are rounded to bfloat16 (2^-9 relative)
# after a float32 computation on bfloat16 inputs (the reference sees the same rounded inputs).
TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=1e-2, atol=1e-2)}
GARBAGE_IDS = np.array([-1, 1 << 20, 2**31 - 1], np.int32)


@dataclasses.dataclass
class Step:
    """One ragged step: its tables, kv_lens and cu_q_lens (jnp int32), rows (with padding), block size."""

    block_tables: jnp.ndarray
    kv_lens: jnp.ndarray
    cu_q_lens: jnp.ndarray
    num_tokens: int
    block_size: int

    def args(self):
        return self.block_tables, self.kv_lens, self.cu_q_lens

    def readable_blocks(self) -> list[int]:
        """The blocks the step may read: each sequence's initial block (rows, and a position before the first)."""
        tables, kv, cu = (np.asarray(a) for a in self.args())
        q_lens = np.diff(cu)
        return sorted({int(tables[s, (kv[s] - q - 1) // self.block_size]) for s, q in enumerate(q_lens)
                       if q > 0 and kv[s] - q > 0})


def allocate(rng: np.random.Generator, final_lens, *, block_size: int, max_blocks: int, extra_blocks: int = 3):
    """(block_tables int32 `[S, max_blocks]`, num_blocks): each sequence's blocks drawn from a shuffled pool of
    S * max_blocks + extra_blocks, entries past the blocks of its final length garbage."""
    num_seqs = len(final_lens)
    num_blocks = num_seqs * max_blocks + extra_blocks
    tables = rng.permutation(num_blocks).astype(np.int32)[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    for s, n in enumerate(final_lens):
        used = -(-int(n) // block_size)
        tables[s, used:] = rng.choice(GARBAGE_IDS, max_blocks - used)
    return tables, num_blocks


def step(tables: np.ndarray, seqs, *, block_size: int, padding_rows: int = 0) -> Step:
    """The step of (q_len, kv_len) per sequence over `tables`, with padding rows after the last sequence's."""
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs])]).astype(np.int32)
    kv = np.array([k for _, k in seqs], np.int32)
    return Step(jnp.asarray(tables), jnp.asarray(kv), jnp.asarray(cu), int(cu[-1]) + padding_rows, block_size)


def pool(rng: np.random.Generator, num_blocks: int, state_shape, readable, dtype=np.float32, scale=0.5):
    """`[num_blocks, *state_shape]`: random states in the readable blocks, NaN in all others."""
    pages = np.full((num_blocks, *state_shape), np.nan, np.float32)
    for b in readable:
        pages[b] = rng.standard_normal(state_shape) * scale
    return jnp.asarray(pages, dtype)


def gdn_inputs(rng, num_tokens: int, num_k_heads: int, num_v_heads: int, head_k: int, head_v: int, dtype: str):
    """q, k, v in dtype; float32 g (log decay in [-2, 0], a third of the entries near 0: slow decay, a sixth in
    [-16, -8]: a reset, as Qwen3-Next's gates reach) and beta in (0, 1)."""
    dt = DTYPES[dtype]
    g = -rng.uniform(0.0, 2.0, (num_tokens, num_v_heads))
    kind = rng.uniform(size=g.shape)
    g = np.where(kind < 1 / 3, g * 0.01, np.where(kind > 5 / 6, g * 4.0 - 8.0, g))
    return dict(q=jnp.asarray(rng.standard_normal((num_tokens, num_k_heads, head_k)), dt),
                k=jnp.asarray(rng.standard_normal((num_tokens, num_k_heads, head_k)), dt),
                v=jnp.asarray(rng.standard_normal((num_tokens, num_v_heads, head_v)), dt),
                g=jnp.asarray(g, jnp.float32),
                beta=jnp.asarray(rng.uniform(0.0, 1.0, (num_tokens, num_v_heads)), jnp.float32))


def conv_inputs(rng, num_tokens: int, channels: int, taps: int, dtype: str):
    dt = DTYPES[dtype]
    return dict(x=jnp.asarray(rng.standard_normal((num_tokens, channels)), dt),
                weight=jnp.asarray(rng.standard_normal((channels, taps)) * 0.5, dt),
                bias=jnp.asarray(rng.standard_normal((channels,)) * 0.1, dt))


def ssd_inputs(rng, num_tokens: int, num_heads: int, head_dim: int, num_groups: int, state_size: int, dtype: str):
    """x, B, C in dtype; dt in [0.01, 0.5] and A in [-4, -0.5] (decays exp(dt A) from 0.14 to 0.995), D, float32."""
    dt = DTYPES[dtype]
    bc = (num_tokens, num_groups, state_size)
    return dict(x=jnp.asarray(rng.standard_normal((num_tokens, num_heads, head_dim)), dt),
                dt=jnp.asarray(rng.uniform(0.01, 0.5, (num_tokens, num_heads)), jnp.float32),
                A=jnp.asarray(-rng.uniform(0.5, 4.0, (num_heads,)), jnp.float32),
                B=jnp.asarray(rng.standard_normal(bc) * 0.5, dt), C=jnp.asarray(rng.standard_normal(bc) * 0.5, dt),
                D=jnp.asarray(rng.standard_normal((num_heads,)), jnp.float32))


def assert_step_close(out, pages, ref_out, ref_pages, before, dtype: str, *, exact_pages: bool = False):
    """out against the reference's within TOL[dtype]; the pages: every block the reference left alone bit-identical
    to `before` (NaN poison included), every written one within tolerance (or bit-identical: `exact_pages`, for conv
    states, which are copies of inputs)."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "output has NaN/inf"
    np.testing.assert_allclose(out, ref_out, **TOL[dtype])
    pages = np.asarray(jnp.asarray(pages, jnp.float32))
    before = np.asarray(jnp.asarray(before, jnp.float32))
    untouched = np.array([np.array_equal(before[b], ref_pages[b], equal_nan=True) for b in range(len(before))])
    np.testing.assert_array_equal(pages[untouched], before[untouched])
    if exact_pages:
        np.testing.assert_array_equal(pages[~untouched], ref_pages[~untouched].astype(np.float32))
    else:
        np.testing.assert_allclose(pages[~untouched], ref_pages[~untouched], rtol=1e-5, atol=1e-5)


# ---- hypothesis strategies -------------------------------------------------------------------------------------


@st.composite
def ragged_seqs(draw, *, block_size: int, max_blocks: int, num_seqs: int, max_rows: int):
    """(q_len, kv_len) per sequence, total rows <= max_rows: decode tokens, chunks after a prefix, whole prompts,
    padding (0, 0) and idle (0, kv) sequences; lengths favour 0, 1 and block multiples +- 1."""
    cap = block_size * max_blocks
    special = sorted({0, 1, block_size - 1, block_size, block_size + 1, 2 * block_size, cap - 1, cap} - {-1})
    seqs, rows = [], 0
    for _ in range(num_seqs):
        kind = draw(st.sampled_from(("chunk", "prompt", "decode", "padding", "idle", "chunk")))
        room = max_rows - rows
        if kind == "padding" or room == 0:
            seqs.append((0, 0))
            continue
        kv = draw(st.sampled_from([n for n in special if n > 0]) | st.integers(1, cap))
        if kind == "idle":
            seqs.append((0, kv))
        elif kind == "decode":
            seqs.append((1, kv))
        elif kind == "prompt":
            seqs.append((min(kv, room), min(kv, room)))
        else:
            q = draw(st.sampled_from([n for n in special if 0 < n <= kv]) | st.integers(1, kv))
            seqs.append((min(q, room), kv))
        rows += seqs[-1][0]
    return seqs
