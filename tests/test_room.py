"""The device's room (backends/base.py): the physical side of the budget that a CUDA
arena's chunks take from and give back to as they are created and released."""

from __future__ import annotations

import threading
import time

import pytest

from weightcache.backends import Room


def test_take_waits_for_what_is_given_back_and_counts_the_wait() -> None:
    room = Room(1 << 20)
    assert room.take(1 << 20) < 0.05  # free at once
    waited: list[float] = []
    t = threading.Thread(target=lambda: waited.append(room.take(4096)))
    t.start()
    deadline = time.monotonic() + 5
    while room.waiting != 1 and time.monotonic() < deadline:  # a demotion reads this to release early
        time.sleep(0.005)
    assert room.waiting == 1
    time.sleep(0.05)  # the wait that take() must count
    room.give(4096)
    t.join(5)
    assert waited and waited[0] >= 0.05 and room.waiting == 0 and room.available == 0


def test_a_lowered_budget_goes_negative_until_chunks_come_back() -> None:
    room = Room(100)
    room.give(-150)  # the budget fell by 150 while 100 were free: 50 must come back first
    assert room.available == -50
    room.give(60)
    room.take(10)
    assert room.available == 0


def test_a_room_never_given_back_times_out_with_a_reason() -> None:
    room = Room(0, timeout_s=0.05)
    with pytest.raises(TimeoutError, match="were not freed within"):
        room.take(1)
    assert room.waiting == 0 and room.available == 0
