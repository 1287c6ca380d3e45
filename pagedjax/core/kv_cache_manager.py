"""The KV cache manager: which blocks each request holds in every KV cache group, prefix-cache lookup, and block
hashing; the one interface the scheduler has to the pool.

Plain Python, no JAX. A model's layers form KV cache groups (`pagedjax.config.kv_layout`: layers of equal specs;
one group for a model of one kind). Every group draws from one `BlockPool` (one allocator, one LRU, one hash index;
a block belongs to one group at a time) and keeps its own block list per request (`pagedjax.core.kv_group`). This
class coordinates them, so that everything the scheduler asks holds for all groups at once:

  - `get_computed_blocks(request)` finds the longest cached prefix every group can serve: a group keeping every
    block needs each of its blocks from the first, a window group only those its first query reads (the blocks
    inside its window at the hit's end; those before are not taken, `RELEASED`); at most `num_tokens - 1` tokens
    count, so the last token is always recomputed and a full hit still yields logits.
  - `allocate_slots(request, num_new_tokens, new_computed_blocks)` makes the request's blocks in every group cover
    `num_computed_tokens + hits + num_new_tokens` tokens. All or nothing across the groups: a failed allocation
    changes no reference count.
  - `cache_blocks(request)` publishes the request's blocks that became full, once their KV is computed
    (the scheduler calls it from `update`, after the step ran, so a hit never points at unwritten KV).
  - `free(request)` releases its blocks, a full group's tail-first (a prefix's later blocks are evicted before its
    earlier ones), a window group's head-first (its last blocks serve the longest hit).

Shapes: with one group, every per-request block quantity is a flat sequence of block ids, as it always was; with
several, it is a tuple with one such sequence per group (hits, held blocks, fresh blocks, lent and adopted blocks).

Invariants (per group):
  - a request holds blocks only between its admission and its preemption / finish / abort;
  - outside a step, a running request holds exactly `cdiv(num_computed_tokens, block_size)` logical blocks; its
    leading `num_computed_tokens // block_size` blocks are full, and hashed unless another block already
    held the same key when they filled;
  - a block's ref_cnt == the number of requests holding it, plus 1 while it is lent to the device.

Forking (several samples of one prompt, beam search): `fork(source, child)` gives the child every block the
source holds, the partially filled last block included, with each block's ref_cnt raised. A request that is
about to write into a block it shares (ref_cnt > 1) first gets a private copy (copy-on-write):
`allocate_slots` replaces the shared block by a fresh one and records `(src, dst)`; the step copies those
blocks (every page array) on device before it writes its new KV (`take_block_copies`). Full shared
blocks are never written, so never copied.

Sliding windows: a window group releases a running request's leading blocks that no future query can see
(`release_out_of_window`, called after each step, once their hashes are published), while groups without a
window keep theirs. Their entries stay in the request's block list as `RELEASED` (-1), so logical block j is
still entry j. A released block that was published keeps its key in the free queue like any cached block.

Fused decode borrows blocks with `lend_blocks` (as many for each group); the device pops them as sequences cross
block boundaries; the host then `adopt_blocks` the used ones and `return_lent_blocks` the rest.

Host tiers (`host_tier_blocks`: slots per pool, 0 for none; `pagedjax.core.host_tier`), each over a disk tier
(`disk_tiers`: a `DiskTier` or None per pool): the cached blocks a pool evicts while allocating are offered to its
tier, and every group of the pool finds hits there too (the host tier's, then the disk's). The moves a
step must make (stores out, loads in: `take_tier_moves`) become real with `commit_tier_moves` once it ran, or are
undone with `discard_tier_moves`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagedjax.config import CacheConfig
from pagedjax.core.block_pool import BlockHash, BlockPool, ExtraKeys
from pagedjax.core.disk_tier import DiskTier
from pagedjax.core.host_tier import HostTier, TierMoves
from pagedjax.core.images import overlapping
from pagedjax.core.kv_group import RELEASED, KVGroupManager, cdiv, host_slot
from pagedjax.core.request import Request

__all__ = ["RELEASED", "KVCacheManager", "cdiv"]


def _check_window(window) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {window!r}")


class KVCacheManager:
    """The block lists of every KV cache group over its block pool. `sliding_window`: a model of one group's window
    (None: every block is kept); `group_windows`: one release window (or None) per group of a model of several, and
    `group_pools` each group's pool (default: all in the one pool). Pool 0 has `num_blocks` blocks, pool i > 0
    `extra_pools[i - 1]` (a recurrent state's snapshots: `pagedjax.config.kv_layout`). A pool's blocks are
    `pool_block_sizes[i]` tokens long (default: `block_size` each), each a multiple of `block_size`, the tokens of
    one chained block hash (`block_hashes`): a state pool's snapshot covers that many tokens."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True,
                 hash_seed: int = 0, sliding_window: int | None = None,
                 group_windows: Sequence[int | None] | None = None, group_pools: Sequence[int] | None = None,
                 extra_pools: Sequence[int] = (), pool_block_sizes: Sequence[int] = (),
                 host_tier_blocks: Sequence[int] = (), disk_tiers: Sequence[DiskTier | None] = (),
                 drop_last_hit_block: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if group_windows is not None and sliding_window is not None:
            raise ValueError("give sliding_window (one group) or group_windows (one per group), not both")
        windows = (sliding_window,) if group_windows is None else tuple(group_windows)
        if not windows:
            raise ValueError("group_windows must name at least one group")
        for window in windows:
            _check_window(window)
        pools = (0,) * len(windows) if group_pools is None else tuple(group_pools)
        sizes = (num_blocks, *extra_pools)
        if len(pools) != len(windows) or sorted(set(pools)) != list(range(len(sizes))):
            raise ValueError(f"group_pools {pools} must give each of the {len(windows)} groups one of the "
                             f"{len(sizes)} pools, and every pool a group")
        pool_block_sizes = tuple(pool_block_sizes) or (block_size,) * len(sizes)
        if len(pool_block_sizes) != len(sizes) or any(b < 1 or b % block_size for b in pool_block_sizes):
            raise ValueError(f"pool_block_sizes {pool_block_sizes} must give each of the {len(sizes)} pools a "
                             f"multiple of block_size {block_size}")
        host_tier_blocks = tuple(host_tier_blocks) or (0,) * len(sizes)
        if len(host_tier_blocks) != len(sizes) or any(n < 0 for n in host_tier_blocks):
            raise ValueError(f"host_tier_blocks {host_tier_blocks} must give each of the {len(sizes)} pools a "
                             "number of host slots (0: no tier)")
        if any(host_tier_blocks) and not enable_caching:
            raise ValueError("a host tier keeps prefix-cache blocks: it needs prefix caching on")
        disk_tiers = tuple(disk_tiers) or (None,) * len(sizes)
        if len(disk_tiers) != len(sizes) or any(d is not None and not n for d, n in zip(disk_tiers, host_tier_blocks,
                                                                                        strict=True)):
            raise ValueError(f"disk_tiers must give each of the {len(sizes)} pools a DiskTier or None, and only a "
                             "pool with a host tier a disk tier (blocks reach the disk through host memory)")
        self.block_size = block_size
        self.enable_caching = enable_caching
        # A prefix hit ends one block (every group's) before the longest cached prefix, so that the block ending it is
        # computed again: an MTP head's KV at a position depends on the token after it (`pagedjax.spec_decode.mtp`),
        # which the request that cached the block may have had otherwise. As vLLM does for EAGLE.
        self.drop_last_hit_block = drop_last_hit_block
        self.pools = tuple(BlockPool(n, enable_caching=enable_caching, hash_seed=hash_seed) for n in sizes)
        self.tiers = tuple(HostTier(n, disk) if n else None
                           for n, disk in zip(host_tier_blocks, disk_tiers, strict=True))
        for pool, tier in zip(self.pools, self.tiers, strict=True):
            if tier is not None:
                pool.evictions = []
        self.groups = tuple(KVGroupManager(self.pools[p], pool_block_sizes[p], group=g, sliding_window=w,
                                           hash_stride=pool_block_sizes[p] // block_size, tier=self.tiers[p])
                            for g, (w, p) in enumerate(zip(windows, pools, strict=True)))
        self.group_pools = pools
        self.prefix_cache_queries = 0  # tokens looked up by first-time admissions
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self.host_hit_tokens = 0  # tokens of prefix hits (any admission) loaded from the host tiers (or disk)

    @classmethod
    def from_config(cls, cache_config: CacheConfig, num_blocks: int, *, sliding_window: int | None = None,
                    group_windows: Sequence[int | None] | None = None, group_pools: Sequence[int] | None = None,
                    extra_pools: Sequence[int] = (), pool_block_sizes: Sequence[int] = (),
                    host_tier_blocks: Sequence[int] = (), disk_tiers: Sequence[DiskTier | None] = (),
                    drop_last_hit_block: bool = False) -> KVCacheManager:
        return cls(num_blocks, cache_config.block_size, enable_caching=cache_config.enable_prefix_caching,
                   hash_seed=cache_config.hash_seed, sliding_window=sliding_window, group_windows=group_windows,
                   group_pools=group_pools, extra_pools=extra_pools, pool_block_sizes=pool_block_sizes,
                   host_tier_blocks=host_tier_blocks, disk_tiers=disk_tiers, drop_last_hit_block=drop_last_hit_block)

    @property
    def block_pool(self) -> BlockPool:
        """Pool 0 (the KV pool of token pages where there is one)."""
        return self.pools[0]

    def _by_pool(self) -> list[list[KVGroupManager]]:
        out: list[list[KVGroupManager]] = [[] for _ in self.pools]
        for group, p in zip(self.groups, self.group_pools, strict=True):
            out[p].append(group)
        return out

    # -- one value per group: flat for one group, a tuple for several ----------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each group's sliding window (None: it keeps every block)."""
        return tuple(g.sliding_window for g in self.groups)

    @property
    def group_block_sizes(self) -> tuple[int, ...]:
        """Each group's block size (its pool's) in tokens."""
        return tuple(g.block_size for g in self.groups)

    def pool_block_size(self, pool: int) -> int:
        """Pool `pool`'s block size in tokens."""
        return self._by_pool()[pool][0].block_size

    @property
    def sliding_window(self) -> int | None:
        """A one-group manager's window (a manager of several groups has one per group: `group_windows`)."""
        if self.num_groups != 1:
            raise RuntimeError(f"this manager has {self.num_groups} KV cache groups, a window each: group_windows")
        return self.groups[0].sliding_window

    def _out(self, per_group: list):
        return per_group[0] if len(self.groups) == 1 else tuple(per_group)

    def _in(self, value, what: str) -> list:
        if len(self.groups) == 1:
            return [value]
        value = list(value)
        if len(value) != len(self.groups):
            raise ValueError(f"{what}: one entry per KV cache group ({len(self.groups)}), got {len(value)}")
        return value

    def per_group(self, value) -> list:
        """A per-request block quantity of this manager (flat for one group) as one entry per group."""
        return self._in(value, "per_group")

    def from_groups(self, per_group: list):
        """One entry per group as this manager takes it (flat for one group): `per_group`'s inverse."""
        return self._out(list(per_group))

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
        """Blocks of pool 0 lent to the device (every pool's: `lent_per_pool`)."""
        return self.lent_per_pool()[0]

    def lent_per_pool(self) -> list[frozenset[int]]:
        """Each pool's blocks lent to the device (block ids are a pool's own)."""
        return [frozenset().union(*(g.lent_block_ids for g in groups)) for groups in self._by_pool()]

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def get_block_ids(self, request_id: str):
        """The blocks `request_id` holds, in logical order (a snapshot; empty if it holds none); `RELEASED`
        for leading blocks released out of a sliding window. One tuple per group for several groups."""
        return self._out([g.get_block_ids(request_id) for g in self.groups])

    def holders(self) -> dict:
        """request id -> the blocks it holds (as `get_block_ids`), for every request holding blocks."""
        return {rid: self.get_block_ids(rid) for rid in self.groups[0].holders()}

    def num_held_blocks(self, request_id: str):
        """How many logical blocks `request_id` covers in each group (released ones included; per group for
        several: `cdiv(tokens, block_size)` of the group's block size)."""
        return self._out([g.num_held_blocks(request_id) for g in self.groups])

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` holds blocks (it does in every group from its admission to its end)."""
        return self.groups[0].holds(request_id)

    def blocks_to_cover(self, request: Request, num_tokens: int):
        """How many blocks (per group for several) the request needs beyond those it holds to cover its first
        `num_tokens` tokens."""
        return self._out([max(cdiv(num_tokens, g.block_size) - g.num_held_blocks(request.request_id), 0)
                          for g in self.groups])

    def num_released_blocks(self, request_id: str):
        """How many of `request_id`'s leading blocks were released out of the sliding window (per group)."""
        return self._out([g.num_released_blocks(request_id) for g in self.groups])

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
        """Chained hashes of every full block of the request's tokens (computed once, then extended); every group
        keys its blocks by these (`KVGroupManager.pool_key`)."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = request.num_tokens // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            tokens = request.get_token_ids(i * bs, (i + 1) * bs)
            hashes.append(self.block_pool.hash_block(parent, tokens, self.extra_keys(request, i)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple:
        """The longest cached prefix of a request that holds no blocks that every group can serve: (its blocks,
        per group as `get_block_ids`, the leading ones a window group's first query does not read `RELEASED`;
        number of tokens). At most `num_tokens - 1` tokens count, so the last token is recomputed; with
        `drop_last_hit_block`, the hit's last block (of every group) is left out too. Changes nothing."""
        none = self._out([[] for _ in self.groups]), 0
        if not self.enable_caching or request.num_computed_tokens or _recomputes_prompt(request):
            return none
        if any(g.holds(request.request_id) for g in self.groups):
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        k = (request.num_tokens - 1) // self.block_size
        if k <= 0:
            return none
        hashes = self.block_hashes(request)
        keep: set[int] = set()  # host slots this lookup found: blocks read from disk go to none of them
        k = self._served(hashes, k, keep)
        if self.drop_last_hit_block and k:
            k = self._served(hashes, k - math.lcm(*(g.hash_stride for g in self.groups)), keep)
        if k <= 0:
            return none
        return (self._out([g.hit_blocks(hashes, k // g.hash_stride) for g in self.groups]),
                k * self.block_size)

    def _served(self, hashes: list[BlockHash], k: int, keep: set[int]) -> int:
        """The largest hit of at most k blocks every group serves (a window group's hits are not nested)."""
        settled = False
        while not settled:
            settled = True
            for group in self.groups:  # in blocks of the hashes; a group's blocks are `hash_stride` of them
                served = group.longest_hit(hashes, k // group.hash_stride, keep) * group.hash_stride
                if served < k:
                    k, settled = served, False
        return k

    def next_block_hash(self, request: Request, num_hit_blocks: int) -> BlockHash | None:
        """The hash a longer hit than `get_computed_blocks`' (of `num_hit_blocks` blocks) needs first: the next
        block's, or with groups of larger blocks (a state pool's) the one ending the next block every group can
        serve (a hit ends at a multiple of every group's block); None if no longer hit fits below the cap (the last
        token is always recomputed) or caching is off."""
        step = math.lcm(*(g.hash_stride for g in self.groups))
        # the next hit every group can serve (one more step past it with `drop_last_hit_block`)
        end = num_hit_blocks + step * (2 if self.drop_last_hit_block else 1)
        if (not self.enable_caching or _recomputes_prompt(request)
                or end > (request.num_tokens - 1) // self.block_size):
            return None
        return self.block_hashes(request)[end - 1]

    def unpublished_block_hashes(self, request: Request) -> list[BlockHash]:
        """The keys a request holding blocks has yet to publish (empty when caching is off): in each group, the
        hash of each of its blocks full of the request's known tokens that is not published yet, which the request
        is computing now or will compute. A group of larger blocks publishes fewer (a state pool's block ends only
        at a multiple of its size)."""
        if not self.enable_caching or not self.holds(request.request_id):
            return []
        hashes = self.block_hashes(request)
        return [hashes[(j + 1) * g.hash_stride - 1] for g in self.groups
                for j in range(g.num_published(request.request_id), len(hashes) // g.hash_stride)]

    def needs_copy(self, request: Request) -> bool:
        """True when the request's next token lands in a block it shares with another request (a fork):
        writing it needs a copy-on-write first."""
        return any(g.needs_copy(request) for g in self.groups)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one first-time admission's lookup (tokens recomputed after a preemption are not hits)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_query_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- mutations -------------------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks=()):
        """Make the request's blocks in every group cover its computed tokens, `new_computed_blocks` (prefix hits
        from `get_computed_blocks`, only for a request holding no blocks yet; leading `RELEASED` entries are kept
        as such, not taken) and `num_new_tokens` more.

        Returns the freshly allocated blocks (possibly empty; per group for several), or None when the free queue
        is too short for all groups together: then nothing at all has changed (no reference count, no queue
        position).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits = self._in(new_computed_blocks, "new_computed_blocks") if len(new_computed_blocks) else \
            [()] * len(self.groups)
        for group, group_hits in zip(self.groups, hits, strict=True):
            group.check_hits(request, group_hits)
        need = [0] * len(self.pools)
        for group, group_hits, p in zip(self.groups, hits, self.group_pools, strict=True):
            need[p] += group.blocks_needed(request, num_new_tokens, group_hits)
        if any(n > pool.num_free_blocks for n, pool in zip(need, self.pools, strict=True)):
            return None
        for group, group_hits in zip(self.groups, hits, strict=True):  # every hit before any allocation evicts it
            group.take_hits(request, group_hits)
        self.host_hit_tokens += max(sum(1 for b in h if host_slot(b) is not None) * g.block_size
                                    for g, h in zip(self.groups, hits, strict=True))
        fresh = [g.allocate(request, num_new_tokens, len(h)) for g, h in zip(self.groups, hits, strict=True)]
        self._offer_evictions()
        return self._out(fresh)

    def _offer_evictions(self) -> None:
        """Each pool's evictions since the last call to its host tier (the blocks are still unwritten: the step
        that writes them first runs this plan's stores)."""
        for pool, tier in zip(self.pools, self.tiers, strict=True):
            if tier is not None and pool.evictions:
                for key, block in pool.evictions:
                    tier.offer(key, block)
                pool.evictions.clear()

    def save_cached_blocks(self) -> int:
        """Have each pool's disk tier take the cached blocks on the device (idle or in use) whose files it lacks,
        straight from the device at the next moves (`HostTier.save`; taken as a plan's are: `take_tier_moves`):
        saving the device's prefix cache to disk. Returns how many."""
        n = 0
        for pool, tier in zip(self.pools, self.tiers, strict=True):
            if tier is not None and tier.disk is not None:
                for key, block in pool.hashed_blocks():
                    n += tier.save(key, block)
        return n

    @property
    def has_host_tier(self) -> bool:
        return any(t is not None for t in self.tiers)

    def take_tier_moves(self) -> tuple[TierMoves, ...] | None:
        """The block moves the plan being made must run before its step (one `TierMoves` per pool; None without
        host tiers), pending until `commit_tier_moves` or `discard_tier_moves`."""
        if not self.has_host_tier:
            return None
        return tuple(TierMoves() if t is None else t.take_moves() for t in self.tiers)

    def commit_tier_moves(self, moves: tuple[TierMoves, ...] | None) -> None:
        """The step of the plan that took `moves` ran: its stored blocks are found in the host tiers."""
        if moves is not None:
            for tier, pool_moves in zip(self.tiers, moves, strict=True):
                if tier is not None:
                    tier.commit(pool_moves)

    def discard_tier_moves(self) -> None:
        """The step of the plan that took the moves did not run: their host slots are free again."""
        for tier in self.tiers:
            if tier is not None:
                tier.discard()

    def take_block_copies(self):
        """The (src, dst) block copies the next step must make before it writes KV (and forget them): every
        group's, each copied in every page array of its pool (a fresh dst is its group's alone); with several
        pools, one list per pool."""
        per_pool = [[copy for g in groups for copy in g.take_block_copies()] for groups in self._by_pool()]
        return per_pool[0] if len(self.pools) == 1 else tuple(per_pool)

    def fork(self, source: Request, child: Request) -> None:
        """Let `child` (holding no blocks) share every block `source` holds: the child continues from the
        source's `num_computed_tokens` tokens, which must be the child's first tokens too. Each block gains a
        reference; the first write into a shared block copies it (see `allocate_slots`)."""
        if not self.holds(source.request_id):
            raise ValueError(f"request {source.request_id!r} holds no blocks; it cannot be forked")
        if self.holds(child.request_id):
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        if any(g.has_copy(source.request_id) for g in self.groups):
            raise ValueError(f"request {source.request_id!r} has a block copy pending; fork it between steps")
        n = source.num_computed_tokens
        if child.num_tokens < n or child.get_token_ids(0, n) != source.get_token_ids(0, n):
            raise ValueError(f"request {child.request_id!r} does not start with the {n} computed tokens of "
                             f"{source.request_id!r}")
        for group in self.groups:
            group.fork(source, child)
        child.block_hashes = list(source.block_hashes[:n // self.block_size])  # same tokens, same chained hashes

    def cache_blocks(self, request: Request) -> int:
        """Publish the request's blocks that are full of computed KV and not yet published, in every group.

        Returns how many blocks got a key (a block whose key another block already holds stays unhashed).
        """
        if not self.enable_caching or not self.holds(request.request_id):
            return 0
        hashes = self.block_hashes(request)
        return sum(g.cache_blocks(request, hashes) for g in self.groups)

    def free(self, request: Request) -> None:
        """Release every block the request holds (`KVGroupManager.free`'s order), window groups' first: the first
        blocks of the groups keeping every block, which every hit needs, are evicted last. A no-op for a request
        holding none."""
        for group in sorted(self.groups, key=lambda g: g.sliding_window is None):
            group.free(request.request_id)

    def release_past_computed(self, request: Request, num_new_tokens: int = 0) -> int:
        """Release the request's trailing blocks past `cdiv(num_computed_tokens + num_new_tokens, block_size)`: a
        speculative step allocated them for proposals that were rejected, or not made (`Scheduler.update`).
        They hold no computed KV, so they are unhashed, and were freshly allocated, so no one else holds them.
        Returns how many (all groups)."""
        keep = request.num_computed_tokens + num_new_tokens
        return sum(g.release_past(request.request_id, cdiv(keep, g.block_size)) for g in self.groups)

    def release_out_of_window(self, request: Request) -> int:
        """Release the request's leading blocks that no query from its next position on can read, in every window
        group (all of their positions < num_computed_tokens - window + 1); their hashes, once published, stay with
        them. Returns how many blocks were released now (0 without a sliding window)."""
        return sum(g.release_out_of_window(request, caching=self.enable_caching) for g in self.groups)

    def max_blocks_held(self, num_kv_tokens: int, max_chunk: int, pool: int = 0) -> int:
        """The most blocks (all groups of `pool`) a request holds at once (lent blocks aside) on its way to
        `num_kv_tokens` tokens of KV, when a step computes at most `max_chunk` of its tokens and allocates their
        blocks before it runs.

        A step from p computed tokens computing n = min(max_chunk, num_kv_tokens - p) tokens holds, in a group,
        cdiv(p + n, block_size) blocks less the leading ones unread from p on: released after the previous step,
        or never taken from a prefix hit ending at p (`get_computed_blocks`). Any p can start a step of that
        size (a preempted request recomputes everything in chunks), so this is the maximum over p; without a
        window it is cdiv(num_kv_tokens, block_size) per group.
        """
        groups = self._by_pool()[pool]
        T, B, C = num_kv_tokens, groups[0].block_size, max_chunk  # the pool's block size
        windows = [g.sliding_window for g in groups if g.sliding_window is not None]
        if not windows or T <= C:  # (with T <= C, p = 0 computes everything at once: nothing is released yet)
            return len(groups) * cdiv(T, B)
        # Past p = T - C the step ends at T and more is released: no larger. Between two windows' thresholds
        # (p = W - 1, from where a window group's count repeats with period B while the others' only grow), the
        # count one block size later is no smaller, so the maximum is among the last B starts before each
        # threshold or before T - C.
        last = T - C
        starts = set(range(max(0, last - B + 1), last + 1))
        for w in windows:
            starts.update(range(max(0, w - 1 - B), min(w - 1, last + 1)))
        return max(sum(g.blocks_held_at(p, C) for g in groups) for p in starts)

    def fits(self, num_kv_tokens: int, max_chunk: int) -> bool:
        """Whether a request reaching `num_kv_tokens` tokens of KV in steps of at most `max_chunk` holds no more
        blocks of any pool at once than the pool has (`max_blocks_held`)."""
        return all(self.max_blocks_held(num_kv_tokens, max_chunk, p) <= pool.num_blocks
                   for p, pool in enumerate(self.pools))

    def max_kv_tokens_held(self, max_chunk: int, limit: int) -> int:
        """The most tokens of KV (at most `limit`) one request can reach in these pools: the largest T that `fits`
        (the counts never fall as T grows)."""
        if self.fits(limit, max_chunk):
            return limit
        lo, hi = 0, limit  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid, max_chunk):
                lo = mid
            else:
                hi = mid
        return lo

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash, the host tiers' too; refused (False) while any block is in use or lent."""
        if any(pool.num_used for pool in self.pools):
            return False
        for pool, tier in zip(self.pools, self.tiers, strict=True):
            if tier is not None:
                tier.clear()
                pool.evictions.clear()
        return all([pool.reset_prefix_cache() for pool in self.pools])

    # -- fused decode -----------------------------------------------------------------------

    def lend_blocks(self, n):
        """Lend `n` free blocks to the device (per group for several; all or nothing; may evict cached blocks).

        Each lent block has ref_cnt 1, held by the lender, and no hash. Returns None if fewer are free.
        """
        counts = self._in(n, "lend_blocks")
        need = [0] * len(self.pools)
        for count, p in zip(counts, self.group_pools, strict=True):
            need[p] += count
        if any(k > pool.num_free_blocks for k, pool in zip(need, self.pools, strict=True)):
            return None
        lent = [g.lend(count) for g, count in zip(self.groups, counts, strict=True)]
        self._offer_evictions()
        return self._out(lent)

    def return_lent_blocks(self, block_ids) -> None:
        """Take back lent blocks the device did not use (per group for several): they rejoin the free queue as
        unhashed blocks."""
        per_group = [[int(b) for b in ids] for ids in self._in(block_ids, "return_lent_blocks")]
        for group, ids in zip(self.groups, per_group, strict=True):
            group.check_lent(ids)
        for group, ids in zip(self.groups, per_group, strict=True):
            group.return_lent(ids)

    def adopt_blocks(self, request: Request, block_ids) -> None:
        """Append lent blocks (in the order the device popped them; per group for several) to the request's
        blocks; the lender's reference becomes the request's."""
        per_group = [[int(b) for b in ids] for ids in self._in(block_ids, "adopt_blocks")]
        for group, ids in zip(self.groups, per_group, strict=True):
            group.check_lent(ids)
        for group, ids in zip(self.groups, per_group, strict=True):
            group.adopt(request.request_id, ids)


def _recomputes_prompt(request: Request) -> bool:
    """A request collecting prompt log-probabilities takes no prefix-cache hits until it has them all:
    every prompt position must go through the model to have logits. Nor does a pooling request whose pooling
    takes hidden states before the last position (mean, first token: `PoolingParams.needs_every_position`)."""
    if request.pooling is not None and request.pooling.needs_every_position:
        return request.pooled_upto < request.num_prompt_tokens
    lps = request.prompt_logprobs
    # A multi-sample request's prefill computes all but the last prompt token, for the whole prompt's entries.
    prompt = request.group.request if request.prefill_only else request
    return lps is not None and len(lps) < prompt.num_prompt_tokens
