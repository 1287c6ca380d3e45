"""Recurrent-state layers over paged state snapshots: the contract, the pieces a step is cut into, the float64
sequential references and the XLA paths of the gated delta rule (Qwen3-Next / Qwen3.5), the causal depthwise
conv1d and Mamba-2's SSD scan (Nemotron-H).

The contract (all three ops; the Pallas kernels in `gpu.recurrent` and `tpu.recurrent` implement the same):
  * A ragged step holds sequences s = 0..S-1; sequence s owns token rows `cu_q_lens[s]:cu_q_lens[s + 1]` at
    positions `start_s = kv_lens[s] - q_len_s, ..., kv_lens[s] - 1` (0 <= q_len_s <= kv_lens[s] <=
    max_blocks_per_seq * block_size). Sequences with q_len 0 (padding, or idle) read and write nothing; rows at or
    past `cu_q_lens[-1]` are padding and get zeros.
  * State pages `[num_blocks, *state_shape]` hold one state per block (not per token): the state after position
    p of sequence s lives in block `block_tables[s, p // block_size]` once written.
  * A sequence's initial state is read from block `block_tables[s, (start_s - 1) // block_size]` when start_s > 0,
    else it is zeros. The tokens are processed in order, and the state after position p is written to block
    `block_tables[s, p // block_size]` for every p that ends a block (`p % block_size == block_size - 1`) and for
    the sequence's last token of the step. So every block boundary holds an exact snapshot (the engine publishes
    full blocks for prefix caching and restarts later requests from them), and a sequence's last, partial block
    holds its live state. Nothing else is read or written: table entries past a sequence's needs may hold
    anything, other blocks may hold anything (NaN included), and blocks may be permuted arbitrarily.
  * A block a sequence writes is its own within the step: no other sequence of the step reads or writes it (the
    engine's allocation guarantees it; a shared, prefix-cached block is full and only ever read).
  * Decode is the same contract with q_len 1.

Pieces: every op cuts each sequence's tokens into pieces that never cross a block boundary (and, for the chunked
forms, never cross a multiple of `chunk_size`): boundaries are absolute positions, so a piece's end is where a
snapshot may be due, and the state there is always materialised exactly, with no state inside a chunk to
reconstruct. With block_size a multiple of chunk_size (the layout to choose: 64 | 256, say) the block boundaries
add no pieces. `pieces` computes them with O(tokens) vector ops, under a static bound (`max_pieces`).

References: `*_reference` run the definition one token at a time in numpy float64 (inputs first rounded to their
own dtype, as the kernels see them), from and into a float64 copy of the pages, and return numpy arrays
(outputs, pages). They are the oracle of every test.

XLA paths (`*_xla`, what the CPU engine runs): the step is vectorised over sequences. The chunked forms gather
all pieces into `[pieces, chunk, ...]` (padded rows are zeros), compute every piece's intra-chunk terms at once
(batched matmuls), then run the inter-chunk recurrence, one small matmul per piece, over the real pieces only (a
dynamic trip count); a piece that starts a sequence takes its initial state (gathered once from the pages), and
the states after the pieces that owe a snapshot are scattered into the pages at the end. The recurrent forms
(decode-shaped steps) loop over rounds, round j advancing every sequence by its j-th token (a dynamic trip count:
one round for a decode batch), the snapshots scattered into the pages inside the loop. The conv has no
recurrence: each token's window is gathered (from the step's rows or the initial conv state).

Definitions (transformers 5.x, `models/qwen3_next/modeling_qwen3_next.py` and `models/mamba2/modeling_mamba2.py`):
  * gated delta rule, per v head h with q/k head h // (Hv / Hk), state S `[Dk, Dv]` float32: q, k L2-normalised
    (`x * rsqrt(sum(x^2) + 1e-6)`, optional), q scaled by Dk^-0.5; then S <- exp(g_t) S; u = beta_t (v_t - S^T k_t);
    S <- S + k_t u^T; o_t = S^T q_t. Chunked (WY / UT form, `torch_chunk_gated_delta_rule`): with
    D_ij = g_{j+1} + ... + g_i, A_ij = beta_i (k_i . k_j) exp(D_ij) (i > j), U = (I + A)^-1 (beta v),
    W = (I + A)^-1 (beta k exp(G)): u = U - W S0, o_i = exp(G_i) q_i S0 + sum_{j<=i} (q_i . k_j) exp(D_ij) u_j,
    S = exp(G_last) S0 + sum_j exp(D_last,j) k_j u_j^T. The pairwise decays are segment sums (as Mamba-2's
    `segment_sum`), not differences of two cumulative sums, which would lose float32 digits on long decays.
  * causal conv1d, per channel c with weight w `[C, K]`: out_t = act(bias + sum_i w[c, i] x_{t-K+1+i}) with the
    inputs before the sequence's first position zeros; the conv state after position p is the last K-1 inputs
    `[x_{p-K+2}, ..., x_p]` (`[C, K-1]`, oldest first, the conv_state layout of transformers' `causal_conv1d_update`).
  * Mamba-2 SSD, per head h of group h // (H / G), state S `[P, N]` float32: S <- exp(dt_t A_h) S + dt_t x_t B_t^T,
    y_t = S C_t + D_h x_t (`mamba2_selective_state_update`; the chunked `mamba2_chunk_scan` is the same sum).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _validate as V

HIGHEST = lax.Precision.HIGHEST
L2NORM_EPS = 1e-6  # transformers' l2norm (the FLA library's): x * rsqrt(sum(x^2) + eps)
CONV_ACTIVATIONS = (None, "silu")
# The XLA paths' chunk: on XLA:CPU a piece's intra-chunk work grows with the chunk per token (the forward
# substitution, the (chunk, chunk) products) while the inter-chunk scan costs one step per piece; of 16 / 32 / 64 /
# 128, 32 was the fastest for the delta rule at prefill 512 and within 15% of 64 for the SSD
# (scripts/bench_recurrent.py --chunks; docs/kernels.md).
XLA_CHUNK = 32


# ---- the step's pieces ------------------------------------------------------------------------------------


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


# ---- float64 references -----------------------------------------------------------------------------------


def _f64(x) -> np.ndarray:
    """An array's values as float64 (bfloat16 widened exactly through float32)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float64:
        x = x.astype(jnp.float32)
    return np.asarray(x, np.float64)


def _reference_walk(block_tables, kv_lens, cu_q_lens, block_size: int, pages: np.ndarray, zero_state, step):
    """Runs the contract one token at a time: for each sequence with rows, its initial state (page or zeros), then
    `state = step(state, row)` per row in order, the state written to its position's block at block ends and after
    the last row. Returns the pages (a float64 copy, updated)."""
    tables = np.asarray(block_tables)
    kv = np.asarray(kv_lens, np.int64)
    cu = np.asarray(cu_q_lens, np.int64)
    pages = pages.copy()
    for s in range(tables.shape[0]):
        q_len = int(cu[s + 1] - cu[s])
        if q_len <= 0:
            continue
        start = int(kv[s]) - q_len
        state = pages[tables[s, (start - 1) // block_size]].copy() if start > 0 else zero_state()
        for i in range(q_len):
            pos = start + i
            state = step(state, int(cu[s]) + i)
            if pos % block_size == block_size - 1 or i == q_len - 1:
                pages[tables[s, pos // block_size]] = state
    return pages


def _l2norm64(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)




def gated_delta_rule_reference(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                               use_qk_l2norm: bool = True, scale: float | None = None):
    """The gated delta rule, one token at a time in float64 (the definition, module docstring). Arguments as
    `pallas_kernels.gated_delta_rule`; returns numpy float64 (out `[T, Hv, Dv]`, pages `[num_blocks, Hv, Dk, Dv]`)."""
    q, k, v, g, beta, pages = (_f64(a) for a in (q, k, v, g, beta, state_pages))
    num_k_heads, head_k = q.shape[1:]
    num_v_heads = v.shape[1]
    if use_qk_l2norm:
        q, k = _l2norm64(q), _l2norm64(k)
    q = q * (head_k ** -0.5 if scale is None else scale)
    ratio = num_v_heads // num_k_heads
    q, k = np.repeat(q, ratio, axis=1), np.repeat(k, ratio, axis=1)  # v head h reads q/k head h // ratio
    out = np.zeros(v.shape)

    def step(state, t):  # state [Hv, Dk, Dv]
        state = state * np.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", state, k[t]))
        state = state + k[t][:, :, None] * u[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", state, q[t])
        return state

    pages = _reference_walk(block_tables, kv_lens, cu_q_lens, block_size, pages, lambda: np.zeros(pages.shape[1:]),
                            step)
    return out, pages


def causal_conv1d_reference(x, weight, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                            bias=None, activation: str | None = None):
    """The causal depthwise conv1d, one token at a time in float64 (module docstring). Arguments as
    `pallas_kernels.causal_conv1d`; returns numpy float64 (out `[T, C]`, pages `[num_blocks, C, K - 1]`)."""
    x, weight, pages = _f64(x), _f64(weight), _f64(conv_state_pages)
    bias = np.zeros(x.shape[1]) if bias is None else _f64(bias)
    out = np.zeros(x.shape)

    def step(window, t):  # window [C, K - 1]: the last K - 1 inputs, oldest first
        full = np.concatenate([window, x[t][:, None]], axis=1)
        y = np.sum(full * weight, axis=1) + bias
        out[t] = y / (1.0 + np.exp(-y)) if activation == "silu" else y
        return full[:, 1:]

    pages = _reference_walk(block_tables, kv_lens, cu_q_lens, block_size, pages, lambda: np.zeros(pages.shape[1:]),
                            step)
    return out, pages


def mamba2_ssd_reference(x, dt, A, B, C, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, D=None):
    """Mamba-2's SSD scan, one token at a time in float64 (module docstring). Arguments as
    `pallas_kernels.mamba2_ssd`; returns numpy float64 (y `[T, H, P]`, pages `[num_blocks, H, P, N]`)."""
    x, dt, A, B, C, pages = (_f64(a) for a in (x, dt, A, B, C, state_pages))
    num_heads = x.shape[1]
    D = np.zeros(num_heads) if D is None else _f64(D)
    ratio = num_heads // B.shape[1]
    B, C = np.repeat(B, ratio, axis=1), np.repeat(C, ratio, axis=1)  # head h reads group h // ratio
    out = np.zeros(x.shape)

    def step(state, t):  # state [H, P, N]
        state = (state * np.exp(dt[t] * A)[:, None, None]
                 + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :])
        out[t] = np.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[t]
        return state

    pages = _reference_walk(block_tables, kv_lens, cu_q_lens, block_size, pages, lambda: np.zeros(pages.shape[1:]),
                            step)
    return out, pages


# ---- XLA paths ----------------------------------------------------------------------------------------------


def _mm(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def l2norm(x: jax.Array) -> jax.Array:
    """transformers' (and the FLA library's) l2norm over the last axis, float32."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def prepare_qk(q: jax.Array, k: jax.Array, *, use_qk_l2norm: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """q, k as the delta rule reads them: float32, L2-normalised if asked, q times scale."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k


def segment_decays(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-chunk decays of log-decays a `[..., C]` (zeros in padded slots): (seg `[..., C, C]`, seg[i, j] = a_{j+1}
    + ... + a_i for i >= j, 0 above the diagonal; G `[..., C]`, G_i = a_0 + ... + a_i). The pairwise sums are
    summed directly, not taken as G_i - G_j: a difference of two long cumulative sums loses float32 digits."""
    c = a.shape[-1]
    i = jnp.arange(c)[:, None]
    j = jnp.arange(c)[None, :]
    seg = jnp.cumsum(jnp.where(i > j, a[..., :, None], 0.0), axis=-2)
    return seg, jnp.cumsum(a, axis=-1)


def _causal(c: int, strict: bool = False) -> jax.Array:
    i = jnp.arange(c)[:, None]
    j = jnp.arange(c)[None, :]
    return i > j if strict else i >= j


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for strictly lower triangular a `[..., C, C]`, by forward substitution: row i of the inverse is
    e_i - sum_{j<i} a_ij (row j), rows in order (backward stable; the kernels solve the same way). On XLA:CPU a
    batched `solve_triangular` took 15-50x longer for chunks of 16-128 rows."""
    c = a.shape[-1]

    def body(i, inv):
        return inv.at[..., i, :].add(-_mm("...j,...jk->...k", a[..., i, :], inv))

    return lax.fori_loop(1, c, body, jnp.broadcast_to(jnp.eye(c, dtype=a.dtype), a.shape))


def _gdn_chunk_terms(q, k, v, g, beta):
    """Every piece's intra-chunk terms at once. q, k `[..., C, Dk]`, v `[..., C, Dv]`, g, beta `[..., C]`, zeros in
    padded slots (so those slots add nothing). Returns (U, W, P, Qd, Kd, last): u = U - W S0 for the chunk's
    initial state S0; o = Qd S0 + P u; S_end = last S0 + Kd^T u (module docstring)."""
    c = g.shape[-1]
    seg, cum = segment_decays(g)
    decay = jnp.where(_causal(c), jnp.exp(seg), 0.0)
    kb = k * beta[..., None]
    inv = unit_lower_inverse(jnp.where(_causal(c, strict=True), _mm("...id,...jd->...ij", kb, k) * decay, 0.0))
    p = _mm("...id,...jd->...ij", q, k) * decay
    return (_mm("...ij,...jv->...iv", inv, v * beta[..., None]),
            _mm("...ij,...jk->...ik", inv, kb * jnp.exp(cum)[..., None]), p, q * jnp.exp(cum)[..., None],
            k * jnp.exp(seg[..., c - 1, :])[..., None], jnp.exp(cum[..., c - 1]))


def _gdn_piece(s0, u_, w, p, qd, kd, last):
    """One piece of the chunked recurrence, all heads: s0 `[Hv, Dk, Dv]` -> (o `[Hv, C, Dv]`, S_end)."""
    u = u_ - _mm("hck,hkv->hcv", w, s0)
    o = _mm("hck,hkv->hcv", qd, s0) + _mm("hcj,hjv->hcv", p, u)
    return o, last[:, None, None] * s0 + _mm("hck,hcv->hkv", kd, u)


def _scan_pieces(p: Pieces, init: jax.Array, terms, piece_fn, out_shape):
    """The inter-chunk recurrence over the real pieces in row order: a piece that starts its sequence starts from
    init[seq] (`[S, *state]`), every other one from the previous piece's end state. terms: per-piece arrays with a
    leading [NP] axis. Returns (outputs `[NP, *out_shape]`, end states `[NP, *state]`), zeros past the real
    pieces."""
    n = p.first.shape[0]
    state_shape = init.shape[1:]

    def body(i, carry):
        state, outs, ends = carry
        s0 = jnp.where(p.first[i], init[p.seq[i]], state)
        o, s1 = piece_fn(s0, *(t[i] for t in terms))
        return s1, outs.at[i].set(o), ends.at[i].set(s1)

    zeros = (jnp.zeros(state_shape, jnp.float32), jnp.zeros((n, *out_shape), jnp.float32),
             jnp.zeros((n, *state_shape), jnp.float32))
    _, outs, ends = lax.fori_loop(0, p.count, body, zeros)
    return outs, ends


def _rounds(r: Rows, init, pages, block_tables, *, block_size: int, num_tokens: int, token_fn, out_row_shape,
            out_dtype):
    """The recurrent form: round j advances every sequence by its j-th row (rounds: the longest q_len, a dynamic
    trip count). token_fn(states `[S, *state]`, rows i32[S]) -> (new states, outputs `[S, *out_row_shape]`). Each
    round writes the states owed a snapshot (block end or last row) into the pages."""
    num_seqs, max_blocks = block_tables.shape
    num_blocks = pages.shape[0]
    seqs = jnp.arange(num_seqs)

    def body(j, carry):
        states, out, pages = carry
        row = r.cu[:-1] + j
        active = j < r.q_len
        new, o = token_fn(states, jnp.clip(row, 0, max(num_tokens - 1, 0)))
        keep = active.reshape(-1, *([1] * (states.ndim - 1)))
        states = jnp.where(keep, new, states)
        out = out.at[jnp.where(active, row, num_tokens)].set(o.astype(out_dtype), mode="drop")
        pos = r.start + j
        write = active & ((pos % block_size == block_size - 1) | (j == r.q_len - 1))
        block = jnp.clip(block_tables[seqs, jnp.clip(pos // block_size, 0, max_blocks - 1)], 0, num_blocks - 1)
        pages = pages.at[jnp.where(write, block, num_blocks)].set(new.astype(pages.dtype), mode="drop")
        return states, out, pages

    out = jnp.zeros((num_tokens, *out_row_shape), out_dtype)
    _, out, pages = lax.fori_loop(0, jnp.max(r.q_len), body, (init, out, pages))
    return out, pages


@functools.partial(jax.jit, static_argnames=("block_size", "use_qk_l2norm", "scale", "form", "chunk_size"))
def _gated_delta_rule_xla(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                          use_qk_l2norm: bool, scale: float, form: str, chunk_size: int):
    num_tokens, num_v_heads, head_v = v.shape
    ratio = num_v_heads // q.shape[1]
    num_blocks = state_pages.shape[0]
    out_dtype = q.dtype
    q, k = prepare_qk(q, k, use_qk_l2norm=use_qk_l2norm, scale=scale)
    q, k = jnp.repeat(q, ratio, axis=1), jnp.repeat(k, ratio, axis=1)  # [T, Hv, Dk]
    v = v.astype(jnp.float32)
    blocks = initial_blocks(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                            num_blocks=num_blocks)
    init = gather_initial(state_pages, blocks)
    if form == "recurrent":
        def token(states, t):  # states [S, Hv, Dk, Dv]
            states = states * jnp.exp(g[t])[:, :, None, None]
            u = beta[t][..., None] * (v[t] - _mm("shkv,shk->shv", states, k[t]))
            states = states + k[t][..., :, None] * u[..., None, :]
            return states, _mm("shkv,shk->shv", states, q[t])

        r = rows(kv_lens, cu_q_lens, num_tokens)
        return _rounds(r, init, state_pages, block_tables, block_size=block_size, num_tokens=num_tokens,
                       token_fn=token, out_row_shape=(num_v_heads, head_v), out_dtype=out_dtype)
    p = pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=chunk_size, block_size=block_size,
               num_blocks=num_blocks)
    slots, valid = piece_rows(p, chunk_size, num_tokens)
    heads_first = lambda x: jnp.moveaxis(gather_pieces(x, slots, valid), 2, 1)  # [NP, Hv, C, ...]
    terms = _gdn_chunk_terms(heads_first(q), heads_first(k), heads_first(v), heads_first(g), heads_first(beta))
    outs, ends = _scan_pieces(p, init, terms, _gdn_piece, (num_v_heads, chunk_size, head_v))
    return (scatter_rows(jnp.moveaxis(outs, 1, 2), slots, valid, num_tokens, out_dtype),
            scatter_snapshots(state_pages, p.write, ends))


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


@functools.partial(jax.jit, static_argnames=("block_size", "activation"))
def _causal_conv1d_xla(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                       activation: str | None):
    num_tokens = x.shape[0]
    taps = weight.shape[1]
    num_blocks = conv_state_pages.shape[0]
    r = rows(kv_lens, cu_q_lens, num_tokens)
    blocks = initial_blocks(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                            num_blocks=num_blocks)
    init = gather_initial(conv_state_pages, blocks)  # [S, C, K - 1]
    weight = weight.astype(jnp.float32)
    width = taps - 1
    # Tap i of row t reads the input K - 1 - i rows back: a static shift of the rows (vectorised; a gather per
    # element was 10x slower on XLA:CPU), kept where that row is in the row's sequence. The rows that reach back past
    # their sequence's first row (the first K - 1 of each) add the initial conv state's slots: slot m + i for tap i of
    # the sequence's row m (static indices), scattered onto those rows.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    rows_back = jnp.concatenate([jnp.zeros((width, x.shape[1]), jnp.float32), x.astype(jnp.float32)])
    first = r.cu[r.seq]
    y = sum(jnp.where((t - width + i >= first)[:, None], rows_back[i:i + num_tokens], 0.0) * weight[:, i]
            for i in range(taps))
    slots = jnp.swapaxes(init, 1, 2).astype(jnp.float32)  # [S, K - 1, C], oldest first
    head = jnp.stack([sum(slots[:, m + i] * weight[:, i] for i in range(width - m)) for m in range(width)], 1)
    m = jnp.arange(width, dtype=jnp.int32)
    head_rows = jnp.where(m[None, :] < r.q_len[:, None], r.cu[:-1, None] + m[None, :], num_tokens)
    y = y.at[head_rows.reshape(-1)].add(head.reshape(-1, x.shape[1]), mode="drop")
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation == "silu":
        y = y * jax.nn.sigmoid(y)
    out = jnp.where(r.valid[:, None], y, 0.0).astype(x.dtype)
    p = pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=None, block_size=block_size,
               num_blocks=num_blocks)
    return out, write_conv_snapshots(conv_state_pages, x, init, r.cu, p)


def write_conv_snapshots(conv_state_pages, x, init, cu, p: Pieces):
    """The pages with each owed conv snapshot written: after a piece, its last K - 1 inputs (rows end - K + 1 ..
    end - 1, from the step or the initial conv state `init [S, C, K - 1]`), copied without arithmetic."""
    width = conv_state_pages.shape[2]
    end = p.row0 + p.length
    snaps = conv_inputs(x, init, cu, p.seq, end[:, None] - width + jnp.arange(width))  # [NP, K - 1, C]
    return scatter_snapshots(conv_state_pages, p.write, jnp.swapaxes(snaps, 1, 2))


def _ssd_chunk_terms(x, dt, a, b, c, d):
    """Every piece's intra-chunk terms of the SSD scan at once: x `[..., H, C, P]`, dt `[..., H, C]`, a `[H]` (A),
    b, c `[..., H, C, N]`, d `[H]` (D, zeros without), zeros in padded slots. Returns (Y, Cd, Xb, B, last): for the
    chunk's initial state S0 `[H, P, N]`, y = Y + Cd S0^T and S_end = last S0 + Xb^T B."""
    cl = dt.shape[-1]
    seg, cum = segment_decays(dt * a[:, None])
    decay = jnp.where(_causal(cl), jnp.exp(seg), 0.0)
    scores = _mm("...in,...jn->...ij", c, b) * decay * dt[..., None, :]
    y = _mm("...ij,...jp->...ip", scores, x) + d[:, None, None] * x
    xb = x * (dt * jnp.exp(seg[..., cl - 1, :]))[..., None]
    return y, c * jnp.exp(cum)[..., None], xb, b, jnp.exp(cum[..., cl - 1])


def _ssd_piece(s0, y, cd, xb, b, last):
    """One piece of the chunked SSD recurrence, all heads: s0 `[H, P, N]` -> (y `[H, C, P]`, S_end)."""
    return y + _mm("hcn,hpn->hcp", cd, s0), last[:, None, None] * s0 + _mm("hcp,hcn->hpn", xb, b)


@functools.partial(jax.jit, static_argnames=("block_size", "form", "chunk_size"))
def _mamba2_ssd_xla(x, dt, a, b, c, d, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, form: str,
                    chunk_size: int):
    num_tokens, num_heads, head_dim = x.shape
    ratio = num_heads // b.shape[1]
    num_blocks = state_pages.shape[0]
    out_dtype = x.dtype
    x = x.astype(jnp.float32)
    b = jnp.repeat(b.astype(jnp.float32), ratio, axis=1)  # [T, H, N]: head h reads group h // ratio
    c = jnp.repeat(c.astype(jnp.float32), ratio, axis=1)
    d = jnp.zeros((num_heads,), jnp.float32) if d is None else d
    blocks = initial_blocks(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                            num_blocks=num_blocks)
    init = gather_initial(state_pages, blocks)
    if form == "recurrent":
        def token(states, t):  # states [S, H, P, N]
            step = dt[t][..., None, None]
            states = states * jnp.exp(dt[t] * a)[..., None, None] + step * x[t][..., :, None] * b[t][..., None, :]
            return states, _mm("shpn,shn->shp", states, c[t]) + d[:, None] * x[t]

        r = rows(kv_lens, cu_q_lens, num_tokens)
        return _rounds(r, init, state_pages, block_tables, block_size=block_size, num_tokens=num_tokens,
                       token_fn=token, out_row_shape=(num_heads, head_dim), out_dtype=out_dtype)
    p = pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=chunk_size, block_size=block_size,
               num_blocks=num_blocks)
    slots, valid = piece_rows(p, chunk_size, num_tokens)
    heads_first = lambda z: jnp.moveaxis(gather_pieces(z, slots, valid), 2, 1)  # [NP, H, C, ...]
    terms = _ssd_chunk_terms(heads_first(x), heads_first(dt), a, heads_first(b), heads_first(c), d)
    outs, ends = _scan_pieces(p, init, terms, _ssd_piece, (num_heads, chunk_size, head_dim))
    return (scatter_rows(jnp.moveaxis(outs, 1, 2), slots, valid, num_tokens, out_dtype),
            scatter_snapshots(state_pages, p.write, ends))


def empty_step(num_tokens: int, block_tables: jax.Array) -> bool:
    """A step with nothing to compute (no rows, no sequences, or tables without blocks): outputs are zeros and the
    pages come back unchanged."""
    return num_tokens == 0 or 0 in block_tables.shape


def gated_delta_rule_xla(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                         use_qk_l2norm: bool = True, scale: float | None = None, form: str | None = None,
                         chunk_size: int = XLA_CHUNK):
    """The gated delta rule over paged state snapshots in XLA (the CPU engine's path): arguments, result and contract
    as `pallas_kernels.gated_delta_rule`. form None: recurrent rounds for decode-shaped steps (T <= S), chunks of
    `chunk_size` otherwise (module docstring; 32 by default, `XLA_CHUNK`)."""
    block_size, scale = V.validate_gated_delta_rule(
        q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
        use_qk_l2norm=use_qk_l2norm, scale=scale, form=form, chunk_size=chunk_size)
    if empty_step(q.shape[0], block_tables):
        return jnp.zeros(v.shape, q.dtype), state_pages
    return _gated_delta_rule_xla(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens,
                                 block_size=block_size, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                 form=form or default_form(q.shape[0], block_tables.shape[0]), chunk_size=chunk_size)


def causal_conv1d_xla(x, weight, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, bias=None,
                      activation: str | None = None):
    """The causal depthwise conv1d over paged conv states in XLA (the CPU engine's path): arguments, result and
    contract as `pallas_kernels.causal_conv1d`. Each row's K inputs are gathered (from the step's rows or its
    sequence's initial conv state), and each snapshot is a copy of the K - 1 inputs before a piece's end."""
    block_size = V.validate_causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens,
                                          block_size=block_size, activation=activation, activations=CONV_ACTIVATIONS)
    if empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), conv_state_pages
    return _causal_conv1d_xla(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens,
                              block_size=block_size, activation=activation)


def mamba2_ssd_xla(x, dt, A, B, C, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, D=None,
                   form: str | None = None, chunk_size: int = XLA_CHUNK):
    """Mamba-2's SSD scan over paged state snapshots in XLA (the CPU engine's path): arguments, result and contract
    as `pallas_kernels.mamba2_ssd`; forms as `gated_delta_rule_xla`."""
    block_size = V.validate_mamba2_ssd(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens,
                                       block_size=block_size, form=form, chunk_size=chunk_size)
    if empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), state_pages
    return _mamba2_ssd_xla(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
                           form=form or default_form(x.shape[0], block_tables.shape[0]), chunk_size=chunk_size)
