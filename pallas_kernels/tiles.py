"""Tiling arithmetic and ragged tile metadata shared by the GPU (Triton) and TPU (Mosaic) kernels and the XLA
paths: powers of two and ceiling division, the page span a program walks under a sliding window, the query
tiles of a ragged batch (`tile_metadata`, `default_block_q`) and their bounds under `attend_until` (`tile_bounds`),
the kernel-name suffix of the variants, and the float32 matmul precision and -inf of both kernels' online softmax.

Nothing here is public API; `pallas_kernels.paged_attention` / `ragged_paged_attention` are the entry points.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quant import is_quantized

NEG_INF = float("-inf")
# tl.dot on NVIDIA GPUs needs every matmul dimension >= 16.
MIN_DOT_DIM = 16
_MAX_ROWS = 128
_MAX_ACC_ELEMENTS = 128 * 128


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a, b):
    """Ceiling division for Python ints and non-negative traced integers alike."""
    return (a + b - 1) // b


def padded_head_dim(head_dim: int) -> int:
    """head_dim as the kernels hold it in registers: a power of two, >= MIN_DOT_DIM (tl.dot). Columns past
    head_dim are masked on load and store."""
    return max(MIN_DOT_DIM, next_pow2(head_dim))


def dot_precision(dtype) -> lax.Precision | None:
    # Both kernel families would otherwise run float32 matmuls at about 1e-3 relative error: Triton in TF32,
    # the TPU matrix unit in a single bfloat16 pass.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def window_pages(sliding_window: int | None, span: int, max_blocks_per_seq: int, block_size: int) -> int:
    """Static bound on the pages one program walks: all of a table's `max_blocks_per_seq`, or with a window
    the pages that can hold `span` consecutive query positions' windows (`span + W - 1` consecutive
    positions starting anywhere in a page)."""
    if sliding_window is None:
        return max_blocks_per_seq
    return min(max_blocks_per_seq, cdiv(span + sliding_window - 2, block_size) + 1)


def variant_suffix(sliding_window: int | None, logits_soft_cap: float | None, page_dtype,
                   attend_until: bool = False, sinks: bool = False) -> str:
    """Kernel-name suffix naming the variants in use (profiles tell the variants apart)."""
    parts = ["window"] if sliding_window is not None else []
    parts += ["softcap"] if logits_soft_cap is not None else []
    parts += [jnp.dtype(page_dtype).name] if is_quantized(page_dtype) else []
    parts += ["until"] if attend_until else []
    parts += ["sinks"] if sinks else []
    return "".join(f"_{part}" for part in parts)


def default_block_q(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> int:
    """Query tokens per tile: the mean query length rounded up to a power of two, so tiles fit the
    sequences, with block_q * group between 16 and 128 rows (64 at head_dim 256: the float32 accumulator
    rows x head_dim stays <= 64 KiB of registers)."""
    group_pad = next_pow2(group)
    dim_pad = padded_head_dim(head_dim)
    lo = max(1, MIN_DOT_DIM // group_pad)
    hi = max(1, min(_MAX_ROWS, _MAX_ACC_ELEMENTS // dim_pad) // group_pad)
    mean = cdiv(max(1, num_tokens), max(1, num_seqs))
    return int(min(max(next_pow2(mean), lo), max(lo, hi)))


def max_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Upper bound on the tiles of num_seqs sequences plus one padding segment holding num_tokens rows:
    sum_i cdiv(n_i, b) <= (sum_i n_i + segments * (b - 1)) / b."""
    return max(1, (num_tokens + (num_seqs + 1) * (block_q - 1)) // block_q)


def tile_metadata(kv_lens: jax.Array, cu_q_lens: jax.Array, num_tokens: int, block_q: int,
                  max_context: int) -> jax.Array:
    """int32 `[num_tiles, 5]`: for each tile (sequence for the block table, first row, number of rows,
    position of its first row, kv length). Rows past cu_q_lens[-1] form a last segment with kv length 0
    (its rows get zeros); tiles past the real count have 0 rows."""
    num_seqs = kv_lens.shape[0]
    num_tiles = max_tiles(num_tokens, num_seqs, block_q)
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, num_tokens)
    cu = jnp.concatenate([cu, jnp.full((1,), num_tokens, jnp.int32)])  # + padding segment
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)  # [num_seqs + 1]
    kv = jnp.concatenate([jnp.clip(kv_lens, 0, max_context), jnp.zeros((1,), jnp.int32)])
    tiles = cdiv(q_lens, block_q)
    tile_cu = jnp.cumsum(tiles)  # tile_cu[s] = first tile after segment s
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # seg[t] = #segments whose tiles end at or before t (a scatter-add and a cumsum: O(tiles + seqs)).
    ends = jnp.zeros((num_tiles + 1,), jnp.int32).at[jnp.minimum(tile_cu, num_tiles)].add(1)
    seg = jnp.cumsum(ends)[:num_tiles]
    in_range = seg <= num_seqs
    seg = jnp.minimum(seg, num_seqs)
    j = t - (tile_cu[seg] - tiles[seg])  # tile index within its segment
    row0 = cu[seg] + j * block_q
    rows = jnp.where(in_range, jnp.clip(q_lens[seg] - j * block_q, 0, block_q), 0)
    pos0 = kv[seg] - q_lens[seg] + j * block_q
    table_row = jnp.minimum(seg, num_seqs - 1)
    return jnp.stack([table_row, row0, rows, pos0, kv[seg]], axis=1).astype(jnp.int32)


def tile_bounds(meta: jax.Array, attend_until: jax.Array, block_q: int) -> tuple[jax.Array, jax.Array]:
    """The key bounds of `tile_metadata`'s tiles under `attend_until` (int32 `[num_tokens]`, one per query row):
    (last i32[num_tiles, block_q]: the last key position each tile slot's row may see, max(its position,
    attend_until[row]), the position alone for slots past the tile's rows; ends i32[num_tiles]: the end of the
    positions any row of the tile sees, min(kv length, 1 + its rows' largest last), 0 for a tile without rows).
    A tile's largest bound may belong to any of its rows (an image span ending past the tile), so the kernels walk
    to `ends`, not to their last row's position. With every attend_until <= its row's position, `ends` is the
    causal end `clip(pos0 + rows, 0, kv length)` the kernels compute without it."""
    num_tokens = attend_until.shape[0]
    t = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    real = t < meta[:, 2:3]
    pos = meta[:, 3:4] + t
    until = attend_until[jnp.clip(meta[:, 1:2] + t, 0, num_tokens - 1)]
    last = jnp.where(real, jnp.maximum(pos, until), pos)
    # Clip to kv length - 1 before adding 1: a bound of int32's max must not overflow.
    ends = jnp.max(jnp.where(real, jnp.minimum(last, meta[:, 4:5] - 1), -1), axis=1) + 1
    return last.astype(jnp.int32), jnp.maximum(ends, 0).astype(jnp.int32)


def decode_metadata(lengths: jax.Array, max_context: int) -> jax.Array:
    """`tile_metadata` of a decode batch: int32 `[num_seqs, 5]`, tile s = sequence s's one query token (row s)
    at position lengths[s] - 1 (lengths clipped to `[0, max_context]`; length 0 attends to nothing). The MLA
    kernels run decode as ragged tiles of one token."""
    s = jnp.arange(lengths.shape[0], dtype=jnp.int32)
    length = jnp.clip(lengths, 0, max_context)
    return jnp.stack([s, s, jnp.ones_like(s), length - 1, length], axis=1).astype(jnp.int32)


def row_metadata(kv_lens: jax.Array, cu_q_lens: jax.Array | None, num_tokens: int,
                 max_context: int) -> tuple[jax.Array, jax.Array]:
    """Per query row: (table row i32[num_tokens], visible end i32[num_tokens]): the row may see positions
    [0, end), end = min(position + 1, kv length) (0 for padding rows past cu_q_lens[-1]). `cu_q_lens=None` is a
    decode batch (row s = sequence s at position lengths[s] - 1, lengths = `kv_lens`). The one-token tiles of
    `tile_metadata` / `decode_metadata`: tile t is row t."""
    if cu_q_lens is None:
        meta = decode_metadata(kv_lens, max_context)
    else:
        meta = tile_metadata(kv_lens, cu_q_lens, num_tokens, 1, max_context)
    end = jnp.where(meta[:, 2] > 0, jnp.clip(meta[:, 3] + 1, 0, meta[:, 4]), 0)
    return meta[:, 0], end.astype(jnp.int32)


def selected_slots(indices: jax.Array,  # i32[rows, top_k], positions (-1 = none)
                   block_tables: jax.Array,  # i32[num_seqs, max_blocks_per_seq]
                   table_rows: jax.Array,  # i32[rows]
                   ends: jax.Array,  # i32[rows]
                   block_size: int) -> jax.Array:
    """The physical slots `block * block_size + offset` (i32[rows, top_k]) of each row's selected positions,
    through its block table: position p -> block_tables[row, p // block_size], offset p % block_size; -1 where
    the entry selects nothing (negative, or not visible to the row: p >= its end). Only table entries of
    visible positions are used (entries past a sequence's length may hold anything)."""
    valid = (indices >= 0) & (indices < ends[:, None])
    p = jnp.where(valid, indices, 0)
    block = block_tables[table_rows[:, None], p // block_size]
    return jnp.where(valid, block * block_size + p % block_size, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("block_size",))
def sparse_slots(indices: jax.Array, block_tables: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array | None,
                 *, block_size: int) -> jax.Array:
    """`selected_slots` of a decode (`cu_q_lens=None`, kv_lens = lengths) or ragged batch: what both sparse MLA
    kernel families read, i32[rows, top_k]."""
    table_rows, ends = row_metadata(kv_lens, cu_q_lens, indices.shape[0], block_tables.shape[1] * block_size)
    return selected_slots(indices, block_tables, table_rows, ends, block_size)
