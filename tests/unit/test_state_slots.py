"""The books of a hybrid model's recurrent state slots (core/state_slots.py): one slot per running request,
handed out lowest first, returned on free, and an integrity check that catches a leak or a double owner."""

from __future__ import annotations

import pytest

from mmserve.core.state_slots import StateSlotLayout, StateSlotPool


def test_slots_are_owned_once_and_come_back() -> None:
    pool = StateSlotPool(StateSlotLayout(num_slots=3, bytes_per_slot=100))
    assert pool.layout.total_bytes == 300
    assert [pool.allocate(r) for r in ("a", "b", "c")] == [0, 1, 2]
    assert pool.allocate("b") == 1  # a request asking again keeps its slot
    assert not pool.can_allocate()
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.allocate("d")
    pool.free("a")
    pool.free("a")  # freeing twice is harmless
    assert pool.slot_of("a") is None and pool.num_free == 1
    assert pool.allocate("d") == 0
    pool.check_integrity({"b", "c", "d"})


def test_lowest_free_slot_first() -> None:
    pool = StateSlotPool(StateSlotLayout(num_slots=4, bytes_per_slot=1))
    for r in "abcd":
        pool.allocate(r)
    pool.free("c")
    pool.free("a")
    assert pool.allocate("e") == 0 and pool.allocate("f") == 2


def test_integrity_catches_a_leak_and_a_double_owner() -> None:
    pool = StateSlotPool(StateSlotLayout(num_slots=2, bytes_per_slot=1))
    pool.allocate("a")
    with pytest.raises(AssertionError, match="not running"):
        pool.check_integrity(set())
    pool._owner["b"] = 0  # a bug that gives one slot to two requests
    with pytest.raises(AssertionError, match="held twice"):
        pool.check_integrity()


def test_layout_rejects_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        StateSlotLayout(num_slots=0, bytes_per_slot=10)
