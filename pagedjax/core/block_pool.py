"""The block pool: the single owner of the physical KV blocks, with prefix caching and LRU eviction.

Plain Python, no JAX. Blocks are named by their integer id in `[0, num_blocks)`; every id is a real,
usable block (there is no reserved null block: block tables are padded with 0, which is harmless because
kernels never read past a sequence's length and `slot_mapping` marks padding with -1).

Every block is in exactly one of three states:

    used     ref_cnt > 0                     held by running requests (or lent to the device)
    cached   ref_cnt == 0, has a block hash  idle but still findable by its hash; evicted lazily
    free     ref_cnt == 0, no hash           idle and holds nothing worth keeping

so `num_used + num_cached + num_free == num_blocks` always. The free queue holds exactly the zero-ref
blocks (cached and free), ordered by reuse priority: unhashed blocks at the front (they are worth nothing,
so they are reused first), hashed blocks behind them in LRU order (least recently released first).
Popping a hashed block for reuse evicts its hash (the block loses it; the hash map forgets it).

Block hashes are chained: `hash(parent_hash, token_ids_of_block, extra_keys)` over a canonical byte
encoding, with keyed BLAKE2b (256-bit) seeded per pool, so a hash identifies the whole prefix up to and
including its block, and a pool with another seed never produces the same hashes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

BlockHash = bytes
"""A 32-byte chained block hash."""

ExtraKeys = tuple[tuple[str, str], ...]
"""Extra (name, value) keys mixed into a block hash, e.g. (("adapter", "lora-a"), ("salt", "tenant-1"))."""

_HASH_VERSION = b"pagedjax-block-v1"
_ROOT_PARENT = bytes(32)  # the parent of a sequence's first block


def hash_key(seed: int) -> bytes:
    """The BLAKE2b key for a pool seeded with `seed` (any Python int)."""
    return hashlib.blake2b(repr(int(seed)).encode(), digest_size=32, person=b"pagedjax-seed").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = (),
                      *, key: bytes = b"") -> BlockHash:
    """Chained hash of one full block: keyed BLAKE2b-256 of a canonical, length-prefixed encoding.

    Encoding: version tag | parent hash (32 bytes; zeros for the first block) | u32 token count |
    tokens as little-endian int64 | u32 extra-key count | per key: u32 len, utf-8 name, u32 len, utf-8 value.
    Every field is fixed-size or length-prefixed, so different inputs never encode to the same bytes.
    """
    h = hashlib.blake2b(digest_size=32, key=key)
    h.update(_HASH_VERSION)
    h.update(_ROOT_PARENT if parent_hash is None else parent_hash)
    n = len(token_ids)
    h.update(struct.pack(f"<I{n}q", n, *token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for name, value in extra_keys:
        name_b, value_b = name.encode(), str(value).encode()
        h.update(struct.pack("<I", len(name_b)))
        h.update(name_b)
        h.update(struct.pack("<I", len(value_b)))
        h.update(value_b)
    return h.digest()


class FreeBlockQueue:
    """An intrusive doubly linked list of block ids: O(1) popleft, append, appendleft and remove.

    `_prev`/`_next` are indexed by block id; two sentinels (ids `n` and `n + 1`) mark the ends.
    Membership is tracked per block, so removing a block that is not queued is an error, not a corruption.
    """

    def __init__(self, num_blocks: int, initial: Iterable[int] = ()) -> None:
        self._head = num_blocks
        self._tail = num_blocks + 1
        self._prev = [-1] * (num_blocks + 2)
        self._next = [-1] * (num_blocks + 2)
        self._next[self._head] = self._tail
        self._prev[self._tail] = self._head
        self._queued = [False] * num_blocks
        self._len = 0
        for b in initial:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return self._queued[block_id]

    def __iter__(self) -> Iterator[int]:
        b = self._next[self._head]
        while b != self._tail:
            yield b
            b = self._next[b]

    def _link_after(self, anchor: int, block_id: int) -> None:
        if self._queued[block_id]:
            raise ValueError(f"block {block_id} is already in the free queue")
        nxt = self._next[anchor]
        self._prev[block_id], self._next[block_id] = anchor, nxt
        self._next[anchor] = block_id
        self._prev[nxt] = block_id
        self._queued[block_id] = True
        self._len += 1

    def append(self, block_id: int) -> None:
        """Queue `block_id` at the back (reused last)."""
        self._link_after(self._prev[self._tail], block_id)

    def appendleft(self, block_id: int) -> None:
        """Queue `block_id` at the front (reused first)."""
        self._link_after(self._head, block_id)

    def remove(self, block_id: int) -> None:
        if not self._queued[block_id]:
            raise ValueError(f"block {block_id} is not in the free queue")
        p, n = self._prev[block_id], self._next[block_id]
        self._next[p] = n
        self._prev[n] = p
        self._prev[block_id] = self._next[block_id] = -1
        self._queued[block_id] = False
        self._len -= 1

    def popleft(self) -> int:
        if self._len == 0:
            raise IndexError("pop from an empty free queue")
        b = self._next[self._head]
        self.remove(b)
        return b


class BlockPool:
    """Reference counts, block hashes and the LRU free queue for `num_blocks` physical blocks.

    Invariants (checked by `check_invariants`):
      - the free queue holds exactly the blocks with ref_cnt == 0; unhashed ones precede hashed ones
        unless a reset or caching being off made them all unhashed;
      - `_cached_block[h] == b` iff `_block_hash[b] == h` (one block per hash; a block has at most one hash);
      - only full blocks are hashed (the KV cache manager's duty: it hashes a block once its KV is computed).
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, hash_seed: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_seed = hash_seed
        self.hash_key = hash_key(hash_seed)
        self._ref_cnt = [0] * num_blocks
        self._allocations = [0] * num_blocks  # times each block was taken by `allocate`
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached_block: dict[BlockHash, int] = {}
        self.free_queue = FreeBlockQueue(num_blocks, range(num_blocks))
        self._num_cached_idle = 0  # zero-ref blocks that still have a hash
        self.num_evictions = 0
        # (hash, block) of each eviction since the owner last took them (`take_evictions`), while it keeps a list
        # (a host tier's: `pagedjax.core.host_tier`); None: not recorded.
        self.evictions: list[tuple[BlockHash, int]] | None = None

    # -- queries ---------------------------------------------------------------------------------------

    def hash_block(self, parent_hash: BlockHash | None, token_ids: Sequence[int],
                   extra_keys: ExtraKeys = ()) -> BlockHash:
        """This pool's (seeded) chained hash of one full block."""
        return hash_block_tokens(parent_hash, token_ids, extra_keys, key=self.hash_key)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def ref_counts(self) -> np.ndarray:
        """Every block's reference count, int32 [num_blocks] (a copy)."""
        return np.array(self._ref_cnt, dtype=np.int32)

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hash[block_id]

    def allocations(self, block_id: int) -> int:
        """How many times `allocate` has taken the block: a holder that finds the count it saw knows the block was
        not given to anyone else since (its contents are what it left there)."""
        return self._allocations[block_id]

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash` (used or idle), or None."""
        return self._cached_block.get(block_hash)

    def hashed_blocks(self) -> list[tuple[BlockHash, int]]:
        """(key, block) of every block with a hash, used or idle (a snapshot)."""
        return list(self._cached_block.items())

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: every zero-ref block, cached ones included (they get evicted)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Idle blocks that still hold a hash (findable by a later prefix lookup)."""
        return self._num_cached_idle

    @property
    def num_free(self) -> int:
        """Idle blocks holding no hash."""
        return len(self.free_queue) - self._num_cached_idle

    @property
    def num_hashed(self) -> int:
        """All blocks with a hash, used or idle."""
        return len(self._cached_block)

    def free_block_ids(self) -> list[int]:
        """The free queue front to back (next reused first)."""
        return list(self.free_queue)

    # -- mutations -------------------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks from the front of the free queue (evicting their hashes), each with ref_cnt 1.

        All or nothing: returns None, changing nothing, when fewer than `n` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self.free_queue):
            return None
        blocks = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b)
            self._ref_cnt[b] = 1
            self._allocations[b] += 1
            blocks.append(b)
        return blocks

    def _evict(self, block_id: int) -> None:
        h = self._block_hash[block_id]
        if h is None:
            return
        if self._ref_cnt[block_id] == 0:
            self._num_cached_idle -= 1
        del self._cached_block[h]
        self._block_hash[block_id] = None
        self.num_evictions += 1
        if self.evictions is not None:
            self.evictions.append((h, block_id))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a prefix-cache hit); an idle block leaves the free queue."""
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                self.free_queue.remove(b)
                if self._block_hash[b] is not None:
                    self._num_cached_idle -= 1
            self._ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given (callers pass a request's blocks
        tail-first). A block reaching zero joins the free queue: at the back if hashed (LRU: its prefix's
        later blocks are evicted before its earlier ones), at the front if not (reused first)."""
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise ValueError(f"block {b} freed more often than referenced")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                if self._block_hash[b] is not None:
                    self.free_queue.append(b)
                    self._num_cached_idle += 1
                else:
                    self.free_queue.appendleft(b)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a full, computed, used block under `block_hash`.

        Returns False (and leaves the block unhashed) if caching is off or another block in use already holds
        that hash: two requests that computed the same block concurrently keep one cached copy. An idle block
        holding it gives it up to this one (and, unhashed, is reused first): a request that recomputed a block it
        could not hit (another KV cache group missed, say) refreshes the cached copy, which its LRU place would
        otherwise evict soon.
        """
        if not self.enable_caching:
            return False
        if self._ref_cnt[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use; only used blocks can be cached")
        if self._block_hash[block_id] is not None:
            raise ValueError(f"block {block_id} already has a hash")
        old = self._cached_block.get(block_hash)
        if old is not None:
            if self._ref_cnt[old] > 0:
                return False
            self.free_queue.remove(old)  # idle and hashed: unhashed now, so it is reused first
            self._block_hash[old] = None
            self._num_cached_idle -= 1
            self.free_queue.appendleft(old)
        self._block_hash[block_id] = block_hash
        self._cached_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (returns False) while any block is in use or lent."""
        if self.num_used:
            return False
        self._cached_block.clear()
        self._block_hash = [None] * self.num_blocks
        self._num_cached_idle = 0
        return True

    # -- checking --------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (O(num_blocks); for tests)."""
        queued = list(self.free_queue)
        assert len(queued) == len(self.free_queue) == len(set(queued)), "free queue corrupt"
        zero_ref = {b for b in range(self.num_blocks) if self._ref_cnt[b] == 0}
        assert set(queued) == zero_ref, "free queue != zero-ref blocks"
        assert all(r >= 0 for r in self._ref_cnt), "negative refcount"
        for h, b in self._cached_block.items():
            assert self._block_hash[b] == h, f"hash map points at block {b} which holds another hash"
        hashed = [b for b in range(self.num_blocks) if self._block_hash[b] is not None]
        assert len(hashed) == len(self._cached_block), "a hashed block is missing from the hash map"
        assert self._num_cached_idle == sum(1 for b in queued if self._block_hash[b] is not None)
        hashed_flags = [self._block_hash[b] is not None for b in queued]
        assert hashed_flags == sorted(hashed_flags), "an unhashed block queued behind a hashed one"
        assert self.num_used + self.num_cached + self.num_free == self.num_blocks
        if not self.enable_caching:
            assert not self._cached_block
