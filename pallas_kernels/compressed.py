"""Compressed attention (DeepSeek V4's CSA and HCA beside a sliding window) over paged pages: the lightning indexer's
scores over compressed keys, and attention over a query's window plus its compressed entries in one exact softmax.
XLA paths (the CPU engine's), dense references, and the kernels' entries: `compressed_attention` (the GPU kernel
`gpu.compressed`; on TPU the DSA kernel's slot attention, `tpu.sparse`) and `compressed_index_scores` (V3.2's
indexer kernel).

Layouts (the engine's `SharedKVWindow`, `CompressedEntries` and `CompressorState` pages, `pagedjax.config.kv_spec`):
  window_pages  [num_blocks, block_size, D]       one vector per token position, read as key and as value (K = V)
  entry_pages   [num_blocks, block_size / m, D]   entry w (pooling positions [w m, (w + 1) m)) in the block of
                                                  position w m, row (w m mod block_size) / m: entries use the
                                                  tokens' block table, `block_size / m` of them per block
  index_pages   [num_blocks, block_size / m, Di]  the indexer's compressed keys, likewise
  state_pages   f32 [num_blocks, P, 3, D]         the compressor's snapshots (`compressor`, which writes the
                                                  entries: every m tokens pooled into one)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _validate as V
from pallas_kernels import merge, tiles
from pallas_kernels.dense import query_tiles
from pallas_kernels.dispatch import resolve_target
from pallas_kernels.gpu.compressed import compressed_attention_gpu
from pallas_kernels.sparse import indexer_scores
from pallas_kernels.tpu.sparse import slot_attention_partials_tpu

HIGHEST = jax.lax.Precision.HIGHEST


def _row_positions(kv_lens, cu_q_lens, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(table row i32[T], visible end i32[T]: the row's position + 1, 0 for a row that sees nothing)."""
    return tiles.row_metadata(kv_lens, cu_q_lens, num_tokens, jnp.iinfo(jnp.int32).max)


def _slots(block_tables: jax.Array, table_rows: jax.Array, index: jax.Array, valid: jax.Array,
           per_block: int) -> jax.Array:
    """Physical rows (i32, -1 where not `valid`) of logical rows `index` `[T, L]` of each row's sequence: logical
    row r is row r % per_block of the block its table holds at column r / per_block (only valid rows' table entries
    are used: entries past a sequence's length may hold anything)."""
    safe = jnp.where(valid, index, 0)
    column = jnp.clip(safe // per_block, 0, block_tables.shape[1] - 1)
    return jnp.where(valid, block_tables[table_rows[:, None], column] * per_block + safe % per_block, -1)


def _gather(pages: jax.Array, slots: jax.Array) -> jax.Array:
    """`[T, L, width]` of the pages' rows `slots` (flat over blocks), zeros for -1 (pages may hold NaN)."""
    g = pages.reshape(-1, pages.shape[-1])[jnp.maximum(slots, 0)]
    return jnp.where((slots >= 0)[..., None], g, jnp.zeros((), pages.dtype))


@functools.partial(jax.jit, static_argnames=("scale", "compress_rate", "q_tile"))
def compressed_index_scores_xla(q_index: jax.Array,  # [T, Hi, Di], RoPE applied
                                weights: jax.Array,  # f32[T, Hi]
                                index_pages: jax.Array,  # [num_blocks, block_size / m, Di]
                                block_tables: jax.Array,  # i32[S, max_blocks]
                                kv_lens: jax.Array,  # i32[S]
                                cu_q_lens: jax.Array,  # i32[S + 1]
                                *, scale: float, compress_rate: int,
                                q_tile: int = 16) -> jax.Array:  # f32[T, max_blocks * E]
    """The indexer's score of every compressed entry a row may read, `scale * sum_h w[h] relu(q[h] . k[w])`, over
    the entries w its position has closed (w < (p + 1) / m); -inf elsewhere. Rows go in tiles of `q_tile` of one
    sequence (`dense.query_tiles`), whose keys are gathered once per tile, one head at a time: a prefill chunk
    gathers its sequence's keys a few times, not once per row."""
    num_tokens, num_heads, _ = q_index.shape
    per_block = index_pages.shape[1]
    width = block_tables.shape[1] * per_block
    tq = max(1, min(q_tile, num_tokens))
    tile_seq, rows, valid, pos, token_slot = query_tiles(cu_q_lens, kv_lens, num_tokens, tq)
    idx = jnp.arange(width, dtype=jnp.int32)
    keep = valid[:, :, None] & (idx[None, None, :] < ((pos + 1) // compress_rate)[:, :, None])  # [NT, tq, L]
    tile_keys = jnp.broadcast_to(idx, (tile_seq.shape[0], width))
    k = _gather(index_pages, _slots(block_tables, tile_seq, tile_keys, jnp.any(keep, axis=1), per_block))
    safe_rows = jnp.clip(rows, 0, num_tokens - 1)
    qt, wt = q_index[safe_rows].astype(jnp.float32), weights[safe_rows].astype(jnp.float32)

    def head(h, acc):  # [NT, tq, L] live, never [NT, tq, H, L]
        s = jnp.einsum("ntd,nld->ntl", qt[:, :, h], k.astype(jnp.float32), precision=HIGHEST)
        return acc + wt[:, :, h, None] * jnp.maximum(s, 0.0)

    s = jax.lax.fori_loop(0, num_heads, head, jnp.zeros(keep.shape, jnp.float32)) * scale
    s = jnp.where(keep, s, -jnp.inf).reshape(-1, width)[jnp.clip(token_slot, 0, keep.shape[0] * tq - 1)]
    t = jnp.arange(num_tokens)
    return jnp.where(((t >= cu_q_lens[0]) & (t < cu_q_lens[-1]))[:, None], s, -jnp.inf)


def compressed_index_scores(q_index: jax.Array,  # [T, Hi, Di], RoPE applied
                            weights: jax.Array,  # f32[T, Hi]
                            index_pages: jax.Array,  # [num_blocks, block_size / m, Di]
                            block_tables: jax.Array,  # i32[S, max_blocks]
                            kv_lens: jax.Array,  # i32[S]
                            cu_q_lens: jax.Array,  # i32[S + 1]
                            *, scale: float, compress_rate: int, target: str = "auto",
                            interpret: bool | None = None, pages_per_iter: int | None = None,
                            num_warps: int | None = None, num_stages: int = 2) -> jax.Array:
    """`compressed_index_scores_xla`'s scores from DeepSeek V3.2's indexer kernel (`sparse.indexer_scores`, its
    decode form) with every query row a sequence of its own: its sequence's block table, and as its length the
    entries its position has closed, (p + 1) / m, so that it scores exactly those (entries are the kernel's
    positions: `block_size / m` per block). Tuning and targets as `indexer_scores`' (the TPU kernel wants whole
    entry pages of 8 rows for float32, 16 for bfloat16)."""
    table_rows, ends = _row_positions(kv_lens, cu_q_lens, q_index.shape[0])
    return indexer_scores(q_index, weights, index_pages, block_tables[table_rows], ends // compress_rate,
                          scale=scale, target=target, interpret=interpret, pages_per_iter=pages_per_iter,
                          num_warps=num_warps, num_stages=num_stages)


def attention_slots(window_tables: jax.Array,  # i32[S, max_blocks] of the window group
                    entry_tables: jax.Array | None,  # i32[S, max_blocks] of the entries' group
                    kv_lens: jax.Array, cu_q_lens: jax.Array,
                    selected: jax.Array | None,  # i32[T, k] entries, -1 none; None: every closed entry
                    *, num_tokens: int, window_rows: int, entry_rows: int | None, sliding_window: int,
                    compress_rate: int | None) -> tuple[jax.Array, jax.Array | None]:
    """Each row's physical window slots i32[T, W] (positions (p - W, p]) and entry slots i32[T, k] (its selected
    entries, or with `selected` None every entry of its table; those its position has not closed are -1), -1 for
    none: what the XLA path gathers and the GPU kernel loads."""
    table_rows, ends = _row_positions(kv_lens, cu_q_lens, num_tokens)
    pos = ends[:, None] - sliding_window + jnp.arange(sliding_window, dtype=jnp.int32)
    window = _slots(window_tables, table_rows, pos, (pos >= 0) & (ends[:, None] > 0), window_rows)
    if entry_tables is None:
        return window, None
    if selected is None:
        width = entry_tables.shape[1] * entry_rows
        selected = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (num_tokens, width))
    chosen = (selected >= 0) & (selected < (ends // compress_rate)[:, None])
    return window, _slots(entry_tables, table_rows, selected, chosen, entry_rows)


def _keys_partial(q: jax.Array, k: jax.Array, valid: jax.Array, scale: float) -> merge.Partial:
    """Each row's partial over its keys: q `[T, H, D]`, k `[T, L, D]` (value = key), valid bool `[T, L]`."""
    s = jnp.einsum("thd,tld->thl", q, k, precision=HIGHEST, preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    e = jnp.exp(s - jnp.where(jnp.isneginf(m), 0.0, m)[..., None])
    u = jnp.einsum("thl,tld->thd", e, k.astype(jnp.float32), precision=HIGHEST)
    return merge.Partial(m, jnp.sum(e, axis=-1), u)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "compress_rate"))
def compressed_attention_xla(q: jax.Array,  # [T, H, D]
                             window_pages: jax.Array,  # [num_blocks, block_size, D]
                             window_tables: jax.Array,  # i32[S, max_blocks] of the window group
                             entry_pages: jax.Array | None,  # [num_blocks, block_size / m, D]; None: window only
                             entry_tables: jax.Array | None,  # i32[S, max_blocks] of the entries' group
                             kv_lens: jax.Array,  # i32[S]
                             cu_q_lens: jax.Array,  # i32[S + 1]
                             selected: jax.Array | None,  # i32[T, k] entries (-1 none); None: every closed one
                             sinks: jax.Array,  # f32[H]
                             *, scale: float, sliding_window: int, compress_rate: int | None) -> jax.Array:
    """`compressed_attention`'s XLA path: the slots' vectors gathered (`attention_slots`), the window's and the
    entries' partials merged exactly, the sink joined. Returns `[T, H, D]` in q's dtype."""
    window, entries = attention_slots(
        window_tables, entry_tables, kv_lens, cu_q_lens, selected, num_tokens=q.shape[0],
        window_rows=window_pages.shape[1], entry_rows=None if entry_pages is None else entry_pages.shape[1],
        sliding_window=sliding_window, compress_rate=compress_rate)
    part = _keys_partial(q, _gather(window_pages, window).astype(q.dtype), window >= 0, scale)
    if entries is not None:
        part = merge.merge_two(part, _keys_partial(q, _gather(entry_pages, entries).astype(q.dtype), entries >= 0,
                                                   scale))
    part = merge.join_sink(*part, sinks.astype(jnp.float32)[None, :])
    return merge.finalize(part.z, part.u, q.dtype)


def _check_attention(q, window_pages, window_tables, entry_pages, entry_tables, kv_lens, cu_q_lens, selected, sinks,
                     sliding_window, compress_rate) -> None:
    if getattr(q, "ndim", 0) != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a float [tokens, heads, head_dim] array, got {getattr(q, 'shape', q)}")
    num_tokens, num_heads, head_dim = q.shape
    if getattr(window_pages, "ndim", 0) != 3 or window_pages.shape[2] != head_dim:
        raise ValueError(f"window_pages must be [num_blocks, block_size, {head_dim}], got "
                         f"{getattr(window_pages, 'shape', window_pages)}")
    V.check_int32("window_tables", window_tables, 2)
    V.check_vector("kv_lens", kv_lens, window_tables.shape[0])
    V.check_vector("cu_q_lens", cu_q_lens, window_tables.shape[0] + 1)
    V.check_positive_int("sliding_window", sliding_window)
    if (entry_pages is None) != (entry_tables is None):
        raise ValueError("give entry_pages and entry_tables together (or neither: a window-only layer)")
    if entry_pages is not None:
        if getattr(entry_pages, "ndim", 0) != 3 or entry_pages.shape[2] != head_dim:
            raise ValueError(f"entry_pages must be [num_blocks, block_size / m, {head_dim}], got "
                             f"{getattr(entry_pages, 'shape', entry_pages)}")
        V.check_int32("entry_tables", entry_tables, 2)
        if entry_tables.shape[0] != window_tables.shape[0]:
            raise ValueError(f"entry_tables has {entry_tables.shape[0]} rows, window_tables "
                             f"{window_tables.shape[0]}: one per sequence")
        V.check_positive_int("compress_rate", compress_rate)
    elif selected is not None:
        raise ValueError("selected needs entry_pages (a CSA layer's entries)")
    if selected is not None:
        V.check_int32("selected", selected, 2)
        if selected.shape[0] != num_tokens:
            raise ValueError(f"selected must have one row per token ({num_tokens}), got {selected.shape}")
    if getattr(sinks, "shape", None) != (num_heads,):
        raise ValueError(f"sinks must be float [num_heads] = ({num_heads},), got {getattr(sinks, 'shape', sinks)}")


def compressed_attention(q: jax.Array,  # [T, H, D]
                         window_pages: jax.Array,  # [num_blocks, block_size, D]
                         window_tables: jax.Array,  # i32[S, max_blocks]
                         entry_pages: jax.Array | None,  # [num_blocks, block_size / m, D], or None
                         entry_tables: jax.Array | None,  # i32[S, max_blocks], or None
                         kv_lens: jax.Array,  # i32[S]
                         cu_q_lens: jax.Array,  # i32[S + 1]
                         selected: jax.Array | None,  # i32[T, k] (CSA), or None
                         sinks: jax.Array,  # f32[H]
                         *, scale: float, sliding_window: int, compress_rate: int | None = None,
                         target: str = "auto", interpret: bool | None = None, block_h: int | None = None,
                         block_k: int | None = None, num_warps: int | None = None,
                         num_stages: int = 2) -> jax.Array:
    """Each row's attention over its window (p - W, p] and its compressed entries (the `selected` ones, CSA; with
    `selected` None every entry its position has closed, HCA; with no entry pages the window alone) in one softmax
    with its head's sink; K = V. Target "gpu": the Triton kernel (`gpu.compressed`; the Pallas interpreter off a
    GPU); "tpu": the TPU sparse kernel's slot attention (`tpu.sparse.slot_attention_partials_tpu`: single-row DMAs
    of the slots) once over the window and once over the entries, their partials merged exactly with the sink
    (TPU interpret mode off a TPU). Tuning: `block_h` heads and `block_k` slots per program step (GPU: powers of two
    >= 16), `num_warps` and `num_stages` (GPU only). Returns `[T, H, D]` in q's dtype."""
    _check_attention(q, window_pages, window_tables, entry_pages, entry_tables, kv_lens, cu_q_lens, selected, sinks,
                     sliding_window, compress_rate)
    target = resolve_target(target, interpret)
    scale = V.resolve_scale(scale, q.shape[2])
    window, entries = attention_slots(
        window_tables, entry_tables, kv_lens, cu_q_lens, selected, num_tokens=q.shape[0],
        window_rows=window_pages.shape[1], entry_rows=None if entry_pages is None else entry_pages.shape[1],
        sliding_window=sliding_window, compress_rate=compress_rate)
    if target == "gpu":
        return compressed_attention_gpu(q, window_pages, window, entry_pages, entries, sinks, scale=scale,
                                        interpret=interpret, block_h=block_h, block_k=block_k, num_warps=num_warps,
                                        num_stages=num_stages)
    if num_warps is not None:
        raise ValueError("num_warps tunes the GPU kernel; target 'tpu' takes block_h and block_k only")
    if 0 in (q.shape[0], window_pages.shape[0]):
        return jnp.zeros(q.shape, q.dtype)
    partial = functools.partial(slot_attention_partials_tpu, q, scale=scale, interpret=interpret, block_h=block_h,
                                block_k=block_k)
    part = merge.Partial(*partial(window_pages, window))
    if entries is not None:
        part = merge.merge_two(part, merge.Partial(*partial(entry_pages, entries)))
    part = merge.join_sink(*part, sinks.astype(jnp.float32)[None, :])
    return merge.finalize(part.z, part.u, q.dtype)


def compressed_attention_reference(q: jax.Array,  # [n, H, D]: one sequence's queries at positions 0..n-1
                                   keys: jax.Array,  # [n, D]: its window vectors (K = V)
                                   entries: jax.Array | None,  # [n // m, D] its compressed entries, or None
                                   selected: jax.Array | None,  # i32[n, k] (-1 none), or None: every closed one
                                   sinks: jax.Array,  # f32[H]
                                   *, scale: float, sliding_window: int, compress_rate: int | None) -> jax.Array:
    """Dense ground truth for one whole sequence, as transformers computes it: scores over `[window keys | entries]`
    masked to (p - W, p] and the closed (selected) entries, the sink's logit appended, one softmax."""
    n = q.shape[0]
    p = jnp.arange(n)[:, None]
    kv = keys.astype(jnp.float32)
    mask = (jnp.arange(n)[None, :] <= p) & (jnp.arange(n)[None, :] > p - sliding_window)
    if entries is not None:
        w = jnp.arange(entries.shape[0])[None, :]
        closed = w < (p + 1) // compress_rate
        if selected is not None:
            hit = jnp.zeros((n, entries.shape[0] + 1), bool).at[
                jnp.arange(n)[:, None], jnp.where(selected >= 0, selected, entries.shape[0])].set(True)
            closed = closed & hit[:, :-1]
        kv = jnp.concatenate([kv, entries.astype(jnp.float32)])
        mask = jnp.concatenate([mask, closed], axis=1)
    s = jnp.einsum("thd,ld->thl", q.astype(jnp.float32), kv, precision=HIGHEST) * scale
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    s = jnp.concatenate([s, jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (n, q.shape[1], 1))], -1)
    probs = jax.nn.softmax(s, axis=-1)[..., :-1]
    return jnp.einsum("thl,ld->thd", probs, kv, precision=HIGHEST).astype(q.dtype)
