"""Device slots: least recently used first, never evicting an adapter the step uses."""

from __future__ import annotations

import pytest

from pagedjax.lora.slots import SlotTable


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
