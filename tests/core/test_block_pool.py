"""BlockPool, its free queue and block hashing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedjax.core.block_pool import BlockPool, FreeBlockQueue, hash_block_tokens, hash_key


def test_free_queue_operations_are_ordered():
    q = FreeBlockQueue(6, range(6))
    assert list(q) == [0, 1, 2, 3, 4, 5] and len(q) == 6
    assert q.popleft() == 0
    q.remove(3)
    q.appendleft(3)
    q.append(0)
    assert list(q) == [3, 1, 2, 4, 5, 0]
    assert 3 in q and 0 in q
    q.remove(5)
    assert 5 not in q and len(q) == 5
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(5)
    with pytest.raises(ValueError, match="already"):
        q.append(1)
    for _ in range(5):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


@given(st.lists(st.tuples(st.sampled_from(["pop", "append", "appendleft", "remove"]), st.integers(0, 7))))
def test_free_queue_matches_a_list_model(ops):
    q = FreeBlockQueue(8, range(8))
    model = list(range(8))
    for op, b in ops:
        if op == "pop":
            if model:
                assert q.popleft() == model.pop(0)
        elif b in model:
            if op == "remove":
                q.remove(b)
                model.remove(b)
        else:
            if op == "append":
                q.append(b)
                model.append(b)
            elif op == "appendleft":
                q.appendleft(b)
                model.insert(0, b)
        assert list(q) == model and len(q) == len(model)


def test_hash_is_deterministic_chained_seeded_and_unambiguous():
    key = hash_key(0)
    h = hash_block_tokens(None, [1, 2, 3], key=key)
    assert len(h) == 32 and h == hash_block_tokens(None, [1, 2, 3], key=key)
    assert h != hash_block_tokens(None, [1, 2, 3], key=hash_key(1)), "seeded per pool"
    assert h != hash_block_tokens(None, [1, 2, 4], key=key)
    assert h != hash_block_tokens(None, [1, 2], key=key)
    assert h != hash_block_tokens(bytes(32), [1, 2, 3], (("salt", ""),), key=key)
    child = hash_block_tokens(h, [4, 5, 6], key=key)
    assert child != hash_block_tokens(None, [4, 5, 6], key=key), "chained on the parent"
    other_parent = hash_block_tokens(None, [9, 2, 3], key=key)
    assert child != hash_block_tokens(other_parent, [4, 5, 6], key=key)
    # length-prefixed fields: moving a boundary never collides
    assert hash_block_tokens(None, [1], (("ab", "c"),), key=key) != \
        hash_block_tokens(None, [1], (("a", "bc"),), key=key)
    assert hash_block_tokens(None, [1], (("a", "b"), ("c", "d")), key=key) != \
        hash_block_tokens(None, [1], (("a", "b\x00c"),), key=key)
    # large and negative token ids encode exactly
    assert hash_block_tokens(None, [2**40], key=key) != hash_block_tokens(None, [0], key=key)


def test_pool_allocate_is_all_or_nothing_and_free_orders_the_queue():
    pool = BlockPool(5)
    assert pool.allocate(6) is None and pool.num_free_blocks == 5
    a = pool.allocate(3)
    assert a == [0, 1, 2] and [pool.ref_cnt(b) for b in a] == [1, 1, 1]
    assert pool.num_used == 3 and pool.num_free == 2 and pool.num_cached == 0
    h = pool.hash_block(None, [7])
    assert pool.cache_block(0, h)
    assert not pool.cache_block(1, h), "one block per hash"
    assert pool.get_cached_block(h) == 0
    pool.free(reversed(a))  # tail-first: 2 (unhashed) to the front, 1 to the front, 0 (hashed) to the back
    assert pool.free_block_ids() == [1, 2, 3, 4, 0]
    assert (pool.num_free, pool.num_cached, pool.num_used) == (4, 1, 0)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])
    pool.check_invariants()


def test_pool_touch_pulls_an_idle_cached_block_and_eviction_forgets_its_hash():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [pool.hash_block(None, [i]) for i in range(3)]
    for b, h in zip(blocks, hashes, strict=True):
        pool.cache_block(b, h)
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [2, 1, 0] and pool.num_cached == 3
    pool.touch([1])
    assert pool.free_block_ids() == [2, 0] and pool.ref_cnt(1) == 1 and pool.num_cached == 2
    assert pool.allocate(1) == [2]  # LRU: evicts block 2's hash
    assert pool.num_evictions == 1 and pool.block_hash(2) is None and pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) == 0
    pool.check_invariants()


def test_an_idle_cached_copy_gives_its_hash_to_a_recomputed_block():
    """A request that recomputed a block whose hash an idle block holds (it could not hit it: another KV cache group
    missed) publishes its own copy, in use; the idle one, unhashed, is reused first. A copy in use keeps its hash."""
    pool = BlockPool(4)
    h = pool.hash_block(None, [5])
    old = pool.allocate(1)[0]
    pool.cache_block(old, h)
    pool.free([old])  # idle, cached: at the back of the LRU order
    new = pool.allocate(1)[0]
    assert pool.cache_block(new, h) and pool.get_cached_block(h) == new and pool.block_hash(old) is None
    assert pool.free_block_ids()[0] == old and pool.num_cached == 0 and pool.num_evictions == 0
    busy = pool.allocate(1)[0]
    assert not pool.cache_block(busy, h) and pool.get_cached_block(h) == new  # `new` is in use: it keeps it
    pool.check_invariants()


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(2)
    b = pool.allocate(1)
    pool.cache_block(b[0], pool.hash_block(None, [1]))
    assert not pool.reset_prefix_cache()
    pool.free(b)
    assert pool.num_cached == 1
    assert pool.reset_prefix_cache()
    assert pool.num_cached == 0 and pool.num_hashed == 0 and pool.block_hash(b[0]) is None
    pool.check_invariants()


def test_caching_disabled_never_hashes():
    pool = BlockPool(2, enable_caching=False)
    b = pool.allocate(1)
    assert not pool.cache_block(b[0], pool.hash_block(None, [1]))
    assert pool.num_hashed == 0


def test_bad_pool_sizes():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(2).allocate(-1)
