"""The cache policy: budgets, states, LRU, pins, keep-alive and leases. Pure: no I/O, no
await, no torch. The server asks it what to do, carries the plan out, and reports back.

Note [invariants]
-----------------
Held after every public method returns (``check_invariants`` asserts them; the property
tests in tests/test_core.py drive random operation sequences against them):

1. Per device, ``used`` is the sum of ``nbytes`` of its RESIDENT models and ``reserved``
   the sum of ``nbytes`` of its LOADING models; ``used + reserved <= budget``.
2. A model's attach count is the number of live leases on it, never negative; only a
   RESIDENT model has leases.
3. A model with a lease, or pinned, is never chosen for eviction; victims are taken in
   least-recently-used order (oldest ``last_used`` first) and no more than needed.

Loads are single-flight by construction: ``begin_load`` refuses a model that is already
LOADING, so the server keeps one in-flight load per model and lets other callers wait on it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import Attached, BadRequest, NoSpace, Pinned, UnknownModel


class State(StrEnum):
    REGISTERED = "registered"  # known, never loaded
    LOADING = "loading"  # reservation held, bytes being read into an arena
    RESIDENT = "resident"  # arena filled and sealed; attachable
    EVICTED = "evicted"  # was resident, arena freed; a load brings it back


@dataclass
class Entry:
    name: str
    device: str
    pinned: bool = False
    keep_alive: float | None = None  # seconds unused and unattached before eviction
    state: State = State.REGISTERED
    nbytes: int = 0  # arena size; set when a load is admitted
    last_used: float = 0.0
    leases: set[int] = field(default_factory=set)
    loads: int = 0
    evictions: int = 0

    @property
    def attach_count(self) -> int:
        return len(self.leases)

    @property
    def evictable(self) -> bool:
        return self.state is State.RESIDENT and not self.leases and not self.pinned


@dataclass
class DeviceAccount:
    budget: int
    used: int = 0  # bytes of RESIDENT arenas
    reserved: int = 0  # bytes promised to loads in flight

    @property
    def free(self) -> int:
        return self.budget - self.used - self.reserved


@dataclass(frozen=True)
class Lease:
    id: int
    model: str
    conn: int  # the connection that holds it; closing the connection ends the lease


@dataclass(frozen=True)
class LoadPlan:
    """What the server must do to admit a load: free these arenas, then fill a new one."""

    name: str
    nbytes: int
    evict: tuple[str, ...]


class CacheCore:
    def __init__(self, budgets: dict[str, int], clock: Callable[[], float] = time.monotonic) -> None:
        self.devices = {dev: DeviceAccount(budget=b) for dev, b in budgets.items()}
        self.entries: dict[str, Entry] = {}
        self.leases: dict[int, Lease] = {}
        self._clock = clock
        self._lease_ids = itertools.count(1)

    # -- registry -------------------------------------------------------------------
    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModel(f"no model named {name!r} is registered", model=name) from None

    def register(self, name: str, device: str, *, pinned: bool = False, keep_alive: float | None = None) -> Entry:
        if name in self.entries:
            raise BadRequest(f"model {name!r} is already registered", model=name)
        if device not in self.devices:
            raise BadRequest(f"device {device!r} has no budget; configured: {sorted(self.devices)}", device=device)
        e = Entry(name=name, device=device, pinned=pinned, keep_alive=keep_alive)
        self.entries[name] = e
        return e

    def unregister(self, name: str) -> Entry:
        """Forget a model. Returns its entry; if it was RESIDENT the caller frees the arena."""
        e = self.entry(name)
        if e.leases:
            raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name, attach_count=e.attach_count)
        if e.state is State.LOADING:
            raise BadRequest(f"model {name!r} is loading; unregister it when the load ends", model=name)
        if e.state is State.RESIDENT:
            self.devices[e.device].used -= e.nbytes
        del self.entries[name]
        return e

    def set_pinned(self, name: str, pinned: bool) -> Entry:
        e = self.entry(name)
        e.pinned = pinned
        return e

    # -- loading --------------------------------------------------------------------
    def begin_load(self, name: str, nbytes: int) -> LoadPlan:
        """Admit a load of ``nbytes``: reserve them, evicting LRU victims as needed.

        The victims are marked EVICTED and their bytes released at once; the caller frees
        their arenas. Raises NoSpace (naming the holders) when evicting everything
        evictable would still not make room; ``details["fits_ever"]`` says whether waiting
        for detaches could help.
        """
        e = self.entry(name)
        if e.state in (State.LOADING, State.RESIDENT):
            raise BadRequest(f"model {name!r} is already {e.state}", model=name)
        acct = self.devices[e.device]
        victims: list[Entry] = []
        if acct.free < nbytes:
            candidates = sorted(
                (x for x in self.entries.values() if x.device == e.device and x.evictable),
                key=lambda x: x.last_used,
            )
            room = acct.free
            for v in candidates:
                if room >= nbytes:
                    break
                victims.append(v)
                room += v.nbytes
            if room < nbytes:
                raise self._no_space(e, nbytes)
        for v in victims:
            v.state = State.EVICTED
            v.evictions += 1
            acct.used -= v.nbytes
        e.state = State.LOADING
        e.nbytes = nbytes
        acct.reserved += nbytes
        return LoadPlan(name=name, nbytes=nbytes, evict=tuple(v.name for v in victims))

    def finish_load(self, name: str) -> Entry:
        e = self._loading(name)
        acct = self.devices[e.device]
        acct.reserved -= e.nbytes
        acct.used += e.nbytes
        e.state = State.RESIDENT
        e.loads += 1
        e.last_used = self._clock()
        return e

    def abort_load(self, name: str) -> Entry:
        """Roll a failed load back: the reservation is returned, the budget is as before."""
        e = self._loading(name)
        self.devices[e.device].reserved -= e.nbytes
        e.state = State.EVICTED if e.loads else State.REGISTERED
        return e

    def _loading(self, name: str) -> Entry:
        e = self.entry(name)
        if e.state is not State.LOADING:
            raise BadRequest(f"model {name!r} is not loading (state {e.state})", model=name)
        return e

    def _no_space(self, e: Entry, nbytes: int) -> NoSpace:
        acct = self.devices[e.device]
        holders = [
            {"name": x.name, "nbytes": x.nbytes, "state": str(x.state), "attach_count": x.attach_count, "pinned": x.pinned}
            for x in self.entries.values()
            if x.device == e.device and x.state in (State.RESIDENT, State.LOADING)
        ]
        held = ", ".join(
            f"{h['name']} ({h['nbytes']} B, {h['state']}, {h['attach_count']} attached{', pinned' if h['pinned'] else ''})"
            for h in holders
        )
        # Memory that no detach can ever free: pinned models and in-flight loads.
        unfreeable = sum(x.nbytes for x in self.entries.values() if x.device == e.device and (x.pinned and x.state is State.RESIDENT))
        fits_ever = nbytes <= acct.budget - unfreeable
        return NoSpace(
            f"model {e.name!r} needs {nbytes} B on {e.device}; budget {acct.budget} B, "
            f"free {acct.free} B; held by: {held or 'nothing'}",
            model=e.name, device=e.device, needed=nbytes, budget=acct.budget, free=acct.free,
            holders=holders, fits_ever=fits_ever,
        )

    # -- eviction -------------------------------------------------------------------
    def evict(self, name: str, *, ignore_pin: bool = False) -> Entry:
        """Explicit eviction of a RESIDENT model; the caller frees its arena.
        ``ignore_pin`` is for stale bytes (checkpoint changed on disk): the pin stays."""
        e = self.entry(name)
        if e.state is not State.RESIDENT:
            raise BadRequest(f"model {name!r} is not resident (state {e.state})", model=name)
        if e.leases:
            raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name, attach_count=e.attach_count)
        if e.pinned and not ignore_pin:
            raise Pinned(f"model {name!r} is pinned; unpin it first", model=name)
        e.state = State.EVICTED
        e.evictions += 1
        self.devices[e.device].used -= e.nbytes
        return e

    def expired(self) -> list[str]:
        """Unattached, unpinned resident models whose keep_alive has run out."""
        now = self._clock()
        return [
            e.name for e in self.entries.values()
            if e.evictable and e.keep_alive is not None and now - e.last_used >= e.keep_alive
        ]

    # -- leases ---------------------------------------------------------------------
    def attach(self, name: str, conn: int) -> Lease:
        e = self.entry(name)
        if e.state is not State.RESIDENT:
            raise BadRequest(f"model {name!r} is not resident (state {e.state})", model=name)
        lease = Lease(id=next(self._lease_ids), model=name, conn=conn)
        self.leases[lease.id] = lease
        e.leases.add(lease.id)
        e.last_used = self._clock()
        return lease

    def detach(self, lease_id: int, conn: int) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or lease.conn != conn:
            raise BadRequest(f"no lease {lease_id} held by this connection", lease=lease_id)
        return self._end_lease(lease)

    def drop_connection(self, conn: int) -> list[Lease]:
        """End every lease the connection held (it closed, or its engine died)."""
        return [self._end_lease(lease) for lease in list(self.leases.values()) if lease.conn == conn]

    def _end_lease(self, lease: Lease) -> Lease:
        del self.leases[lease.id]
        e = self.entries[lease.model]
        e.leases.discard(lease.id)
        e.last_used = self._clock()  # detaching counts as use: keep_alive runs from here
        return lease

    # -- introspection --------------------------------------------------------------
    def check_invariants(self) -> None:
        for dev, acct in self.devices.items():
            mine = [e for e in self.entries.values() if e.device == dev]
            assert acct.used == sum(e.nbytes for e in mine if e.state is State.RESIDENT), dev
            assert acct.reserved == sum(e.nbytes for e in mine if e.state is State.LOADING), dev
            assert acct.used + acct.reserved <= acct.budget, dev
        for e in self.entries.values():
            assert all(self.leases[i].model == e.name for i in e.leases)
            assert not e.leases or e.state is State.RESIDENT, e.name
        assert sum(e.attach_count for e in self.entries.values()) == len(self.leases)

    def device_summary(self) -> dict[str, dict[str, Any]]:
        return {
            dev: {"budget": a.budget, "used": a.used, "reserved": a.reserved, "free": a.free}
            for dev, a in self.devices.items()
        }
