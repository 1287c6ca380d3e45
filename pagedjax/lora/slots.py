"""`SlotTable`: which adapter sits in which device slot, least recently used first (plain Python)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable


class SlotTable:
    """Adapters (by any key: the manager's adapter keys) in device slots 1..max_loras (slot 0: the base model).

    `assign(ids)` gives every adapter of one step a slot: those resident keep theirs; each other one takes a
    free slot, else the least recently used slot whose adapter is not in the step. An adapter the step uses is
    never evicted by it, so a step of at most `max_loras` adapters always fits; more is a ValueError (the
    scheduler never plans such a step: `Scheduler`'s `max_loras` admission rule)."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()  # adapter -> slot, least recently used first

    def slot_of(self, adapter: Hashable) -> int | None:
        return self._slot_of.get(adapter)

    @property
    def resident(self) -> list[Hashable]:
        """The adapters in slots, least recently used first."""
        return list(self._slot_of)

    def release(self, adapter: Hashable) -> int | None:
        """Free `adapter`'s slot; the slot it had (None: none). What the device slot holds is the caller's: the
        manager zeroes it."""
        return self._slot_of.pop(adapter, None)

    def assign(self, adapters: Iterable[Hashable]) -> tuple[dict[Hashable, int], list[tuple[Hashable, int]]]:
        """(slot of each adapter of the step, the (adapter, slot) pairs to load before it runs: new residents,
        each replacing its slot's former adapter)."""
        wanted = list(dict.fromkeys(adapters))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step of {len(wanted)} distinct LoRA adapters, more than max_loras "
                             f"{self.max_loras} (the scheduler admits no such step: a bug)")
        loads = []
        for adapter in wanted:
            if adapter in self._slot_of:
                self._slot_of.move_to_end(adapter)
                continue
            taken = set(self._slot_of.values())
            free = next((s for s in range(1, self.max_loras + 1) if s not in taken), None)
            if free is None:
                victim = next(a for a in self._slot_of if a not in wanted)  # exists: len(wanted) <= max_loras
                free = self._slot_of.pop(victim)
            self._slot_of[adapter] = free
            loads.append((adapter, free))
        return {a: self._slot_of[a] for a in wanted}, loads
