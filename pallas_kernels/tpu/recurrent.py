"""Recurrent-state layers over paged state snapshots on TPUs, in Pallas (Mosaic): the gated delta rule and Mamba-2's
SSD scan in chunk form, and the causal depthwise conv1d. The contract is `pallas_kernels.recurrent`'s.

Gated delta rule and SSD: the wrapper cuts the step into pieces (`recurrent.pieces`: never across a block boundary
or a multiple of the chunk) and gathers each piece's rows into tile-aligned `[pieces, heads, chunk, dim]` float32
arrays (rows past a piece's end are zeros; q is normalised and scaled here, which XLA fuses into the gather: these
are q-sized copies, the pages are never copied). The grid is (head, piece): heads parallel, pieces "arbitrary",
i.e. in order on one core, so the state stays in a VMEM scratch from one piece to the next. A piece that starts its
sequence first DMAs the sequence's initial block into that scratch (or zeroes it); a piece that owes a snapshot DMAs
the scratch into its block after computing it (the pages are aliased input to output, in HBM; every DMA is waited on
before the next step reads or writes the scratch). The pieces' inputs and outputs are ordinary pipelined VMEM blocks.
Pieces past the real ones compute nothing.

A piece is computed with matrix-unit products and (chunk, chunk) element-wise ops only:
  * segment sums seg[i, j] = a_{j+1} + ... + a_i as one matmul of a lower-triangular ones matrix with the masked
    log-decays (no cumulative sum in Mosaic; HIGHEST precision keeps it float32-exact), and the cumulative sums
    from the piece's start as seg[:, 0] + a_0;
  * transposes as NT products with an identity (`_transpose`: products with ones, exact at HIGHEST precision), so
    that every matmul is an NN or NT product, the forms the attention kernels use;
  * the delta rule's (I + A)^-1 by forward substitution, one row per iteration, with columns of A^T taken by lane
    reductions (no single-row matmuls).
Decode-shaped steps ("recurrent" form) run the same kernel on pieces of one sublane tile (8 rows): a token-by-token
walk would need the same vector-matrix products, and the state's DMA in and out dominates either way.

Causal conv1d: the wrapper gathers each piece's rows with the K - 1 inputs before it (from the step, or the
sequence's initial conv state) into `[pieces, rows, channels]` windows; the grid (piece, channel tile) is all
parallel, and each program sums its K taps as sublane rotations of its window. The snapshots are copies of inputs
without arithmetic, in the pages' channel-major `[C, K - 1]` layout (the transpose of the kernel's time-major
tiles): the wrapper scatters them with XLA.

Everything is float32 inside (bfloat16 inputs are widened by the wrapper's gather). Nothing here is public API; the
entry points with target="tpu" are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import pieces as R
from pallas_kernels.tpu import _common as T

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
PIECE_META = 4  # piece_metadata's columns: starts its sequence, initial block (-1: zeros), snapshot block (-1), rows
RECURRENT_CHUNK = T.SUBLANES  # the decode-shaped steps' pieces: one float32 sublane tile


def _nn(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)


def _nt(a, b):
    """a `[m, k]` times b `[n, k]` transposed: `[m, n]`."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)


def _iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _transpose(x):
    """x `[m, n]` transposed, as the NT product of the identity `[n, n]` with x (each entry a product with one)."""
    n = x.shape[1]
    return _nt(jnp.where(_iota((n, n), 0) == _iota((n, n), 1), 1.0, 0.0), x)


def _segment_sums(a_col):
    """Log-decays a `[C, 1]` (zeros past the piece's end) -> (seg `[C, C]`, seg[i, j] = a_{j+1} + ... + a_i for
    i >= j, zero above the diagonal; cum `[C, 1]`, a_0 + ... + a_i)."""
    c = a_col.shape[0]
    i, j = _iota((c, c), 0), _iota((c, c), 1)
    seg = _nn(jnp.where(i >= j, 1.0, 0.0), jnp.where(i > j, a_col, 0.0))
    return seg, seg[:, 0:1] + a_col[0:1, :]


def piece_metadata(p: R.Pieces, initial: jax.Array) -> jax.Array:
    """int32 `[NP * 4]` (flat, for SMEM): per piece (starts its sequence, its sequence's initial block or -1,
    snapshot block or -1, rows)."""
    init = jnp.where(p.first, initial[p.seq], -1)
    return jnp.stack([p.first.astype(jnp.int32), init, p.write, p.length], axis=1).astype(jnp.int32).reshape(-1)


def _carry_state(meta_ref, pages_in, state_ref, sem, head, piece):
    """Sets up the state scratch for this piece: a piece that starts its sequence DMAs its initial block in (or zeroes
    the scratch); any other continues from the previous piece's end state, already there."""
    first, init = meta_ref[piece * PIECE_META], meta_ref[piece * PIECE_META + 1]

    @pl.when(first == 1)
    def _():
        state_ref[...] = jnp.zeros(state_ref.shape, F32)

        @pl.when(init >= 0)
        def _():
            copy = pltpu.make_async_copy(pages_in.at[init, head], state_ref, sem)
            copy.start()
            copy.wait()


def _store_snapshot(meta_ref, pages_out, state_ref, sem, head, piece):
    block = meta_ref[piece * PIECE_META + 2]

    @pl.when(block >= 0)
    def _():
        copy = pltpu.make_async_copy(state_ref, pages_out.at[block, head], sem)
        copy.start()
        copy.wait()


# ---- gated delta rule ------------------------------------------------------------------------------------------


def _gdn_kernel(meta_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pages_in, o_ref, pages_out, state_ref, sem):
    """meta_ref i32[NP * 4] (SMEM, `piece_metadata`); q_ref, k_ref [C, Dk] (q normalised and scaled), v_ref, o_ref
    [C, Dv], g_ref, beta_ref [C, 1] (the piece's rows of head h, zeros past its end); pages_in = pages_out f32
    [num_blocks, Hv, Dk, Dv] (HBM, aliased); state_ref f32[Dk, Dv] (VMEM scratch), sem a DMA semaphore."""
    head, piece = pl.program_id(0), pl.program_id(1)

    @pl.when(meta_ref[piece * PIECE_META + 3] > 0)
    def _():
        _carry_state(meta_ref, pages_in, state_ref, sem, head, piece)
        q, k, v, g, beta = q_ref[...], k_ref[...], v_ref[...], g_ref[...], beta_ref[...]
        state = state_ref[...]
        c = g.shape[0]
        i, j = _iota((c, c), 0), _iota((c, c), 1)
        seg, cum = _segment_sums(g)
        decay = jnp.where(i >= j, jnp.exp(seg), 0.0)
        kb = k * beta
        a_t = _transpose(jnp.where(i > j, _nt(kb, k) * decay, 0.0))  # A^T: column i of it is row i of A

        def substitute(n, inv):  # row n of (I + A)^-1 = e_n - sum_{m<n} A[n, m] (row m)
            a_n = jnp.sum(jnp.where(j == n, a_t, 0.0), axis=1, keepdims=True)  # [C, 1]
            return jnp.where(i == n, inv - jnp.sum(a_n * inv, axis=0, keepdims=True), inv)

        inv = lax.fori_loop(1, c, substitute, jnp.where(i == j, 1.0, 0.0))
        u = _nn(inv, v * beta) - _nn(_nn(inv, kb * jnp.exp(cum)), state)
        o_ref[...] = _nn(q * jnp.exp(cum), state) + _nn(_nt(q, k) * decay, u)
        tail = jnp.exp(seg[c - 1:c, :])  # [1, C]: exp(g_{j+1} + ... + g_last)
        state_ref[...] = jnp.exp(cum[c - 1:c, :]) * state + _nn(_transpose(k) * tail, u)
        _store_snapshot(meta_ref, pages_out, state_ref, sem, head, piece)


def _heads_first(x, slots, valid):
    """`[T, H, ...]` -> the pieces' rows `[NP, H, C, ...]` float32 (zeros past each piece's end)."""
    return jnp.moveaxis(R.gather_pieces(x.astype(F32), slots, valid), 2, 1)


def _piece_call(kernel, p, initial, blocks, state_pages, out_shape, state_shape, *, interpret, name, smem=()):
    """The (head, piece) pallas_call shared by the delta rule and the SSD. Inputs: the piece metadata (scalar
    prefetch), `smem` (small float32 vectors, whole in SMEM), blocks = ((array `[NP, heads, ...]`, block shape, head
    map: grid head -> the array's head), ...) as pipelined VMEM blocks, then the pages (HBM), aliased to the second
    output. Outputs (`out_shape` float32 `[NP, heads, C, width]`, the pages)."""
    num_heads = state_pages.shape[1]
    arrays = [array for array, _, _ in blocks]
    specs = [pl.BlockSpec((None, None, *shape), lambda h, n, *_, hm=head_map: (n, hm(h), 0, 0))
             for _, shape, head_map in blocks]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_heads, p.first.shape[0]),
        in_specs=[*(pl.BlockSpec(memory_space=pltpu.SMEM) for _ in smem), *specs, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[pl.BlockSpec((None, None, *out_shape[2:]), lambda h, n, *_: (n, h, 0, 0)),
                   pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(state_shape, F32), pltpu.SemaphoreType.DMA(())],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct(out_shape, F32), jax.ShapeDtypeStruct(state_pages.shape, F32)),
        input_output_aliases={1 + len(smem) + len(arrays): 1},  # after the metadata, the SMEM vectors, the blocks
        interpret=interpret,
        # Heads are independent; pieces carry the state from one to the next, in order.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name=name,
    )(piece_metadata(p, initial), *smem, *arrays, state_pages)


@functools.partial(jax.jit, static_argnames=("block_size", "use_qk_l2norm", "scale", "chunk", "interpret"))
def _gated_delta_rule(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                      use_qk_l2norm: bool, scale: float, chunk: int, interpret):
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    ratio = num_v_heads // num_k_heads
    num_blocks = state_pages.shape[0]
    p = R.pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=chunk, block_size=block_size,
                 num_blocks=num_blocks)
    initial = R.initial_blocks(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                               num_blocks=num_blocks)
    slots, valid = R.piece_rows(p, chunk, num_tokens)
    q, k = R.prepare_qk(q, k, use_qk_l2norm=use_qk_l2norm, scale=scale)
    # Heads are non-negative: lax.div (truncating) is the floor division, without the sign fix-ups of //.
    same, shared = (lambda h: h), (lambda h: lax.div(h, ratio))  # v heads; the q/k head of v head h
    pieces_of = lambda x: _heads_first(x, slots, valid)
    blocks = [(pieces_of(q), (chunk, head_k), shared), (pieces_of(k), (chunk, head_k), shared),
              (pieces_of(v), (chunk, head_v), same), (pieces_of(g[..., None]), (chunk, 1), same),
              (pieces_of(beta[..., None]), (chunk, 1), same)]
    num_pieces = p.first.shape[0]
    outs, pages = _piece_call(_gdn_kernel, p, initial, blocks, state_pages,
                              (num_pieces, num_v_heads, chunk, head_v), (head_k, head_v), interpret=interpret,
                              name=f"gated_delta_rule_tpu_c{chunk}")
    return R.scatter_rows(jnp.moveaxis(outs, 1, 2), slots, valid, num_tokens, v.dtype), pages


def check_chunk(chunk_size: int) -> None:
    """A piece is one `[chunk_size, ...]` float32 block: whole sublane tiles (a multiple of 8)."""
    if chunk_size % T.SUBLANES:
        raise ValueError(f"target 'tpu' needs chunk_size to be a multiple of {T.SUBLANES} (a piece's rows are whole "
                         f"float32 sublane tiles), got {chunk_size}")


def resolve_chunk(form: str, chunk_size: int) -> int:
    """The rows of a piece: chunk_size for the chunked form, one sublane tile (8) for decode-shaped steps."""
    check_chunk(chunk_size)
    return RECURRENT_CHUNK if form == "recurrent" else int(chunk_size)


def gated_delta_rule_tpu(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                         use_qk_l2norm: bool, scale: float, form: str, chunk_size: int, interpret):
    """The TPU kernel behind `pallas_kernels.gated_delta_rule(..., target="tpu")`, which has validated the arguments.
    Checks the TPU rules (float32 or bfloat16 inputs, chunk_size a multiple of 8) and runs the kernel with pieces of
    chunk_size rows (8 for the recurrent form)."""
    T.check_dtype(q.dtype)
    chunk = resolve_chunk(form, chunk_size)
    if R.empty_step(q.shape[0], block_tables):
        return jnp.zeros(v.shape, q.dtype), state_pages
    return _gated_delta_rule(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
                             use_qk_l2norm=use_qk_l2norm, scale=scale, chunk=chunk,
                             interpret=T.resolve_interpret(interpret))


# ---- Mamba-2 SSD -----------------------------------------------------------------------------------------------


def _ssd_kernel(meta_ref, a_ref, d_ref, x_ref, dt_ref, b_ref, c_ref, pages_in, y_ref, pages_out, state_ref, sem):
    """meta_ref i32[NP * 4] (SMEM, `piece_metadata`); a_ref, d_ref f32[H] (SMEM: A, and D or zeros); x_ref, y_ref
    [C, P], dt_ref [C, 1], b_ref, c_ref [C, N] (the piece's rows of head h and its group, zeros past its end);
    pages_in = pages_out f32[num_blocks, H, P, N] (HBM, aliased); state_ref f32[P, N] (VMEM scratch)."""
    head, piece = pl.program_id(0), pl.program_id(1)

    @pl.when(meta_ref[piece * PIECE_META + 3] > 0)
    def _():
        _carry_state(meta_ref, pages_in, state_ref, sem, head, piece)
        x, dt, b, cm = x_ref[...], dt_ref[...], b_ref[...], c_ref[...]
        state = state_ref[...]
        c = dt.shape[0]
        seg, cum = _segment_sums(dt * a_ref[head])
        scores = _nt(cm, b) * jnp.where(_iota((c, c), 0) >= _iota((c, c), 1), jnp.exp(seg), 0.0)
        xd = x * dt  # row j scaled by dt_j: the input of the state update
        y_ref[...] = _nn(scores, xd) + jnp.exp(cum) * _nt(cm, state) + d_ref[head] * x
        tail = jnp.exp(seg[c - 1:c, :])  # [1, C]: exp(a_{j+1} + ... + a_last)
        state_ref[...] = jnp.exp(cum[c - 1:c, :]) * state + _nn(_transpose(xd) * tail, b)
        _store_snapshot(meta_ref, pages_out, state_ref, sem, head, piece)


@functools.partial(jax.jit, static_argnames=("block_size", "chunk", "interpret"))
def _mamba2_ssd(x, dt, a, b, c, d, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, chunk: int,
                interpret):
    num_tokens, num_heads, head_dim = x.shape
    ratio = num_heads // b.shape[1]
    state_size = b.shape[2]
    num_blocks = state_pages.shape[0]
    p = R.pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=chunk, block_size=block_size,
                 num_blocks=num_blocks)
    initial = R.initial_blocks(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                               num_blocks=num_blocks)
    slots, valid = R.piece_rows(p, chunk, num_tokens)
    same, grouped = (lambda h: h), (lambda h: lax.div(h, ratio))
    pieces_of = lambda z: _heads_first(z, slots, valid)
    blocks = [(pieces_of(x), (chunk, head_dim), same), (pieces_of(dt[..., None]), (chunk, 1), same),
              (pieces_of(b), (chunk, state_size), grouped), (pieces_of(c), (chunk, state_size), grouped)]
    d = jnp.zeros((num_heads,), F32) if d is None else d
    outs, pages = _piece_call(
        _ssd_kernel, p, initial, blocks, state_pages, (p.first.shape[0], num_heads, chunk, head_dim),
        (head_dim, state_size), interpret=interpret, name=f"mamba2_ssd_tpu_c{chunk}", smem=(a, d))
    return R.scatter_rows(jnp.moveaxis(outs, 1, 2), slots, valid, num_tokens, x.dtype), pages


def mamba2_ssd_tpu(x, dt, a, b, c, d, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int, form: str,
                   chunk_size: int, interpret):
    """The TPU kernel behind `pallas_kernels.mamba2_ssd(..., target="tpu")`, which has validated the arguments.
    Checks the TPU rules (float32 or bfloat16 inputs, chunk_size a multiple of 8) and runs the kernel with pieces of
    chunk_size rows (8 for the recurrent form)."""
    T.check_dtype(x.dtype)
    chunk = resolve_chunk(form, chunk_size)
    if R.empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), state_pages
    return _mamba2_ssd(x, dt, a, b, c, d, state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
                       chunk=chunk, interpret=T.resolve_interpret(interpret))


# ---- causal conv1d ---------------------------------------------------------------------------------------------


def _conv_kernel(ext_ref, w_ref, bias_ref, o_ref, *, activation: str | None):
    """ext_ref f32[W, Cb]: a piece's window, row r the input K - 1 - r positions before its first row (so row r + i
    is tap i's input for output row r); w_ref f32[K, Cb] (the weights, taps on rows); bias_ref f32[1, Cb]; o_ref
    f32[rows, Cb]."""
    ext = ext_ref[...]
    width, rows = ext.shape[0], o_ref.shape[0]
    acc = jnp.broadcast_to(bias_ref[...], o_ref.shape)
    for i in range(w_ref.shape[0]):  # rotate rows i.. to the top: out[r] = ext[r + i]
        shifted = ext if i == 0 else pltpu.roll(ext, width - i, 0)
        acc = acc + w_ref[i:i + 1, :] * shifted[:rows, :]
    if activation == "silu":
        acc = acc * jax.nn.sigmoid(acc)
    o_ref[...] = acc


def default_block_c(channels: int) -> int:
    """Channels per program: the largest multiple of 128 dividing the channels, at most 1024 (so the window of a
    64-row piece stays under 0.3 MiB of VMEM per buffer); all channels where they are not a multiple of 128."""
    if channels % T.LANES:
        return channels
    lanes = channels // T.LANES
    return T.LANES * max(d for d in range(1, min(lanes, 8) + 1) if lanes % d == 0)


@functools.partial(jax.jit, static_argnames=("block_size", "activation", "block_t", "block_c", "interpret"))
def _causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                   activation: str | None, block_t: int, block_c: int, interpret):
    num_tokens, channels = x.shape
    taps = weight.shape[1]
    num_blocks = conv_state_pages.shape[0]
    p = R.pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=block_t, block_size=block_size,
                 num_blocks=num_blocks)
    r = R.rows(kv_lens, cu_q_lens, num_tokens)
    init = R.gather_initial(conv_state_pages, R.initial_blocks(kv_lens, cu_q_lens, block_tables,
                                                               num_tokens=num_tokens, block_size=block_size,
                                                               num_blocks=num_blocks))
    width = T.round_up(block_t + taps - 1, T.SUBLANES)
    src = p.row0[:, None] - (taps - 1) + jnp.arange(width)  # [NP, W]
    ext = R.conv_inputs(x, init, r.cu, p.seq, src)
    ext = jnp.where((src < (p.row0 + p.length)[:, None])[..., None], ext.astype(F32), 0.0)  # [NP, W, C]
    bias = jnp.zeros((1, channels), F32) if bias is None else bias.astype(F32)[None, :]
    num_pieces = p.first.shape[0]
    out = pl.pallas_call(
        functools.partial(_conv_kernel, activation=activation),
        grid=(num_pieces, channels // block_c),
        in_specs=[pl.BlockSpec((None, width, block_c), lambda n, c: (n, 0, c)),
                  pl.BlockSpec((taps, block_c), lambda n, c: (0, c)),
                  pl.BlockSpec((1, block_c), lambda n, c: (0, c))],
        out_specs=pl.BlockSpec((None, block_t, block_c), lambda n, c: (n, 0, c)),
        out_shape=jax.ShapeDtypeStruct((num_pieces, block_t, channels), F32),
        interpret=interpret,
        compiler_params=T.compiler_params(2),
        name=f"causal_conv1d_tpu_t{block_t}_c{block_c}" + ("_silu" if activation else ""),
    )(ext, weight.astype(F32).T, bias)
    slots, valid = R.piece_rows(p, block_t, num_tokens)
    return (R.scatter_rows(out, slots, valid, num_tokens, x.dtype),
            R.write_conv_snapshots(conv_state_pages, x, init, r.cu, p))


def causal_conv1d_tpu(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size: int,
                      activation: str | None, block_t: int | None, block_c: int | None, interpret):
    """The TPU kernel behind `pallas_kernels.causal_conv1d(..., target="tpu")`, which has validated the arguments.
    Checks the TPU rules (float32 or bfloat16 x; block_t a multiple of 8; block_c a multiple of 128 dividing the
    channels, or all of them), fills in the defaults (64 rows, `default_block_c`) and runs the kernel."""
    T.check_dtype(x.dtype)
    channels = x.shape[1]
    block_t = 64 if block_t is None else block_t
    if not isinstance(block_t, int) or block_t < 1 or block_t % T.SUBLANES:
        raise ValueError(f"target 'tpu' needs block_t to be a positive multiple of {T.SUBLANES}, got {block_t!r}")
    block_c = default_block_c(channels) if block_c is None else block_c
    if not isinstance(block_c, int) or block_c < 1 or channels % block_c or (block_c % T.LANES
                                                                              and block_c != channels):
        raise ValueError(f"target 'tpu' needs block_c to divide the channels ({channels}) and be a multiple of "
                         f"{T.LANES} (or all of them), got {block_c!r}")
    if R.empty_step(x.shape[0], block_tables):
        return jnp.zeros(x.shape, x.dtype), conv_state_pages
    return _causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, block_size=block_size,
                          activation=activation, block_t=block_t, block_c=block_c,
                          interpret=T.resolve_interpret(interpret))
