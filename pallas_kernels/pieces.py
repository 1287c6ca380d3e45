"""How a ragged step's rows cut into per-block pieces of recurrent state, and the snapshot gathers and scatters: shared
by the recurrent kernels (`gpu.recurrent`, `tpu.recurrent`) and `recurrent`'s references and XLA paths.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

L2NORM_EPS = 1e-6  # transformers' l2norm (the FLA library's): x * rsqrt(sum(x^2) + eps)


class Rows(NamedTuple):
    """Per token row of a ragged step (rows past cu_q_lens[-1] are padding: `valid` False)."""

    seq: jax.Array  # i32[T] the row's sequence (clipped into range for padding rows)
    pos: jax.Array  # i32[T] its position
    valid: jax.Array  # bool[T]
    cu: jax.Array  # i32[S + 1] cu_q_lens clipped to [0, T]
    q_len: jax.Array  # i32[S]
    start: jax.Array  # i32[S] position of each sequence's first row


def rows(kv_lens: jax.Array, cu_q_lens: jax.Array, num_tokens: int) -> Rows:
    num_seqs = kv_lens.shape[0]
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
    q_len = jnp.maximum(cu[1:] - cu[:-1], 0)
    start = kv_lens.astype(jnp.int32) - q_len
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # side="right" skips empty sequences: row t belongs to the s with cu[s] <= t < cu[s + 1].
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, num_seqs - 1).astype(jnp.int32)
    return Rows(seq, start[seq] + t - cu[seq], t < cu[num_seqs], cu, q_len, start)


class Pieces(NamedTuple):
    """The pieces of a step, in row order; pieces past the real ones have length 0."""

    seq: jax.Array  # i32[NP] the piece's sequence
    row0: jax.Array  # i32[NP] its first row
    length: jax.Array  # i32[NP] its tokens
    pos0: jax.Array  # i32[NP] the position of its first row
    first: jax.Array  # bool[NP] it starts its sequence's step (so it starts from the initial state)
    write: jax.Array  # i32[NP] the block that receives the state after it, -1 for none
    count: jax.Array  # i32[] real pieces


def max_pieces(num_tokens: int, num_seqs: int, chunk: int | None, block_size: int) -> int:
    """Static bound on the pieces of a step of `num_tokens` rows and `num_seqs` sequences. A sequence of q tokens
    from position a has 1 + #{cut points in (a, a + q)} pieces; an open interval of q - 1 integers holds at most
    floor((q - 1) / m) + 1 multiples of m, so summed over at most min(S, T) non-empty sequences: S' pieces plus
    T // m + S' per cut period m. Where one period divides the other their cuts coincide (one period counts)."""
    if num_tokens == 0 or num_seqs == 0:
        return 1
    busy = min(num_seqs, num_tokens)
    periods = [block_size] if chunk is None else sorted({chunk, block_size})
    if len(periods) == 2 and periods[1] % periods[0] == 0:
        periods = periods[:1]
    bound = busy + sum(num_tokens // m + busy for m in periods)
    return max(1, min(num_tokens, bound))


def pieces(kv_lens: jax.Array, cu_q_lens: jax.Array, block_tables: jax.Array, *, num_tokens: int,
           chunk: int | None, block_size: int, num_blocks: int) -> Pieces:
    """Cuts each sequence's rows before every position that is a multiple of block_size or of chunk (None: block
    boundaries only). A piece owes a snapshot (`write`) when it ends a block or its sequence's step; its block is
    read from the table only then (written blocks are clipped into the pool: a malformed table cannot write out of
    bounds)."""
    num_seqs, max_blocks = block_tables.shape
    r = rows(kv_lens, cu_q_lens, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    cut = r.pos % block_size == 0
    if chunk is not None:
        cut = cut | (r.pos % chunk == 0)
    starts = r.valid & ((t == r.cu[r.seq]) | cut)
    pid = jnp.cumsum(starts.astype(jnp.int32)) - 1
    n = max_pieces(num_tokens, num_seqs, chunk, block_size)
    row0 = jnp.zeros((n,), jnp.int32).at[jnp.where(starts, pid, n)].set(t, mode="drop")
    length = jnp.zeros((n,), jnp.int32).at[jnp.where(r.valid, pid, n)].add(1, mode="drop")
    real = length > 0
    seq = r.seq[row0]
    pos0 = r.pos[row0]
    end = pos0 + length  # one past the piece's last position
    write = real & ((end % block_size == 0) | (row0 + length == r.cu[seq + 1]))
    column = jnp.clip((end - 1) // block_size, 0, max_blocks - 1)
    block = jnp.clip(block_tables[seq, column], 0, num_blocks - 1)
    return Pieces(seq, row0, length, pos0, real & (row0 == r.cu[seq]), jnp.where(write, block, -1),
                  jnp.sum(real.astype(jnp.int32)))


def initial_blocks(kv_lens: jax.Array, cu_q_lens: jax.Array, block_tables: jax.Array, *, num_tokens: int,
                   block_size: int, num_blocks: int) -> jax.Array:
    """i32[S]: the block holding each sequence's initial state (the state after position start_s - 1), -1 where it
    starts from zeros (start_s == 0) or has no rows (it reads nothing)."""
    max_blocks = block_tables.shape[1]
    r = rows(kv_lens, cu_q_lens, num_tokens)
    column = jnp.clip((r.start - 1) // block_size, 0, max_blocks - 1)
    block = jnp.clip(block_tables[jnp.arange(block_tables.shape[0]), column], 0, num_blocks - 1)
    return jnp.where((r.q_len > 0) & (r.start > 0), block, -1).astype(jnp.int32)


def gather_initial(pages: jax.Array, blocks: jax.Array) -> jax.Array:
    """The initial states `[S, *state_shape]` of `initial_blocks`: a page where the block is >= 0, zeros elsewhere
    (selected, never multiplied: other pages may hold NaN)."""
    state = pages[jnp.maximum(blocks, 0)]
    keep = (blocks >= 0).reshape(-1, *([1] * (pages.ndim - 1)))
    return jnp.where(keep, state, jnp.zeros((), pages.dtype))


def piece_rows(p: Pieces, chunk: int, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(rows i32[NP, chunk] clipped into [0, T), valid bool[NP, chunk]) of the pieces' slots."""
    c = jnp.arange(chunk, dtype=jnp.int32)
    return jnp.clip(p.row0[:, None] + c, 0, max(num_tokens - 1, 0)), c[None, :] < p.length[:, None]


def gather_pieces(x: jax.Array, slots: jax.Array, valid: jax.Array) -> jax.Array:
    """x `[T, ...]` -> `[NP, chunk, ...]`, zeros in slots past a piece's length (selected: rows of other sequences
    and padding rows may hold anything)."""
    g = x[slots]
    return jnp.where(valid.reshape(*valid.shape, *([1] * (x.ndim - 1))), g, jnp.zeros((), x.dtype))


def scatter_rows(values: jax.Array, slots: jax.Array, valid: jax.Array, num_tokens: int, dtype) -> jax.Array:
    """`[NP, chunk, ...]` -> `[T, ...]` in dtype: each valid slot's value at its row, zeros in rows no piece
    covers (padding)."""
    rows_flat = jnp.where(valid, slots, num_tokens).reshape(-1)
    flat = values.reshape(-1, *values.shape[2:]).astype(dtype)
    return jnp.zeros((num_tokens, *values.shape[2:]), dtype).at[rows_flat].set(flat, mode="drop")


def scatter_snapshots(pages: jax.Array, write: jax.Array, states: jax.Array) -> jax.Array:
    """pages with states[i] written into block write[i] wherever write[i] >= 0."""
    target = jnp.where(write >= 0, write, pages.shape[0])
    return pages.at[target].set(states.astype(pages.dtype), mode="drop")


def default_form(num_tokens: int, num_seqs: int) -> str:
    """"recurrent" for decode-shaped steps (no more rows than sequences), "chunked" otherwise."""
    return "recurrent" if num_tokens <= num_seqs else "chunked"


def l2norm(x: jax.Array) -> jax.Array:
    """transformers' (and the FLA library's) l2norm over the last axis, float32."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prepare_qk(q: jax.Array, k: jax.Array, *, use_qk_l2norm: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """q, k as the delta rule reads them: float32, L2-normalised if asked, q times scale."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def conv_inputs(x: jax.Array, init: jax.Array, cu: jax.Array, seq: jax.Array, src: jax.Array) -> jax.Array:
    """The conv inputs at rows `src` (i32[..., W]) of sequences `seq` (i32[...]), as `[..., W, C]` in x's dtype:
    x's row where it lies in the sequence's step (src >= cu[seq]), else the slot of the sequence's initial conv state
    (`init [S, C, K - 1]`, oldest first) holding that earlier position. Callers pass rows at most K - 1 before the
    step's first (so a slot exists)."""
    first = cu[seq][..., None]
    width = init.shape[2]
    from_x = x[jnp.clip(src, 0, max(x.shape[0] - 1, 0))]
    # Time-major, so that both gathers copy whole rows of C values (a gather along the strided slot axis is one
    # element at a time: 10x slower on XLA:CPU for a prefill).
    from_state = jnp.swapaxes(init, 1, 2)[seq[..., None], jnp.clip(src - first + width, 0, width - 1)]
    return jnp.where((src >= first)[..., None], from_x, from_state)


def write_conv_snapshots(conv_state_pages, x, init, cu, p: Pieces):
    """The pages with each owed conv snapshot written: after a piece, its last K - 1 inputs (rows end - K + 1 ..
    end - 1, from the step or the initial conv state `init [S, C, K - 1]`), copied without arithmetic."""
    width = conv_state_pages.shape[2]
    end = p.row0 + p.length
    snaps = conv_inputs(x, init, cu, p.seq, end[:, None] - width + jnp.arange(width))  # [NP, K - 1, C]
    return scatter_snapshots(conv_state_pages, p.write, jnp.swapaxes(snaps, 1, 2))


def empty_step(num_tokens: int, block_tables: jax.Array) -> bool:
    """A step with nothing to compute (no rows, no sequences, or tables without blocks): outputs are zeros and the
    pages come back unchanged."""
    return num_tokens == 0 or 0 in block_tables.shape
