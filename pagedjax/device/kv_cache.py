"""The paged KV cache as a pytree, and writing new keys/values into it by slot mapping.

Layout: for each layer, `k` and `v` pages `[num_kv_heads, num_blocks, block_size, head_dim]` — the layout the
kernels take (with 8-bit pages, their scales `[num_kv_heads, num_blocks, block_size]` beside them: `LayerKV`).
The cache holds one such set per layer (a tuple of `num_layers` `LayerKV`s) rather than one
stacked `[num_layers, ...]` array: a kernel is a custom call whose operands XLA must materialise, so slicing a
layer out of a stacked array would copy that layer's whole pool on every layer of every step. Per-layer leaves
are donated to each jitted step and updated in place. `stacked()` gives the `[num_layers, ...]` view.

A slot is `block_id * block_size + offset`; slot -1 marks padding and is never written.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.config.cache import kv_cache_bytes
from pallas_kernels.quant import is_quantized, quantize_kv

SCALE_DTYPE = jnp.dtype(jnp.float32)  # of 8-bit pages' scales (`config.KV_SCALE_BYTES` bytes)


class LayerKV(NamedTuple):
    """One layer's pages. k, v: `[num_kv_heads, num_blocks, block_size, head_dim]`; k_scales, v_scales: float32
    `[num_kv_heads, num_blocks, block_size]` when k/v hold 8-bit values (`pallas_kernels.quant`), else None."""

    k: jax.Array
    v: jax.Array
    k_scales: jax.Array | None = None
    v_scales: jax.Array | None = None


class KVCache(NamedTuple):
    """`layers[l]`: layer l's pages (`LayerKV`)."""

    layers: tuple[LayerKV, ...]

    @property
    def k(self) -> tuple[jax.Array, ...]:
        return tuple(layer.k for layer in self.layers)

    @property
    def v(self) -> tuple[jax.Array, ...]:
        return tuple(layer.v for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return self.layers[0].k.shape[1]

    @property
    def block_size(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self))

    @property
    def nbytes_per_device(self) -> int:
        """Bytes of the cache on each device it is spread over (`nbytes` on one device; nbytes / tp when
        sharded by KV heads over tp devices)."""
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(self))

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """`(k, v)` as `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]` arrays (a copy)."""
        return jnp.stack(self.k), jnp.stack(self.v)


def init_kv_cache(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                  dtype=jnp.float32, *, sharding: jax.sharding.Sharding | None = None) -> KVCache:
    """A zero-filled cache of `num_blocks` blocks per layer; with `sharding` (e.g. by KV heads over a mesh),
    each device allocates only its own shard. An 8-bit `dtype` (int8, float8_e4m3fn) adds float32 scales
    `[num_kv_heads, num_blocks, block_size]` per layer for K and for V, sharded like the pages (by axis 0)."""
    dtype = jnp.dtype(dtype)
    quantized = is_quantized(dtype)

    def maker(shape, dtype):
        if sharding is None:
            return lambda: jnp.zeros(shape, dtype)
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)  # traced once, called per array

    pages = maker((num_kv_heads, num_blocks, block_size, head_dim), dtype)
    scales = maker((num_kv_heads, num_blocks, block_size), SCALE_DTYPE)

    def layer() -> LayerKV:
        if not quantized:
            return LayerKV(pages(), pages())
        # Zero scales with zero values dequantize to exact zeros, as float pages start.
        return LayerKV(pages(), pages(), scales(), scales())

    cache = KVCache(tuple(layer() for _ in range(num_layers)))
    expected = kv_cache_bytes(num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype.itemsize,
                              SCALE_DTYPE.itemsize if quantized else 0)
    assert cache.nbytes == expected
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


def copy_blocks(kv_cache: KVCache, block_copies: jax.Array) -> KVCache:
    """Copy whole blocks, every layer's K and V (and 8-bit pages' scales): `block_copies` int32 `[C, 2]` rows
    (src, dst); dst -1 = padding.

    All sources are read before any destination is written, so a block may be a source and, for another row,
    a destination in the same call (copy-on-write of blocks shared by forks; see `KVCacheManager.fork`)."""
    src, dst = block_copies[:, 0], block_copies[:, 1]
    dst = jnp.where(dst < 0, kv_cache.num_blocks, dst)  # out of bounds: dropped
    copy = lambda x: x.at[:, dst].set(x[:, src], mode="drop")
    return jax.tree.map(copy, kv_cache)
