"""The paged KV cache as a pytree, and writing new keys/values into it by slot mapping.

Layout: for each layer, `k` and `v` pages `[num_kv_heads, num_blocks, block_size, head_dim]` — the layout the
kernels take. The cache holds one such array per layer (a tuple of `num_layers` leaves) rather than one
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

from pagedjax.config import kv_cache_bytes


class KVCache(NamedTuple):
    """`k[l], v[l]`: `[num_kv_heads, num_blocks, block_size, head_dim]` for layer l."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)

    @property
    def nbytes_per_device(self) -> int:
        """Bytes of the cache on each device it is spread over (`nbytes` on one device; nbytes / tp when
        sharded by KV heads over tp devices)."""
        return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in self.k + self.v)

    def stacked(self) -> tuple[jax.Array, jax.Array]:
        """`(k, v)` as `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]` arrays (a copy)."""
        return jnp.stack(self.k), jnp.stack(self.v)


def init_kv_cache(num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                  dtype=jnp.float32, *, sharding: jax.sharding.Sharding | None = None) -> KVCache:
    """A zero-filled cache of `num_blocks` blocks per layer; with `sharding` (e.g. by KV heads over a mesh),
    each device allocates only its own shard."""
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if sharding is None:
        zeros = lambda: jnp.zeros(shape, dtype)
    else:
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    k = tuple(zeros() for _ in range(num_layers))
    v = tuple(zeros() for _ in range(num_layers))
    expected = kv_cache_bytes(num_layers, num_blocks * block_size, num_kv_heads, head_dim, jnp.dtype(dtype).itemsize)
    assert sum(a.nbytes for a in k + v) == expected
    return KVCache(k, v)


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k_new: jax.Array, v_new: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scatter new keys/values into one layer's pages.

    k_pages, v_pages: `[num_kv_heads, num_blocks, block_size, head_dim]`
    k_new, v_new:     `[num_tokens, num_kv_heads, head_dim]`
    slot_mapping:     int32 `[num_tokens]`; -1 = padding, dropped.
    """
    num_blocks, block_size = k_pages.shape[1], k_pages.shape[2]
    # Padding goes to block index `num_blocks` (out of bounds), which mode="drop" discards.
    block = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    offset = jnp.where(slot_mapping < 0, 0, slot_mapping % block_size)
    # Adjacent advanced indices keep their place: the update has shape [heads, tokens, dim].
    k_pages = k_pages.at[:, block, offset].set(k_new.astype(k_pages.dtype).transpose(1, 0, 2), mode="drop")
    v_pages = v_pages.at[:, block, offset].set(v_new.astype(v_pages.dtype).transpose(1, 0, 2), mode="drop")
    return k_pages, v_pages


def copy_blocks(kv_cache: KVCache, block_copies: jax.Array) -> KVCache:
    """Copy whole blocks, every layer's K and V: `block_copies` int32 `[C, 2]` rows (src, dst); dst -1 = padding.

    All sources are read before any destination is written, so a block may be a source and, for another row,
    a destination in the same call (copy-on-write of blocks shared by forks; see `KVCacheManager.fork`)."""
    src, dst = block_copies[:, 0], block_copies[:, 1]
    dst = jnp.where(dst < 0, kv_cache.num_blocks, dst)  # out of bounds: dropped
    k = tuple(x.at[:, dst].set(x[:, src], mode="drop") for x in kv_cache.k)
    v = tuple(x.at[:, dst].set(x[:, src], mode="drop") for x in kv_cache.v)
    return KVCache(k, v)
