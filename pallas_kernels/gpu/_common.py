"""Pieces shared by the GPU (Triton) decode and ragged kernels: the interpret-mode switch, the tuning rules and
defaults, the page-tile gather and the online-softmax step. Platform-free checks are in `pallas_kernels._validate`,
tiling arithmetic and tile metadata in `pallas_kernels.tiles`.

Nothing here is public API; `pallas_kernels.paged_attention` / `ragged_paged_attention` with target="gpu"
are the entry points.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._validate import check_pow2_option
from pallas_kernels.tiles import MIN_DOT_DIM, NEG_INF, dot_precision, next_pow2, padded_head_dim


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` picks compiled Triton on GPU and the Pallas interpreter everywhere else."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def check_pages_per_iter(pages_per_iter: int | None, block_size: int) -> None:
    """`None` (the default) or a power of two whose tile of `pages_per_iter` (padded) blocks has at least
    MIN_DOT_DIM rows (tl.dot)."""
    check_pow2_option("pages_per_iter", pages_per_iter)
    if pages_per_iter is not None and pages_per_iter * next_pow2(block_size) < MIN_DOT_DIM:
        raise ValueError(
            f"pages_per_iter * block_size must be >= {MIN_DOT_DIM} (tl.dot), got {pages_per_iter} pages "
            f"of {block_size} tokens")


def check_dot_tiles(**tiles_by_name: int | None) -> None:
    """Each tuning int given (None: the default) a power of two of at least `MIN_DOT_DIM`: a tile side of a tl.dot
    (the kernels' `block_h`, `block_k`)."""
    for name, value in tiles_by_name.items():
        check_pow2_option(name, value)
        if value is not None and value < MIN_DOT_DIM:
            raise ValueError(f"{name} must be >= {MIN_DOT_DIM} (tl.dot), got {value}")


def default_pages_per_iter(block_size: int, max_blocks_per_seq: int, head_dim: int, dtype,
                           max_tokens: int = 128, tile_bytes: int = 32 * 1024) -> int:
    """Pages gathered per inner-loop iteration (a power of two).

    About `tile_bytes` of K per tile in `dtype`, the dtype the tile is computed in (q's): 128 tokens for bf16
    at head_dim 128, 64 for float32 or head_dim 256; at most `max_tokens` tokens, at least 16 (tl.dot), and
    never more pages than a program walks (rounded up; with a sliding window, the window's page count).
    8-bit pages are dequantized into q's dtype in registers, so their tile is sized by that register
    footprint as well (callers pass q's dtype): their 1-byte loads only shrink the shared memory the
    software pipeline stages, which this bound already keeps small.
    """
    block_pad = next_pow2(block_size)
    dim_pad = padded_head_dim(head_dim)
    tokens = max(MIN_DOT_DIM, min(max_tokens, tile_bytes // (dim_pad * jnp.dtype(dtype).itemsize)))
    pages = max(1, tokens // block_pad)
    pages = min(pages, next_pow2(max(1, max_blocks_per_seq)))
    while pages * block_pad < MIN_DOT_DIM:
        pages *= 2
    return pages


def gather_page_tile(table_ref, k_ref, v_ref, *, seq, head, first_page, page_end, token_end,
                     pages_per_iter: int, block_size: int, head_dim: int, token_start=None, scale_refs=None,
                     dtype=None):
    """Loads one KV tile of `pages_per_iter` pages through the block table.

    Returns (k, v, valid, pos): k and v are `[pages_per_iter * block_pad, dim_pad]` (zeros where masked),
    valid `[tile]` says which tile rows are real tokens (logical page < page_end, position < token_end and,
    with a `token_start`, position >= token_start), pos `[tile]` their positions in the sequence. Padded
    rows, padded head_dim columns and rows outside [token_start, token_end) are never read from memory
    (masked loads), so a NaN there cannot leak in. Table entries of pages before `first_page` are never read.

    8-bit pages come with `scale_refs` = (k_scales_ref, v_scales_ref) `[num_kv_heads, num_blocks, block_size]`:
    the tile is loaded as 8-bit (a quarter of float32's bytes), its per-token scales with the same mask, and
    dequantized in registers, `(values.astype(float32) * scales)` cast to `dtype` (q's).
    """
    block_pad = next_pow2(block_size)
    dim_pad = padded_head_dim(head_dim)
    t = jnp.arange(pages_per_iter * block_pad, dtype=jnp.int32)
    page = first_page + t // block_pad  # logical page of each tile row
    offset = t % block_pad
    page_ok = page < page_end
    pos = page * block_size + offset
    valid = page_ok & (pos < token_end)
    if token_start is not None:
        valid = valid & (pos >= token_start)
    if block_pad != block_size:  # static: only padded blocks need the slot test
        valid = valid & (offset < block_size)
    physical = plgpu.load(table_ref.at[seq, page], mask=page_ok, other=0)
    d = jnp.arange(dim_pad, dtype=jnp.int32)
    kv_mask = valid[:, None]
    if dim_pad != head_dim:  # static: only padded head_dims need the column test
        kv_mask = kv_mask & (d < head_dim)[None, :]
    idx = (head, physical[:, None], offset[:, None], d[None, :])
    # A float fill for float pages: Triton casts the fill to the page dtype, and has no int -> fp8 cast.
    fill = 0.0 if jnp.issubdtype(k_ref.dtype, jnp.floating) else 0
    k = plgpu.load(k_ref.at[idx], mask=kv_mask, other=fill)
    v = plgpu.load(v_ref.at[idx], mask=kv_mask, other=fill)
    if scale_refs is not None:
        k_scales_ref, v_scales_ref = scale_refs
        scale_idx = (head, physical, offset)
        k_scales = plgpu.load(k_scales_ref.at[scale_idx], mask=valid, other=0).astype(jnp.float32)
        v_scales = plgpu.load(v_scales_ref.at[scale_idx], mask=valid, other=0).astype(jnp.float32)
        k = (k.astype(jnp.float32) * k_scales[:, None]).astype(dtype)
        v = (v.astype(jnp.float32) * v_scales[:, None]).astype(dtype)
    return k, v, valid, pos


def online_softmax_step(q, k, v, mask, carry, *, scale: float, logits_soft_cap: float | None = None):
    """One flash-attention step over a KV tile, exact in float32.

    q `[rows, dim]`, k/v `[tile, dim]` (q's dtype), mask `[rows, tile]` (or broadcastable); carry = (m, z, u)
    with m, z `[rows]` and u `[rows, dim]`, all float32. m is the running max (-inf while nothing was seen),
    z the running sum of exp(s - m), u the running sum of exp(s - m) * v. With `logits_soft_cap` c the
    scaled scores pass through c * tanh(s / c) first (bounded scores: the merge is unchanged).
    """
    s = plgpu.dot(q, k, trans_b=True, precision=dot_precision(q.dtype)) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    return online_softmax_update(s, v, mask, carry)


def online_softmax_update(s, v, mask, carry):
    """The online-softmax update of `online_softmax_step` from its scaled scores s `[rows, tile]` float32 (the
    MLA kernel sums two dots into them): masks s, rescales the carry and adds exp(s - m) @ v."""
    m_prev, z_prev, u_prev = carry
    s = jnp.where(mask, s, NEG_INF)
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    # Rows that have seen nothing yet keep m = -inf; exponentiate against 0 there so no (-inf) - (-inf).
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    z_next = alpha * z_prev + p.sum(axis=-1)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=dot_precision(v.dtype))
    u_next = alpha[:, None] * u_prev + pv
    return m_next, z_next, u_next


def init_carry(rows: int, dim_pad: int):
    return (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dim_pad), jnp.float32))


def compiler_params(num_warps: int | None, num_stages: int | None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
