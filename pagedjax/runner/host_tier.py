"""The host tiers' bytes (`pagedjax.core.host_tier` keeps which key is in which slot): per block pool, one host
array per leaf of the pool's page arrays, `[slots, ...]` (the page array without its block axis), and the moves a
step plan lists, run before its step: every store (device to host) first, then the loads (host to device), so a
block evicted and reused in the same step is read before it is written. Counts of moved blocks are padded to powers
of two (a few compiled programs); the cache keeps its shardings.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.core.host_tier import TierMoves
from pagedjax.device.kv_cache import KVCache, read_blocks, write_blocks


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class HostBlocks:
    """`capacities[p]` host slots of pool p's blocks (0: no tier), shaped after `kv_cache`'s page arrays."""

    def __init__(self, kv_cache: KVCache, slot_pools: tuple[int, ...], capacities: tuple[int, ...]):
        self.slot_pools = slot_pools
        self.arrays: list[list[np.ndarray] | None] = []
        for pool, capacity in enumerate(capacities):
            if not capacity:
                self.arrays.append(None)
                continue
            leaves = [(type(layer).block_axis, x) for layer, p in zip(kv_cache.layers, slot_pools, strict=True)
                      if p == pool for x in jax.tree.leaves(layer)]
            self.arrays.append([np.zeros((capacity, *np.delete(np.array(x.shape), axis)), x.dtype)
                                for axis, x in leaves])
        self.bytes_stored = self.bytes_loaded = 0  # moved by `move`, and the seconds that took
        self.seconds = 0.0
        shardings = jax.tree.map(lambda x: x.sharding, kv_cache)
        self._read = jax.jit(read_blocks, static_argnames=("slot_pools", "pool"))
        self._write = jax.jit(write_blocks, static_argnames=("slot_pools", "pool"), donate_argnums=(0,),
                              out_shardings=shardings)

    def move(self, kv_cache: KVCache, moves: tuple[TierMoves, ...]) -> KVCache:
        """Run a plan's moves (one `TierMoves` per pool); returns the cache with the loaded blocks written."""
        start = time.perf_counter()
        for pool, m in enumerate(moves):
            if m.stores:
                blocks, slots = (np.array(x, np.int32) for x in zip(*m.stores, strict=True))
                padded = np.zeros(_bucket(len(blocks)), np.int32)
                padded[:len(blocks)] = blocks
                data = self._read(kv_cache, jnp.asarray(padded), slot_pools=self.slot_pools, pool=pool)
                for host, x in zip(self.arrays[pool], data, strict=True):
                    host[slots] = np.asarray(x)[:len(blocks)]
                    self.bytes_stored += host[0].nbytes * len(blocks)
        for pool, m in enumerate(moves):
            if m.loads:
                n = _bucket(len(m.loads))
                slots, blocks = np.zeros(n, np.int32), np.full(n, -1, np.int32)  # padding: slot 0, dropped
                slots[:len(m.loads)], blocks[:len(m.loads)] = zip(*m.loads, strict=True)
                values = [host[slots] for host in self.arrays[pool]]  # one gathered copy each
                kv_cache = self._write(kv_cache, jnp.asarray(blocks), values, slot_pools=self.slot_pools, pool=pool)
                self.bytes_loaded += sum(host[0].nbytes for host in self.arrays[pool]) * len(m.loads)
        if any(m.loads for m in moves):
            jax.block_until_ready(kv_cache)  # the loads' time, not the step's
        self.seconds += time.perf_counter() - start
        return kv_cache
