"""Recurrent-state layers over paged state snapshots on NVIDIA GPUs, in Pallas (Triton): the gated delta rule,
Mamba-2's SSD scan (each in a chunked and a recurrent form) and the causal depthwise conv1d. The contract (which
blocks are read and written) is `pallas_kernels.recurrent`'s.

Gated delta rule and SSD: the grid is (sequence, head, tile of the state's value columns: Dv for the delta rule,
head_dim for the SSD). Each program owns its state tile for the whole step: it loads it from the sequence's initial
block (or starts from zeros), walks the sequence's rows in order, and stores it into the pages after every piece
that owes a snapshot. The state's columns are independent of each other in both recurrences (the delta rule's
keys, gates and (I + A)^-1 act on rows, the SSD's decays on whole states), so tiling them is exact; each tile's
program recomputes the per-chunk row terms. A program reads the initial block before it writes any block, and
every state element it stores depends on the loaded elements of its column, so the in-place update (the pages are
aliased input to output) has no read-after-write hazard; no other program touches the sequence's blocks.
  * chunked form: the walk goes piece by piece (pieces end at multiples of chunk_size and of block_size, so the
    state at each block boundary is materialised); a piece is loaded as a `[chunk_size, ...]` tile (rows past its
    end masked to zeros, which add nothing) and computed with matmuls. The delta rule's (I + A)^-1 is solved by
    forward substitution, one row per iteration (backward stable, unlike a Neumann product: the powers of A can
    grow large although the inverse stays bounded).
  * recurrent form (decode-shaped steps): the walk goes token by token, vector-matrix products on the state in
    registers (no tl.dot, so no 16-row minimum).
Causal conv1d: the grid is (piece, channel tile), pieces of at most block_t rows cut at block boundaries: each
program computes its rows from K shifted loads (rows of the step, or slots of the sequence's initial conv state,
gathered by the wrapper so that no program reads a block another one writes) and stores the snapshot owed at its
piece's end: a copy of its last K - 1 inputs.

Everything is computed in float32; inputs are cast after loading. Nothing here is public API; the entry points
`pallas_kernels.gated_delta_rule`, `mamba2_ssd` and `causal_conv1d` with target="gpu" are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _validate as V
from pallas_kernels import pieces as R
from pallas_kernels import tiles
from pallas_kernels.gpu import _common as C

F32 = jnp.float32


def seq_metadata(kv_lens, cu_q_lens, block_tables, *, num_tokens: int, block_size: int, num_blocks: int):
    """int32 `[S, 4]`: per sequence (first row, q_len, first position, block of its initial state or -1: zeros)."""
    r = R.rows(kv_lens, cu_q_lens, num_tokens)
    init = R.initial_blocks(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                            num_blocks=num_blocks)
    return jnp.stack([r.cu[:-1], r.q_len, r.start, init], axis=1).astype(jnp.int32)


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=tiles.dot_precision(F32))


def _load(ref, idx, mask):
    """A masked load as float32, zeros where masked (masked slots are never read: they may hold anything)."""
    return plgpu.load(ref.at[idx], mask=mask, other=0).astype(F32)


def _last_row(m, c):
    """Row n - 1 of a register matrix m `[n, n]` (no static slicing of register tensors in Triton)."""
    return jnp.sum(jnp.where(c[:, None] == m.shape[0] - 1, m, 0.0), axis=0)


def _unit_lower_inverse(a, c):
    """(I + a)^-1 for a strictly lower triangular `[n, n]`, by forward substitution: row i of the inverse is
    e_i - sum_{j<i} a_ij (row j), rows taken in order. Backward stable: the inverse of the delta rule's system stays
    bounded (the recurrence is a contraction for unit keys and beta in [0, 1]) while the powers of a need not."""
    rows = c[:, None]
    eye = jnp.where(rows == c[None, :], 1.0, 0.0)

    def body(i, inv):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)
        return jnp.where(rows == i, inv - jnp.sum(a_i[:, None] * inv, axis=0)[None, :], inv)

    return lax.fori_loop(1, a.shape[0], body, eye)


def _walk(seq, meta_ref, table_ref, state, piece, store_state, *, chunk: int, block_size: int):
    """Walks sequence seq's rows piece by piece (a piece ends at the next multiple of chunk or block_size, or at the
    step's end): state = piece(state, first row, length); after each piece store_state(state, block, owed) with the
    block of its last position, owed when the piece ends a block or the step."""
    row0, q_len, start = meta_ref[seq, 0], meta_ref[seq, 1], meta_ref[seq, 2]
    end = start + q_len
    max_blocks = table_ref.shape[1]

    def body(carry):
        cur, state = carry
        nxt = jnp.minimum(end, jnp.minimum((cur // chunk + 1) * chunk, (cur // block_size + 1) * block_size))
        state = piece(state, row0 + cur - start, nxt - cur)
        block = table_ref[seq, jnp.clip((nxt - 1) // block_size, 0, max_blocks - 1)]
        store_state(state, block, (nxt % block_size == 0) | (nxt == end))
        return nxt, state

    return lax.while_loop(lambda carry: carry[0] < end, body, (start, state))[1]


def _state_tile(pages_in, pages_out, head, rows, cols, mask):
    """(initial state loader, state storer) of one program's state tile pages[:, head, rows, cols] (mask: its real
    extent); block ids are clipped into the pool, so a malformed table cannot reach outside it."""
    num_blocks = pages_in.shape[0]
    idx = lambda block: (jnp.clip(block, 0, num_blocks - 1), head, rows[:, None], cols[None, :])

    def load(block):  # block -1: zeros (nothing read)
        return plgpu.load(pages_in.at[idx(block)], mask=mask & (block >= 0), other=0.0)

    def store(state, block, owed):
        plgpu.store(pages_out.at[idx(block)], state, mask=mask & owed)

    return load, store


# ---- gated delta rule ------------------------------------------------------------------------------------------


def _gdn_kernel(meta_ref, table_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pages_in, o_ref, pages_out, *, form: str,
                ratio: int, head_k: int, dk_pad: int, head_v: int, block_v: int, chunk: int, block_size: int,
                scale: float, use_qk_l2norm: bool):
    """meta_ref i32[S, 4] (`seq_metadata`); table_ref i32[S, max_blocks]; q_ref, k_ref [T, Hk, Dk]; v_ref, o_ref
    [T, Hv, Dv]; g_ref, beta_ref f32[T, Hv]; pages_in = pages_out f32[num_blocks, Hv, Dk, Dv] (aliased). Program
    (s, h, t): sequence s, v head h (q/k head h // ratio), state columns t * block_v ...."""
    seq, head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dk = jnp.arange(dk_pad, dtype=jnp.int32)
    dv = tile * block_v + jnp.arange(block_v, dtype=jnp.int32)
    dk_ok, dv_ok = dk < head_k, dv < head_v
    load_state, store_state = _state_tile(pages_in, pages_out, head, dk, dv, dk_ok[:, None] & dv_ok[None, :])
    kh = head // ratio

    def qk(q, k):
        if use_qk_l2norm:
            q, k = R.l2norm(q), R.l2norm(k)
        return q * scale, k

    if form == "recurrent":
        row0, q_len, start = meta_ref[seq, 0], meta_ref[seq, 1], meta_ref[seq, 2]
        max_blocks = table_ref.shape[1]

        def token(n, state):  # state [Dk, block_v]
            row = row0 + n
            pos = start + n
            q, k = qk(_load(q_ref, (row, kh, dk), dk_ok), _load(k_ref, (row, kh, dk), dk_ok))
            v = _load(v_ref, (row, head, dv), dv_ok)
            state = state * jnp.exp(g_ref[row, head])
            u = beta_ref[row, head] * (v - jnp.sum(state * k[:, None], axis=0))
            state = state + k[:, None] * u[None, :]
            plgpu.store(o_ref.at[row, head, dv], jnp.sum(state * q[:, None], axis=0).astype(o_ref.dtype),
                        mask=dv_ok)
            block = table_ref[seq, jnp.clip(pos // block_size, 0, max_blocks - 1)]
            store_state(state, block, (pos % block_size == block_size - 1) | (n == q_len - 1))
            return state

        lax.fori_loop(0, q_len, token, load_state(meta_ref[seq, 3]))
        return

    c = jnp.arange(chunk, dtype=jnp.int32)
    below, causal = c[:, None] > c[None, :], c[:, None] >= c[None, :]

    def piece(state, row0, length):  # state [Dk, block_v]; rows past length load zeros and add nothing
        rows, ok = row0 + c, c < length
        qk_mask = ok[:, None] & dk_ok[None, :]
        q, k = qk(_load(q_ref, (rows[:, None], kh, dk[None, :]), qk_mask),
                  _load(k_ref, (rows[:, None], kh, dk[None, :]), qk_mask))
        v_mask = ok[:, None] & dv_ok[None, :]
        v = _load(v_ref, (rows[:, None], head, dv[None, :]), v_mask)
        g = _load(g_ref, (rows, head), ok)
        beta = _load(beta_ref, (rows, head), ok)
        seg = jnp.cumsum(jnp.where(below, g[:, None], 0.0), axis=0)  # seg[i, j] = g_{j+1} + ... + g_i
        decay = jnp.where(causal, jnp.exp(seg), 0.0)
        cum = jnp.exp(jnp.cumsum(g))
        kb = k * beta[:, None]
        inv = _unit_lower_inverse(jnp.where(below, _dot(kb, k, trans_b=True) * decay, 0.0), c)
        u = _dot(inv, v * beta[:, None]) - _dot(_dot(inv, kb * cum[:, None]), state)
        o = _dot(q * cum[:, None], state) + _dot(_dot(q, k, trans_b=True) * decay, u)
        plgpu.store(o_ref.at[rows[:, None], head, dv[None, :]], o.astype(o_ref.dtype), mask=v_mask)
        tail = jnp.exp(_last_row(seg, c))  # exp(g_{j+1} + ... + g_last)
        return jnp.exp(jnp.sum(g)) * state + _dot(k * tail[:, None], u, trans_a=True)

    _walk(seq, meta_ref, table_ref, load_state(meta_ref[seq, 3]), piece, store_state, chunk=chunk,
          block_size=block_size)


def _zero_padding_rows(out, cu_q_lens):
    """Rows at or past cu_q_lens[-1] belong to no sequence: no program writes them; they are zeros."""
    t = jnp.arange(out.shape[0], dtype=jnp.int32)
    keep = (t < jnp.clip(cu_q_lens[-1], 0, out.shape[0])).reshape(-1, *([1] * (out.ndim - 1)))
    return jnp.where(keep, out, jnp.zeros((), out.dtype))


@functools.partial(jax.jit, static_argnames=("block_size", "use_qk_l2norm", "scale", "form", "chunk", "block_v",
                                             "interpret", "num_warps", "num_stages"), donate_argnames=())
def _gated_delta_rule(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                      use_qk_l2norm: bool, scale: float, form: str, chunk: int, block_v: int, interpret: bool,
                      num_warps: int, num_stages: int):
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    num_seqs = block_tables.shape[0]
    meta = seq_metadata(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                        num_blocks=state_pages.shape[0])
    dk_pad = tiles.next_pow2(head_k) if form == "recurrent" else tiles.padded_head_dim(head_k)
    kernel = functools.partial(_gdn_kernel, form=form, ratio=num_v_heads // num_k_heads, head_k=head_k, dk_pad=dk_pad,
                               head_v=head_v, block_v=block_v, chunk=chunk, block_size=block_size, scale=scale,
                               use_qk_l2norm=use_qk_l2norm)
    out, pages = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_v_heads, tiles.cdiv(head_v, block_v)),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(state_pages.shape, F32)),
        input_output_aliases={7: 1},
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"gated_delta_rule_{form}_c{chunk}_v{block_v}",
    )(meta, block_tables, q, k, v, g, beta, state_pages)
    return _zero_padding_rows(out, cu_q_lens), pages


def check_chunk(form: str, chunk_size: int) -> None:
    """The chunked kernels tile a piece as `[chunk_size, ...]` matrices for tl.dot: a power of two >= 16."""
    V.check_pow2_option("chunk_size", chunk_size)
    if form == "chunked" and chunk_size < tiles.MIN_DOT_DIM:
        raise ValueError(f"target 'gpu' needs chunk_size >= {tiles.MIN_DOT_DIM} for the chunked form (tl.dot), got "
                         f"{chunk_size}")


def check_block(name: str, value: int | None, form: str) -> None:
    V.check_pow2_option(name, value)
    if value is not None and form == "chunked" and value < tiles.MIN_DOT_DIM:
        raise ValueError(f"target 'gpu' needs {name} >= {tiles.MIN_DOT_DIM} for the chunked form (tl.dot), got "
                         f"{value}")


def default_block(dim: int, form: str) -> int:
    """State columns per program: 8 in the recurrent form (many small programs for a decode batch, as the FLA
    library's fused recurrent kernel), 32 in the chunked form (at least 16: tl.dot); never past the padded
    dimension. Modeled on FLA's choices, not tuned on a GPU here."""
    if form == "recurrent":
        return min(8, tiles.next_pow2(dim))
    return max(tiles.MIN_DOT_DIM, min(32, tiles.next_pow2(dim)))


def default_num_warps(form: str) -> int:
    """1 warp for the recurrent form's small vector programs, 4 for the chunked form's matmuls."""
    return 1 if form == "recurrent" else 4


def gated_delta_rule_gpu(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                         use_qk_l2norm: bool, scale: float, form: str, chunk_size: int, block_v: int | None,
                         interpret: bool | None, num_warps: int | None, num_stages: int):
    """The GPU kernels behind `pallas_kernels.gated_delta_rule(..., target="gpu")`, which has validated the
    arguments. Checks the GPU tile rules, fills in the defaults and runs the form's kernel."""
    check_chunk(form, chunk_size)
    check_block("block_v", block_v, form)
    if R.empty_step(q.shape[0], block_tables):
        return jnp.zeros(v.shape, q.dtype), state_pages
    return _gated_delta_rule(
        q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
        use_qk_l2norm=use_qk_l2norm, scale=scale, form=form, chunk=int(chunk_size),
        block_v=int(block_v or default_block(v.shape[2], form)), interpret=C.resolve_interpret(interpret),
        num_warps=int(num_warps or default_num_warps(form)), num_stages=int(num_stages))


# ---- Mamba-2 SSD -----------------------------------------------------------------------------------------------


def _ssd_kernel(meta_ref, table_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, *refs, form: str, ratio: int,
                head_dim: int, block_p: int, state_size: int, n_pad: int, chunk: int, block_size: int, has_d: bool):
    """meta_ref i32[S, 4] (`seq_metadata`); table_ref i32[S, max_blocks]; x_ref, y_ref [T, H, P]; dt_ref f32[T, H];
    a_ref f32[H]; b_ref, c_ref [T, G, N]; refs = (d_ref f32[H] with has_d, pages_in, y_ref, pages_out), pages
    f32[num_blocks, H, P, N] (aliased). Program (s, h, t): sequence s, head h (group h // ratio), state rows
    t * block_p ...."""
    d_ref = refs[0] if has_d else None
    pages_in, y_ref, pages_out = refs[-3:]
    seq, head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    p = tile * block_p + jnp.arange(block_p, dtype=jnp.int32)
    n = jnp.arange(n_pad, dtype=jnp.int32)
    p_ok, n_ok = p < head_dim, n < state_size
    load_state, store_state = _state_tile(pages_in, pages_out, head, p, n, p_ok[:, None] & n_ok[None, :])
    group = head // ratio
    decay_rate = a_ref[head]
    skip = d_ref[head] if has_d else 0.0

    if form == "recurrent":
        row0, q_len, start = meta_ref[seq, 0], meta_ref[seq, 1], meta_ref[seq, 2]
        max_blocks = table_ref.shape[1]

        def token(i, state):  # state [block_p, N]
            row = row0 + i
            pos = start + i
            x = _load(x_ref, (row, head, p), p_ok)
            step = dt_ref[row, head]
            b = _load(b_ref, (row, group, n), n_ok)
            state = state * jnp.exp(step * decay_rate) + step * x[:, None] * b[None, :]
            y = jnp.sum(state * _load(c_ref, (row, group, n), n_ok)[None, :], axis=1) + skip * x
            plgpu.store(y_ref.at[row, head, p], y.astype(y_ref.dtype), mask=p_ok)
            block = table_ref[seq, jnp.clip(pos // block_size, 0, max_blocks - 1)]
            store_state(state, block, (pos % block_size == block_size - 1) | (i == q_len - 1))
            return state

        lax.fori_loop(0, q_len, token, load_state(meta_ref[seq, 3]))
        return

    c = jnp.arange(chunk, dtype=jnp.int32)
    below, causal = c[:, None] > c[None, :], c[:, None] >= c[None, :]

    def piece(state, row0, length):  # state [block_p, N]; rows past length load zeros and add nothing
        rows, ok = row0 + c, c < length
        x = _load(x_ref, (rows[:, None], head, p[None, :]), ok[:, None] & p_ok[None, :])
        step = _load(dt_ref, (rows, head), ok)
        bc_mask = ok[:, None] & n_ok[None, :]
        b = _load(b_ref, (rows[:, None], group, n[None, :]), bc_mask)
        cm = _load(c_ref, (rows[:, None], group, n[None, :]), bc_mask)
        a = step * decay_rate
        seg = jnp.cumsum(jnp.where(below, a[:, None], 0.0), axis=0)  # seg[i, j] = a_{j+1} + ... + a_i
        scores = _dot(cm, b, trans_b=True) * jnp.where(causal, jnp.exp(seg), 0.0) * step[None, :]
        y = (_dot(scores, x) + jnp.exp(jnp.cumsum(a))[:, None] * _dot(cm, state, trans_b=True) + skip * x)
        plgpu.store(y_ref.at[rows[:, None], head, p[None, :]], y.astype(y_ref.dtype),
                    mask=ok[:, None] & p_ok[None, :])
        weight = step * jnp.exp(_last_row(seg, c))  # dt_j exp(a_{j+1} + ... + a_last)
        return jnp.exp(jnp.sum(a)) * state + _dot(x * weight[:, None], b, trans_a=True)

    _walk(seq, meta_ref, table_ref, load_state(meta_ref[seq, 3]), piece, store_state, chunk=chunk,
          block_size=block_size)


@functools.partial(jax.jit, static_argnames=("block_size", "form", "chunk", "block_p", "interpret", "num_warps",
                                             "num_stages"))
def _mamba2_ssd(x, dt, a, b, c, d, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, form: str,
                chunk: int, block_p: int, interpret: bool, num_warps: int, num_stages: int):
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = b.shape[1:]
    meta = seq_metadata(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                        num_blocks=state_pages.shape[0])
    n_pad = tiles.next_pow2(state_size) if form == "recurrent" else tiles.padded_head_dim(state_size)
    kernel = functools.partial(_ssd_kernel, form=form, ratio=num_heads // num_groups, head_dim=head_dim,
                               block_p=block_p, state_size=state_size, n_pad=n_pad, chunk=chunk, block_size=block_size,
                               has_d=d is not None)
    inputs = (meta, block_tables, x, dt, a, b, c, *(() if d is None else (d,)), state_pages)
    y, pages = pl.pallas_call(
        kernel,
        grid=(block_tables.shape[0], num_heads, tiles.cdiv(head_dim, block_p)),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(state_pages.shape, F32)),
        input_output_aliases={len(inputs) - 1: 1},
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"mamba2_ssd_{form}_c{chunk}_p{block_p}",
    )(*inputs)
    return _zero_padding_rows(y, cu_q_lens), pages


def mamba2_ssd_gpu(x, dt, a, b, c, d, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, form: str,
                   chunk_size: int, block_p: int | None, interpret: bool | None, num_warps: int | None,
                   num_stages: int):
    """The GPU kernels behind `pallas_kernels.mamba2_ssd(..., target="gpu")`, which has validated the arguments.
    Checks the GPU tile rules, fills in the defaults and runs the form's kernel."""
    check_chunk(form, chunk_size)
    check_block("block_p", block_p, form)
    if R.empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), state_pages
    return _mamba2_ssd(x, dt, a, b, c, d, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
                       form=form, chunk=int(chunk_size), block_p=int(block_p or default_block(x.shape[2], form)),
                       interpret=C.resolve_interpret(interpret), num_warps=int(num_warps or default_num_warps(form)),
                       num_stages=int(num_stages))


# ---- causal conv1d ---------------------------------------------------------------------------------------------

CONV_META = 5  # conv_metadata's columns: sequence, first row, rows, the sequence's first row, snapshot block (-1)


def conv_metadata(kv_lens, cu_q_lens, block_tables, *, num_tokens: int, block_t: int, block_size: int,
                  num_blocks: int):
    """int32 `[NP, 5]`: the step's pieces of at most block_t rows cut at block boundaries (`recurrent.pieces`), each
    (sequence, first row, rows, its sequence's first row, block owed its snapshot or -1)."""
    p = R.pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=block_t, block_size=block_size,
                 num_blocks=num_blocks)
    first = jnp.clip(cu_q_lens, 0, num_tokens)[p.seq]
    return jnp.stack([p.seq, p.row0, p.length, first, p.write], axis=1).astype(jnp.int32)


def _conv_kernel(meta_ref, x_ref, w_ref, *refs, taps: int, channels: int, block_t: int, block_c: int, has_bias: bool,
                 activation: str | None):
    """meta_ref i32[NP, 5] (`conv_metadata`); x_ref, o_ref [T, C]; w_ref [C, K]; refs = (bias_ref [C] with has_bias,
    init_ref [S, C, K - 1] (the sequences' initial conv states), pages_in, o_ref, pages_out), pages [num_blocks, C,
    K - 1] in x's dtype (aliased; only written). Program (i, j): piece i, channels j * block_c ...."""
    bias_ref = refs[0] if has_bias else None
    init_ref, _, o_ref, pages_out = refs[-4:]
    piece, tile = pl.program_id(0), pl.program_id(1)
    seq, row0, length, first, owed = (meta_ref[piece, col] for col in range(CONV_META))
    ch = tile * block_c + jnp.arange(block_c, dtype=jnp.int32)
    ch_ok = ch < channels
    width = taps - 1

    def inputs(src, ok):
        """The inputs at rows src i32[n] (ok: which are wanted) as f32 `[n, block_c]`: the step's row where it is in
        the sequence's step, else the initial state's slot of that position."""
        in_step = src >= first
        from_x = _load(x_ref, (src[:, None], ch[None, :]), (ok & in_step)[:, None] & ch_ok[None, :])
        slot = jnp.clip(src - first + width, 0, width - 1)
        from_state = _load(init_ref, (seq, ch[None, :], slot[:, None]), (ok & ~in_step)[:, None] & ch_ok[None, :])
        return jnp.where(in_step[:, None], from_x, from_state)

    t = jnp.arange(block_t, dtype=jnp.int32)
    rows, ok = row0 + t, t < length
    acc = jnp.zeros((block_t, block_c), F32)
    if has_bias:
        acc = acc + _load(bias_ref, (ch,), ch_ok)[None, :]
    for i in range(taps):  # tap i reads the input K - 1 - i positions back
        acc = acc + _load(w_ref, (ch, i), ch_ok)[None, :] * inputs(rows - width + i, ok)
    if activation == "silu":
        acc = acc * jax.nn.sigmoid(acc)
    plgpu.store(o_ref.at[rows[:, None], ch[None, :]], acc.astype(o_ref.dtype), mask=ok[:, None] & ch_ok[None, :])
    # The snapshot owed at the piece's end: its last K - 1 inputs, oldest first (slot j: row end - K + 1 + j).
    j = jnp.arange(tiles.next_pow2(width), dtype=jnp.int32)
    j_ok = j < width
    snap = inputs(row0 + length - width + j, j_ok & (owed >= 0))
    block = jnp.clip(owed, 0, pages_out.shape[0] - 1)
    plgpu.store(pages_out.at[block, ch[None, :], j[:, None]], snap.astype(pages_out.dtype),
                mask=(owed >= 0) & j_ok[:, None] & ch_ok[None, :])


@functools.partial(jax.jit, static_argnames=("block_size", "activation", "block_t", "block_c", "interpret",
                                             "num_warps", "num_stages"))
def _causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                   activation: str | None, block_t: int, block_c: int, interpret: bool, num_warps: int,
                   num_stages: int):
    num_tokens, channels = x.shape
    num_blocks = conv_state_pages.shape[0]
    meta = conv_metadata(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_t=block_t,
                         block_size=block_size, num_blocks=num_blocks)
    # The initial states are gathered here, before the kernel writes any page: a program may owe a snapshot to the
    # block another program of the same sequence reads its initial state from.
    init = R.gather_initial(conv_state_pages, R.initial_blocks(kv_lens, cu_q_lens, block_tables,
                                                               num_tokens=num_tokens, block_size=block_size,
                                                               num_blocks=num_blocks))
    kernel = functools.partial(_conv_kernel, taps=weight.shape[1], channels=channels, block_t=block_t,
                               block_c=block_c, has_bias=bias is not None, activation=activation)
    inputs = (meta, x, weight, *(() if bias is None else (bias,)), init, conv_state_pages)
    out, pages = pl.pallas_call(
        kernel,
        grid=(meta.shape[0], tiles.cdiv(channels, block_c)),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(conv_state_pages.shape, x.dtype)),
        input_output_aliases={len(inputs) - 1: 1},
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"causal_conv1d_t{block_t}_c{block_c}" + ("_silu" if activation else ""),
    )(*inputs)
    return _zero_padding_rows(out, cu_q_lens), pages


def causal_conv1d_gpu(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                      activation: str | None, block_t: int | None, block_c: int | None, interpret: bool | None,
                      num_warps: int | None, num_stages: int):
    """The GPU kernel behind `pallas_kernels.causal_conv1d(..., target="gpu")`, which has validated the arguments.
    Checks the tile rules (powers of two), fills in the defaults (32 rows, 128 channels: 16 KiB of float32
    accumulator per program) and runs it."""
    V.check_pow2_option("block_t", block_t)
    V.check_pow2_option("block_c", block_c)
    if R.empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), conv_state_pages
    return _causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
                          activation=activation, block_t=int(block_t or 32),
                          block_c=int(block_c or min(128, tiles.next_pow2(x.shape[1]))),
                          interpret=C.resolve_interpret(interpret), num_warps=int(num_warps or 4),
                          num_stages=int(num_stages))
