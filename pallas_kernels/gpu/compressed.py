"""DeepSeek V4's compressed attention on NVIDIA GPUs in Pallas compiled through Triton (`compressed_attention_gpu`).

The wrapper (`pallas_kernels.compressed.attention_slots`) turns each query row's window positions (p - W, p] and its
compressed entries (the indexer's selection, or every entry its position has closed) into physical slots through
their tables, -1 for none. Grid (row, head block): program (i, b) holds `block_h` heads of row i and walks the
window's slots, then the entries' slots, `block_k` at a time: each step loads the slots' vectors once (K = V: the
same tile gives the scores and the values), scores them with one dot and keeps the exact float32 online softmax of
`_common`; the head's sink joins once at the end (`merge.join_sink`), then the division. Slots -1 are never loaded;
a row that sees nothing gives zeros. Cost O(W + k) per row (HCA: O(W + n / m')), whatever the context.

Exported for platform "cuda" (tests/kernels/test_compressed.py) and run in the Pallas interpreter; not yet compiled
or timed on a GPU here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import tiles
from pallas_kernels.gpu import _common as C
from pallas_kernels.merge import finalize, join_sink

DEFAULT_BLOCK_K = 32  # slots per step


def _kernel(window_slots_ref, q_ref, window_ref, sinks_ref, *refs, scale: float, num_heads: int, head_dim: int,
            block_h: int, block_k: int, window_rows: int, entry_rows: int | None):
    """window_slots_ref i32[rows, W]; q_ref [rows, H, D]; window_ref [num_blocks, block_size, D]; sinks_ref f32[H];
    with entries refs starts with entry_slots_ref i32[rows, K] and entry_ref [num_blocks, block_size / m, D]; then
    o_ref [rows, H, D]."""
    (entry_slots_ref, entry_ref, o_ref) = refs if entry_rows is not None else (None, None, *refs)
    row, head_block = pl.program_id(0), pl.program_id(1)
    head = head_block * block_h + jnp.arange(block_h, dtype=jnp.int32)
    head_ok = head < num_heads
    d = jnp.arange(tiles.padded_head_dim(head_dim), dtype=jnp.int32)
    io_idx = (row, head[:, None], d[None, :])
    io_mask = head_ok[:, None] & (d < head_dim)[None, :]
    q = plgpu.load(q_ref.at[io_idx], mask=io_mask, other=0)
    precision = tiles.dot_precision(q.dtype)

    def walk(slots_ref, pages_ref, rows_per_block: int, carry):
        count = slots_ref.shape[1]

        def body(i, carry):
            j = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
            slot = plgpu.load(slots_ref.at[row, j], mask=j < count, other=-1)
            valid = slot >= 0
            safe = jnp.where(valid, slot, 0)
            block, offset = lax.div(safe, rows_per_block), lax.rem(safe, rows_per_block)
            k = plgpu.load(pages_ref.at[block[:, None], offset[:, None], d[None, :]],
                           mask=valid[:, None] & (d < head_dim)[None, :], other=0.0).astype(q.dtype)
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
            return C.online_softmax_update(s, k, valid[None, :], carry)

        return lax.fori_loop(0, tiles.cdiv(count, block_k), body, carry)

    carry = walk(window_slots_ref, window_ref, window_rows, C.init_carry(block_h, d.shape[0]))
    if entry_ref is not None:
        carry = walk(entry_slots_ref, entry_ref, entry_rows, carry)
    sinks = plgpu.load(sinks_ref.at[head], mask=head_ok, other=0.0)
    _, z, u = join_sink(*carry, sinks)
    plgpu.store(o_ref.at[io_idx], finalize(z, u, o_ref.dtype), mask=io_mask)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_h", "block_k", "num_warps", "num_stages"))
def _call(q, window_pages, window_slots, entry_pages, entry_slots, sinks, *, scale: float, interpret: bool,
          block_h: int, block_k: int, num_warps: int, num_stages: int):
    num_rows, num_heads, head_dim = q.shape
    with_entries = entry_pages is not None
    kernel = functools.partial(
        _kernel, scale=scale, num_heads=num_heads, head_dim=head_dim, block_h=block_h, block_k=block_k,
        window_rows=window_pages.shape[1], entry_rows=entry_pages.shape[1] if with_entries else None)
    return pl.pallas_call(
        kernel,
        grid=(num_rows, tiles.cdiv(num_heads, block_h)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        compiler_params=C.compiler_params(num_warps, num_stages),
        name=f"compressed_attention_h{block_h}_k{block_k}" + ("_entries" if with_entries else "_window"),
    )(window_slots, q, window_pages, sinks, *((entry_slots, entry_pages) if with_entries else ()))


def compressed_attention_gpu(q, window_pages, window_slots, entry_pages, entry_slots, sinks, *, scale: float,
                             interpret: bool | None, block_h: int | None, block_k: int | None,
                             num_warps: int | None, num_stages: int) -> jax.Array:
    """The GPU kernel behind `pallas_kernels.compressed_attention(..., target="gpu")`, which has validated the
    arguments and computed the slots. Checks the GPU tile rules (block_h and block_k powers of two >= 16: tl.dot),
    fills in the defaults (heads padded to a power of two of at least 16, up to 64; DEFAULT_BLOCK_K; 4 warps) and
    runs the kernel."""
    C.check_dot_tiles(block_h=block_h, block_k=block_k)
    if 0 in (q.shape[0], window_pages.shape[0]):
        return jnp.zeros(q.shape, q.dtype)
    block_h = block_h or min(max(tiles.next_pow2(q.shape[1]), tiles.MIN_DOT_DIM), 64)
    return _call(q, window_pages, window_slots, entry_pages, entry_slots, sinks.astype(jnp.float32), scale=scale,
                 interpret=C.resolve_interpret(interpret), block_h=int(block_h),
                 block_k=int(block_k or DEFAULT_BLOCK_K), num_warps=int(num_warps or 4), num_stages=int(num_stages))
