"""Memory accounting: KV waste and fragmentation of the paged pool, and a contiguous baseline allocator.

Plain Python + numpy, no JAX. Definitions (all in KV slots, one slot = one token's K and V in one layer
stack):

  reserved   slots in blocks held by requests (each physical block counted once, shared or not)
  used       reserved slots holding a computed token's KV
  wasted     reserved - used: the unfilled tail of each request's last block (internal fragmentation);
             a paged pool has no other waste, since any free block serves any request
  external   a paged pool has no external fragmentation by construction; `free_runs` /
             `largest_free_run` show how scattered the free block ids are (harmless here, fatal for a
             contiguous allocator, which `ContiguousAllocator` demonstrates)
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pagedjax.core.kv_cache_manager import RELEASED, KVCacheManager
from pagedjax.core.request import Request


@dataclass(frozen=True)
class KVMemoryStats:
    """The pool's memory at one moment. Blocks: free + used + cached == num_blocks."""

    num_blocks: int
    block_size: int
    num_used_blocks: int  # ref_cnt > 0 (lent blocks included)
    num_free_blocks: int  # idle, no hash
    num_cached_blocks: int  # idle, still hashed (reusable by a prefix hit until evicted)
    num_lent_blocks: int  # lent to a fused decode in flight
    slots_reserved: int  # in blocks held by requests (lent blocks excluded)
    slots_used: int  # reserved slots holding computed KV
    num_partial_blocks: int  # requests whose last block is not full
    # Maximal runs of consecutive idle block ids (how scattered free memory is: harmless when paged).
    # None unless computed (`with_free_runs`: O(num_blocks)).
    free_runs: int | None
    largest_free_run: int | None
    # Blocks held by requests in each KV cache group (`pagedjax.config.kv_layout`; one entry for a model of one
    # group): a window group's stay within its window while a full group's grow with the context.
    group_blocks: tuple[int, ...] = ()

    @property
    def slots_wasted(self) -> int:
        """Reserved but unused: the unfilled tails of partially filled blocks."""
        return self.slots_reserved - self.slots_used

    @property
    def waste_fraction(self) -> float:
        """Reserved-but-unused slots over reserved slots (0 when nothing is reserved)."""
        return self.slots_wasted / self.slots_reserved if self.slots_reserved else 0.0

    @property
    def block_usage(self) -> float:
        """Used blocks over all blocks."""
        return self.num_used_blocks / self.num_blocks

    @property
    def occupancy(self) -> float:
        """Slots holding KV over all slots of the pool."""
        return self.slots_used / (self.num_blocks * self.block_size)


def kv_memory_stats(manager: KVCacheManager, requests: Iterable[Request], *,
                    with_free_runs: bool = True) -> KVMemoryStats:
    """Snapshot of pool 0's memory use (the KV pool; a state pool's snapshots count in `group_blocks` only), given
    the requests holding blocks.

    A request's used slots are its `num_computed_tokens` (between `schedule` and `update` the tokens being
    computed in the step are not counted yet). A block shared by several requests (a prefix hit, or forks
    sharing their partial last block) holds the same tokens for all of them and is counted once.
    """
    pool = manager.block_pool
    first = manager.group_pools.index(0)  # a group of pool 0 (with a state pool, group 0 may be the state group)
    bs = manager.group_block_sizes[first]
    filled: dict[int, int] = {}  # held block of pool 0 -> slots of it holding computed KV
    group_held: list[set[int]] = [set() for _ in range(manager.num_groups)]
    partial = 0
    for r in requests:
        if not manager.holds(r.request_id):
            continue
        per_group = manager.per_group(manager.get_block_ids(r.request_id))
        for held, blocks, p in zip(group_held, per_group, manager.group_pools, strict=True):
            for i, b in enumerate(blocks):
                if b == RELEASED:  # out of the sliding window: back in the pool
                    continue
                held.add(b)
                if p == 0:
                    filled[b] = max(filled.get(b, 0), min(bs, max(0, r.num_computed_tokens - i * bs)))
        partial += len(per_group[first]) * bs > r.num_computed_tokens
    reserved = len(filled) * bs
    used = sum(filled.values())
    free_runs = largest = None
    if with_free_runs:
        free_runs = largest = 0
        free_mask = pool.ref_counts() == 0
        if free_mask.any():
            padded = np.concatenate([[False], free_mask, [False]]).astype(np.int8)
            edges = np.diff(padded)
            starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
            free_runs = len(starts)
            largest = int((ends - starts).max())
    return KVMemoryStats(
        num_blocks=pool.num_blocks, block_size=bs, num_used_blocks=pool.num_used, num_free_blocks=pool.num_free,
        num_cached_blocks=pool.num_cached, num_lent_blocks=len(manager.lent_block_ids), slots_reserved=reserved,
        slots_used=used, num_partial_blocks=partial, free_runs=free_runs, largest_free_run=largest,
        group_blocks=tuple(len(held) for held in group_held))


class ContiguousAllocator:
    """First-fit allocator of contiguous slot ranges in `[0, capacity)`: the pre-paging baseline.

    Each request reserves one contiguous range up front (its maximum or its exact final length), so a
    pool with enough free slots in total can still fail an allocation when no single hole is large enough
    (external fragmentation): `num_failures_despite_free` counts exactly those.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = []  # sorted starts of allocated ranges
        self._ranges: dict[int, int] = {}  # start -> length
        self._owner: dict[str, int] = {}  # request id -> start
        self.num_allocated = 0
        self.num_failures = 0
        self.num_failures_despite_free = 0

    @property
    def num_free(self) -> int:
        return self.capacity - self.num_allocated

    def holes(self) -> list[tuple[int, int]]:
        """Free ranges as (start, length), in address order."""
        out, cursor = [], 0
        for s in self._starts:
            if s > cursor:
                out.append((cursor, s - cursor))
            cursor = s + self._ranges[s]
        if cursor < self.capacity:
            out.append((cursor, self.capacity - cursor))
        return out

    def allocate(self, owner: str, size: int) -> int | None:
        """Reserve `size` contiguous slots for `owner` at the lowest address that fits; None if none does."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if owner in self._owner:
            raise ValueError(f"{owner!r} already holds a range")
        for start, length in self.holes():
            if length >= size:
                bisect.insort(self._starts, start)
                self._ranges[start] = size
                self._owner[owner] = start
                self.num_allocated += size
                return start
        self.num_failures += 1
        if self.num_free >= size:
            self.num_failures_despite_free += 1
        return None

    def free(self, owner: str) -> None:
        start = self._owner.pop(owner)
        self.num_allocated -= self._ranges.pop(start)
        self._starts.pop(bisect.bisect_left(self._starts, start))

    def largest_hole(self) -> int:
        return max((length for _, length in self.holes()), default=0)
