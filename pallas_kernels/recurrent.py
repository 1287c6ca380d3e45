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
add no pieces. `pallas_kernels.pieces.pieces` computes them with O(tokens) vector ops, under a static bound
(`max_pieces`).

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
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import _validate as V
from pallas_kernels.dispatch import resolve_target, tpu_has_no
from pallas_kernels.gpu.recurrent import causal_conv1d_gpu, gated_delta_rule_gpu, mamba2_ssd_gpu
from pallas_kernels.pieces import (
    L2NORM_EPS,
    Pieces,
    Rows,
    default_form,
    empty_step,
    gather_initial,
    gather_pieces,
    initial_blocks,
    piece_rows,
    pieces,
    prepare_qk,
    rows,
    scatter_rows,
    scatter_snapshots,
    write_conv_snapshots,
)
from pallas_kernels.tpu.recurrent import causal_conv1d_tpu, gated_delta_rule_tpu, mamba2_ssd_tpu

HIGHEST = lax.Precision.HIGHEST
CONV_ACTIVATIONS = (None, "silu")
# The XLA paths' chunk: on XLA:CPU a piece's intra-chunk work grows with the chunk per token (the forward
# substitution, the (chunk, chunk) products) while the inter-chunk scan costs one step per piece; of 16 / 32 / 64 /
# 128, 32 was the fastest for the delta rule at prefill 512 and within 15% of 64 for the SSD
# (scripts/bench_recurrent.py --chunks; docs/kernels.md).
XLA_CHUNK = 32


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


def gated_delta_rule_xla(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                         use_qk_l2norm: bool = True, scale: float | None = None, form: str | None = None,
                         chunk_size: int = XLA_CHUNK):
    """The gated delta rule over paged state snapshots in XLA (the CPU engine's path): arguments, result and contract
    as `pallas_kernels.gated_delta_rule`. form None: recurrent rounds for decode-shaped steps (T <= S), chunks of
    `chunk_size` otherwise (module docstring; 32 by default, `XLA_CHUNK`)."""
    block_size, scale = validate_gated_delta_rule(
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
    block_size = validate_causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens,
                                          block_size=block_size, activation=activation, activations=CONV_ACTIVATIONS)
    if empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), conv_state_pages
    return _causal_conv1d_xla(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens,
                              block_size=block_size, activation=activation)


def mamba2_ssd_xla(x, dt, A, B, C, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, D=None,
                   form: str | None = None, chunk_size: int = XLA_CHUNK):
    """Mamba-2's SSD scan over paged state snapshots in XLA (the CPU engine's path): arguments, result and contract
    as `pallas_kernels.mamba2_ssd`; forms as `gated_delta_rule_xla`."""
    block_size = validate_mamba2_ssd(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens,
                                       block_size=block_size, form=form, chunk_size=chunk_size)
    if empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), state_pages
    return _mamba2_ssd_xla(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
                           form=form or default_form(x.shape[0], block_tables.shape[0]), chunk_size=chunk_size)


# ---- the entry points and their argument checks --------------------------------------------------------------

def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    block_size: int,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    form: str | None = None,
    chunk_size: int = 64,
    block_v: int | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule (Qwen3-Next / Qwen3.5 linear attention) of a ragged step over paged state snapshots.

    Per v head h (q/k head h // (Hv / Hk)), with state S `[Dk, Dv]` float32 and q, k L2-normalised, q scaled: S <-
    exp(g_t) S; u = beta_t (v_t - S^T k_t); S <- S + k_t u^T; o_t = S^T q_t (transformers'
    `torch_recurrent_gated_delta_rule`; the chunked form is its `torch_chunk_gated_delta_rule`, with pairwise decays
    summed as segments). Sequence s's rows `cu_q_lens[s]:cu_q_lens[s + 1]` sit at positions kv_lens[s] - q_len_s ...
    kv_lens[s] - 1; its initial state is read from the block of position start - 1 (zeros at position 0) and the
    state after every position that ends a block, and after its last row, is written to that position's block
    (`pallas_kernels.recurrent`'s contract: nothing else is read or written).

    Args:
      q, k: `[T, Hk, Dk]`, float32, bfloat16 or float16 (one dtype with v).
      v: `[T, Hv, Dv]`, Hv a multiple of Hk: each q/k head serves Hv / Hk consecutive v heads.
      g: float32 `[T, Hv]`, the log decay (<= 0: transformers' -exp(A_log) * softplus(a + dt_bias)).
      beta: float32 `[T, Hv]` (transformers' sigmoid(b)).
      state_pages: float32 `[num_blocks, Hv, Dk, Dv]`, one state per block; updated and returned (aliased: under
        jit with the pages donated, in place).
      block_tables: int32 `[S, max_blocks_per_seq]`; entries past a sequence's needs are never read.
      kv_lens: int32 `[S]`: positions after the step, 0 <= q_len_s <= kv_lens[s] <= max_blocks_per_seq * block_size.
      cu_q_lens: int32 `[S + 1]`, non-decreasing from 0; sequences with q_len 0 read and write nothing, rows past
        cu_q_lens[-1] are padding (zeros out).
      block_size: tokens per block of the block tables (a Python int: the pages hold one state per block).
      use_qk_l2norm: L2-normalise q and k per head (`x * rsqrt(sum(x^2) + 1e-6)`, in float32), as Qwen3-Next does.
      scale: multiplies q; defaults to Dk^-0.5.
      form: "chunked" (pieces of chunk_size rows and matmuls: prefill), "recurrent" (token by token: decode), or
        None: "recurrent" when T <= S (decode-shaped steps), else "chunked". Both compute the same function.
      chunk_size: rows per chunk of the chunked form; a chunk never crosses a block boundary (pieces end at
        multiples of chunk_size and of block_size), so block_size a multiple of chunk_size adds no pieces. GPU: a
        power of two >= 16; TPU: a multiple of 8 (decode-shaped steps run pieces of 8 rows).
      block_v: GPU only, state columns (of Dv) per program, a power of two (>= 16 for the chunked form); None: 8
        recurrent, 32 chunked (`gpu.recurrent.default_block`).
      interpret, target: as for `ragged_paged_attention` (TPU: float32 or bfloat16 inputs).
      num_warps: Triton warps per program (compiled GPU mode only); None: 1 recurrent, 4 chunked.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      (out `[T, Hv, Dv]` in q's dtype, state_pages).

    Raises:
      ValueError: on malformed arguments (shapes, dtypes, heads, block_size) or tuning values.
    """
    target = resolve_target(target, interpret)
    block_size, scale = validate_gated_delta_rule(
        q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
        use_qk_l2norm=use_qk_l2norm, scale=scale, form=form, chunk_size=chunk_size)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    form = form or default_form(q.shape[0], block_tables.shape[0])
    args = (q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens)
    common = dict(block_size=block_size, use_qk_l2norm=use_qk_l2norm, scale=scale, form=form, chunk_size=chunk_size,
                  interpret=interpret)
    if target == "tpu":
        tpu_has_no("block_v", block_v)
        return gated_delta_rule_tpu(*args, **common)
    return gated_delta_rule_gpu(*args, block_v=block_v, num_warps=num_warps, num_stages=num_stages, **common)


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    conv_state_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    block_size: int,
    bias: jax.Array | None = None,
    activation: str | None = None,
    block_t: int | None = None,
    block_c: int | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """The causal depthwise conv1d of a ragged step (the short convolution before Qwen3-Next's delta rule and
    Mamba-2's scan) over paged conv states.

    Per channel c: out_t = act(bias[c] + sum_i weight[c, i] x_{t-K+1+i}), inputs before a sequence's position 0
    being zeros (transformers' `causal_conv1d_fn` / `causal_conv1d_update`). The conv state after position p is the
    last K - 1 inputs `[x_{p-K+2}, ..., x_p]` (`[C, K - 1]`, oldest first); it is read and written under
    `pallas_kernels.recurrent`'s contract, as `gated_delta_rule`'s state.

    Args:
      x: `[T, C]`, float32, bfloat16 or float16.
      weight: `[C, K]`, K >= 2 (transformers' `conv1d.weight.squeeze(1)`), a float dtype.
      conv_state_pages: `[num_blocks, C, K - 1]` in x's dtype (they hold inputs), one state per block; updated and
        returned (aliased).
      block_tables, kv_lens, cu_q_lens, block_size, interpret, target: as for `gated_delta_rule` (TPU: float32 or
        bfloat16 x).
      bias: `[C]` or None, a float dtype.
      activation: None or "silu" (Qwen3-Next and Nemotron-H use "silu").
      block_t: rows per program (a piece never crosses a block boundary). GPU: a power of two, None = 32; TPU: a
        multiple of 8, None = 64.
      block_c: channels per program. GPU: a power of two, None = min(128, next_pow2(C)); TPU: a multiple of 128
        dividing C, or C; None = `tpu.recurrent.default_block_c`.
      num_warps: Triton warps per program (compiled GPU mode only), None = 4.
      num_stages: Triton software-pipelining stages (compiled GPU mode only).

    Returns:
      (out `[T, C]` in x's dtype, computed in float32, conv_state_pages).

    Raises:
      ValueError: on malformed arguments (shapes, dtypes, K < 2, the pages' dtype, the activation) or tuning values.
    """
    target = resolve_target(target, interpret)
    block_size = validate_causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens,
                                          block_size=block_size, activation=activation, activations=CONV_ACTIVATIONS)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    args = (x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens)
    common = dict(block_size=block_size, activation=activation, block_t=block_t, block_c=block_c,
                  interpret=interpret)
    if target == "tpu":
        return causal_conv1d_tpu(*args, **common)
    return causal_conv1d_gpu(*args, num_warps=num_warps, num_stages=num_stages, **common)


def mamba2_ssd(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    state_pages: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    *,
    block_size: int,
    D: jax.Array | None = None,
    form: str | None = None,
    chunk_size: int = 64,
    block_p: int | None = None,
    interpret: bool | None = None,
    target: str = "auto",
    num_warps: int | None = None,
    num_stages: int = 2,
) -> tuple[jax.Array, jax.Array]:
    """Mamba-2's SSD scan (Nemotron-H's mixer) of a ragged step over paged state snapshots.

    Per head h (B/C group h // (H / G)), with state S `[P, N]` float32: S <- exp(dt_t A_h) S + dt_t x_t B_t^T;
    y_t = S C_t + D_h x_t (transformers' `mamba2_selective_state_update`; the chunked form is `mamba2_chunk_scan`'s
    sum). States are read and written under `pallas_kernels.recurrent`'s contract, as `gated_delta_rule`'s.

    Args:
      x: `[T, H, P]`, float32, bfloat16 or float16.
      dt: float32 `[T, H]`: the time step as the scan uses it, after the caller's bias, softplus and clamp
        (transformers: `clamp(softplus(dt + dt_bias), *time_step_limit)`).
      A: float32 `[H]` (transformers' -exp(A_log)).
      B, C: `[T, G, N]` in x's dtype, H a multiple of G.
      state_pages: float32 `[num_blocks, H, P, N]`; updated and returned (aliased).
      block_tables, kv_lens, cu_q_lens, block_size, form, chunk_size, interpret, target, num_warps, num_stages: as
        for `gated_delta_rule` (the gate z and the norm after the scan are the caller's).
      D: float32 `[H]` or None: the skip connection D_h x_t.
      block_p: GPU only, state rows (of P) per program, a power of two (>= 16 for the chunked form); None: 8
        recurrent, 32 chunked.

    Returns:
      (y `[T, H, P]` in x's dtype, state_pages).

    Raises:
      ValueError: on malformed arguments (shapes, dtypes, groups, block_size) or tuning values.
    """
    target = resolve_target(target, interpret)
    block_size = validate_mamba2_ssd(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens,
                                       block_size=block_size, form=form, chunk_size=chunk_size)
    V.check_positive_option("num_warps", num_warps)
    V.check_positive_int("num_stages", num_stages)
    form = form or default_form(x.shape[0], block_tables.shape[0])
    args = (x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens)
    common = dict(block_size=block_size, form=form, chunk_size=chunk_size, interpret=interpret)
    if target == "tpu":
        tpu_has_no("block_p", block_p)
        return mamba2_ssd_tpu(*args, **common)
    return mamba2_ssd_gpu(*args, block_p=block_p, num_warps=num_warps, num_stages=num_stages, **common)


RECURRENT_FORMS = ("chunked", "recurrent")


def _check_arrays(**arrays) -> None:
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")


def _check_float(name: str, x, dtypes=V.SUPPORTED_DTYPES) -> None:
    if jnp.dtype(x.dtype) not in dtypes:
        raise ValueError(f"{name}'s dtype must be one of {', '.join(jnp.dtype(d).name for d in dtypes)}; got "
                         f"{x.dtype}")


def _check_shape(name: str, x, shape: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(x.shape)}")


def validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size) -> int:
    """The step arguments every recurrent entry point shares: block_tables int32 `[S, max_blocks_per_seq]`, kv_lens
    int32 `[S]`, cu_q_lens int32 `[S + 1]`, block_size a positive Python int (the state pages hold one state per
    block, so it is not in their shape). Returns block_size."""
    _check_arrays(block_tables=block_tables)
    V.check_int32("block_tables", block_tables, 2)
    V.check_vector("kv_lens", kv_lens, block_tables.shape[0])
    V.check_vector("cu_q_lens", cu_q_lens, block_tables.shape[0] + 1)
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (tokens per block of the block tables), got "
                         f"{block_size!r}")
    return int(block_size)


def _check_pages(name: str, pages, tail: tuple, what: str, dtypes) -> None:
    if pages.ndim != 1 + len(tail) or tuple(pages.shape[1:]) != tuple(tail) or pages.shape[0] < 1:
        raise ValueError(f"{name} must have shape [num_blocks >= 1, {what}] = [num_blocks, "
                         f"{', '.join(map(str, tail))}], got {tuple(pages.shape)}")
    _check_float(name, pages, dtypes)


def check_form(form) -> None:
    if form is not None and form not in RECURRENT_FORMS:
        raise ValueError(f"form must be None (by shape), 'chunked' or 'recurrent', got {form!r}")


def validate_gated_delta_rule(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size,
                              use_qk_l2norm, scale, form, chunk_size) -> tuple[int, float]:
    """q, k `[T, Hk, Dk]` and v `[T, Hv, Dv]` in one float dtype with Hv a multiple of Hk; g, beta float32
    `[T, Hv]`; state_pages float32 `[num_blocks, Hv, Dk, Dv]`; the step arguments. Returns (block_size, scale:
    Dk^-0.5 unless given)."""
    _check_arrays(q=q, k=k, v=v, g=g, beta=beta, state_pages=state_pages)
    block_size = validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size)
    if q.ndim != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be 3-D [tokens, num_k_heads, head_k_dim] of one shape, got {q.shape} and "
                         f"{k.shape}")
    if v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be 3-D [tokens, num_v_heads, head_v_dim] with q's {q.shape[0]} tokens, got "
                         f"{v.shape}")
    _check_float("q", q)
    if jnp.dtype(k.dtype) != jnp.dtype(q.dtype) or jnp.dtype(v.dtype) != jnp.dtype(q.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    if min(num_k_heads, num_v_heads, head_k, head_v) < 1:
        raise ValueError(f"need at least one head of at least one dimension, got q {q.shape} and v {v.shape}")
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads}): each q/k "
                         f"head serves num_v_heads // num_k_heads consecutive v heads")
    for name, x in (("g", g), ("beta", beta)):
        _check_shape(name, x, (num_tokens, num_v_heads), "[tokens, num_v_heads]")
        _check_float(name, x, (jnp.dtype(jnp.float32),))
    _check_pages("state_pages", state_pages, (num_v_heads, head_k, head_v), "num_v_heads, head_k_dim, head_v_dim",
                 (jnp.dtype(jnp.float32),))
    if not isinstance(use_qk_l2norm, bool):
        raise ValueError(f"use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")
    check_form(form)
    V.check_positive_int("chunk_size", chunk_size)
    return block_size, (head_k ** -0.5 if scale is None else V.resolve_scale(scale, head_k))


def validate_causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size,
                           activation, activations) -> int:
    """x `[T, C]` in a float dtype; weight `[C, K]` (K >= 2) and bias `[C]` (or None) in float dtypes;
    conv_state_pages `[num_blocks, C, K - 1]` in x's dtype (they hold inputs); the step arguments. Returns
    block_size."""
    _check_arrays(x=x, weight=weight, conv_state_pages=conv_state_pages)
    block_size = validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be 2-D [tokens, channels], got shape {x.shape}")
    _check_float("x", x)
    channels = x.shape[1]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise ValueError(f"weight must have shape [channels, kernel_size] = [{channels}, K] with K >= 2 (a kernel "
                         f"of one tap keeps no state), got {tuple(weight.shape)}")
    _check_float("weight", weight)
    if bias is not None:
        _check_arrays(bias=bias)
        _check_shape("bias", bias, (channels,), "[channels]")
        _check_float("bias", bias)
    taps = weight.shape[1]
    _check_pages("conv_state_pages", conv_state_pages, (channels, taps - 1), "channels, kernel_size - 1",
                 (jnp.dtype(x.dtype),))
    if activation not in activations:
        raise ValueError(f"activation must be one of {activations}, got {activation!r}")
    return block_size


def validate_mamba2_ssd(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size, form,
                        chunk_size) -> int:
    """x `[T, H, P]` in a float dtype; dt float32 `[T, H]`; A float32 `[H]`; B, C `[T, G, N]` in x's dtype with H a
    multiple of G; D float32 `[H]` or None; state_pages float32 `[num_blocks, H, P, N]`; the step arguments.
    Returns block_size."""
    _check_arrays(x=x, dt=dt, A=A, B=B, C=C, state_pages=state_pages)
    block_size = validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size)
    if x.ndim != 3 or min(x.shape[1:]) < 1:
        raise ValueError(f"x must be 3-D [tokens, num_heads, head_dim], got shape {x.shape}")
    _check_float("x", x)
    num_tokens, num_heads, head_dim = x.shape
    if B.ndim != 3 or B.shape[0] != num_tokens or min(B.shape[1:]) < 1 or C.shape != B.shape:
        raise ValueError(f"B and C must be 3-D [tokens, n_groups, state_size] of one shape with x's {num_tokens} "
                         f"tokens, got {B.shape} and {C.shape}")
    if jnp.dtype(B.dtype) != jnp.dtype(x.dtype) or jnp.dtype(C.dtype) != jnp.dtype(x.dtype):
        raise ValueError(f"B and C must be in x's dtype ({x.dtype}), got {B.dtype} and {C.dtype}")
    num_groups, state_size = B.shape[1:]
    if num_heads % num_groups:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of n_groups ({num_groups})")
    f32 = (jnp.dtype(jnp.float32),)
    _check_shape("dt", dt, (num_tokens, num_heads), "[tokens, num_heads]")
    _check_float("dt", dt, f32)
    _check_shape("A", A, (num_heads,), "[num_heads]")
    _check_float("A", A, f32)
    if D is not None:
        _check_arrays(D=D)
        _check_shape("D", D, (num_heads,), "[num_heads]")
        _check_float("D", D, f32)
    _check_pages("state_pages", state_pages, (num_heads, head_dim, state_size), "num_heads, head_dim, state_size",
                 f32)
    check_form(form)
    V.check_positive_int("chunk_size", chunk_size)
    return block_size
