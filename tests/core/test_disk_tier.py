"""The disk tier (`pagedjax.core.disk_tier`) and the host tier over it: files by key that survive a restart, a bound
kept by least recent use, every bad file a miss (removed, counted), never a payload; the
host stores written through, keys found only on disk read into host slots that the next plan fills before it loads
anything."""

from __future__ import annotations

import os

import pytest

from pagedjax.core.disk_tier import HEADER_BYTES, DiskTier
from pagedjax.core.host_tier import HostTier
from pagedjax.core.kv_cache_manager import KVCacheManager
from pagedjax.core.kv_group import host_slot
from tests.core.test_kv_cache_manager import make_request

TAG = b"config-a"
KEY_A, KEY_B, KEY_C = (bytes([i]) * 32 for i in (1, 2, 3))


def test_blocks_survive_a_restart_in_least_recently_used_order(tmp_path):
    disk = DiskTier(tmp_path, 2, TAG)
    assert disk.write(KEY_A, b"a" * 10) and disk.write(KEY_B, b"b" * 10)
    os.utime(disk.path(KEY_A), ns=(1, 1))  # the restart below reads the order from the files' times
    os.utime(disk.path(KEY_B), ns=(2, 2))
    assert disk.read(KEY_A) == b"a" * 10  # refreshed: B is now the least recently used
    assert disk.write(KEY_B, b"ignored") and disk.num_written == 2  # a key it holds is only refreshed
    os.utime(disk.path(KEY_B), ns=(1, 1))
    (tmp_path / "x.kv.1.2.3.tmp").write_bytes(b"half a write")  # what a crash mid-write leaves
    (tmp_path / "notes.txt").write_text("not ours")
    again = DiskTier(tmp_path, 2, TAG)
    assert KEY_A in again and KEY_B in again and len(again) == 2
    assert not (tmp_path / "x.kv.1.2.3.tmp").exists() and (tmp_path / "notes.txt").exists()
    assert again.write(KEY_C, b"c" * 10)  # over the bound: the least recently used file (B) goes
    assert KEY_B not in again and not again.path(KEY_B).exists() and again.read(KEY_A) == b"a" * 10
    assert again.bytes_read == 10 and again.bytes_written == 10 and again.seconds > 0
    smaller = DiskTier(tmp_path, 1, TAG)  # a restart with a smaller bound deletes the oldest files
    assert len(smaller) == 1 and len(list(tmp_path.glob("*.kv"))) == 1
    smaller.check_invariants()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header", "empty", "foreign", "renamed", "magic"])
def test_a_bad_file_is_a_miss_and_is_removed(tmp_path, damage):
    disk = DiskTier(tmp_path / "a", 4, TAG)
    disk.write(KEY_A, bytes(range(200)))
    path = disk.path(KEY_A)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[HEADER_BYTES + 17] ^= 1
    elif damage == "truncate":
        del data[-1]
    elif damage == "header":
        del data[HEADER_BYTES - 3:]
    elif damage == "empty":
        data = bytearray()
    elif damage == "magic":
        data[0] ^= 0xFF
    elif damage in ("foreign", "renamed"):  # another configuration's file, or another key's, under this name
        other = DiskTier(tmp_path / "b", 4, b"config-b" if damage == "foreign" else TAG)
        other.write(KEY_A if damage == "foreign" else KEY_B, bytes(range(200)))
        data = bytearray(other.path(KEY_A if damage == "foreign" else KEY_B).read_bytes())
    path.write_bytes(bytes(data))
    assert disk.read(KEY_A) is None
    assert disk.num_bad == 1 and KEY_A not in disk and not path.exists() and disk.num_read == 0


def test_a_missing_or_unwritable_file_is_a_plain_miss(tmp_path):
    disk = DiskTier(tmp_path, 4, TAG)
    disk.write(KEY_A, b"a")
    disk.path(KEY_A).unlink()  # removed by another server sharing the folder
    assert disk.read(KEY_A) is None and KEY_A not in disk and disk.num_bad == 0
    disk.path(KEY_B).mkdir()  # a file that cannot be written: the block is not kept, nothing raises
    assert not disk.write(KEY_B, b"b") and KEY_B not in disk and disk.num_written == 1
    assert not list(tmp_path.glob("*.tmp"))
    disk.open(tmp_path / "other", b"config-b")  # new weights: another folder, nothing of the old one found
    assert len(disk) == 0 and disk.directory == tmp_path / "other"
    with pytest.raises(ValueError, match="at least one block"):
        DiskTier(tmp_path, 0, TAG)
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        DiskTier(tmp_path, 1, b"")


def _commit(tier: HostTier, moves) -> None:
    tier.commit(moves)
    tier.check_invariants()


def test_the_host_tier_writes_its_stores_through_and_reads_disk_hits_into_slots(tmp_path):
    disk = DiskTier(tmp_path, 8, TAG)
    tier = HostTier(2, disk)
    for block, key in enumerate((KEY_A, KEY_B)):
        tier.offer(key, block)
    moves = tier.take_moves()
    assert sorted(moves.writes) == [(0, KEY_A), (1, KEY_B)]  # written through, after the stores
    for _, key in moves.writes:
        disk.write(key, key[:1])  # what the runner does with them
    _commit(tier, moves)
    tier.offer(KEY_C, 5)  # full: drops A (least recently used), which is on disk already
    moves = tier.take_moves()
    assert moves.stores == [(5, 0)] and moves.writes == [(0, KEY_C)]
    disk.write(KEY_C, KEY_C[:1])
    _commit(tier, moves)
    assert tier.lookup(KEY_A) is None and KEY_A in disk
    slot = tier.find(KEY_A, keep={tier.lookup(KEY_C)})  # only on disk: read now, into B's slot (C is kept)
    assert slot == tier.lookup(KEY_A) == 1 and tier.lookup(KEY_B) is None
    tier.pin_slot(slot)
    tier.load(slot, 9)
    moves = tier.take_moves()
    assert moves.fills == [(KEY_A[:1], 1)] and moves.loads == [(1, 9)] and not moves.writes
    _commit(tier, moves)
    assert tier.num_filled == 1 and tier.find(KEY_B, set()) is not None  # B back from disk, into a slot
    _commit(tier, tier.take_moves())
    assert tier.lookup(KEY_C) is None  # B took C's slot
    tier.offer(KEY_C, 3)  # stored again: on disk already, not written again
    moves = tier.take_moves()
    assert moves.stores and not moves.writes


def test_a_slot_being_filled_is_kept_and_a_step_that_did_not_run_forgets_its_fills(tmp_path):
    disk = DiskTier(tmp_path, 8, TAG)
    for key in (KEY_A, KEY_B, KEY_C):
        disk.write(key, key[:1])
    tier = HostTier(2, disk)
    a, b = tier.find(KEY_A, set()), tier.find(KEY_B, set())
    assert {a, b} == {0, 1}
    assert tier.find(KEY_C, set()) is None  # both slots are being filled: neither is dropped for C
    tier.offer(KEY_C, 4)  # nor for a store
    moves = tier.take_moves()
    assert sorted(moves.fills) == [(KEY_A[:1], a), (KEY_B[:1], b)] and not moves.stores
    tier.discard()  # the step did not run: A and B were never written into their slots
    tier.check_invariants()
    assert tier.lookup(KEY_A) is None and tier.lookup(KEY_B) is None and len(tier) == 0
    disk.path(KEY_C).write_bytes(b"garbage")
    assert tier.find(KEY_C, set()) is None and disk.num_bad == 1 and len(tier) == 0  # a bad file: a miss
    tier.find(KEY_A, set())
    tier.clear()  # fills not taken are dropped with their keys
    assert not tier.take_moves() and len(tier) == 0


def test_a_manager_lookup_reads_the_prefix_from_disk_into_slots_it_keeps(tmp_path):
    """A prefix of 3 blocks on disk, a host tier of 3 slots holding other keys: the lookup reads all three, none
    dropped for another of the same lookup, and the step fills then loads them."""
    disk = DiskTier(tmp_path, 16, TAG)
    manager = KVCacheManager(6, 4, host_tier_blocks=(3,), disk_tiers=(disk,))
    request = make_request("a", list(range(13)) + [1])
    keys = [manager.groups[0].block_key(manager.block_hashes(request), j) for j in range(3)]
    for key in keys:
        disk.write(key, b"kv")
    tier = manager.tiers[0]
    for block, key in enumerate((KEY_A, KEY_B, KEY_C)):
        tier.offer(key, block)
    _commit(tier, tier.take_moves())
    hits, num_hit = manager.get_computed_blocks(request)
    assert num_hit == 12 and all(host_slot(b) is not None for b in hits)
    assert manager.allocate_slots(request, 2, hits) is not None
    moves = manager.take_tier_moves()[0]
    assert sorted(s for _, s in moves.fills) == sorted(s for s, _ in moves.loads) == [0, 1, 2]
    manager.commit_tier_moves((moves,))
    assert manager.host_hit_tokens == 12 and tier.num_filled == 3
    with pytest.raises(ValueError, match="only a pool with a host tier a disk tier"):
        KVCacheManager(6, 4, disk_tiers=(disk,))


def test_a_block_no_host_slot_takes_goes_to_disk_straight_from_the_device(tmp_path):
    disk = DiskTier(tmp_path, 8, TAG)
    tier = HostTier(1, disk)
    assert tier.offer(KEY_A, 3)  # the one slot, claimed by A's store in this plan
    assert not tier.offer(KEY_B, 4)  # no slot: B is written from device block 4 to its file instead
    disk.write(KEY_C, b"C")
    assert not tier.offer(KEY_C, 5)  # its file exists: nothing to do
    moves = tier.take_moves()
    assert moves.stores == [(3, 0)] and moves.writes == [(0, KEY_A)] and moves.disk_stores == [(4, KEY_B)]
    _commit(tier, moves)
    assert tier.lookup(KEY_B) is None and not tier.take_moves()
    without = HostTier(1)
    without.offer(KEY_A, 3)
    assert not without.offer(KEY_B, 4) and not without.take_moves().disk_stores  # no disk: B is not kept


def test_saving_sends_device_blocks_to_disk_unless_their_files_exist(tmp_path):
    disk = DiskTier(tmp_path, 8, TAG)
    disk.write(KEY_A, b"A")
    tier = HostTier(1, disk)
    assert not tier.save(KEY_A, 3) and tier.save(KEY_B, 4) and tier.save(KEY_C, 5)  # none takes a host slot
    moves = tier.take_moves()
    assert moves.disk_stores == [(4, KEY_B), (5, KEY_C)] and not moves.stores and not moves.writes
    _commit(tier, moves)
    with pytest.raises(RuntimeError, match="no disk tier"):
        HostTier(1).save(KEY_A, 3)
