"""The vLLM-style prefix-caching scenarios (block size 16, an 11-block pool), on the KV cache manager."""

from __future__ import annotations

import pytest

from pagedjax.core.block_pool import hash_block_tokens
from pagedjax.core.kv_cache_manager import RELEASED, KVCacheManager
from pagedjax.core.request import Request
from pagedjax.sampling_params import SamplingParams

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]  # 3 full blocks


def make_request(rid: str, tokens: list[int], *, salt: str | None = None, adapter: str | None = None,
                 max_tokens: int = 16) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), cache_salt=salt,
                   adapter_id=adapter)


def prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Look up, allocate the rest of the prompt, compute it, publish its full blocks."""
    hits, num_hit = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return hits


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(11, BS, hash_seed=0)


def test_miss_then_hit_shares_three_full_blocks(manager):
    pool = manager.block_pool
    req0 = make_request("0", COMMON + [3] * 7)
    hits, num_hit = manager.get_computed_blocks(req0)
    assert (hits, num_hit) == ([], 0)
    assert len(manager.block_hashes(req0)) == 3
    assert manager.allocate_slots(req0, 55) == [0, 1, 2, 3]
    req0.num_computed_tokens = 55
    assert manager.cache_blocks(req0) == 3
    parent = None
    for b in (0, 1, 2):
        expected = hash_block_tokens(parent, COMMON[b * BS:(b + 1) * BS], key=pool.hash_key)
        assert pool.block_hash(b) == expected and pool.ref_cnt(b) == 1
        parent = expected
    assert pool.block_hash(3) is None and pool.ref_cnt(3) == 1  # the partial block is never hashed

    req1 = make_request("1", COMMON + [3] * 5)
    hits, num_hit = manager.get_computed_blocks(req1)
    assert hits == [0, 1, 2] and num_hit == 3 * BS
    assert manager.allocate_slots(req1, 53 - 3 * BS, hits) == [4]
    assert [pool.ref_cnt(b) for b in (0, 1, 2)] == [2, 2, 2]
    assert manager.num_free_blocks == 6
    pool.check_invariants()

    # freeing: partial blocks first (most recently freed first), then untouched blocks, then the shared
    # prefix tail-first (its later blocks are evicted before its earlier ones)
    manager.free(req0)
    manager.free(req1)
    assert manager.num_free_blocks == 11
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    assert (pool.num_free, pool.num_cached, pool.num_used) == (8, 3, 0)
    pool.check_invariants()


def test_hit_on_idle_cached_block_removes_it_from_the_free_queue(manager):
    pool = manager.block_pool
    req0 = make_request("0", COMMON + [3] * 7)
    prefill(manager, req0)
    manager.free(req0)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1, 0]
    req2 = make_request("2", COMMON + [7] * 10)
    hits, num_hit = manager.get_computed_blocks(req2)
    assert hits == [0, 1, 2] and num_hit == 48
    assert manager.allocate_slots(req2, 10, hits) == [3]
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10]
    assert [pool.ref_cnt(b) for b in (0, 1, 2, 3)] == [1, 1, 1, 1]
    assert pool.num_cached == 0 and pool.num_evictions == 0
    pool.check_invariants()


def test_full_hit_still_recomputes_the_last_token(manager):
    req0 = make_request("0", COMMON)
    prefill(manager, req0)
    manager.free(req0)
    req1 = make_request("1", COMMON)
    hits, num_hit = manager.get_computed_blocks(req1)
    assert hits == [0, 1] and num_hit == 32  # not 48: the last token (in block 2) must be computed


def test_drop_last_hit_block_ends_a_hit_one_block_early():
    """An MTP head's KV at a block's last position depends on the token after the block, so its engine's hits
    leave the block ending them out; the next block whose hash makes a longer hit is one further."""
    manager = KVCacheManager(11, BS, hash_seed=0, drop_last_hit_block=True)
    req0 = make_request("0", COMMON + [3] * 7)
    prefill(manager, req0)
    req1 = make_request("1", COMMON + [4] * 40)  # 3 cached blocks: a hit of 2
    hits, num_hit = manager.get_computed_blocks(req1)
    assert hits == [0, 1] and num_hit == 2 * BS
    hashes = manager.block_hashes(req1)
    assert manager.next_block_hash(req1, 2) == hashes[3]  # a hit of 3 needs 4 cached
    assert manager.next_block_hash(make_request("3", COMMON + [4] * 5), 2) is None  # 4 do not fit below its cap
    assert manager.get_computed_blocks(make_request("2", COMMON[:BS] + [5] * 3)) == ([], 0)  # one cached: none
    plain = KVCacheManager(11, BS, hash_seed=0)
    prefill(plain, make_request("0", COMMON + [3] * 7))
    assert plain.get_computed_blocks(req1)[1] == 3 * BS
    assert plain.next_block_hash(req1, 2) == hashes[2]


def test_decode_hashes_a_block_exactly_when_it_fills(manager):
    pool = manager.block_pool
    req = make_request("0", list(range(20)), max_tokens=40)
    prefill(manager, req)
    blocks = manager.get_block_ids("0")
    assert blocks == (0, 1) and pool.block_hash(0) is not None and pool.block_hash(1) is None
    tokens = list(range(20))
    while req.num_computed_tokens < 33:
        # sample one token, then compute it in the next step
        t = 100 + req.num_tokens
        req.output_token_ids.append(t)
        tokens.append(t)
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        manager.cache_blocks(req)
        if req.num_computed_tokens < 32:
            assert pool.block_hash(1) is None
        else:
            expected = hash_block_tokens(pool.block_hash(0), tokens[16:32], key=pool.hash_key)
            assert pool.block_hash(1) == expected
    assert manager.get_block_ids("0") == (0, 1, 2) and pool.block_hash(2) is None


def test_failed_allocation_changes_no_refcount(manager):
    pool = manager.block_pool
    req0 = make_request("0", COMMON + [3] * 7)
    prefill(manager, req0)
    manager.free(req0)  # blocks 0-2 idle and cached
    hog = make_request("hog", [9] * (6 * BS))
    assert manager.allocate_slots(hog, 6 * BS) is not None  # leaves 5 idle: 3 cached + 2 free
    queue_before = pool.free_block_ids()
    refs_before = [pool.ref_cnt(b) for b in range(11)]
    req1 = make_request("1", COMMON + [5] * (3 * BS))  # needs 3 hits + 3 fresh = 6 > 5
    hits, num_hit = manager.get_computed_blocks(req1)
    assert hits == [0, 1, 2]
    assert manager.allocate_slots(req1, 3 * BS, hits) is None
    assert [pool.ref_cnt(b) for b in range(11)] == refs_before
    assert pool.free_block_ids() == queue_before
    assert manager.get_block_ids("1") == () and "1" not in manager.holders()
    assert pool.num_evictions == 0
    pool.check_invariants()
    # with one block less it fits, and the hits were not evicted to make room for the fresh blocks
    req2 = make_request("2", COMMON + [5] * (2 * BS))
    hits, _ = manager.get_computed_blocks(req2)
    assert manager.allocate_slots(req2, 2 * BS, hits) is not None
    assert manager.get_block_ids("2")[:3] == (0, 1, 2)
    pool.check_invariants()


def test_lru_eviction_takes_a_prefix_tail_first(manager):
    pool = manager.block_pool
    req0 = make_request("0", COMMON + [3] * 7)
    prefill(manager, req0)
    manager.free(req0)
    hog = make_request("hog", [9] * (9 * BS))  # 8 unhashed blocks, then one eviction
    assert manager.allocate_slots(hog, 9 * BS) is not None
    assert pool.num_evictions == 1 and pool.block_hash(2) is None
    req1 = make_request("1", COMMON + [3])
    hits, num_hit = manager.get_computed_blocks(req1)
    assert hits == [0, 1] and num_hit == 32


def test_different_salts_never_share_the_same_salt_does(manager):
    req_a = make_request("a", COMMON + [3], salt="tenant-a")
    prefill(manager, req_a)
    req_b = make_request("b", COMMON + [3], salt="tenant-b")
    assert manager.get_computed_blocks(req_b) == ([], 0)
    req_none = make_request("n", COMMON + [3])
    assert manager.get_computed_blocks(req_none) == ([], 0)
    req_a2 = make_request("a2", COMMON + [3], salt="tenant-a")
    assert manager.get_computed_blocks(req_a2) == ([0, 1, 2], 48)
    # the salt enters the first block only, yet every later hash differs through the chain
    assert all(x != y for x, y in zip(manager.block_hashes(req_a), manager.block_hashes(req_b), strict=True))


def test_adapters_never_share(manager):
    req_a = make_request("a", COMMON + [3], adapter="lora-1")
    prefill(manager, req_a)
    assert manager.get_computed_blocks(make_request("b", COMMON + [3], adapter="lora-2")) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", COMMON + [3])) == ([], 0)
    assert manager.get_computed_blocks(make_request("d", COMMON + [3], adapter="lora-1"))[1] == 48


def test_reset_fails_while_blocks_are_in_use(manager):
    req0 = make_request("0", COMMON + [3])
    prefill(manager, req0)
    assert not manager.reset_prefix_cache()
    manager.free(req0)
    assert manager.block_pool.num_cached == 3
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("1", COMMON + [3])) == ([], 0)
    assert manager.block_pool.num_cached == 0


def test_hash_seed_separates_pools():
    a = KVCacheManager(4, BS, hash_seed=1)
    b = KVCacheManager(4, BS, hash_seed=2)
    req = make_request("0", COMMON)
    ha = a.block_hashes(req)
    req.block_hashes = []
    assert b.block_hashes(req) != ha


def test_caching_disabled_gives_no_hits():
    m = KVCacheManager(11, BS, enable_caching=False)
    req0 = make_request("0", COMMON + [3])
    prefill(m, req0)
    assert m.block_pool.num_hashed == 0
    m.free(req0)
    assert m.get_computed_blocks(make_request("1", COMMON + [3])) == ([], 0)
    assert m.block_pool.free_block_ids()[:4] == [0, 1, 2, 3]  # unhashed: reused first


def test_duplicate_content_keeps_one_cached_copy(manager):
    pool = manager.block_pool
    req0, req1 = make_request("0", COMMON + [3]), make_request("1", COMMON + [3])
    # both miss (neither computed yet), both compute the same blocks
    for r in (req0, req1):
        assert manager.get_computed_blocks(r) == ([], 0)
        manager.allocate_slots(r, r.num_tokens)
    for r in (req0, req1):
        r.num_computed_tokens = r.num_tokens
        manager.cache_blocks(r)
    assert [pool.block_hash(b) is not None for b in manager.get_block_ids("1")] == [False] * 4
    assert pool.num_hashed == 3
    manager.free(req1)
    assert pool.free_block_ids()[:4] == [4, 5, 6, 7]  # the duplicates are reused first
    pool.check_invariants()


def test_lend_adopt_and_return():
    m = KVCacheManager(6, 4)
    pool = m.block_pool
    req = make_request("0", list(range(5)))
    prefill(m, req)  # blocks 0, 1
    lent = m.lend_blocks(3)
    assert lent == [2, 3, 4] and all(pool.ref_cnt(b) == 1 for b in lent)
    assert m.lent_block_ids == {2, 3, 4}
    assert m.lend_blocks(2) is None and pool.num_free_blocks == 1
    assert not m.reset_prefix_cache()
    m.adopt_blocks(req, [2])
    assert m.get_block_ids("0") == (0, 1, 2) and m.lent_block_ids == {3, 4}
    with pytest.raises(ValueError, match="not lent"):
        m.return_lent_blocks([2])
    m.return_lent_blocks([3, 4])
    assert not m.lent_block_ids and pool.free_block_ids()[:2] == [3, 4]
    with pytest.raises(ValueError, match="holds no blocks"):
        m.adopt_blocks(make_request("x", [1]), [])
    pool.check_invariants()


# -- sliding windows: blocks out of every layer's window go back to the pool while the request runs -------

def test_release_out_of_window_frees_exactly_the_unreadable_leading_blocks():
    kv = KVCacheManager(11, 4, sliding_window=5)
    r = make_request("w", list(range(13)))
    assert kv.allocate_slots(r, 13) is not None
    blocks = kv.get_block_ids("w")  # 4 blocks: positions 0-3, 4-7, 8-11, 12
    r.num_computed_tokens = 13
    kv.cache_blocks(r)
    free_before = kv.num_free_blocks
    # The next query sits at position 13 and reads positions 9..13: blocks 0 and 1 (positions < 8) are unread;
    # block 2 (8-11) is still read.
    assert kv.release_out_of_window(r) == 2
    assert kv.get_block_ids("w") == (-1, -1) + blocks[2:]
    assert kv.num_released_blocks("w") == 2 and kv.num_held_blocks("w") == 4
    assert kv.num_free_blocks == free_before + 2
    assert kv.release_out_of_window(r) == 0  # idempotent
    # the released, published blocks stay cached: the same prompt hits the whole prefix while they are present,
    # and takes only the blocks its first query (position 12, reading 8..12) sees
    twin = make_request("twin", list(range(13)))
    hits, num_hit = kv.get_computed_blocks(twin)
    assert hits == [RELEASED, RELEASED, blocks[2]] and num_hit == 12
    kv.free(r)
    assert kv.num_free_blocks == 11


def test_release_needs_published_blocks_and_a_valid_window():
    kv = KVCacheManager(8, 2, sliding_window=1)
    r = make_request("w", list(range(6)))
    assert kv.allocate_slots(r, 6) is not None
    r.num_computed_tokens = 6
    with pytest.raises(RuntimeError, match="publish"):
        kv.release_out_of_window(r)
    kv.cache_blocks(r)
    # window 1: the next query (position 6) reads only itself; every computed block is released
    assert kv.release_out_of_window(r) == 3 and kv.num_released_blocks("w") == 3
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            KVCacheManager(8, 2, sliding_window=bad)
    assert KVCacheManager(8, 2).release_out_of_window(r) == 0  # no window: nothing is ever released


def test_a_window_hit_needs_only_the_blocks_its_first_query_reads():
    """With a sliding window a prefix hit needs the cached blocks inside the window at the hit's end, not the chain
    from the first block (vLLM's rule): an evicted block before the window does not cut the hit, one inside it
    does."""
    kv = KVCacheManager(4, 4, sliding_window=4)
    r = make_request("w", list(range(12)))
    assert kv.allocate_slots(r, 12) is not None
    r.num_computed_tokens = 12
    kv.cache_blocks(r)
    first, second, third = kv.get_block_ids("w")
    assert kv.release_out_of_window(r) == 2  # next query at 12 reads 9..12
    other = make_request("o", [50] * 4)  # takes the one free block, then evicts the oldest idle cached one
    assert kv.allocate_slots(other, 8) is not None
    # released blocks are freed tail-first (like `free`), so a prefix's later block is evicted before its first
    assert second in kv.get_block_ids("o") and first not in kv.get_block_ids("o")
    twin = make_request("twin", list(range(12)) + [7])  # its first query, at 12, reads 9..12: block 2 only
    assert kv.get_computed_blocks(twin) == ([RELEASED, RELEASED, third], 12)
    short = make_request("short", list(range(8)) + [7])  # a hit of 8 would read 5..8, in the evicted block 1
    assert kv.get_computed_blocks(short) == ([first], 4)


def test_freed_groups_keep_what_hits_need_longest():
    """Freeing a request of a window group (4) and a full one: the window group's blocks go first, head-first (its
    last block is what the longest hit reads), then the full group's tail-first (every hit needs its first block):
    evictions take the least useful first, and a hit needs only the window's last block and the full chain."""
    kv = KVCacheManager(8, 4, group_windows=(4, None))
    w = make_request("w", list(range(12)))
    assert kv.allocate_slots(w, 12) == ([0, 1, 2], [3, 4, 5])
    w.num_computed_tokens = 12
    kv.cache_blocks(w)
    kv.free(w)
    assert kv.block_pool.free_block_ids() == [6, 7, 0, 1, 2, 5, 4, 3]
    hog = make_request("hog", [50] * 8)  # two blocks per group: the two free ones, then window blocks 0 and 1
    assert kv.allocate_slots(hog, 8) == ([6, 7], [0, 1])
    twin = make_request("twin", list(range(12)) + [7])
    assert kv.get_computed_blocks(twin) == (([RELEASED, RELEASED, 2], [3, 4, 5]), 12)


def test_a_state_pool_of_larger_blocks_snapshots_every_few_kv_blocks():
    """A state group (release window 2) in a pool of 3-block-long blocks beside a full group: each holds
    cdiv(tokens, its block size) blocks, a state block is published under the chained hash of the last KV block it
    covers, and a hit is what both serve: the KV pool's 4 cached blocks count as 3 (one state block)."""
    m = KVCacheManager(16, 4, group_windows=(2, None), group_pools=(1, 0), extra_pools=(6,),
                       pool_block_sizes=(4, 12))
    assert m.group_block_sizes == (12, 4) and m.pool_block_size(1) == 12
    a = make_request("a", list(range(18)))
    prefill(m, a)
    assert m.num_held_blocks("a") == (2, 5)
    assert m.get_block_ids("a")[0][0] != RELEASED  # not released until the step's end
    m.release_out_of_window(a)
    assert m.get_block_ids("a")[0][0] == RELEASED  # the snapshot at 12 is cached, the live state (at 18) held
    state_pool = m.pools[1]
    assert state_pool.num_cached == 1
    b = make_request("b", list(range(17)) + [99, 5])
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 12 and [len(h) for h in hits] == [1, 3]
    assert m.blocks_to_cover(b, 19) == (2, 5)
    assert m.allocate_slots(b, 19 - 12, hits) is not None
    assert m.num_held_blocks("b") == (2, 5)
    # Lending counts per group: a state block every 12 tokens.
    lent = m.lend_blocks((1, 2))
    assert [len(ids) for ids in lent] == [1, 2]
    m.return_lent_blocks(lent)
    with pytest.raises(ValueError, match="multiple of block_size 4"):
        KVCacheManager(16, 4, group_windows=(2, None), group_pools=(1, 0), extra_pools=(6,), pool_block_sizes=(4, 6))


def test_a_waiting_request_waits_only_for_what_every_group_will_publish():
    """With a state pool of 3-block blocks, a longer hit needs the next whole state block: a request waits for a
    running one to compute it (`next_block_hash` among its `unpublished_block_hashes`) only when that one will
    publish it, never for a state block its known tokens do not fill (it would wait the whole run)."""
    m = KVCacheManager(32, 4, group_windows=(2, None), group_pools=(1, 0), extra_pools=(8,),
                       pool_block_sizes=(4, 12))
    c = make_request("c", list(range(30)))
    assert m.allocate_slots(c, 26) is not None
    d = make_request("d", list(range(30)) + [99] * 10)
    hashes = m.block_hashes(c)
    # Nothing computed yet: c will publish KV blocks 0-6 and state blocks 0-1 (keyed by hashes 2 and 5).
    assert sorted(m.unpublished_block_hashes(c)) == sorted(hashes[:7] + [hashes[2], hashes[5]])
    assert m.next_block_hash(d, 0) == hashes[2]  # d's first whole state block: in flight, d waits
    c.num_computed_tokens = 26
    m.cache_blocks(c)
    _, hit = m.get_computed_blocks(d)
    assert hit == 24  # two state blocks
    assert m.unpublished_block_hashes(c) == [hashes[6]]  # state block 2 (tokens 24-35) never fills from 30 tokens
    assert m.next_block_hash(d, hit // 4) == m.block_hashes(d)[8] not in m.unpublished_block_hashes(c)


def test_memory_stats_count_the_kv_pool_whatever_the_groups_order():
    """`kv_memory_stats` is pool 0's (the KV pool's) even where group 0 is a state group of larger blocks: a request
    of 6 tokens holds 2 KV blocks of 4, the second partial (its state block of 12 counts in `group_blocks` only)."""
    from pagedjax.core.memory_stats import kv_memory_stats

    m = KVCacheManager(16, 4, group_windows=(2, None), group_pools=(1, 0), extra_pools=(6,),
                       pool_block_sizes=(4, 12))
    r = make_request("r", list(range(6)))
    prefill(m, r)
    stats = kv_memory_stats(m, [r], with_free_runs=False)
    assert (stats.num_partial_blocks, stats.slots_reserved, stats.slots_used) == (1, 8, 6)
    assert stats.group_blocks == (1, 2) and stats.block_size == 4
