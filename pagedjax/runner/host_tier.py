"""The host tiers' bytes (`pagedjax.core.host_tier` keeps which key is in which slot): per block pool, one host
array per leaf of the pool's page arrays, `[slots, ...]` (the page array without its block axis), and the moves a
step plan lists, run before its step: per pool, the fills (a disk tier file's bytes into a host slot), the stores
(device to host), the writes (a stored slot to its key's file) and the disk stores (a device block no host slot
took, to its file), then every load (host to device), so a block evicted and reused in the same step is read before
it is written. Counts of moved blocks are padded to powers of two (a few compiled programs); the cache keeps its
shardings.

A block's bytes on disk (`pagedjax.core.disk_tier`'s payload) are its slot's rows of the pool's host arrays, in
order, as numpy lays them out; `kv_identity` names what makes them differ, the disk tier's folder.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.core.disk_tier import DiskTier
from pagedjax.core.host_tier import TierMoves
from pagedjax.device.attention import resolve_backend
from pagedjax.device.kv_cache import KVCache, read_blocks, write_blocks

DISK_FORMAT = "pagedjax-kv-disk-1"  # a change to how a block's bytes are laid out changes every folder's name
DISK_CHUNK = 64  # device blocks read at once on their way to disk (a save of the whole pool: bounded host memory)


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kv_identity(params, setup: str) -> str:
    """A hex digest of everything that makes a pool's KV bytes differ, a disk tier's folder name: the bytes'
    layout, the weights (`params`: every leaf's path, shape, dtype and bytes) and `setup`, a description of the
    rest (the engine's: the model's class, config and KV spec, the KV dtype and block sizes, the block hashes' seed,
    the attention backend, the mesh, the platform and the JAX version: a parallel layout's or a compiler's
    arithmetic may differ in the last bits). Reads every weight once (about a gigabyte a second)."""
    h = hashlib.blake2b(digest_size=16, person=b"pagedjax-kvid")
    h.update(f"{DISK_FORMAT}\n{setup}".encode())
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        x = np.ascontiguousarray(jax.device_get(x))
        h.update(repr((jax.tree_util.keystr(path), x.shape, str(x.dtype))).encode())
        h.update(x.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


def kv_setup(model, spec, *, kv_dtype: str, pool_block_sizes: tuple[int, ...], hash_seed: int, backend: str,
             mesh) -> str:
    """`kv_identity`'s description of what, besides the weights, makes `model`'s KV bytes differ."""
    return "\n".join([f"{type(model).__module__}.{type(model).__qualname__}", repr(getattr(model, "config", None)),
                      repr(spec), f"kv {kv_dtype} blocks {pool_block_sizes} seed {hash_seed}",
                      f"backend {resolve_backend(backend)} mesh {None if mesh is None else dict(mesh.shape)}",
                      f"{jax.default_backend()} jax {jax.__version__}"])


def open_disk_tiers(directory: str, identity: str, blocks: tuple[int, ...]) -> tuple[DiskTier | None, ...]:
    """Pool p's disk tier of `blocks[p]` files (0: none) in `directory`/`identity`/pool`p`. Refused over several
    processes (`jax.distributed`): each process's scheduler must make the same plans, and what one finds on its
    disk another may not."""
    if jax.process_count() > 1:
        raise ValueError(f"CacheConfig.kv_disk_dir: a disk tier serves one process; this engine runs over "
                         f"{jax.process_count()} (jax.distributed), whose schedulers must make the same plans from "
                         "the same cache: leave the disk tier out (the host tier is the same on every process)")
    folders = [_pool_folder(directory, identity, p) for p in range(len(blocks))]
    return tuple(DiskTier(folder, n, tag) if n else None for (folder, tag), n in zip(folders, blocks, strict=True))


def reopen_disk_tiers(disks: tuple[DiskTier | None, ...], directory: str, identity: str) -> None:
    """Point `disks` (`open_disk_tiers`') at the folders of another identity (new weights)."""
    for p, disk in enumerate(disks):
        if disk is not None:
            disk.open(*_pool_folder(directory, identity, p))


def _pool_folder(directory: str, identity: str, pool: int) -> tuple[Path, bytes]:
    """Pool `pool`'s disk tier folder under `directory` for `identity`, and the tag its files' checksums take."""
    return Path(directory, identity, f"pool{pool}"), bytes.fromhex(identity) + pool.to_bytes(4, "little")


class HostBlocks:
    """`capacities[p]` host slots of pool p's blocks (0: no tier), shaped after `kv_cache`'s page arrays, over
    `disks[p]` (the disk tier whose files pool p's writes go to; empty: none)."""

    def __init__(self, kv_cache: KVCache, slot_pools: tuple[int, ...], capacities: tuple[int, ...],
                 disks: tuple[DiskTier | None, ...] = ()):
        self.slot_pools = slot_pools
        self.disks = disks or (None,) * len(capacities)
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
            for payload, slot in m.fills:
                self._fill(pool, slot, payload)
            if m.stores:
                blocks, slots = (np.array(x, np.int32) for x in zip(*m.stores, strict=True))
                padded = np.zeros(_bucket(len(blocks)), np.int32)
                padded[:len(blocks)] = blocks
                data = self._read(kv_cache, jnp.asarray(padded), slot_pools=self.slot_pools, pool=pool)
                for host, x in zip(self.arrays[pool], data, strict=True):
                    host[slots] = np.asarray(x)[:len(blocks)]
                    self.bytes_stored += host[0].nbytes * len(blocks)
            for slot, key in m.writes:
                self.disks[pool].write(key, b"".join(host[slot].tobytes() for host in self.arrays[pool]))
            for start in range(0, len(m.disk_stores), DISK_CHUNK):  # device blocks straight to their files
                chunk = m.disk_stores[start:start + DISK_CHUNK]
                blocks = np.zeros(_bucket(len(chunk)), np.int32)
                blocks[:len(chunk)] = [b for b, _ in chunk]
                data = [np.asarray(x) for x in self._read(kv_cache, jnp.asarray(blocks), slot_pools=self.slot_pools,
                                                           pool=pool)]
                for i, (_, key) in enumerate(chunk):
                    self.disks[pool].write(key, b"".join(x[i].tobytes() for x in data))
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

    def warmup(self, kv_cache: KVCache, pool_sizes: tuple[int, ...]) -> KVCache:
        """Compile and run once the moves of every padded count up to each tiered pool's size (`pool_sizes`), on
        padding that reads block 0 and writes nothing; returns the cache (its contents as they were)."""
        for pool, hosts in enumerate(self.arrays):
            if hosts is None:
                continue
            n = 1
            while True:
                self._read(kv_cache, jnp.zeros(n, jnp.int32), slot_pools=self.slot_pools, pool=pool)
                values = [np.zeros((n, *host.shape[1:]), host.dtype) for host in hosts]
                kv_cache = self._write(kv_cache, jnp.full(n, -1, jnp.int32), values, slot_pools=self.slot_pools,
                                       pool=pool)
                if n >= pool_sizes[pool]:
                    break
                n *= 2
        return jax.block_until_ready(kv_cache)

    def _fill(self, pool: int, slot: int, payload: bytes) -> None:
        hosts = self.arrays[pool]
        block_bytes = sum(host[0].nbytes for host in hosts)
        if len(payload) != block_bytes:
            raise RuntimeError(f"a disk tier block of {len(payload)} bytes for pool {pool}, whose blocks take "
                               f"{block_bytes} (a file of another layout in this folder)")
        offset = 0
        for host in hosts:
            host[slot] = np.frombuffer(payload, host.dtype, host[0].size, offset).reshape(host.shape[1:])
            offset += host[0].nbytes
