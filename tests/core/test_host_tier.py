"""The host tier (`pagedjax.core.host_tier`) and the KV cache manager's use of it: evicted cached blocks are stored,
found by later prefix lookups past the device's blocks, loaded into fresh blocks and published only after the step
that loads them ran; a step that did not run leaves no key behind."""

from __future__ import annotations

import pytest

from pagedjax.core.host_tier import HostTier, TierMoves
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.kv_group import host_entry, host_slot
from tests.core.test_kv_cache_manager import make_request

BS = 4


def _committed(tier: HostTier, keys) -> None:
    """Store `keys` (as blocks 0, 1, ...) through one plan that ran."""
    for block, key in enumerate(keys):
        tier.offer(key, block)
    tier.commit(tier.take_moves())
    tier.check_invariants()


def test_a_stored_key_is_found_only_once_its_step_ran():
    tier = HostTier(2)
    tier.offer(b"a", 7)
    assert tier.lookup(b"a") is None  # stored by a plan not made yet
    moves = tier.take_moves()
    assert moves.stores == [(7, 0)] and not moves.loads
    assert tier.lookup(b"a") is None  # its step has not run
    tier.commit(moves)
    assert tier.lookup(b"a") == 0 and len(tier) == 1 and tier.num_stored == 1
    tier.offer(b"a", 3)  # inclusive: a key it holds costs no copy
    assert not tier.take_moves()
    tier.commit(TierMoves())
    tier.check_invariants()


def test_a_step_that_did_not_run_gives_its_slots_back():
    tier = HostTier(1)
    tier.offer(b"a", 1)
    tier.take_moves()
    tier.discard()
    assert tier.lookup(b"a") is None and tier.num_stored == 0
    tier.check_invariants()
    _committed(tier, [b"b"])  # the slot is free again
    assert tier.lookup(b"b") == 0


def test_least_recently_used_keys_go_first_and_pinned_slots_stay():
    tier = HostTier(2)
    _committed(tier, [b"a", b"b"])
    tier.pin_slot(tier.lookup(b"a"))  # a hit on "a": it is the most recent now, and pinned
    tier.load(tier.lookup(b"a"), 5)
    tier.offer(b"c", 9)  # full: "b" (unpinned) makes room
    moves = tier.take_moves()
    assert moves.loads == [(0, 5)] and moves.stores == [(9, 1)]
    tier.offer(b"d", 4)  # every slot pinned or claimed by the plan in flight: dropped
    tier.commit(moves)
    assert tier.lookup(b"b") is None and tier.lookup(b"a") == 0 and tier.lookup(b"c") == 1
    assert not tier.take_moves()  # "d" was not kept
    tier.commit(TierMoves())
    tier.check_invariants()


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="at least one slot"):
        HostTier(0)
    tier = HostTier(2)
    with pytest.raises(RuntimeError, match="holds no key"):
        tier.pin_slot(0)
    _committed(tier, [b"a"])
    with pytest.raises(ValueError, match="not pinned"):
        tier.load(0, 3)
    tier.offer(b"b", 2)
    tier.take_moves()
    with pytest.raises(RuntimeError, match="neither committed nor discarded"):
        tier.take_moves()
    with pytest.raises(RuntimeError, match="in flight"):
        tier.clear()
    tier.discard()
    tier.clear()
    assert len(tier) == 0
    tier.check_invariants()


def _step(manager: KVCacheManager, request, hits=(), num_new=None, ran: bool = True):
    """Admit `request` (with `hits`), plan, run (or fail) its step, publish its blocks; returns the plan's moves."""
    num_hit = sum(1 for _ in hits) * BS
    n = request.num_tokens - num_hit if num_new is None else num_new
    assert manager.allocate_slots(request, n, list(hits)) is not None
    moves = manager.take_tier_moves()
    if not ran:
        manager.discard_tier_moves()
        return moves
    manager.commit_tier_moves(moves)
    request.num_computed_tokens = num_hit + n
    manager.cache_blocks(request)
    return moves


def test_the_manager_stores_evicted_blocks_and_loads_them_for_a_later_hit():
    manager = KVCacheManager(4, BS, host_tier_blocks=(8,))
    pool, tier = manager.block_pool, manager.tiers[0]
    first = make_request("a", list(range(13)))  # 3 full blocks and one token
    _step(manager, first)
    manager.free(first)
    other = make_request("b", list(range(100, 116)))  # takes every block: evicts a's 3 cached ones
    moves = _step(manager, other)[0]
    assert len(moves.stores) == 3 and len(tier) == 3 and manager.block_pool.num_cached == 0
    manager.free(other)
    again = make_request("c", list(range(13)) + [50])
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 12 and all(host_slot(b) is not None for b in hits)
    assert manager.allocate_slots(again, 2, hits) is not None
    held = manager.get_block_ids("c")
    moves = manager.take_tier_moves()[0]
    assert sorted(b for _, b in moves.loads) == sorted(held[:3])  # fresh blocks, loaded before the step
    assert all(pool.block_hash(b) is None for b in held[:3])  # published only after the step ran
    manager.commit_tier_moves((moves,))
    again.num_computed_tokens = 14
    manager.cache_blocks(again)
    assert all(pool.block_hash(b) is not None for b in held[:3])
    assert manager.host_hit_tokens == 12 and tier.num_loaded == 3
    pool.check_invariants()
    tier.check_invariants()


def test_a_hit_continues_on_the_host_after_the_device_blocks_and_a_failed_step_keeps_nothing():
    manager = KVCacheManager(5, BS, host_tier_blocks=(8,))
    pool, tier = manager.block_pool, manager.tiers[0]
    first = make_request("a", list(range(13)))
    _step(manager, first)
    manager.free(first)  # tail-first: its last blocks are evicted first
    filler = make_request("b", list(range(100, 116)))  # 4 blocks: 2 unhashed ones, then a's last 2 cached ones
    _step(manager, filler)
    manager.free(filler)
    again = make_request("c", list(range(13)) + [1])
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 12 and host_slot(hits[0]) is None and [host_slot(b) is not None for b in hits[1:]] == [1, 1]
    moves = _step(manager, again, hits, num_new=2, ran=False)[0]  # the step fails: the request is dropped
    held = manager.get_block_ids("c")
    assert held[0] == hits[0] and sorted(b for _, b in moves.loads) == sorted(held[1:3])
    manager.free(again)
    assert pool.block_hash(held[1]) is None and pool.block_hash(held[2]) is None  # never published
    pool.check_invariants()
    tier.check_invariants()
    assert tier.lookup(manager.groups[0].block_key(again.block_hashes, 1)) is not None  # the host still has it


def test_host_hits_are_refused_where_they_cannot_be_served():
    manager = KVCacheManager(4, BS)
    request = make_request("a", list(range(9)))
    with pytest.raises(ValueError, match="host tier hits"):
        manager.allocate_slots(request, 1, [host_entry(0), host_entry(1)])
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVCacheManager(4, BS, enable_caching=False, host_tier_blocks=(2,))
    with pytest.raises(ValueError, match="host_tier_blocks"):
        KVCacheManager(4, BS, host_tier_blocks=(2, 2))
    windowed = KVCacheManager(4, BS, group_windows=(8, None), host_tier_blocks=(2,))
    assert windowed.groups[0].tier is windowed.groups[1].tier is windowed.tiers[0]  # every group of the pool


def test_a_window_group_hit_mixes_host_and_device_blocks_in_place():
    """A window group of 2 blocks and a full group over one pool of 11: a freed prefix's window-group blocks are
    evicted first (after the unhashed ones), head first, so a filler of 3 blocks a group takes the two partial
    blocks, the unused one and the window group's first three, which go into the tier. A hit then reads the window
    group's block 2 from the host and its block 3 from the device, in position, and the full group's from the
    device; the loaded block is published once the step ran."""
    manager = KVCacheManager(11, BS, group_windows=(2 * BS, None), host_tier_blocks=(16,))
    pool, tier = manager.block_pool, manager.tiers[0]
    first = make_request("a", list(range(17)))  # 4 full blocks and one token, in each group
    _step(manager, first)
    manager.free(first)
    window, full = manager.groups
    keys = {g: [g.block_key(first.block_hashes, j) for j in range(4)] for g in manager.groups}
    filler = make_request("b", list(range(100, 112)))
    _step(manager, filler)
    manager.free(filler)
    assert [pool.get_cached_block(k) is None for k in keys[window]] == [True, True, True, False]
    assert all(tier.lookup(k) is not None for k in keys[window][:3])
    again = make_request("c", list(range(17)) + [1])
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 16
    window_hits, full_hits = hits
    assert window_hits[:2] == [-1, -1] and host_slot(window_hits[2]) is not None
    assert window_hits[3] == pool.get_cached_block(keys[window][3])
    assert full_hits == [pool.get_cached_block(k) for k in keys[full]]
    assert manager.allocate_slots(again, 2, hits) is not None
    held = manager.get_block_ids("c")
    moves = manager.take_tier_moves()[0]
    assert held[0][:2] == (-1, -1) and held[0][3] == window_hits[3] and held[0][2] >= 0
    assert [b for _, b in moves.loads] == [held[0][2]] and pool.block_hash(held[0][2]) is None
    manager.commit_tier_moves((moves,))
    again.num_computed_tokens = 18
    manager.cache_blocks(again)
    assert pool.block_hash(held[0][2]) == keys[window][2]
    assert manager.host_hit_tokens == BS
    pool.check_invariants()
    tier.check_invariants()
