"""Device slots: least recently used first, never evicting an adapter the step uses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.lora.slots import SlotTable
from tests.kernels.cases import examples


def test_new_adapters_take_free_slots_then_the_least_recently_used():
    t = SlotTable(2)
    assert t.assign([7]) == ({7: 1}, [(7, 1)])
    assert t.assign([8, 7]) == ({8: 2, 7: 1}, [(8, 2)])  # 7 resident: no load
    assert t.resident == [8, 7]  # 7 used last
    assert t.assign([9]) == ({9: 2}, [(9, 2)])  # 8 was least recently used
    assert t.resident == [7, 9]


def test_an_adapter_of_the_step_is_never_evicted():
    t = SlotTable(2)
    t.assign([1])
    t.assign([2])  # 1 is least recently used now
    slots, loads = t.assign([1, 3])  # 1 is resident and in the step: 3 must take 2's slot
    assert slots == {1: 1, 3: 2} and loads == [(3, 2)]


def test_a_released_slot_is_taken_first():
    t = SlotTable(2)
    t.assign([1])
    t.assign([2])
    t.release(2)
    t.release(9)  # not resident: nothing
    assert t.assign([3]) == ({3: 2}, [(3, 2)])  # 2's freed slot, not 1's (least recently used)


def test_repeats_count_once_and_too_many_is_refused():
    t = SlotTable(2)
    assert t.assign([5, 5, 5])[0] == {5: 1}
    with pytest.raises(ValueError, match="more than max_loras 2"):
        t.assign([1, 2, 3])


@settings(max_examples=examples(8))
@given(st.integers(1, 4), st.lists(st.one_of(st.lists(st.integers(0, 6), max_size=5).map(tuple),
                                              st.integers(0, 6)), max_size=30))
def test_any_sequence_of_steps_keeps_lru_order_and_the_steps_adapters(max_loras, ops):
    """Against a model (a list, least recently used first): each step's adapters get distinct slots in
    1..max_loras, a resident one keeps its slot and is not reloaded, every other one is loaded into a free slot or
    the slot of the least recently used adapter not in the step; a step of more than max_loras adapters is refused
    and changes nothing. Integers are releases."""
    t = SlotTable(max_loras)
    lru: list[int] = []
    slots: dict[int, int] = {}
    for op in ops:
        if isinstance(op, int):
            t.release(op)
            if op in slots:
                lru.remove(op)
                del slots[op]
            continue
        wanted = list(dict.fromkeys(op))
        if len(wanted) > max_loras:
            with pytest.raises(ValueError, match="more than max_loras"):
                t.assign(op)
            assert t.resident == lru
            continue
        expected_loads = []
        for a in wanted:
            if a in slots:
                lru.remove(a)
            else:
                free = min(set(range(1, max_loras + 1)) - set(slots.values()), default=None)
                if free is None:
                    victim = next(v for v in lru if v not in wanted)
                    lru.remove(victim)
                    free = slots.pop(victim)
                slots[a] = free
                expected_loads.append((a, free))
            lru.append(a)
        got, loads = t.assign(op)
        assert got == {a: slots[a] for a in wanted} and loads == expected_loads
        assert t.resident == lru and len(set(slots.values())) == len(slots) <= max_loras
