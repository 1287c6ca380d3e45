"""One KV cache group's block lists: which blocks each request holds for the group's layers, its prefix hits, its
copy-on-write, its release rule. The `KVCacheManager` (`pagedjax.core.kv_cache_manager`) coordinates one of these
per group over one shared `BlockPool`; nothing else calls them.

Plain Python, no JAX. A group's `block_size` is its pool's (a state pool's may be a multiple of the KV pool's: one
snapshot per that many tokens, `pagedjax.config.kv_layout`). Per group and request:
  - the blocks in logical order; logical block j holds token positions [j * block_size, (j + 1) * block_size);
    a leading block released out of the group's sliding window stays as `RELEASED` (-1), so block j is still
    entry j (block tables carry -1 there, which the kernels never read: a window skips whole pages before it);
  - how many leading blocks are published under their chained hash (`cache_blocks`), each keyed in the pool by
    the hash and the group (`pool_key`), so two groups never share a block: they hold other layers' KV;
  - a pending copy-on-write (src, dst) when the request writes into a block it shares with a fork;
  - the blocks lent to the device for a fused decode (held by the lender until adopted or returned).

A group may have its pool's host tier (`pagedjax.core.host_tier`, and a disk tier under it): a prefix hit's block
missing on the device is then looked up there (a block found only on disk is read into a host slot by the lookup),
a `host_entry` in the hit list, anywhere among the device blocks (a window group's leading blocks are evicted first:
those are the ones the host holds), which `allocate` gives a fresh block that the step loads before it computes; it
is published like a computed block once the step ran (`cache_blocks`), never before.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from pagedjax.core.block_pool import BlockHash, BlockPool
from pagedjax.core.host_tier import HostTier
from pagedjax.core.request import Request

# A request's block-list entry for a logical block released out of the sliding window.
RELEASED = -1


def host_entry(slot: int) -> int:
    """A prefix hit's entry for a block found in the host tier's `slot` (below RELEASED: never a block id)."""
    return -2 - slot


def host_slot(entry: int) -> int | None:
    """The host slot of a hit entry, None for a device block or RELEASED."""
    return -2 - entry if entry <= -2 else None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVGroupManager:
    """The block lists of one KV cache group (`group`, its index) with sliding window `sliding_window` (None: it
    keeps every block), over `pool`. Its blocks are `hash_stride` blocks of the chained block hashes long (the
    hashes every group is given: `KVCacheManager.block_hashes`); its block j is keyed by the hash of the last of
    them, which chains over every token up to the block's end."""

    def __init__(self, pool: BlockPool, block_size: int, *, group: int = 0, sliding_window: int | None = None,
                 hash_stride: int = 1, tier: HostTier | None = None):
        self.pool = pool
        self.tier = tier
        self.block_size = block_size
        self.hash_stride = hash_stride
        self.group = group
        self.sliding_window = sliding_window
        # Group 0's blocks are keyed by their chained hash, group g > 0's by the hash and g (`pool_key`).
        self._key_suffix = b"" if group == 0 else struct.pack("<H", group)
        self._req_blocks: dict[str, list[int]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # leading blocks of a request already published
        self._lent: set[int] = set()
        self._copies: dict[str, tuple[int, int]] = {}  # request id -> its pending (src, dst) block copy
        self._host_hits: dict[str, list[tuple[int, int]]] = {}  # request id -> (position, host slot) of each hit
        # its next allocation loads; until then the position holds the hit's `host_entry`

    def pool_key(self, block_hash: BlockHash) -> BlockHash:
        """The key this group's block of `block_hash` is cached under in the shared pool."""
        return block_hash + self._key_suffix

    def block_key(self, hashes: Sequence[BlockHash], j: int) -> BlockHash:
        """The pool key of this group's block j, from the chain of (KV) block hashes `hashes`."""
        return self.pool_key(hashes[(j + 1) * self.hash_stride - 1])

    # -- queries ---------------------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._req_blocks.get(request_id, ()))

    def holders(self) -> dict[str, tuple[int, ...]]:
        return {rid: tuple(blocks) for rid, blocks in self._req_blocks.items()}

    def holds(self, request_id: str) -> bool:
        return request_id in self._req_blocks

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._req_blocks.get(request_id, ()))

    def num_released_blocks(self, request_id: str) -> int:
        blocks = self._req_blocks.get(request_id, ())
        n = 0
        while n < len(blocks) and blocks[n] == RELEASED:
            n += 1
        return n

    @property
    def lent_block_ids(self) -> frozenset[int]:
        return frozenset(self._lent)

    def has_copy(self, request_id: str) -> bool:
        return request_id in self._copies

    def num_unread_blocks(self, num_computed_tokens: int) -> int:
        """How many leading blocks no query from position `num_computed_tokens` on reads (0 without a window)."""
        window = self.sliding_window
        if window is None:
            return 0
        # The query at position p reads positions > p - window; block j ends at position (j + 1) * block_size - 1,
        # so blocks j < (p - window + 1) // block_size are unread (all of them full, since window >= 1).
        return max(0, (num_computed_tokens - window + 1) // self.block_size)

    def longest_hit(self, hashes: Sequence[BlockHash], max_blocks: int, keep: set[int] | None = None) -> int:
        """The most leading blocks k <= `max_blocks` of a chain of hashes this group can serve as a prefix hit:
        every block a query at position k * block_size reads, i.e. blocks [unread(k), k), cached in this group, on
        the device or in the host tier, where a block found only on disk is read into a host slot now
        (`HostTier.find`); the host slots it finds join `keep` (none of them is dropped for another block read from
        disk in the same lookup, so `hit_blocks` finds them all)."""
        lookup = self.pool.get_cached_block
        keep = set() if keep is None else keep

        def present(j: int) -> bool:
            key = self.block_key(hashes, j)
            if lookup(key) is not None:
                return True
            slot = None if self.tier is None else self.tier.find(key, keep)
            if slot is not None:
                keep.add(slot)
            return slot is not None

        if self.sliding_window is None:  # every block from the first
            k = 0
            while k < max_blocks and present(k):
                k += 1
            return k
        k = max_blocks
        while k > 0:
            first = self.num_unread_blocks(k * self.block_size)
            j = k - 1
            while j >= first and present(j):
                j -= 1
            if j < first:
                return k
            # Block j is missing: a hit of k' in (j, k) reads it too (its first unread block is <= first <= j).
            k = j
        return 0

    def hit_blocks(self, hashes: Sequence[BlockHash], num_blocks: int) -> list[int]:
        """The cached blocks of a hit of `num_blocks` (`longest_hit` allows it), the leading ones no query from the
        hit's end on reads as `RELEASED`: those are not taken at all, so a long cached prefix costs no more blocks
        than computing it would."""
        lookup = self.pool.get_cached_block
        skip = self.num_unread_blocks(num_blocks * self.block_size)
        out = [RELEASED] * skip
        for j in range(skip, num_blocks):
            block = lookup(self.block_key(hashes, j))
            out.append(host_entry(self.tier.lookup(self.block_key(hashes, j))) if block is None else block)
        return out

    def needs_copy(self, request: Request) -> bool:
        """Whether the request's next token lands in a block it shares with another request (a fork)."""
        held = self._req_blocks.get(request.request_id)
        return bool(held) and request.num_computed_tokens % self.block_size != 0 and self.pool.ref_cnt(held[-1]) > 1

    def blocks_needed(self, request: Request, num_new_tokens: int, hits: Sequence[int]) -> int:
        """How many blocks of the free queue `allocate` would take (fresh ones, a copy-on-write's, idle hits)."""
        held = self._req_blocks.get(request.request_id)
        total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        fresh = cdiv(total, self.block_size) - (len(held) if held else 0) - len(hits)
        if num_new_tokens and self.needs_copy(request):
            return max(fresh, 0) + 1
        on_host = sum(1 for b in hits if host_slot(b) is not None)  # each loaded into a fresh block
        return max(fresh, 0) + on_host + sum(1 for b in hits if b != RELEASED and host_slot(b) is None
                                             and self.pool.ref_cnt(b) == 0)

    # -- mutations (the coordinator checks that they fit first) ----------------------------------------

    def check_hits(self, request: Request, hits: Sequence[int]) -> None:
        """ValueError unless `hits` may be added to the request (only to one holding no blocks, leading RELEASED)."""
        if hits and (self._req_blocks.get(request.request_id) or request.num_computed_tokens):
            raise ValueError("prefix hits can only be added to a request holding no blocks")
        taken = [b for b in hits if b != RELEASED]
        if RELEASED in hits[len(hits) - len(taken):]:
            raise ValueError("only leading prefix hits can be RELEASED")
        if self.tier is None and any(host_slot(b) is not None for b in taken):
            raise ValueError("host tier hits in a group without a host tier")

    def take_hits(self, request: Request, hits: Sequence[int]) -> None:
        """The request starts holding its prefix hits (`check_hits` passed): before any fresh block is allocated,
        so that no allocation evicts them."""
        rid = request.request_id
        held = self._req_blocks.setdefault(rid, [])
        self._num_hashed_blocks.setdefault(rid, 0)
        if not hits:
            return
        on_host = [(j, host_slot(b)) for j, b in enumerate(hits) if host_slot(b) is not None]
        self.pool.touch([b for b in hits if b != RELEASED and host_slot(b) is None])
        held.extend(hits)  # a host hit's position keeps its entry until `allocate` gives it a block
        # Hits are hashed already, up to the first host hit (a loaded block is published once its step ran).
        self._num_hashed_blocks[rid] = on_host[0][0] if on_host else len(held)
        if on_host:  # pinned now: no allocation may reuse their slots before the step loads them
            self._host_hits[rid] = on_host
            for _, slot in on_host:
                self.tier.pin_slot(slot)

    def allocate(self, request: Request, num_new_tokens: int, num_hits: int = 0) -> list[int]:
        """Make the request's blocks (its `num_hits` prefix hits taken) cover its computed tokens, the hits and
        `num_new_tokens` more; a write into its shared last block first replaces that block by a fresh one
        (copy-on-write, recorded for the step). Returns the fresh blocks. The coordinator checked that
        `blocks_needed` fits."""
        rid = request.request_id
        held = self._req_blocks.setdefault(rid, [])
        self._num_hashed_blocks.setdefault(rid, 0)
        total = request.num_computed_tokens + num_hits * self.block_size + num_new_tokens
        fresh = max(cdiv(total, self.block_size) - len(held), 0)
        copy = bool(num_new_tokens) and self.needs_copy(request)
        loads = self._host_hits.pop(rid, [])
        new_blocks = self.pool.allocate(len(loads) + fresh + copy)
        assert new_blocks is not None, "the coordinator let an allocation through that does not fit (a bug)"
        for (j, slot), block in zip(loads, new_blocks[:len(loads)], strict=True):  # the host hits take the first
            held[j] = block
            self.tier.load(slot, block)
        rest = new_blocks[len(loads):]
        if copy:
            src, dst = held[-1], rest[0]
            held[-1] = dst
            self.pool.free([src])  # the other holders keep it
            self._copies[rid] = (src, dst)
            held.extend(rest[1:])
        else:
            held.extend(rest)
        return new_blocks

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies = list(self._copies.values())
        self._copies.clear()
        return copies

    def fork(self, source: Request, child: Request) -> None:
        """The child shares every block the source holds for its computed tokens (one reference more each)."""
        blocks = self._req_blocks[source.request_id]
        n = source.num_computed_tokens
        shared = blocks[:cdiv(n, self.block_size)]
        self.pool.touch([b for b in shared if b != RELEASED])
        self._req_blocks[child.request_id] = list(shared)
        self._num_hashed_blocks[child.request_id] = min(self._num_hashed_blocks[source.request_id],
                                                        n // self.block_size)

    def cache_blocks(self, request: Request, hashes: Sequence[BlockHash]) -> int:
        """Publish the request's blocks full of computed KV and not yet published, under `hashes` (the request's
        chained block hashes). Returns how many got a key (one whose key another block holds stays unhashed)."""
        rid = request.request_id
        done = self._num_hashed_blocks.get(rid)
        if done is None:
            return 0
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= done:
            return 0
        blocks = self._req_blocks[rid]
        if num_full > len(blocks):
            raise RuntimeError(f"request {rid!r} has {request.num_computed_tokens} computed tokens "
                               f"but holds only {len(blocks)} blocks")
        n = 0
        for i in range(done, num_full):
            if blocks[i] != RELEASED and self.pool.block_hash(blocks[i]) is None:
                n += self.pool.cache_block(blocks[i], self.block_key(hashes, i))
        self._num_hashed_blocks[rid] = num_full
        return n

    def num_published(self, request_id: str) -> int | None:
        """Leading blocks of the request published (None: it holds no blocks)."""
        return self._num_hashed_blocks.get(request_id)

    def free(self, request_id: str) -> None:
        """Release every block the request holds: a group keeping every block tail-first (a prefix's later blocks
        are evicted first: every hit needs its first ones), a window group head-first (its last blocks are what
        the longest hit reads: they are evicted last)."""
        blocks = self._req_blocks.pop(request_id, None)
        self._num_hashed_blocks.pop(request_id, None)
        self._copies.pop(request_id, None)  # its step will not run: nothing to copy for it
        self._host_hits.pop(request_id, None)
        if blocks:
            live = [b for b in blocks if b != RELEASED]
            self.pool.free(live if self.sliding_window is not None else reversed(live))

    def release_past(self, request_id: str, keep: int) -> int:
        """Release the request's trailing blocks past its first `keep` (unhashed, held by it alone)."""
        held = self._req_blocks.get(request_id)
        if not held or len(held) <= keep:
            return 0
        extra = held[keep:]
        del held[keep:]
        self.pool.free(extra[::-1])
        return len(extra)

    def release_out_of_window(self, request: Request, *, caching: bool) -> int:
        """Release the request's leading blocks no query from its next position on can read; their hashes, once
        published, stay with them (`caching`: publishing is on, so they must be published first)."""
        blocks = self._req_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return 0
        end = min(self.num_unread_blocks(request.num_computed_tokens), len(blocks))
        if caching and end > self._num_hashed_blocks.get(request.request_id, 0):
            raise RuntimeError(f"request {request.request_id!r}: publish its full blocks (cache_blocks) before "
                               "releasing them")
        released = [b for b in blocks[:end] if b != RELEASED]
        if released:
            blocks[:end] = [RELEASED] * end
            self.pool.free(reversed(released))
        return len(released)

    def blocks_held_at(self, p: int, chunk: int) -> int:
        """Blocks a request holds during a step from `p` computed tokens computing `chunk` more (its leading unread
        blocks released or never taken)."""
        return cdiv(p + chunk, self.block_size) - self.num_unread_blocks(p)

    # -- fused decode ------------------------------------------------------------------------------------

    def lend(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        assert blocks is not None, "the coordinator let a loan through that does not fit (a bug)"
        self._lent.update(blocks)
        return blocks

    def return_lent(self, ids: list[int]) -> None:
        self.check_lent(ids)
        self._lent.difference_update(ids)
        self.pool.free(reversed(ids))

    def adopt(self, request_id: str, ids: list[int]) -> None:
        self.check_lent(ids)
        if request_id not in self._req_blocks:
            raise ValueError(f"request {request_id!r} holds no blocks; it cannot adopt any")
        self._lent.difference_update(ids)
        self._req_blocks[request_id].extend(ids)

    def check_lent(self, ids: list[int]) -> None:
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in {ids}")
        not_lent = [b for b in ids if b not in self._lent]
        if not_lent:
            raise ValueError(f"blocks {not_lent} are not lent")
