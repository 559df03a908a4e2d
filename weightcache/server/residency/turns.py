"""Turns at a device's fill, shared fairly between tenants.

A device fills one arena at a time (residency/fill.py says why). With a plain
``asyncio.Lock`` the turns go first come, first served, so a tenant that queues ten big
fills makes another tenant's one big fill wait for all ten. Here the waiters are served
round-robin by tenant (the model's owner; None is the operator's own models), first come,
first served within a tenant: another tenant waits for at most one fill of each tenant
queued ahead of it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager


class FairTurns:
    """One holder at a time; waiters served round-robin by key (see the module docstring)."""

    def __init__(self) -> None:
        self._held = False
        # key -> its waiters in order; the key served next is first (round-robin by moving a
        # served key that still has waiters to the end).
        self._waiting: OrderedDict[Hashable, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @asynccontextmanager
    async def turn(self, key: Hashable) -> AsyncIterator[None]:
        if self._held or self._waiting:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(key, deque()).append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # handed the turn as it was cancelled: pass it on
                    self._pass()
                else:
                    self._forget(key, fut)
                raise
        else:
            self._held = True
        try:
            yield
        finally:
            self._pass()

    def _forget(self, key: Hashable, fut: asyncio.Future[None]) -> None:
        q = self._waiting.get(key)
        if q is not None and fut in q:
            q.remove(fut)
            if not q:
                del self._waiting[key]

    def _pass(self) -> None:
        """The holder is done: hand the turn to the next tenant's first waiter."""
        while self._waiting:
            key, q = next(iter(self._waiting.items()))
            fut = q.popleft()
            if q:
                self._waiting.move_to_end(key)
            else:
                del self._waiting[key]
            if not fut.done():
                fut.set_result(None)  # the turn goes to it: still held
                return
        self._held = False
