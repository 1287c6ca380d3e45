"""DeepSeek V4's compressor over paged snapshots: pools every `m` tokens into one entry, a window that opens in one
step closing in a later one. The kernel entry `compress` (Pallas: Triton on a GPU, Mosaic on a TPU, their
interpreters elsewhere), its XLA path `compress_xla` (the CPU engine's) and the dense reference `compress_reference`.

The math. Per token a projected vector c and gate logits z (position bias already added: one row per slot
j = position mod m), both of width D per series. HCA pools window w as sum_j softmax_j(z_j) c_j over its m slots,
per channel. CSA pools two series: entry w is the softmax over 2m slots, the A series of window w - 1 and the B
series of window w (width 2m, stride m; entry 0 has no A half). A softmax over slots is an exact merge of partials
(as attention's, `merge`: m = max, z = sum exp(. - m), u = sum exp(. - m) c, here per channel), so a window may close
in a later step than it opened: the state carries the open window's partials (B; for CSA also A) and, for CSA, the
A partial of the last closed window (`carry`), the half the next entry needs.

State pages `f32[num_blocks, P, 3, D]`: P = 1 `[open_b]` (HCA) or P = 3 `[carry, open_a, open_b]` (CSA), each a
partial `(m, z, u)` of D channels; an empty partial is (-inf, 0, 0). The snapshots follow `recurrent`'s contract (a
sequence starts from the snapshot in the block of its first position's predecessor, none at position 0, and leaves
one after every block and after its step); with the state block a multiple of m, `pieces` cuts every sequence's
step into pieces that each lie in one window.

One data flow for the XLA path and the kernels (`_tiles`, then `piece_partials`, then `_finish`):
  1. per piece, tiles of its slots `[pieces, M, D]` (c, and z with -inf in slots it does not own; M >= m): its own
     rows of each series, and for CSA the previous window's A rows that lie in this step; the parts of its windows
     in earlier steps come as partials from its sequence's initial snapshot (`extras`: for the piece that starts a
     sequence's step the snapshot's open windows and carry, for the next piece the open A half it closed);
  2. per piece and channel, each tile's softmax partial merged with its extra: the partials (prev, a, b) and the
     entry pool(prev + b) (HCA: pool(b)). The XLA path computes every piece at once; the kernel one (piece, channel
     tile) per program, all independent;
  3. the snapshots chosen by whether the piece closes its window (then `[a, empty, empty]`, else `[prev, a, b]`)
     and scattered into the blocks the pieces owe; the entries into the rows that close windows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _validate as V
from pallas_kernels import tiles
from pallas_kernels.dispatch import resolve_target
from pallas_kernels.gpu import _common as gpu_common
from pallas_kernels.merge import Partial
from pallas_kernels.pieces import Pieces, initial_blocks, pieces, rows, scatter_snapshots
from pallas_kernels.tpu import _common as tpu_common

NEG_INF = float("-inf")


def _empty(shape) -> Partial:
    return Partial(jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32),
                   jnp.zeros(shape, jnp.float32))


def _combine(a: Partial, b: Partial) -> Partial:
    """Two per-channel partials merged exactly (written out, element-wise only, for the kernels' bodies too)."""
    m = jnp.maximum(a.m, b.m)
    safe = jnp.where(m == NEG_INF, 0.0, m)
    sa, sb = jnp.exp(a.m - safe), jnp.exp(b.m - safe)
    return Partial(m, a.z * sa + b.z * sb, a.u * sa + b.u * sb)


def _slots_partial(c: jax.Array, z: jax.Array) -> Partial:
    """The partial over a tile's slots (axis -2, kept): c, z f32 `[..., M, D]`, z -inf in slots not counted (c 0
    there) -> `[..., 1, D]` each."""
    m = jnp.max(z, axis=-2, keepdims=True)
    e = jnp.exp(z - jnp.where(m == NEG_INF, 0.0, m))  # 0 in slots not counted
    return Partial(m, jnp.sum(e, axis=-2, keepdims=True), jnp.sum(e * c, axis=-2, keepdims=True))


def _pool(p: Partial) -> jax.Array:
    has = p.z > 0
    return jnp.where(has, p.u / jnp.where(has, p.z, 1.0), 0.0)


def piece_partials(extras: list[Partial], b: tuple[jax.Array, jax.Array], a: tuple[jax.Array, jax.Array] | None,
                   prev: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, list[Partial]]:
    """Step 2 of the module docstring, element-wise and per channel, on tiles `[..., M, D]` and partials
    `[..., 1, D]`: extras `[b]` (HCA) or `[prev, a, b]` (CSA); b, a, prev the (c, z) tiles of the piece's B rows,
    its A rows and the previous window's A rows (a and prev None for HCA). Returns (entry `[..., 1, D]`, the
    partials in the state's order)."""
    b_part = _combine(_slots_partial(*b), extras[-1])
    if a is None:
        return _pool(b_part), [b_part]
    prev_part = _combine(_slots_partial(*prev), extras[0])
    a_part = _combine(_slots_partial(*a), extras[1])
    return _pool(_combine(prev_part, b_part)), [prev_part, a_part, b_part]


def _as_rows(parts: list[Partial]) -> jax.Array:
    """Partials `[N, 1, D]` -> `[N, 3 len(parts), D]`: row 3 i + j is component j of partial i."""
    return jnp.concatenate([x for p in parts for x in p], axis=-2)


def _of_rows(x: jax.Array, num_parts: int) -> list[Partial]:
    return [Partial(*(x[..., 3 * i + j:3 * i + j + 1, :] for j in range(3))) for i in range(num_parts)]


class _Tiles(NamedTuple):
    """Step 1's output."""

    pairs: list  # the (c, z) tiles f32[NP, M, Dp] in `piece_partials`' order: b, then CSA's a and prev
    extras: jax.Array  # f32[NP, R, Dp]: rows as `_as_rows`, then zero rows up to R
    p: Pieces


def _tiles(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, *, compress_rate: int, block_size: int,
           slots: int, extra_rows: int, width: int) -> _Tiles:
    """Step 1 with tiles of `slots` rows (>= m), `extra_rows` rows of extras (>= 3P) and `width` channels (>= D;
    padding channels and rows are zeros)."""
    num_tokens = kv.shape[0]
    num_parts, d = state_pages.shape[1], state_pages.shape[-1]
    m = compress_rate
    p = pieces(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, chunk=m, block_size=block_size,
               num_blocks=state_pages.shape[0])
    cu = rows(kv_lens, cu_q_lens, num_tokens).cu
    j = jnp.arange(slots, dtype=jnp.int32)[None, :]
    live = (p.length > 0)[:, None]

    def gathered(first_row, columns=slice(None)):  # (c, z) f32 `[NP, slots, columns]` of each piece's rows
        rows_ = jnp.clip(first_row[:, None] + j, 0, max(num_tokens - 1, 0))
        return kv[:, columns][rows_].astype(jnp.float32), gate[:, columns][rows_].astype(jnp.float32)

    def pair(c, z, owned):  # the tile: slots not owned weigh nothing (c 0, z -inf); channels padded to `width`
        c, z = jnp.where(owned[..., None], c, 0.0), jnp.where(owned[..., None], z, NEG_INF)
        if width == d:
            return c, z
        pad = ((0, 0), (0, 0), (0, width - d))
        return jnp.pad(c, pad), jnp.pad(z, pad)

    own = live & (j < p.length[:, None])
    c_own, z_own = gathered(p.row0)  # both series at once (CSA: A then B)
    pairs = [pair(c_own[..., -d:], z_own[..., -d:], own)]
    blocks = initial_blocks(kv_lens, cu_q_lens, block_tables, num_tokens=num_tokens, block_size=block_size,
                            num_blocks=state_pages.shape[0])
    init = state_pages[jnp.maximum(blocks, 0)]  # selected, never multiplied: other pages may hold NaN
    empty_state = jnp.stack([jnp.stack(_empty((d,)))] * num_parts)
    start = jnp.where((blocks >= 0)[:, None, None, None], init, empty_state)[p.seq]  # [NP, P, 3, D]
    first = p.first[:, None, None]
    empty = jnp.stack(_empty((d,)))[None]  # [1, 3, D]
    if num_parts == 1:
        extras = [jnp.where(first, start[:, 0], empty)]
    else:
        # The previous window's A rows in this step: rows [row0 - m, row0) of the sequence's step, for a piece that
        # does not start it (it starts at a window boundary). The part before the step is the snapshot's open A
        # half when the previous piece started the step mid-window (empty when it started at a boundary).
        prev_row = p.row0[:, None] - slots + j
        prev_owned = live & ~p.first[:, None] & (prev_row >= p.row0[:, None] - m) & (prev_row >= cu[p.seq][:, None])
        pairs += [pair(c_own[..., :d], z_own[..., :d], own), pair(*gathered(p.row0 - slots, slice(0, d)), prev_owned)]
        prev_open = (~p.first & (cu[p.seq] > p.row0 - m))[:, None, None]
        extras = [jnp.where(first, start[:, 0], jnp.where(prev_open, start[:, 1], empty)),
                  jnp.where(first, start[:, 1], empty), jnp.where(first, start[:, 2], empty)]
    extras = jnp.concatenate(extras, axis=1)  # [NP, 3P, D]
    if (extra_rows, width) != extras.shape[1:]:
        extras = jnp.pad(extras, ((0, 0), (0, extra_rows - extras.shape[1]), (0, width - d)))
    return _Tiles(pairs, extras, p)


def _finish(t: _Tiles, entry: jax.Array, parts: list[Partial], state_pages: jax.Array, *, num_tokens: int,
            compress_rate: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Step 3: entry `[NP, 1, >= D]`, the partials `[NP, 1, D]` in the state's order -> (entries f32 `[T, D]`,
    closes bool `[T]`, pages)."""
    p, (num_parts, d) = t.p, (state_pages.shape[1], state_pages.shape[-1])
    closes = (p.length > 0) & ((p.pos0 + p.length) % compress_rate == 0)
    empty = _empty(parts[0].m.shape)
    pick = lambda x, y: Partial(*(jnp.where(closes[:, None, None], u, v) for u, v in zip(x, y, strict=True)))  # noqa: E731
    if num_parts == 3:
        prev, a, b = parts
        after = [pick(a, prev), pick(empty, a), pick(empty, b)]
    else:
        after = [pick(empty, parts[0])]
    after = _as_rows(after).reshape(-1, num_parts, 3, d)
    state_pages = scatter_snapshots(state_pages, p.write, after)
    target = jnp.where(closes, p.row0 + p.length - 1, num_tokens)
    entries = jnp.zeros((num_tokens, d), jnp.float32).at[target].set(entry[:, 0, :d], mode="drop")
    return entries, jnp.zeros((num_tokens,), bool).at[target].set(True, mode="drop"), state_pages


@functools.partial(jax.jit, static_argnames=("compress_rate", "block_size"))
def compress_xla(kv: jax.Array,  # f32[T, D] (HCA) or [T, 2D] (CSA: series A then B)
                 gate: jax.Array,  # f32, kv's shape: the gate logits, position bias added
                 state_pages: jax.Array,  # f32[num_blocks, P, 3, D], P = 1 (HCA) or 3 (CSA)
                 block_tables: jax.Array,  # i32[S, max_blocks] of the state group
                 kv_lens: jax.Array,  # i32[S]
                 cu_q_lens: jax.Array,  # i32[S + 1]
                 *, compress_rate: int, block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One step of the compressor (module docstring), every piece at once: (entries f32 `[T, D]`, the pooled entry
    of the window a row closes (its position is a multiple of m minus one), zeros on other rows; closes bool `[T]`;
    the state pages with this step's snapshots written). `block_size`: the state group's, a multiple of
    `compress_rate`."""
    num_parts = state_pages.shape[1]
    t = _tiles(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, compress_rate=compress_rate,
               block_size=block_size, slots=compress_rate, extra_rows=3 * num_parts, width=state_pages.shape[-1])
    entry, parts = piece_partials(_of_rows(t.extras, num_parts), t.pairs[0], *(t.pairs[1:] or (None, None)))
    return _finish(t, entry, parts, state_pages, num_tokens=kv.shape[0], compress_rate=compress_rate)


def _kernel(*refs, num_parts: int):
    """Tiles' refs `[M, bd]` (c, z per series, `piece_partials`' order), extras_ref `[R, bd]`; outputs entry_ref
    `[1, bd]`, parts_ref `[R, bd]` (rows past 3P left unwritten)."""
    *tile_refs, extras_ref, entry_ref, parts_ref = refs
    pairs = [(tile_refs[i][...], tile_refs[i + 1][...]) for i in range(0, len(tile_refs), 2)]
    extras = [Partial(*(extras_ref[3 * i + j:3 * i + j + 1, :] for j in range(3))) for i in range(num_parts)]
    entry, parts = piece_partials(extras, pairs[0], *(pairs[1:] or (None, None)))
    entry_ref[...] = entry
    for i, part in enumerate(parts):
        for j, x in enumerate(part):
            parts_ref[3 * i + j:3 * i + j + 1, :] = x


def _check_compress(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, compress_rate, block_size) -> None:
    V.check_positive_int("compress_rate", compress_rate)
    V.check_positive_int("block_size", block_size)
    if block_size % compress_rate:
        raise ValueError(f"block_size ({block_size}) must be a multiple of compress_rate ({compress_rate}): every "
                         f"piece of a step must lie in one window")
    if (getattr(state_pages, "ndim", 0) != 4 or state_pages.shape[1] not in (1, 3) or state_pages.shape[2] != 3
            or state_pages.dtype != jnp.float32):
        raise ValueError(f"state_pages must be float32 [num_blocks, P, 3, D] with P = 1 (HCA) or 3 (CSA), got "
                         f"{getattr(state_pages, 'dtype', None)} {getattr(state_pages, 'shape', state_pages)}")
    d, num_parts = state_pages.shape[3], state_pages.shape[1]
    width = d * (2 if num_parts == 3 else 1)
    for name, x in (("kv", kv), ("gate", gate)):
        if getattr(x, "ndim", 0) != 2 or x.shape[1] != width or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be float [tokens, {width}] (P = {num_parts}: "
                             f"{'two series of' if num_parts == 3 else 'one series of'} D = {d}), got "
                             f"{getattr(x, 'dtype', None)} {getattr(x, 'shape', x)}")
    if gate.shape[0] != kv.shape[0]:
        raise ValueError(f"gate has {gate.shape[0]} rows, kv {kv.shape[0]}")
    V.check_int32("block_tables", block_tables, 2)
    V.check_vector("kv_lens", kv_lens, block_tables.shape[0])
    V.check_vector("cu_q_lens", cu_q_lens, block_tables.shape[0] + 1)


def _tile_slots(target: str, compress_rate: int) -> int:
    """A tile's slots: Triton wants power-of-two tile sides; Mosaic whole sublane tiles of float32 (8 rows)."""
    return tiles.next_pow2(compress_rate) if target == "gpu" else tpu_common.round_up(compress_rate, 8)


def _default_block_d(target: str, d: int, slots: int) -> int:
    """GPU: about 2048 elements per tile (powers of two, at least 16 channels); TPU: the largest multiple of 128
    dividing D up to 512, else all of D."""
    if target == "gpu":
        return min(tiles.next_pow2(d), max(16, 2048 // slots))
    if d % tpu_common.LANES:
        return d
    return max(b for b in range(tpu_common.LANES, min(d, 512) + 1, tpu_common.LANES) if d % b == 0)


def _check_block_d(target: str, block_d: int, d: int) -> None:
    if target == "gpu":
        V.check_pow2_option("block_d", block_d)
    elif not isinstance(block_d, int) or block_d < 1 or d % block_d or (block_d % tpu_common.LANES and block_d != d):
        raise ValueError(f"target 'tpu' needs block_d to divide D ({d}) and be a multiple of {tpu_common.LANES} (or "
                         f"all of D), got {block_d!r}")


@functools.partial(jax.jit, static_argnames=("compress_rate", "block_size", "target", "block_d", "interpret",
                                             "num_warps"))
def _compress_pallas(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, *, compress_rate: int, block_size: int,
                     target: str, block_d: int, interpret, num_warps: int):
    num_parts, d = state_pages.shape[1], state_pages.shape[-1]
    slots = _tile_slots(target, compress_rate)
    extra_rows = tiles.next_pow2(3 * num_parts)
    width = tiles.cdiv(d, block_d) * block_d
    t = _tiles(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, compress_rate=compress_rate,
               block_size=block_size, slots=slots, extra_rows=extra_rows, width=width)
    num_pieces = t.extras.shape[0]
    arrays = [x for pair in t.pairs for x in pair]
    spec = lambda rows_: pl.BlockSpec((None, rows_, block_d), lambda n, c: (n, 0, c))  # noqa: E731
    params = (gpu_common.compiler_params(num_warps, 1) if target == "gpu" else tpu_common.compiler_params(2))
    entry, parts = pl.pallas_call(
        functools.partial(_kernel, num_parts=num_parts),
        grid=(num_pieces, width // block_d),
        in_specs=[spec(slots)] * len(arrays) + [spec(extra_rows)],
        out_specs=[spec(1), spec(extra_rows)],
        out_shape=[jax.ShapeDtypeStruct((num_pieces, 1, width), jnp.float32),
                   jax.ShapeDtypeStruct((num_pieces, extra_rows, width), jnp.float32)],
        interpret=interpret,
        compiler_params=params,
        name=f"compress_{target}_{'csa' if num_parts == 3 else 'hca'}_m{compress_rate}_d{block_d}",
    )(*arrays, t.extras)
    parts = _of_rows(parts[:, :3 * num_parts, :d], num_parts)
    return _finish(t, entry, parts, state_pages, num_tokens=kv.shape[0], compress_rate=compress_rate)


def compress(kv: jax.Array,  # [T, D] (HCA) or [T, 2D] (CSA: series A then B)
             gate: jax.Array,  # kv's shape: the gate logits, position bias added
             state_pages: jax.Array,  # f32[num_blocks, P, 3, D], P = 1 (HCA) or 3 (CSA)
             block_tables: jax.Array,  # i32[S, max_blocks] of the state group
             kv_lens: jax.Array,  # i32[S]
             cu_q_lens: jax.Array,  # i32[S + 1]
             *, compress_rate: int, block_size: int, target: str = "auto", interpret: bool | None = None,
             block_d: int | None = None, num_warps: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`compress_xla`'s step with the per-piece arithmetic as a Pallas kernel: grid (piece, channel tile), every
    program independent (module docstring). Target "gpu": Triton (the Pallas interpreter off a GPU), tiles of
    next_pow2(m) slots; "tpu": Mosaic (TPU interpret mode off a TPU), tiles of whole 8-row sublane tiles. Tuning:
    `block_d` channels per program (GPU: a power of two, default about 2048 / m of them; TPU: a multiple of 128
    dividing D, or D), `num_warps` (GPU only, default 4). Returns (entries f32 `[T, D]`, closes bool `[T]`, the
    state pages with this step's snapshots)."""
    _check_compress(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, compress_rate, block_size)
    target = resolve_target(target, interpret)
    d = state_pages.shape[-1]
    if block_d is not None:
        _check_block_d(target, block_d, d)
    if target == "tpu":
        if num_warps is not None:
            raise ValueError("num_warps tunes the GPU kernel; target 'tpu' takes block_d only")
        interpret = tpu_common.resolve_interpret(interpret)
    else:
        interpret = gpu_common.resolve_interpret(interpret)
    if kv.shape[0] == 0 or 0 in block_tables.shape or state_pages.shape[0] == 0:
        return jnp.zeros((kv.shape[0], d), jnp.float32), jnp.zeros((kv.shape[0],), bool), state_pages
    block_d = block_d or _default_block_d(target, d, _tile_slots(target, compress_rate))
    return _compress_pallas(kv, gate, state_pages, block_tables, kv_lens, cu_q_lens, compress_rate=compress_rate,
                            block_size=block_size, target=target, block_d=int(block_d), interpret=interpret,
                            num_warps=int(num_warps or 4))


def compress_reference(kv: jax.Array,  # f32[n, D] (HCA) or [n, 2D] (CSA): one whole sequence from position 0
                       gate: jax.Array,  # f32, kv's shape
                       *, compress_rate: int, overlap: bool) -> jax.Array:  # f32[n // m, D]
    """Every closed window's entry of one sequence as transformers computes it: a softmax over each window's slots,
    per channel; with `overlap` (CSA) over the previous window's A half, then this window's B half (entry 0's A
    half weighs nothing)."""
    m = compress_rate
    n = kv.shape[0] // m
    c, z = (x[:n * m].reshape(n, m, x.shape[-1]).astype(jnp.float32) for x in (kv, gate))
    if overlap and n == 0:
        return jnp.zeros((0, kv.shape[-1] // 2), jnp.float32)
    if overlap:
        d = c.shape[-1] // 2
        c = jnp.concatenate([jnp.concatenate([jnp.zeros((1, m, d)), c[:-1, :, :d]]), c[..., d:]], axis=1)
        z = jnp.concatenate([jnp.concatenate([jnp.full((1, m, d), -jnp.inf), z[:-1, :, :d]]), z[..., d:]], axis=1)
    return jnp.sum(jax.nn.softmax(z, axis=1) * c, axis=1)
