"""The KV write and paged attention of one layer under tensor parallelism: a `shard_map` over the `tp` axis,
so that each device writes and attends over its own KV heads with the unchanged single-device kernels (Pallas
or the XLA path). No collective is needed inside: a query head only ever reads its own KV head, and the heads
are split so that they sit on the same device (device d holds query heads [d, d+1) * Hq/tp and KV heads
[d, d+1) * Hkv/tp, or one replicated copy of KV head d // (tp / Hkv) when tp > Hkv). Attention sinks (one
logit per query head) are split as the query heads, so each device has its own heads' sinks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pagedjax.config.parallel import TP
from pagedjax.device import compressed
from pagedjax.device.attention import (
    AttentionMetadata,
    latent_attention,
    paged_attention,
    sparse_attend,
    sparse_attention,
)
from pagedjax.device.kv_cache import LayerKV, write_kv, write_latent, write_sparse

_HEADS = P(None, TP, None)  # [tokens, heads, head_dim] split by heads
_PAGES = P(TP)  # [kv_heads, blocks, block_size(, head_dim)] split by KV heads
_SINKS = P(TP)  # [heads] split as q's heads (None, no sinks: a spec over no arrays)


def sharded_write_and_attend(q: jax.Array,  # [T, Hq, D], any sharding (columns of q_proj: by heads)
                             k: jax.Array,  # [T, Hkv, D]
                             v: jax.Array,  # [T, Hkv, D]
                             layer: LayerKV,  # pages [Hs, N, block_size, D] (scales [Hs, N, block_size]) by heads
                             meta: AttentionMetadata,  # replicated
                             *, mesh: Mesh, backend: str, decode_only: bool,
                             sinks: jax.Array | None = None,  # [Hq], float: split as q's heads
                             **attention_options):
    """Write this step's K/V and attend, per device over its heads (Hs = max(Hkv, tp) stored heads).
    `attention_options` go to `device.attention.paged_attention` (scale, window, soft cap), and so do each
    device's `sinks` (its query heads'). Returns (o `[T, Hq, D]`, sharded by heads; the layer's pages)."""
    stored = layer.k.shape[0]
    if k.shape[1] != stored:  # tp > Hkv: KV head h is cached on the tp / Hkv devices that hold its query heads
        k = jnp.repeat(k, stored // k.shape[1], axis=1)
        v = jnp.repeat(v, stored // v.shape[1], axis=1)

    def local(q, k, v, layer, meta, sinks):
        layer = write_kv(layer, k, v, meta.slot_mapping)
        o = paged_attention(q, layer, meta, backend=backend, decode_only=decode_only, sinks=sinks,
                            **attention_options)
        return o, layer

    pages = jax.tree.map(lambda _: _PAGES, layer)  # every array of the layer is split by KV heads (axis 0)
    # check_vma off: pallas_call has no replication typing; every operand's spec is stated explicitly here.
    run = jax.shard_map(local, mesh=mesh, in_specs=(_HEADS, _HEADS, _HEADS, pages, P(), _SINKS),
                        out_specs=(_HEADS, pages), check_vma=False)
    return run(q, k, v, layer, meta, sinks)


def sharded_latent_write_and_attend(q_latent: jax.Array,  # [T, H, R], any sharding (by heads from q_b_proj)
                                    q_rope: jax.Array,  # [T, H, Dr]
                                    c_kv: jax.Array,  # [T, R], replicated
                                    k_rope: jax.Array,  # [T, Dr], replicated
                                    layer,  # LatentKV / SparseKV: replicated pages (one entry per token, all heads)
                                    meta: AttentionMetadata, *, mesh: Mesh, backend: str, decode_only: bool,
                                    scale: float, index=None, index_topk: int | None = None,
                                    index_scale: float | None = None, selected: jax.Array | None = None):
    """An MLA (or, with `index` = (q_index, index_weights, k_index), a DeepSeek sparse attention; with `selected`
    int32 `[T, k]`, a GLM-5 shared layer attending over those positions) layer under tensor parallelism: every
    device writes this step's entries into its whole copy of the latent pages (the same values everywhere, so the
    copies stay equal) and attends with its own query heads. No collective: a head reads only the shared latent
    entries. The indexer (replicated: its heads are not the attention's) scores and selects the same positions on
    every device. Returns (o_latent `[T, H, R]` sharded by heads, the layer, and for a sparse layer the indexer's
    tie count of `sparse_select` and its selection, the same on every device; None, None otherwise)."""

    def local(q_latent, q_rope, c_kv, k_rope, index, selected, layer, meta):
        if index is None:
            layer = write_latent(layer, c_kv, k_rope, meta.slot_mapping)
            if selected is None:
                return latent_attention(q_latent, q_rope, layer, meta, backend=backend, decode_only=decode_only,
                                        scale=scale), layer, None, None
            return sparse_attend(q_latent, q_rope, layer, meta, selected, backend=backend, decode_only=decode_only,
                                 scale=scale), layer, None, None
        q_index, weights, k_index = index
        layer = write_sparse(layer, c_kv, k_rope, k_index, meta.slot_mapping)
        o, ties, selected = sparse_attention(q_latent, q_rope, q_index, weights, layer, meta, backend=backend,
                                             decode_only=decode_only, scale=scale, index_scale=index_scale,
                                             index_topk=index_topk)
        return o, layer, ties, selected

    pages = jax.tree.map(lambda _: P(), layer)
    replicated = jax.tree.map(lambda _: P(), index)
    given = None if selected is None else P()
    chosen = None if index is None else P()
    run = jax.shard_map(local, mesh=mesh, in_specs=(_HEADS, _HEADS, P(), P(), replicated, given, pages, P()),
                        out_specs=(_HEADS, pages, chosen, chosen), check_vma=False)
    return run(q_latent, q_rope, c_kv, k_rope, index, selected, layer, meta)


def sharded_compressed_attend(q: jax.Array,  # [T, H, D], any sharding (columns of wq_b: by heads)
                              window_pages: jax.Array,  # replicated, this step's vectors written
                              window_meta: AttentionMetadata,
                              entry_pages: jax.Array | None,  # replicated, this step's entries written
                              entry_meta: AttentionMetadata | None,
                              selected: jax.Array | None,  # i32[T, k], the same on every device
                              sinks: jax.Array,  # f32[H]: split as q's heads
                              *, mesh: Mesh, **options) -> jax.Array:
    """DeepSeek V4's attention over its window and compressed entries under tensor parallelism: each device attends
    with its own query heads and their sinks over its whole copy of the pages (one shared K = V head, written with
    the same values on every device, as the latent pages are) and the indexer's selection, the same everywhere. No
    collective. `options` go to `device.compressed.attend`. Returns o `[T, H, D]` split by heads."""

    def local(q, sinks, window_pages, window_meta, entry_pages, entry_meta, selected):
        return compressed.attend(q, window_pages, window_meta, entry_pages, entry_meta, selected, sinks, **options)

    run = jax.shard_map(local, mesh=mesh, in_specs=(_HEADS, _SINKS, P(), P(), P(), P(), P()), out_specs=_HEADS,
                        check_vma=False)
    return run(q, sinks, window_pages, window_meta, entry_pages, entry_meta, selected)
