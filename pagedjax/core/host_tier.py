"""The host tier of one block pool: cached blocks the device pool evicts are kept in host memory, keyed as the pool
keys them (the chained block hash, and the KV cache group past the first), and loaded back into fresh device blocks
when a prefix lookup misses on the device but finds them here.

Plain Python, no JAX: this holds which host slot holds which key; the runner holds the slots' bytes
(`pagedjax.runner.host_tier`) and carries out the moves a step plan lists.

Policy:
  - write on evict: a hashed idle block the pool takes back for reuse is offered (`offer`) and stored unless its key
    is already here (the tier is inclusive: a block loaded from here keeps its copy, so evicting it again copies
    nothing); a full tier makes room by dropping its least recently used key;
  - load on hit: `pin_slot` marks a slot a request will load (its slot cannot be reused until the step ran), `load`
    records the device block it goes to;
  - two phases: the moves a plan takes (`take_moves`) become real only when its step ran (`commit`); a step that did
    not run (`discard`) gives their slots back, so a key is never found here unless its bytes were written (or,
    a block read from disk, are written by the next step before it loads anything).

With a disk tier under it (`pagedjax.core.disk_tier`), write-through: every block stored here is also written to its
key's file (`TierMoves.writes`, after the stores), unless the file exists, and an evicted block no slot can take (all
pinned or claimed in this plan) goes to its file straight from the device (`TierMoves.disk_stores`): so the disk
holds every block the device evicted (within its own least recently used bound), and a restart finds every such
prefix, not only those the host dropped. A lookup that reaches a key found only on disk (`find`) reads and checks
the file now, and the key is committed at once to a slot that the plan fills with those bytes (`TierMoves.fills`)
before anything loads from it; a slot being filled is not dropped before its step ran, and a step that did not run
forgets the keys it was to fill.

Invariants: every slot is free, committed to one key, or claimed by one pending store; a pinned slot is committed;
a slot being filled is committed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedjax.core.block_pool import BlockHash
from pagedjax.core.disk_tier import DiskTier


@dataclass
class TierMoves:
    """One step's block moves for one pool, run in this order before the step computes: `fills` (file payload,
    host slot) put blocks read from disk into host slots, `stores` (device block, host slot) copy evicted blocks
    out (before anything writes them), `writes` (host slot, key) write stored blocks to the disk tier,
    `disk_stores` (device block, key) write evicted blocks no host slot could take straight to it, then `loads`
    (host slot, device block) copy blocks in."""

    stores: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    fills: list[tuple[bytes, int]] = field(default_factory=list)
    writes: list[tuple[int, BlockHash]] = field(default_factory=list)
    disk_stores: list[tuple[int, BlockHash]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.fills or self.writes or self.disk_stores)


class HostTier:
    """`capacity` host slots of one pool's blocks, over `disk` if given (module docstring)."""

    def __init__(self, capacity: int, disk: DiskTier | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a host tier needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.disk = disk
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # committed, least recently used first
        self._key_of: dict[int, BlockHash] = {}  # committed slot -> its key
        self._free = list(range(capacity - 1, -1, -1))
        self._stores: dict[BlockHash, tuple[int, int]] = {}  # key -> (slot, device block): not taken yet
        self._loads: list[tuple[int, int]] = []  # (slot, device block), not taken yet
        self._pinned: set[int] = set()
        self._taken: list[tuple[BlockHash, int]] = []  # the in-flight plan's stores: (key, slot)
        self._taken_pins: set[int] = set()
        self._fills: dict[int, bytes] = {}  # slot -> the payload read from disk for it, not taken yet
        self._disk_stores: dict[BlockHash, int] = {}  # key -> device block for the disk (no slot took it, or saved)
        self._taken_fills: list[int] = []  # the in-flight plan's filled slots
        self.num_stored = 0  # blocks copied out, counted when their step ran
        self.num_loaded = 0  # blocks copied in, likewise
        self.num_filled = 0  # blocks read from disk into host slots, likewise

    def __len__(self) -> int:
        """Keys committed (findable)."""
        return len(self._slots)

    def lookup(self, key: BlockHash) -> int | None:
        """The slot holding `key`'s bytes, or None (a key stored by a step that has not run is not found)."""
        return self._slots.get(key)

    def offer(self, key: BlockHash, block: int) -> bool:
        """The device pool is reusing `block`, which held `key`: keep its bytes unless this tier has them. False if
        no slot could take it (every one pinned, being filled or claimed by a store): then a disk tier takes it
        straight from the device, unless it has it."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return True
        if key in self._stores:
            return True
        slot = self._free.pop() if self._free else self._evict_lru()
        if slot is not None:
            self._stores[key] = (slot, block)
        elif self.disk is not None and key not in self.disk:
            self._disk_stores[key] = block
        return slot is not None

    def save(self, key: BlockHash, block: int) -> bool:
        """Device `block`, which holds `key`, goes to the disk tier at the next moves, unless its file exists
        (`TierMoves.disk_stores`: the device's cached blocks saved before exiting). Returns whether it will."""
        if self.disk is None:
            raise RuntimeError("this host tier has no disk tier to save blocks to")
        if key in self.disk:
            return False
        self._disk_stores[key] = block
        return True

    def find(self, key: BlockHash, keep: set[int]) -> int | None:
        """`lookup`, and with a disk tier a key found only there is read now (a bad file is a miss) and committed
        to a slot the next plan fills, none of `keep` (slots the caller holds on to: the lookup's earlier hits)."""
        slot = self._slots.get(key)
        if slot is not None or self.disk is None or key not in self.disk:
            return slot
        payload = self.disk.read(key)
        if payload is None:
            return None
        slot = self._free.pop() if self._free else self._evict_lru(keep)
        if slot is None:
            return None
        self._fills[slot] = payload
        self._slots[key], self._key_of[slot] = slot, key
        return slot

    def _evict_lru(self, keep: set[int] = frozenset()) -> int | None:
        busy = self._pinned | self._taken_pins | self._fills.keys() | set(self._taken_fills) | keep
        for key, slot in self._slots.items():
            if slot not in busy:
                del self._slots[key], self._key_of[slot]
                return slot
        return None

    def pin_slot(self, slot: int) -> None:
        """A request will load committed `slot` (found by `lookup` just before): it is kept until the step that
        loads it ran."""
        key = self._key_of.get(slot)
        if key is None:
            raise RuntimeError(f"host slot {slot} holds no key: a hit's slot was reused before it was pinned")
        self._slots.move_to_end(key)
        self._pinned.add(slot)

    def load(self, slot: int, block: int) -> None:
        """The pinned `slot` goes into device `block` before the next step computes."""
        if slot not in self._pinned:
            raise ValueError(f"host slot {slot} is not pinned")
        self._loads.append((slot, block))

    def take_moves(self) -> TierMoves:
        """The moves since the last plan, for the plan being made (one in flight at a time)."""
        if self._taken or self._taken_pins or self._taken_fills:
            raise RuntimeError("the previous plan's tier moves were neither committed nor discarded")
        moves = TierMoves([(block, slot) for slot, block in self._stores.values()], list(self._loads),
                          [(payload, slot) for slot, payload in self._fills.items()],
                          [] if self.disk is None else
                          [(slot, key) for key, (slot, _) in self._stores.items() if key not in self.disk],
                          [(block, key) for key, block in self._disk_stores.items()])
        self._taken = [(key, slot) for key, (slot, _) in self._stores.items()]
        self._taken_pins = set(self._pinned)
        self._taken_fills = list(self._fills)
        self._stores, self._loads, self._pinned, self._fills, self._disk_stores = {}, [], set(), {}, {}
        return moves

    def commit(self, moves: TierMoves) -> None:
        """The plan's step ran: its stored keys become findable."""
        for key, slot in self._taken:
            self._slots[key], self._key_of[slot] = slot, key
        self.num_stored += len(moves.stores)
        self.num_loaded += len(moves.loads)
        self.num_filled += len(moves.fills)
        self._taken, self._taken_pins, self._taken_fills = [], set(), []

    def discard(self) -> None:
        """The plan's step did not run: its stores' and fills' slots are free again (their keys were never
        written)."""
        self._free.extend(slot for _, slot in self._taken)
        for slot in self._taken_fills:
            del self._slots[self._key_of.pop(slot)]
            self._free.append(slot)
        self._taken, self._taken_pins, self._taken_fills = [], set(), []

    def clear(self) -> None:
        """Forget every key, and stores not taken by a plan yet (the KV they hold is stale: new weights, or a lost
        cache). Refused while a plan's moves are in flight."""
        if self._taken or self._taken_pins or self._taken_fills:
            raise RuntimeError("the host tier has a plan's moves in flight")
        self._slots.clear()
        self._key_of.clear()
        self._stores, self._loads, self._pinned, self._fills, self._disk_stores = {}, [], set(), {}, {}
        self._free = list(range(self.capacity - 1, -1, -1))

    def check_invariants(self) -> None:
        """AssertionError if the bookkeeping is inconsistent (for tests)."""
        claimed = [s for s, _ in self._stores.values()] + [s for _, s in self._taken]
        slots = list(self._slots.values()) + claimed + self._free
        assert sorted(slots) == list(range(self.capacity)), "a host slot is lost or held twice"
        assert (self._pinned | self._taken_pins) <= set(self._slots.values()), "a pinned slot is not committed"
        assert self._key_of == {slot: key for key, slot in self._slots.items()}, "slot -> key map out of step"
        assert (self._fills.keys() | set(self._taken_fills)) <= set(self._slots.values()), \
            "a slot being filled is not committed"
        if self.disk is not None:
            self.disk.check_invariants()
