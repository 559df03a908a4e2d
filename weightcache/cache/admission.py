"""Admission: which evictable models must leave a device for a load to fit there (its
tenants' byte quotas first, then the budget and the max_loaded count, in the policy's
order: Note [invariants] 3 in core.py) or for a lowered budget or count to hold, and the
refusal, naming what holds the memory, when no choice of them can make room."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import NoSpace
from ..units import format_size
from .entries import DeviceAccount, Entry, State, arena_key
from .policy import EvictionPolicy
from .quotas import Parses, Quota, over_quota, tenant_bytes
from .shares import Shares


class Admission:
    def __init__(self, entries: dict[str, Entry], devices: dict[str, DeviceAccount], shares: Shares,
                 policy: EvictionPolicy, max_loaded: dict[str, int]) -> None:
        self.entries = entries  # the core's, as are the accounts and the count limits
        self.devices = devices
        self.shares = shares
        self.policy = policy
        self.max_loaded = max_loaded  # device -> the most models RESIDENT or LOADING on it at once
        self.quotas: dict[str, Quota] = {}  # tenant -> its quota (Note [quotas] in quotas.py)
        self.parses = Parses()  # tenants' parses running, charged to their quotas

    def choose(self, e: Entry, nbytes: int, commit: bool) -> tuple[list[Entry], list[Entry] | None]:
        """The victims a load of ``nbytes`` for ``e`` needs: its tenants' own (for their
        quotas; NoSpace naming the quota when those cannot make room), and then the
        others for the device's room, or None when none can make it. The policy's clock
        moves past the others only if ``commit`` (the tenants' own: when the caller admits)."""
        own = self.quota_victims(e, nbytes)
        acct = self.devices[e.device]
        arenas = {arena_key(v): v.nbytes for v in own}  # a shared arena once
        taken = {v.name for v in own}
        return own, self.victims(e.device, nbytes - acct.free - sum(arenas.values()),
                                 self.over_count(e.device) - len(arenas), among=lambda x: x.name not in taken,
                                 commit=commit)

    def loaded_on(self, device: str) -> int:
        """Models counted against ``device``'s max_loaded: RESIDENT or LOADING there, a
        shared arena once."""
        return len({arena_key(x) for x in self.entries.values()
                    if x.device == device and x.state in (State.RESIDENT, State.LOADING)})

    def over_count(self, device: str) -> int:
        """How many models must leave ``device`` before one more may load there."""
        limit = self.max_loaded.get(device)
        return 0 if limit is None else self.loaded_on(device) + 1 - limit

    def victims(self, device: str, need: int, count: int = 0,
                 among: Callable[[Entry], bool] | None = None, commit: bool = True) -> list[Entry] | None:
        """The policy's victims among the evictable models on ``device`` (those ``among``
        accepts) whose bytes add up to ``need`` and that number at least ``count`` (Note
        [invariants], 3), its clock moved past them unless not ``commit``; None if all of
        them would not."""
        candidates: list[Entry] = []
        groups: dict[str, list[Entry]] = {}
        for x in self.entries.values():
            if x.device != device or not x.evictable or (among is not None and not among(x)):
                continue
            if x.share is None:
                candidates.append(x)
            elif x.share not in groups:
                # A shared arena leaves only with every name on it, so only when none is
                # attached or pinned; it is ranked as its most valuable name.
                group = groups[x.share] = [y for y in (x, *self.shares.siblings(x)) if y.state is State.RESIDENT]
                if all(y.evictable for y in group):
                    candidates.append(max(group, key=self.policy.priority))
        victims = self.policy.choose(candidates, need, count)
        if victims and commit:
            self.policy.evicted(device, victims)
            return [y for v in victims for y in (groups[v.share] if v.share is not None else [v])]
        return victims

    def quota_victims(self, e: Entry, nbytes: int) -> list[Entry]:
        """The tenant's own evictable models on ``e``'s device that must leave for a load of
        ``nbytes`` to stay within each of ``e``'s tenants' byte quotas there (the policy's
        order among them); NoSpace naming the quota when they cannot."""
        chosen: list[Entry] = []
        for t in e.tenants:
            q = self.quotas.get(t)
            limit = q.nbytes.get(e.device) if q is not None else None
            if limit is None:
                continue
            taken = {v.name for v in chosen}
            going = sum({arena_key(v): v.nbytes for v in chosen if t in v.tenants}.values())
            used = tenant_bytes(self.entries.values(), t, e.device) + self.parses.bytes(t, e.device)
            over = used - going + nbytes - limit
            if over <= 0:
                continue

            def mine(x: Entry, t: str = t, taken: set[str] = taken) -> bool:
                return t in x.tenants and x.name not in taken

            victims = self.victims(e.device, over, among=mine, commit=False)
            if victims is None:
                assert q is not None
                raise over_quota(self.entries.values(), e, nbytes, t, q, limit, used)
            chosen += victims
        return chosen

    def no_space(self, e: Entry, nbytes: int) -> NoSpace:
        acct = self.devices[e.device]
        there = [x for x in self.entries.values() if x.device == e.device and x.state in (State.RESIDENT, State.LOADING)]
        holders = [{"name": x.name, "nbytes": x.nbytes, "state": str(x.state), "attach_count": x.attach_count, "pinned": x.pinned}
                   for x in there]
        held = [f"{x.name} ({format_size(x.nbytes)}, {x.state}, {x.attach_count} attached{', pinned' if x.pinned else ''})"
                for x in there]
        # Memory that no detach can ever free: pinned models and in-flight loads.
        pinned = [x for x in self.entries.values() if x.device == e.device and x.pinned and x.state is State.RESIDENT]
        fits_ever = nbytes <= acct.budget - sum(x.nbytes for x in pinned)
        limit = self.max_loaded.get(e.device)
        count: dict[str, Any] = {}
        if limit is not None and self.over_count(e.device) > 0:
            # The count, not the bytes, may be what is full: say so, naming the key.
            count = {"max_loaded_models": limit, "loaded": self.loaded_on(e.device)}
            fits_ever = fits_ever and len(pinned) < limit
        return NoSpace.over_budget(model=e.name, needed=nbytes, device=e.device, budget=acct.budget, free=acct.free,
                                   held=held, holders=holders, fits_ever=fits_ever, **count)

    def _unevictable(self, device: str) -> list[Entry]:
        return [x for x in self.entries.values()
                if x.device == device and x.state in (State.RESIDENT, State.LOADING) and not x.evictable]

    def to_lower_budget(self, device: str, budget: int) -> list[Entry]:
        """The victims that lowering ``device``'s budget to ``budget`` needs; NoSpace naming
        what cannot be evicted (attached, pinned, loading) when they cannot make it fit."""
        acct = self.devices[device]
        victims = self.victims(device, acct.used + acct.reserved - budget)
        if victims is None:
            held = sorted(f"{x.name} ({format_size(x.nbytes)})" for x in self._unevictable(device))
            raise NoSpace(f"cannot lower the {device} budget to {format_size(budget)}: {', '.join(held)} cannot be "
                          "evicted now (attached, pinned or loading)", device=device, budget=budget)
        return victims

    def to_lower_count(self, device: str, limit: int | None) -> list[Entry]:
        """The victims that a max_loaded count of ``limit`` on ``device`` needs (None: no
        count); NoSpace naming what cannot be evicted when they are too few."""
        over = 0 if limit is None else self.loaded_on(device) - limit
        if over <= 0:
            return []
        found = self.victims(device, 0, over)
        if found is None:
            held = sorted(x.name for x in self._unevictable(device))
            raise NoSpace(f"cannot lower max_loaded_models.{device} to {limit}: {self.loaded_on(device)} models are "
                          f"loaded and {', '.join(held)} cannot be evicted now",
                          device=device, max_loaded_models=limit, loaded=self.loaded_on(device))
        return found
