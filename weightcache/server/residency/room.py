"""Waiting for room: the one loop in which a load (``SingleFlight.ensure_resident``) and a
publish (``Fill.fill_new_arena`` with a wait) retry an admission refused NO_SPACE, woken
by detaches and frees in the order they first waited (``SpaceFreed``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ...cache import CacheCore
from ...errors import NoSpace

T = TypeVar("T")


class SpaceFreed:
    """Requests waiting for room, woken in the order they first waited: one that is
    refused again keeps its place instead of going to the back (asyncio.Condition would
    re-queue it behind later arrivals).

    Waiters for the same model (``key``) would all be refused or all admitted alike, so a
    notification wakes only the oldest of each key; the others follow when it gets its
    model or fails with an error of the model's own, and the next oldest when it is
    cancelled (``settle``). Every detach notifies: with all woken, 1,920 loads waiting for
    one model made a detach take 28-50 ms of the event loop on the CI VM, one refused
    retry each (python -m benchmarks waiter-herd)."""

    def __init__(self) -> None:
        self.generation = 0  # counts notifications: a waiter that missed one sees it
        self._waiters: dict[int, tuple[str | None, asyncio.Future[None], Callable[[], bool] | None]] = {}
        self._tickets = itertools.count()

    def ticket(self) -> int:
        return next(self._tickets)

    async def wait(self, ticket: int, timeout: float, gone: asyncio.Future[None] | None = None,
                   key: str | None = None, fits: Callable[[], bool] | None = None) -> None:
        """Until the next notification (for ``key``'s turn) after which ``fits()`` says the
        load would now be admitted, ``timeout`` seconds, or ``gone`` is done (the
        requester's connection closed), whichever comes first. Without ``fits`` every
        notification wakes: 48 loads parked over a 2.2 MiB header were each woken by
        every detach, anyone's, and each re-parsed its header in the shared io pool only
        to be refused again (another tenant's cold load got no reply within 20 s)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = (key, fut, fits)

        def wake(_: object) -> None:
            if not fut.done():
                fut.set_result(None)

        if gone is not None:
            gone.add_done_callback(wake)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, timeout)
        finally:
            self._waiters.pop(ticket, None)
            if gone is not None:
                gone.remove_done_callback(wake)

    def notify(self) -> None:
        self.generation += 1
        woken: set[str] = set()
        for ticket in sorted(self._waiters):  # their tasks resume in this order
            key, fut, fits = self._waiters[ticket]
            if key is not None:
                if key in woken:
                    continue  # its oldest tries for all of them (or none fits)
                woken.add(key)
            if fits is not None and not fits():
                continue  # the room freed is not enough for it: it sleeps on, and so do the others of its key
            del self._waiters[ticket]
            if not fut.done():
                fut.set_result(None)

    def settle(self, key: str, everyone: bool) -> None:
        """A request for ``key`` ended other than refused NO_SPACE. Got its model, or an
        error of the model's own (``everyone``): the rest waiting for it try now, and
        join its load. Cancelled (request timeout, its peer gone, shutdown): the oldest
        tries in its place, in case it held the turn a notification gave."""
        for ticket in sorted(t for t, (k, _, _) in self._waiters.items() if k == key):
            _, fut, _ = self._waiters.pop(ticket)
            if not fut.done():
                fut.set_result(None)
            if not everyone:
                return


class RoomQueue:
    """Where requests refused NO_SPACE wait for room, and what wakes them."""

    def __init__(self, core: CacheCore) -> None:
        self.core = core
        self.freed = SpaceFreed()
        # Called when a request is refused for room: what else holds memory may
        # give it back (the peer port's idle lends, weightcache/peers/server.py).
        self.on_refused: Callable[[], object] | None = None

    def notify(self) -> None:
        """Room may have been freed (a detach, a free, a failed load's reservation back)."""
        self.freed.notify()

    async def until_admitted(self, name: str, attempt: Callable[[], Awaitable[T]], wait_s: float, *,
                             key: str | None, waits: list[float] | None = None,
                             gone: asyncio.Future[None] | None = None) -> T:
        """``attempt()`` (a load of entry ``name``, or the core's admission of it), tried
        again while it is refused NO_SPACE that detaches could cure, until ``wait_s`` has
        passed (then the refusal is raised); woken only once the room freed would admit
        ``name``. Each wait's seconds go in ``waits`` (the attach reply's ``waited_s``).

        ``key``: the requests of one model queue behind its oldest, and each one's end
        lets the others try (``SpaceFreed.settle``). None for an admission inside a load
        (the load's own requests queue and settle by its name) and for a publish's
        staging entry (unique: nobody queues behind it).

        ``gone`` is done once the requester's connection closed: a load it started or
        joined still finishes, but it waits for room no more (a peer could otherwise
        leave requests waiting up to request_timeout_s, without end, each woken to try
        again by every detach)."""
        deadline = time.monotonic() + wait_s
        ticket: int | None = None
        try:
            while True:
                generation = self.freed.generation
                try:
                    got = await attempt()
                except NoSpace as exc:
                    if self.on_refused is not None and exc.fits_ever:
                        self.on_refused()  # before the refusal goes back: the room is there for a retry, or this wait
                    left = deadline - time.monotonic()
                    if left <= 0 or not exc.fits_ever or (gone is not None and gone.done()):
                        raise
                    if self.freed.generation != generation:
                        continue  # room was freed while the refusal travelled back: try again now
                    if ticket is None:
                        ticket = self.freed.ticket()  # kept across retries: our place in line
                    waited_from = time.monotonic()
                    needed = exc.details.get("needed")
                    fits = None if not isinstance(needed, int) else functools.partial(self.core.could_admit, name, needed)
                    await self.freed.wait(ticket, left, gone, key=key, fits=fits)
                    if waits is not None:
                        waits.append(time.monotonic() - waited_from)
                else:
                    if key is not None:
                        self.freed.settle(key, everyone=True)  # the others waiting for it join now
                    return got
        except NoSpace:
            raise  # the others waiting for this model would be refused too: they sleep on
        except Exception:
            # The model's own error (its files no longer parse, the io timeout, removed):
            # all of them try now and join one load, as when every waiter was woken. The
            # next oldest alone made each waiter run its own failed load in turn.
            if key is not None:
                self.freed.settle(key, everyone=True)
            raise
        except BaseException:
            if key is not None:
                self.freed.settle(key, everyone=False)  # cancelled: the next one tries in its place
            raise
