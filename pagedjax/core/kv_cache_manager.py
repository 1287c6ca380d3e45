"""The KV cache manager: which blocks each request holds, prefix-cache lookup, and block hashing.

Plain Python, no JAX. It sits between the scheduler and the `BlockPool`:

  - `get_computed_blocks(request)` walks the request's chain of full-block hashes from the first block and
    stops at the first miss; at most `num_tokens - 1` tokens count as computed, so the last token is always
    recomputed and a full hit still yields logits.
  - `allocate_slots(request, num_new_tokens, new_computed_blocks)` makes the request's blocks cover
    `num_computed_tokens + len(new_computed_blocks) * block_size + num_new_tokens` tokens. All or nothing:
    a failed allocation changes no reference count.
  - `cache_blocks(request)` publishes the request's blocks that became full, once their KV is computed
    (the scheduler calls it from `update`, after the step ran, so a hit never points at unwritten KV).
  - `free(request)` releases its blocks tail-first (a prefix's later blocks are evicted before its earlier
    ones).

Invariants:
  - a request holds blocks only between its admission and its preemption / finish / abort;
  - outside a step, a running request holds exactly `cdiv(num_computed_tokens, block_size)` blocks; its
    leading `num_computed_tokens // block_size` blocks are full, and hashed unless another block already
    held the same hash when they filled;
  - a block's ref_cnt == the number of requests holding it, plus 1 while it is lent to the device.

Forking (several samples of one prompt, beam search): `fork(source, child)` gives the child every block the
source holds, the partially filled last block included, with each block's ref_cnt raised. A request that is
about to write into a block it shares (ref_cnt > 1) first gets a private copy (copy-on-write):
`allocate_slots` replaces the shared block by a fresh one and records `(src, dst)`; the step copies those
blocks (every layer, K and V) on device before it writes its new KV (`take_block_copies`). Full shared
blocks are never written, so never copied.

Sliding windows: when every layer of the model attends only to its last `sliding_window` positions, a
running request's leading blocks that no future query can see are released (`release_out_of_window`, called
after each step, once their hashes are published). Their entries stay in the request's block list as
`RELEASED` (-1), so logical block j is still entry j: block tables carry -1 there, which the kernels never
read (a window skips whole pages before it). A released block that was published keeps its hash in the
free queue like any cached block; a prefix lookup walks the hash chain from the first block and stops at the
first miss, so a hit still always covers a prefix whose every block is present.

Fused decode borrows blocks with `lend_blocks`; the device pops them as sequences cross block
boundaries; the host then `adopt_blocks` the used ones and `return_lent_blocks` the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedjax.config import CacheConfig
from pagedjax.core.block_pool import BlockHash, BlockPool, ExtraKeys
from pagedjax.core.images import overlapping
from pagedjax.core.request import Request

# A request's block-list entry for a logical block released out of the sliding window (see the module doc).
RELEASED = -1


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 hash_seed: int = 0, sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        self.block_size = block_size
        # Positions older than `p - sliding_window` are read by no query at position >= p (None: all are read).
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching, hash_seed=hash_seed)
        self._req_blocks: dict[str, list[int]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # leading blocks of a request already published
        self._lent: set[int] = set()
        self._copies: dict[str, tuple[int, int]] = {}  # request id -> its pending (src, dst) block copy
        self.prefix_cache_queries = 0  # tokens looked up by first-time admissions
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    @classmethod
    def from_config(cls, cache_config: CacheConfig, num_blocks: int, *,
                    sliding_window: int | None = None) -> KVCacheManager:
        return cls(num_blocks, cache_config.block_size, enable_caching=cache_config.enable_prefix_caching,
                   hash_seed=cache_config.hash_seed, sliding_window=sliding_window)

    # -- queries ---------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free and idle cached ones)."""
        return self.block_pool.num_free_blocks

    @property
    def lent_block_ids(self) -> frozenset[int]:
        return frozenset(self._lent)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def get_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The blocks `request_id` holds, in logical order (a snapshot; empty if it holds none); `RELEASED`
        for leading blocks released out of the sliding window."""
        return tuple(self._req_blocks.get(request_id, ()))

    def holders(self) -> dict[str, tuple[int, ...]]:
        """request id -> the blocks it holds, for every request holding blocks (a snapshot)."""
        return {rid: tuple(blocks) for rid, blocks in self._req_blocks.items()}

    def num_held_blocks(self, request_id: str) -> int:
        """How many logical blocks `request_id` covers (those released out of the window included)."""
        return len(self._req_blocks.get(request_id, ()))

    def num_released_blocks(self, request_id: str) -> int:
        """How many of `request_id`'s leading blocks were released out of the sliding window."""
        blocks = self._req_blocks.get(request_id, ())
        n = 0
        while n < len(blocks) and blocks[n] == RELEASED:
            n += 1
        return n

    def extra_keys(self, request: Request, block_index: int) -> ExtraKeys:
        """Keys mixed into block `block_index`'s hash: the adapter in every block, the salt in the first, and the
        content hash of each image whose placeholder tokens fall in the block."""
        keys: list[tuple[str, str]] = []
        if request.adapter_id is not None:
            keys.append(("adapter", str(request.adapter_id)))
        if block_index == 0 and request.cache_salt is not None:
            keys.append(("salt", str(request.cache_salt)))
        if request.images:
            start = block_index * self.block_size
            images = overlapping(request.images, start, start + self.block_size)
            keys.extend(("image", im.content_hash) for im in images)
        return tuple(keys)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of every full block of the request's tokens (computed once, then extended)."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.get_token_ids(i * bs, (i + 1) * bs)
            hashes.append(self.block_pool.hash_block(parent, tokens, self.extra_keys(request, i)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of a request that holds no blocks: (its blocks, number of tokens).

        Walks the hash chain from the first block and stops at the first miss; at most
        `num_tokens - 1` tokens count, so the last token is recomputed. With a sliding window, the leading
        hits that no query from the hit's end on can read are `RELEASED` entries (as `release_out_of_window`
        leaves them): only the rest are taken by `allocate_slots`. Changes nothing.
        """
        if not self.enable_caching or request.num_computed_tokens or _recomputes_prompt(request):
            return [], 0
        if request.request_id in self._req_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        hashes = self.block_hashes(request)
        lookup = self.block_pool.get_cached_block
        blocks: list[int] = []
        for h in hashes[:max_blocks]:
            b = lookup(h)
            if b is None:
                break
            blocks.append(b)
        # With a sliding window the first query (at the hit's end) reads nothing before its window: those hits
        # are not taken at all, so a long cached prefix costs no more blocks than computing it would.
        skip = self._num_unread_blocks(len(blocks) * self.block_size)
        return [RELEASED] * skip + blocks[skip:], len(blocks) * self.block_size

    def next_block_hash(self, request: Request, num_hit_blocks: int) -> BlockHash | None:
        """The hash of the block where `get_computed_blocks` stopped (its first miss), or None if the
        lookup stopped at its cap (the last token is always recomputed) or caching is off."""
        if (not self.enable_caching or _recomputes_prompt(request)
                or num_hit_blocks >= (request.num_tokens - 1) // self.block_size):
            return None
        return self.block_hashes(request)[num_hit_blocks]

    def unpublished_block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the full blocks of a request holding blocks that are not published yet: the blocks
        of its known tokens it is computing now or will compute (empty when caching is off)."""
        done = self._num_hashed_blocks.get(request.request_id)
        if done is None or not self.enable_caching:
            return []
        return self.block_hashes(request)[done:]

    def needs_copy(self, request: Request) -> bool:
        """True when the request's next token lands in a block it shares with another request (a fork):
        writing it needs a copy-on-write first."""
        held = self._req_blocks.get(request.request_id)
        return bool(held) and request.num_computed_tokens % self.block_size != 0 and \
            self.block_pool.ref_cnt(held[-1]) > 1

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one first-time admission's lookup (tokens recomputed after a preemption are not hits)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- mutations -------------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Make the request's blocks cover its computed tokens, `new_computed_blocks` (prefix hits from
        `get_computed_blocks`, only for a request holding no blocks yet; its leading `RELEASED` entries are
        kept as such, not taken) and `num_new_tokens` more.

        Returns the freshly allocated blocks (possibly empty), or None when the free queue is too short:
        then nothing at all has changed (no reference count, no queue position).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        held = self._req_blocks.get(rid)
        if new_computed_blocks and (held or request.num_computed_tokens):
            raise ValueError("prefix hits can only be added to a request holding no blocks")
        pool = self.block_pool
        bs = self.block_size
        total = request.num_computed_tokens + len(new_computed_blocks) * bs + num_new_tokens
        num_held = len(held) if held else 0
        fresh = cdiv(total, bs) - num_held - len(new_computed_blocks)
        if num_new_tokens and self.needs_copy(request):
            return self._allocate_with_copy(request, max(fresh, 0))
        if fresh <= 0 and not new_computed_blocks:
            if held is None:
                self._req_blocks[rid] = []
                self._num_hashed_blocks[rid] = 0
            return []
        fresh = max(fresh, 0)
        taken = [b for b in new_computed_blocks if b != RELEASED]
        if RELEASED in new_computed_blocks[len(new_computed_blocks) - len(taken):]:
            raise ValueError("only leading prefix hits can be RELEASED")
        idle_hits = sum(1 for b in taken if pool.ref_cnt(b) == 0)
        if fresh + idle_hits > pool.num_free_blocks:
            return None
        if held is None:
            held = self._req_blocks[rid] = []
            self._num_hashed_blocks[rid] = 0
        if new_computed_blocks:
            pool.touch(taken)  # before allocating, so the hits cannot be evicted
            held.extend(new_computed_blocks)
            self._num_hashed_blocks[rid] = len(held)  # hits are hashed already
        new_blocks = pool.allocate(fresh)
        assert new_blocks is not None
        held.extend(new_blocks)
        return new_blocks

    def _allocate_with_copy(self, request: Request, fresh: int) -> list[int] | None:
        """`allocate_slots` for a request whose next write lands in its shared last block: one more fresh
        block replaces that block (its content copied on device before the step writes), all or nothing."""
        pool = self.block_pool
        new_blocks = pool.allocate(fresh + 1)
        if new_blocks is None:
            return None
        rid = request.request_id
        held = self._req_blocks[rid]
        src, dst = held[-1], new_blocks[0]
        held[-1] = dst
        pool.free([src])  # the other holders keep it
        self._copies[rid] = (src, dst)
        held.extend(new_blocks[1:])
        return new_blocks

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies the next step must make before it writes KV (and forget them)."""
        copies = list(self._copies.values())
        self._copies.clear()
        return copies

    def fork(self, source: Request, child: Request) -> None:
        """Let `child` (holding no blocks) share every block `source` holds: the child continues from the
        source's `num_computed_tokens` tokens, which must be the child's first tokens too. Each block gains a
        reference; the first write into a shared block copies it (see `allocate_slots`)."""
        blocks = self._req_blocks.get(source.request_id)
        if blocks is None:
            raise ValueError(f"request {source.request_id!r} holds no blocks; it cannot be forked")
        if child.request_id in self._req_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        if source.request_id in self._copies:
            raise ValueError(f"request {source.request_id!r} has a block copy pending; fork it between steps")
        n = source.num_computed_tokens
        if child.num_tokens < n or child.get_token_ids(0, n) != source.get_token_ids(0, n):
            raise ValueError(f"request {child.request_id!r} does not start with the {n} computed tokens of "
                             f"{source.request_id!r}")
        shared = blocks[:cdiv(n, self.block_size)]
        self.block_pool.touch([b for b in shared if b != RELEASED])
        self._req_blocks[child.request_id] = list(shared)
        full = n // self.block_size
        self._num_hashed_blocks[child.request_id] = min(self._num_hashed_blocks[source.request_id], full)
        child.block_hashes = list(source.block_hashes[:full])  # same tokens, same chained hashes

    def cache_blocks(self, request: Request) -> int:
        """Publish the request's blocks that are full of computed KV and not yet published.

        Returns how many blocks got a hash (a block whose hash another block already holds stays unhashed).
        """
        rid = request.request_id
        done = self._num_hashed_blocks.get(rid)
        if done is None or not self.enable_caching:
            return 0
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= done:
            return 0
        blocks = self._req_blocks[rid]
        if num_full > len(blocks):
            raise RuntimeError(f"request {rid!r} has {request.num_computed_tokens} computed tokens "
                               f"but holds only {len(blocks)} blocks")
        hashes = self.block_hashes(request)
        pool = self.block_pool
        n = 0
        for i in range(done, num_full):
            if blocks[i] != RELEASED and pool.block_hash(blocks[i]) is None:
                n += pool.cache_block(blocks[i], hashes[i])
        self._num_hashed_blocks[rid] = num_full
        return n

    def free(self, request: Request) -> None:
        """Release every block the request holds, tail-first. A no-op for a request holding none."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        self._copies.pop(request.request_id, None)  # its step will not run: nothing to copy for it
        if blocks:
            self.block_pool.free([b for b in reversed(blocks) if b != RELEASED])

    def release_past_computed(self, request: Request, num_new_tokens: int = 0) -> int:
        """Release the request's trailing blocks past `cdiv(num_computed_tokens + num_new_tokens, block_size)`: a
        speculative step allocated them for proposals that were rejected, or not made (`Scheduler.update`).
        They hold no computed KV, so they are unhashed, and were freshly allocated, so no one else holds them.
        Returns how many."""
        held = self._req_blocks.get(request.request_id)
        keep = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if not held or len(held) <= keep:
            return 0
        extra = held[keep:]
        del held[keep:]
        self.block_pool.free(extra[::-1])
        return len(extra)

    def release_out_of_window(self, request: Request) -> int:
        """Release the request's leading blocks that no query from its next position on can read (all of
        their positions < num_computed_tokens - sliding_window + 1); their hashes, once published, stay with
        them. Returns how many blocks were released now (0 without a sliding window)."""
        blocks = self._req_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return 0
        # (Publish first: cache_blocks hashes a block only while the request still holds it.)
        end = min(self._num_unread_blocks(request.num_computed_tokens), len(blocks))
        done = self._num_hashed_blocks.get(request.request_id, 0)
        if self.enable_caching and end > done:
            raise RuntimeError(f"request {request.request_id!r}: publish its full blocks (cache_blocks) before "
                               "releasing them")
        released = [b for b in blocks[:end] if b != RELEASED]
        if released:
            blocks[:end] = [RELEASED] * end
            self.block_pool.free(reversed(released))
        return len(released)

    def _num_unread_blocks(self, num_computed_tokens: int) -> int:
        """How many leading blocks no query from position `num_computed_tokens` on reads (0 without a window)."""
        window = self.sliding_window
        if window is None:
            return 0
        # The query at position p reads positions > p - window; block j ends at position (j + 1) * block_size - 1,
        # so blocks j < (p - window + 1) // block_size are unread (all of them full, since window >= 1).
        return max(0, (num_computed_tokens - window + 1) // self.block_size)

    def max_blocks_held(self, num_kv_tokens: int, max_chunk: int) -> int:
        """The most blocks a request holds at once (lent blocks aside) on its way to `num_kv_tokens` tokens of
        KV, when a step computes at most `max_chunk` of its tokens and allocates their blocks before it runs.

        A step from p computed tokens computing n = min(max_chunk, num_kv_tokens - p) tokens holds
        cdiv(p + n, block_size) blocks less the leading ones unread from p on: released after the previous step,
        or never taken from a prefix hit ending at p (`get_computed_blocks`). Any p can start a step of that
        size (a preempted request recomputes everything in chunks), so this is the maximum over p; without a
        window it is cdiv(num_kv_tokens, block_size).
        """
        T, B, C, W = num_kv_tokens, self.block_size, max_chunk, self.sliding_window
        if W is None or T <= C:  # (with T <= C, p = 0 computes everything at once: nothing is released yet)
            return cdiv(T, B)
        # Past p = T - C the step ends at T and more is released: no larger. Before p = W - 1 nothing is
        # released and the count grows with p; from there on it repeats with period B. So a few p suffice.
        last = T - C
        starts = {min(W - 2, last), *range(max(W - 1, last - B + 1), last + 1)}
        return max(cdiv(p + C, B) - self._num_unread_blocks(p) for p in starts if p >= 0)

    def max_kv_tokens_held(self, max_chunk: int, limit: int) -> int:
        """The most tokens of KV (at most `limit`) one request can reach in this pool: the largest T whose
        `max_blocks_held(T, max_chunk)` fits `num_blocks` (that count never falls as T grows)."""
        if self.max_blocks_held(limit, max_chunk) <= self.num_blocks:
            return limit
        lo, hi = 0, limit  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.max_blocks_held(mid, max_chunk) <= self.num_blocks:
                lo = mid
            else:
                hi = mid
        return lo

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; refused (False) while any block is in use or lent."""
        return self.block_pool.reset_prefix_cache()

    # -- fused decode -----------------------------------------------------------------------

    def lend_blocks(self, n: int) -> list[int] | None:
        """Lend `n` free blocks to the device (all or nothing; may evict cached blocks).

        Each lent block has ref_cnt 1, held by the lender, and no hash. Returns None if fewer are free.
        """
        blocks = self.block_pool.allocate(n)
        if blocks is not None:
            self._lent.update(blocks)
        return blocks

    def return_lent_blocks(self, block_ids: Sequence[int]) -> None:
        """Take back lent blocks the device did not use: they rejoin the free queue as unhashed blocks."""
        ids = [int(b) for b in block_ids]
        self._check_lent(ids)
        self._lent.difference_update(ids)
        self.block_pool.free(reversed(ids))

    def adopt_blocks(self, request: Request, block_ids: Sequence[int]) -> None:
        """Append lent blocks (in the order the device popped them) to the request's blocks; the
        lender's reference becomes the request's."""
        ids = [int(b) for b in block_ids]
        self._check_lent(ids)
        rid = request.request_id
        if rid not in self._req_blocks:
            raise ValueError(f"request {rid!r} holds no blocks; it cannot adopt any")
        self._lent.difference_update(ids)
        self._req_blocks[rid].extend(ids)

    def _check_lent(self, ids: list[int]) -> None:
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in {ids}")
        not_lent = [b for b in ids if b not in self._lent]
        if not_lent:
            raise ValueError(f"blocks {not_lent} are not lent")


def _recomputes_prompt(request: Request) -> bool:
    """A request collecting prompt log-probabilities takes no prefix-cache hits until it has them all:
    every prompt position must go through the model to have logits."""
    lps = request.prompt_logprobs
    # A multi-sample request's prefill computes all but the last prompt token, for the whole prompt's entries.
    prompt = request.group.request if request.prefill_only else request
    return lps is not None and len(lps) < prompt.num_prompt_tokens
