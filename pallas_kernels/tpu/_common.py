"""Pieces shared by the TPU (Mosaic) decode and ragged kernels: the interpret-mode switch, the layout rules
and defaults, the online-softmax step and the tile rows of the wrappers that gather ragged queries into
tile-aligned blocks (`page_chunks` holds the double-buffered page DMAs).

Nothing here is public API; `pallas_kernels.paged_attention` / `ragged_paged_attention` and the MLA entry
points with target="tpu" are.

Layout rules (a TPU vector register is 8 sublanes x 128 lanes of 32 bits; 16-bit values pack two rows per
sublane, so their native tile is 16 x 128):
  * a page `[block_size, head_dim]` is DMA'd HBM -> VMEM into rows i * block_size ... of its chunk's
    `[pages * block_size, head_dim]` matrix, a window of whole tiles (no relayout, no reshape) only if
    block_size is a multiple of the tile's rows: 8 for float32, 16 for bfloat16 (`check_block_size`);
  * matrix-unit operands in 16-bit types need whole tiles of rows too, so the query rows of a program
    (GQA group x query tokens) are padded with zero rows to `sublane_rows(dtype)` in the wrapper (q is
    small; the KV cache is never copied or padded);
  * head_dim stays as it is in HBM; in VMEM every row occupies whole 128-lane tiles (a head_dim of 64 is
    padded to 128 lanes there), and Mosaic masks those padding lanes out of the contraction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _validate as V
from pallas_kernels.quant import is_quantized
from pallas_kernels.tiles import NEG_INF, dot_precision

META = 5  # tiles.tile_metadata's columns: table row, first query row, rows, first position, kv length
LANES = 128
SUBLANES = 8
TPU_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Default chunk: about this many bytes of K per DMA chunk (K and V, double-buffered: 4x in VMEM), and at
# least this many tokens, so the score matrix of a chunk fills the 128 lanes of a vector register.
CHUNK_BYTES = 64 * 1024
MIN_CHUNK_TOKENS = 128


def sublane_rows(dtype) -> int:
    """Rows of one native VMEM tile: 8 for 32-bit types, 16 for 16-bit (packed) types."""
    return SUBLANES * (4 // jnp.dtype(dtype).itemsize)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def cdiv(a, b: int):
    """Ceiling division of a non-negative traced int32 scalar by a positive static int. lax.div truncates,
    which equals floor division here; jnp's `//` would add sign corrections to the scalar code."""
    return lax.div(a + (b - 1), b)


def check_dtype(dtype) -> None:
    if jnp.dtype(dtype) not in TPU_DTYPES:
        raise ValueError(f"target 'tpu' supports float32 and bfloat16 (TPU matrix units have no float16), "
                         f"got {jnp.dtype(dtype).name}")


def check_block_size(block_size: int, dtype) -> None:
    """The TPU block-size rule: a multiple of the native tile's rows (8 for float32, 16 for bfloat16)."""
    rows = sublane_rows(dtype)
    if block_size % rows:
        raise ValueError(
            f"target 'tpu' needs block_size to be a multiple of {rows} for {jnp.dtype(dtype).name} (pages are "
            f"DMA'd as whole {rows} x 128 VMEM tiles and stacked into one matrix per chunk), got {block_size}")


def check_pages_per_iter(pages_per_iter: int | None) -> None:
    V.check_positive_option("pages_per_iter", pages_per_iter)


def default_pages_per_iter(block_size: int, max_blocks_per_seq: int, head_dim: int, dtype) -> int:
    """Pages per DMA chunk: about CHUNK_BYTES of K (at least MIN_CHUNK_TOKENS tokens), at most the table's
    width. 256 tokens for bfloat16 at head_dim 128, 128 for float32 or head_dim 256."""
    row_bytes = round_up(head_dim, LANES) * jnp.dtype(dtype).itemsize  # VMEM rows are whole lane tiles
    tokens = max(MIN_CHUNK_TOKENS, CHUNK_BYTES // row_bytes)
    return int(max(1, min(tokens // block_size, max_blocks_per_seq)))


def resolve_interpret(interpret) -> pltpu.InterpretParams | bool:
    """`None`: compiled Mosaic on a TPU, Pallas's TPU interpret mode elsewhere. `True` is the interpret mode
    with its defaults (DMAs land only when waited on, out-of-bounds reads raise, fresh VMEM is NaN: a
    kernel that reads a page it did not copy or forgets a wait fails its tests). An `InterpretParams`
    instance is used as given (e.g. `detect_races=True`)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    return pltpu.InterpretParams() if interpret else False


def compiler_params(num_grid_dims: int) -> pltpu.CompilerParams:
    # Every program starts and waits for its own DMAs (no state crosses grid points), so all grid dimensions
    # are parallel: a two-TensorCore chip (megacore) may split any of them.
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * num_grid_dims)


def check_variants(k_pages) -> None:
    """Target 'tpu' runs sliding windows and soft caps; 8-bit pages it does not (their per-token scales would
    need a lane-to-sublane relayout per chunk and int8/fp8 VMEM tiles of 32 rows): a clear error, no fallback."""
    if is_quantized(k_pages.dtype):
        raise ValueError(f"target 'tpu' does not support quantized ({jnp.dtype(k_pages.dtype).name}) KV pages "
                         f"(k_scales/v_scales); use target 'gpu' or float32/bfloat16 pages")


def online_softmax_step(q, k, v, score_ok, value_ok, carry, *, scale: float, logits_soft_cap: float | None = None):
    """One exact float32 flash-attention step over a chunk.

    q `[rows, head_dim]`, k/v `[tokens, head_dim]` (the cache dtype); score_ok bool `[rows, tokens]` (or
    broadcastable): which (query, key) pairs attend; value_ok bool `[tokens, head_dim]`: which V rows are real
    tokens (rows of stale or past-the-length slots are zeroed before the P @ V product, so a NaN there never
    reaches the arithmetic: 0 * NaN would), or None where every row of v is known finite (the sparse kernel
    fills unselected slots with zeros). carry (m, z, u): m, z `[rows, 1]` (2-D: a TPU vector is sublanes x lanes),
    u `[rows, head_dim]`, float32; m is the running max (-inf while nothing was seen), z the running sum
    of exp(s - m), u the running sum of exp(s - m) * v. With `logits_soft_cap` c the scaled scores pass
    through c * tanh(s / c) first.
    """
    m_prev, z_prev, u_prev = carry
    precision = dot_precision(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale  # [rows, tokens]
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    s = jnp.where(score_ok, s, NEG_INF)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # Rows that have seen nothing yet keep m = -inf; exponentiate against 0 there, so no (-inf) - (-inf).
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    z_next = alpha * z_prev + jnp.sum(p, axis=1, keepdims=True)
    if value_ok is not None:
        v = jnp.where(value_ok, v, jnp.zeros((), v.dtype))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return m_next, z_next, alpha * u_prev + pv


def init_carry(rows: int, head_dim: int):
    return (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def finalize_rows(z, u, dtype):
    """o = u / z per row, zeros where nothing was attended (z == 0); z `[rows, 1]`, u `[rows, head_dim]`.
    `merge.finalize` in the kernel's 2-D shapes."""
    has = z > 0
    return jnp.where(has, u / jnp.where(has, z, 1.0), 0.0).astype(dtype)


def tile_rows(meta, num_tokens: int, block_q: int):
    """For the wrappers that gather each tile's query rows into a tile-aligned block (the ragged GQA and the MLA
    kernels): (rows [num_tiles, block_q]: the query row of each tile slot, clipped into range; slot_of_token
    [num_tokens]: the flat tile slot holding each query row)."""
    t = jnp.arange(block_q, dtype=jnp.int32)
    rows = meta[:, 1:2] + t[None, :]
    real = t[None, :] < meta[:, 2:3]
    # tile_metadata covers every row exactly once, so every token gets its slot; the rest are dropped.
    dest = jnp.where(real, rows, num_tokens).reshape(-1)
    slots = jnp.arange(dest.shape[0], dtype=jnp.int32)
    slot_of_token = jnp.zeros((num_tokens,), jnp.int32).at[dest].set(slots, mode="drop")
    return jnp.clip(rows, 0, num_tokens - 1), slot_of_token
