"""A device's fill turns (server/residency/fill.py: FairTurns): round-robin by tenant, first come
first served within one, and a waiter that goes away neither keeps nor loses a turn."""

from __future__ import annotations

import asyncio

from weightcache.server.residency.fill import FairTurns


async def _queue(turns: FairTurns, order: list[str], jobs: list[tuple[str, int | None]]) -> None:
    started, queued = asyncio.Event(), asyncio.Event()

    async def fill(label: str, owner: int | None) -> None:
        async with turns.turn(owner):
            order.append(label)

    async def holder() -> None:  # holds the turn until the others have queued, in the order given
        async with turns.turn("first"):
            started.set()
            await queued.wait()

    h = asyncio.ensure_future(holder())
    await started.wait()
    tasks = []
    for label, owner in jobs:
        tasks.append(asyncio.ensure_future(fill(label, owner)))
        await asyncio.sleep(0)  # queued in this order
    assert turns.waiting == len(jobs)
    queued.set()
    await asyncio.wait_for(asyncio.gather(h, *tasks), 5)


async def test_a_tenant_with_many_fills_queued_does_not_hold_back_another() -> None:
    order: list[str] = []
    turns = FairTurns()
    # tenant 1 queues four fills, then tenant 2 one, then the operator's (owner None) one
    await _queue(turns, order, [("a1", 1), ("a2", 1), ("a3", 1), ("a4", 1), ("b1", 2), ("op", None)])
    assert order == ["a1", "b1", "op", "a2", "a3", "a4"]  # plain FIFO would have put b1 fifth
    assert turns.waiting == 0 and not turns._held


async def test_a_cancelled_waiter_leaves_the_queue_and_the_turn_moves_on() -> None:
    turns = FairTurns()
    order: list[str] = []
    async with turns.turn(1):
        async def fill(label: str, owner: int) -> None:
            async with turns.turn(owner):
                order.append(label)

        gone = asyncio.ensure_future(fill("gone", 2))
        stays = asyncio.ensure_future(fill("stays", 3))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert turns.waiting == 1
    await asyncio.wait_for(stays, 5)  # a turn lost with the cancelled waiter would hang here
    assert order == ["stays"] and gone.cancelled()
    assert not turns._held  # nobody holds it after the last


async def test_a_waiter_cancelled_just_as_it_is_handed_the_turn_passes_it_on() -> None:
    turns = FairTurns()
    order: list[str] = []

    async def fill(label: str, owner: int) -> None:
        async with turns.turn(owner):
            order.append(label)

    async with turns.turn(1):
        unlucky = asyncio.ensure_future(fill("unlucky", 2))
        nxt = asyncio.ensure_future(fill("next", 3))
        await asyncio.sleep(0)
    # the turn was handed to "unlucky" when the block ended; it is cancelled before it runs
    unlucky.cancel()
    await asyncio.wait_for(asyncio.gather(unlucky, nxt, return_exceptions=True), 5)  # not passed on: a hang
    assert order == ["next"] and unlucky.cancelled()
    assert not turns._held and turns.waiting == 0
