"""The paged KV cache as a pytree, and writing new entries into it by slot mapping.

What a layer's token slot holds is its KV cache spec (`pagedjax.config.kv_spec`, declared in
`ModelSpec.kv_layers`), which states its page arrays (`page_shapes`) in its kind's container:
  - `FullAttention`: `LayerKV`, `k` and `v` pages `[num_kv_heads, num_blocks, block_size, head_dim]` (with 8-bit
    pages, their scales `[num_kv_heads, num_blocks, block_size]` beside them);
  - `LatentAttention`: `LatentKV`, pages `[num_blocks, block_size, kv_lora_rank + rope_dim]` (with 8-bit pages,
    scales `[num_blocks, block_size]`);
  - `IndexedSparse`: `SparseKV`, those latent pages and the indexer keys `[num_blocks, block_size,
    index_head_dim]` (8-bit: each with its scales).
The cache holds one such set per page array (slot) of the model's KV cache layout (`pagedjax.config.kv_layout`:
a slot serves one layer of each KV cache group; a model of one group has one slot per layer) rather than one
stacked `[num_slots, ...]` array: a kernel is a custom call whose operands XLA must materialise, so slicing a layer
out of a stacked array would copy that layer's whole pool on every layer of every step. Per-slot leaves are donated
to each jitted step and updated in place. `stacked()` gives the `[num_layers, ...]` view of a full-attention
cache.

A slot is `block_id * block_size + offset`; slot -1 marks padding and is never written.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.config.cache import KV_SCALE_BYTES
from pagedjax.config.kv_layout import KVCacheLayout, kv_cache_layout
from pagedjax.config.kv_spec import KVCacheSpec, LatentKV, LayerKV, SparseKV
from pallas_kernels.quant import is_quantized, quantize_kv

__all__ = ["KVCache", "LatentKV", "LayerKV", "PagedLayer", "SparseKV", "copy_blocks", "init_kv_cache", "read_blocks",
           "write_blocks",
           "layer_shapes", "token_block_size", "write_kv", "write_latent", "write_sparse"]

PagedLayer = LayerKV | LatentKV | SparseKV  # the built-in kinds' containers (a model's own kind has its own)


class KVCache(NamedTuple):
    """`layers[s]`: page array (slot) s's pages, in its spec's container (`LayerKV`, `LatentKV`, ...)."""

    layers: tuple[NamedTuple, ...]

    @property
    def num_layers(self) -> int:
        """Page arrays (slots) held: the model's layers, for a model of one KV cache group."""
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        first = self.layers[0]
        return first[0].shape[type(first).block_axis]

    @property
    def block_size(self) -> int | None:
        """Tokens per block of the first page array (`token_block_size`)."""
        return token_block_size(self.layers[0])

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))

    @property
    def nbytes_per_device(self) -> int:
        """Bytes of the cache on each device it is spread over (`nbytes` on one device; a full-attention
        layer's share on each of tp devices when sharded by KV heads; latent pages are replicated)."""
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(self))

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """`(k, v)` of a full-attention cache as `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`
        arrays (a copy)."""
        if not all(isinstance(layer, LayerKV) for layer in self.layers):
            raise ValueError("KVCache.stacked: only a cache whose every layer is full attention (LayerKV) stacks")
        return jnp.stack([layer.k for layer in self.layers]), jnp.stack([layer.v for layer in self.layers])


def token_block_size(pages) -> int | None:
    """Tokens per block of a layer's pages of a built-in token kind (`LayerKV`, `LatentKV`, `SparseKV`: the token
    axis follows the block axis); None for other containers (a recurrent state's `StatePages` hold one snapshot per
    block, whose size in tokens the engine chose: `PagedKVCache.block_sizes`)."""
    if not isinstance(pages, LayerKV | LatentKV | SparseKV):
        return None
    return pages[0].shape[type(pages).block_axis + 1]


def layer_shapes(spec: KVCacheSpec, num_blocks: int, block_size: int, dtype, *,
                 num_kv_heads: int | None = None) -> NamedTuple:
    """The arrays (`jax.ShapeDtypeStruct`s) of one layer's pages for its spec (`spec.page_shapes`); an 8-bit
    `dtype` (int8, float8_e4m3fn) adds float32 scales. `num_kv_heads`: per-head pages' heads as stored, when it
    differs from the spec's (tensor parallelism past the KV heads repeats each)."""
    dtype = jnp.dtype(dtype)
    shapes = spec.page_shapes(num_blocks, block_size, dtype.name, quantized=is_quantized(dtype),
                              num_kv_heads=num_kv_heads)
    return type(shapes)(*(None if a is None else jax.ShapeDtypeStruct(a.shape, jnp.dtype(a.dtype))
                          for a in shapes))


def init_kv_cache(layout: KVCacheLayout | tuple[KVCacheSpec, ...], num_blocks: int, block_size: int,
                  dtype=jnp.float32, *, num_kv_heads: int | None = None, sharding_of=None,
                  extra_pools: tuple[int, ...] = ()) -> KVCache:
    """A zero-filled cache of `num_blocks` blocks of `block_size` slots for each page array of `layout` (a
    `KVCacheLayout`, or a model's per-layer specs, whose layout it is: `ModelSpec.kv_layout`) (`layer_shapes`;
    zero scales with zero values dequantize to exact zeros, as float pages start); the arrays of pool i > 0 (a
    recurrent state's snapshots) have `extra_pools[i - 1]` blocks. `sharding_of(spec)` gives the sharding of a
    spec's arrays: each device then allocates only its own shard. `num_kv_heads`: see `layer_shapes`."""
    if not isinstance(layout, KVCacheLayout):
        layout = kv_cache_layout(tuple(layout))
    pool_blocks = (num_blocks, *extra_pools)
    if len(pool_blocks) != len(layout.pools):
        raise ValueError(f"the layout has {len(layout.pools)} block pools ({', '.join(layout.pools)}): give the "
                         f"sizes of the {len(layout.pools) - 1} past the first as extra_pools, got {extra_pools}")
    dtype = jnp.dtype(dtype)
    makers: dict = {}

    def zeros(shape: jax.ShapeDtypeStruct | None, spec: KVCacheSpec):
        if shape is None:
            return None
        key = (shape.shape, shape.dtype, None if sharding_of is None else spec.heads_axis)
        if key not in makers:  # traced once per shape, called per array
            make = lambda: jnp.zeros(shape.shape, shape.dtype)
            makers[key] = make if sharding_of is None else jax.jit(make, out_shardings=sharding_of(spec))
        return makers[key]()

    cache = KVCache(tuple(
        type(shapes)(*(zeros(a, spec) for a in shapes))
        for spec, shapes in ((spec, layer_shapes(spec, pool_blocks[pool], block_size, dtype, num_kv_heads=num_kv_heads))
                             for spec, pool in zip(layout.slot_specs, layout.slot_pools, strict=True))))
    scale_bytes = KV_SCALE_BYTES if is_quantized(dtype) else 0
    element = 1 if scale_bytes else dtype.itemsize
    if num_kv_heads is None:
        assert cache.nbytes == sum(n * layout.bytes_per_block(block_size, element, scale_bytes, pool=p)
                                   for p, n in enumerate(pool_blocks))
    return cache


def write_kv(layer: LayerKV, k_new: jax.Array, v_new: jax.Array, slot_mapping: jax.Array) -> LayerKV:
    """Scatter new keys/values into one layer's pages; into 8-bit pages they are quantized on the way
    (`pallas_kernels.quant.quantize_kv`: one scale per token and KV head, scattered beside its values).

    layer:        the layer's pages (`LayerKV`)
    k_new, v_new: `[num_tokens, num_kv_heads, head_dim]`
    slot_mapping: int32 `[num_tokens]`; -1 = padding, dropped.
    """
    num_blocks, block_size = layer.k.shape[1], layer.k.shape[2]
    quantized = is_quantized(layer.k.dtype)
    if quantized != (layer.k_scales is not None and layer.v_scales is not None):
        raise ValueError(f"write_kv: pages of dtype {layer.k.dtype} need k_scales and v_scales exactly when they are "
                         "8-bit (int8, float8_e4m3fn)")
    # Padding goes to block index `num_blocks` (out of bounds), which mode="drop" discards.
    block = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    offset = jnp.where(slot_mapping < 0, 0, slot_mapping % block_size)
    # Adjacent advanced indices keep their place: the update has shape [heads, tokens(, dim)].
    scatter = lambda pages, new: pages.at[:, block, offset].set(jnp.swapaxes(new, 0, 1), mode="drop")
    if not quantized:
        return layer._replace(k=scatter(layer.k, k_new.astype(layer.k.dtype)),
                              v=scatter(layer.v, v_new.astype(layer.v.dtype)))
    k_values, k_scales = quantize_kv(k_new, layer.k.dtype)  # [T, Hkv, D], [T, Hkv]
    v_values, v_scales = quantize_kv(v_new, layer.v.dtype)
    return LayerKV(scatter(layer.k, k_values), scatter(layer.v, v_values),
                   scatter(layer.k_scales, k_scales.astype(layer.k_scales.dtype)),
                   scatter(layer.v_scales, v_scales.astype(layer.v_scales.dtype)))


def _write_rows(pages: jax.Array,  # [num_blocks, block_size, width]
                scales: jax.Array | None,  # [num_blocks, block_size], with 8-bit pages
                rows: jax.Array,  # [T, width]
                slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Scatter one vector per token into token-major pages; into 8-bit pages quantized on the way (one scale per
    token over its whole vector, as the kernels dequantize). Slot -1 (padding) is dropped."""
    num_blocks, block_size, width = pages.shape
    if rows.shape[-1] != width:
        raise ValueError(f"a token's vector of {rows.shape[-1]} does not fill the pages' entries of {width}")
    if is_quantized(pages.dtype) != (scales is not None):
        raise ValueError(f"pages of dtype {pages.dtype} need scales exactly when they are 8-bit")
    if rows.shape[0] == 1:
        # One row (a decode step of one sequence): written with a second, dropped row. XLA rewrites a one-index
        # scatter into a dynamic-update-slice, which it then fused into the attention's page gather (every layer
        # but the first): the update computed twice, once inside the gather over the old pages and once in place,
        # so the old pages had to be kept, a copy of each layer's whole pool per step (batch-1 decode of a 145M MLA
        # model ran 7x slower at 2k blocks than at 64; `scripts/bench_mla.py`). A two-index scatter stays a scatter.
        rows = jnp.concatenate([rows, jnp.zeros_like(rows)])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), -1, slot_mapping.dtype)])
    block = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)  # out of bounds: dropped
    offset = jnp.where(slot_mapping < 0, 0, slot_mapping % block_size)
    if scales is None:
        return pages.at[block, offset].set(rows.astype(pages.dtype), mode="drop"), None
    values, row_scales = quantize_kv(rows[:, None, :], pages.dtype)  # [T, 1, width], [T, 1]
    return (pages.at[block, offset].set(values[:, 0], mode="drop"),
            scales.at[block, offset].set(row_scales[:, 0].astype(scales.dtype), mode="drop"))


def write_latent(layer: LatentKV, c_kv: jax.Array, k_rope: jax.Array, slot_mapping: jax.Array) -> LatentKV:
    """Scatter new MLA entries `[c_kv | k_rope]` into one latent layer's pages (8-bit: one scale per entry).

    c_kv:         `[num_tokens, kv_lora_rank]`
    k_rope:       `[num_tokens, rope_dim]`
    slot_mapping: int32 `[num_tokens]`; -1 = padding, dropped.
    """
    width = layer.pages.shape[-1]
    if c_kv.shape[-1] + k_rope.shape[-1] != width:
        raise ValueError(f"write_latent: c_kv [.., {c_kv.shape[-1]}] and k_rope [.., {k_rope.shape[-1]}] do not "
                         f"fill the pages' entries of {width}")
    entry = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)  # [T, R + Dr]
    return LatentKV(*_write_rows(layer.pages, layer.scales, entry, slot_mapping))


def write_sparse(layer: SparseKV, c_kv: jax.Array, k_rope: jax.Array, k_index: jax.Array,
                 slot_mapping: jax.Array) -> SparseKV:
    """`write_latent` into a DSA layer's latent pages, and each token's indexer key `k_index` `[num_tokens,
    index_head_dim]` into the same slot of its indexer-key pages."""
    latent = write_latent(layer.latent, c_kv, k_rope, slot_mapping)
    index_keys, index_scales = _write_rows(layer.index_keys, layer.index_scales, k_index, slot_mapping)
    return SparseKV(latent.pages, index_keys, latent.scales, index_scales)


def copy_blocks(kv_cache: KVCache, block_copies: jax.Array, slot_pools: tuple[int, ...] | None = None) -> KVCache:
    """Copy whole blocks, every layer's pages (and 8-bit pages' scales): `block_copies` int32 `[C, 2]` rows
    (src, dst); dst -1 = padding. With several block pools (block ids are a pool's own), `[num_pools, C, 2]`: pool
    p's rows copy within the page arrays of pool p (`slot_pools[s]`: slot s's pool).

    All sources are read before any destination is written, so a block may be a source and, for another row,
    a destination in the same call (copy-on-write of blocks shared by forks; see `KVCacheManager.fork`)."""

    def copy_layer(layer: NamedTuple, copies: jax.Array) -> NamedTuple:
        where = (slice(None),) * type(layer).block_axis  # the axes before the blocks
        src, dst = copies[:, 0], copies[:, 1]
        dst = jnp.where(dst < 0, layer[0].shape[type(layer).block_axis], dst)  # out of bounds: dropped
        return jax.tree.map(lambda x: x.at[(*where, dst)].set(x[(*where, src)], mode="drop"), layer)

    if block_copies.ndim == 2:
        return KVCache(tuple(copy_layer(layer, block_copies) for layer in kv_cache.layers))
    return KVCache(tuple(copy_layer(layer, block_copies[pool])
                         for layer, pool in zip(kv_cache.layers, slot_pools, strict=True)))


def read_blocks(kv_cache: KVCache, blocks: jax.Array, slot_pools: tuple[int, ...], pool: int) -> list[jax.Array]:
    """The contents of `blocks` (int32 `[n]`) in every page array of block pool `pool` (`slot_pools[s]`: slot s's
    pool): one array per leaf of each of the pool's layers, in order, its block axis first (`[n, ...]`)."""
    out = []
    for layer, p in zip(kv_cache.layers, slot_pools, strict=True):
        if p == pool:
            axis = type(layer).block_axis
            out.extend(jnp.moveaxis(jnp.take(x, blocks, axis=axis), axis, 0) for x in jax.tree.leaves(layer))
    return out


def write_blocks(kv_cache: KVCache, blocks: jax.Array, values: list[jax.Array], slot_pools: tuple[int, ...],
                 pool: int) -> KVCache:
    """`read_blocks`' inverse: `values` (its layout) written into `blocks` (int32 `[n]`; -1 = padding, dropped)."""
    it = iter(values)
    layers = []
    for layer, p in zip(kv_cache.layers, slot_pools, strict=True):
        if p == pool:
            axis = type(layer).block_axis
            where = (slice(None),) * axis
            dst = jnp.where(blocks < 0, layer[0].shape[axis], blocks)  # out of bounds: dropped

            def put(x, v, where=where, dst=dst, axis=axis):
                return x.at[(*where, dst)].set(jnp.moveaxis(v, 0, axis).astype(x.dtype), mode="drop")

            layer = jax.tree.map(lambda x: put(x, next(it)), layer)
        layers.append(layer)
    return KVCache(tuple(layers))
