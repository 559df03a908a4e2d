"""Per-tenant quotas: what one uid's or group's models may hold, and the
rules that the core (core.py) applies with them. Pure: no I/O.

A tenant is named ``"uid:N"`` or ``"gid:N"``. A model registered or published by a peer
belongs to every tenant its owner was at that moment: its uid and each of its groups
(``tenant_keys``). The operator's configured models belong to no tenant and count
against no quota.

Note [quotas]
-------------
A tenant ("uid:N" or "gid:N") may have a quota: bytes per device and a number
of pins. An entry counts against the quotas of its ``tenants`` (its owner's uid and
groups; none for the operator's configured models). Bytes are those of its RESIDENT and
LOADING arenas on the device (a shared one once); the host tier is not counted. The
eviction rule: a load that would put one of its tenants over that tenant's quota on the
device first evicts, in the policy's order, that tenant's own evictable models there
until it fits the quota; other tenants' models cannot bring it under its quota, so they
are never taken for it. Only then, if the device's budget is still short, does the
policy choose among every evictable model on the device (the tenant's own included) as
it always does. If the tenant's own evictable models cannot make room under its quota,
NoSpace names the quota (``details["quota"]``), and nothing is evicted. A pin that would
give a tenant more pinned models than its ``pins`` (a sharded model is one) is refused
with NoSpace naming it, whoever asks (the server lets an owner pin its own model only
where a pins quota covers it: ``pins_limited``). Quotas are checked when bytes or pins are taken: lowering a
quota evicts nothing by itself. So, in addition to (1): once ``begin_load`` admits a
load, each of its tenants with a byte quota on the device holds at most that quota there
(a tenant over a lowered quota must get under it before it loads more).

A parse of a tenant's checkpoint (its register, or a load's) holds memory too, for as
long as it runs: what its headers cost to parse (loader/checkpoint.parse_cost), counted
from their length fields before any is read. It is charged to the same quotas, on the
model's device, while it runs (``Parses``): it counts in the tenant's ``used`` and in
the room its loads see, and a parse that does not fit beside what the tenant holds that
cannot leave now (attached, pinned or loading models, its other parses) is refused with
NoSpace naming the quota. It evicts nothing: it is over in seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import NoSpace
from ..units import format_size
from .entries import DeviceAccount, Entry, State, arena_key
from .names import model_of


@dataclass(frozen=True)
class Quota:
    tenant: str  # "uid:1000" or "gid:100"
    nbytes: dict[str, int] = field(default_factory=dict)  # device -> most bytes resident or loading there
    pins: int | None = None  # most of its models pinned at once; None: no limit

    def where(self) -> str:
        """The config key that sets it, for messages."""
        return f'quotas."{self.tenant}"'


def tenant_keys(uid: int, gids: Iterable[int]) -> tuple[str, ...]:
    """The tenants a peer's model belongs to: its owner's uid, then its groups."""
    return (f"uid:{uid}", *(f"gid:{g}" for g in sorted(set(gids))))


def tenant_bytes(entries: Iterable[Entry], tenant: str, device: str) -> int:
    """Bytes ``tenant``'s models hold on ``device``, resident or loading (a shared arena once)."""
    return sum({arena_key(x): x.nbytes for x in entries
                if tenant in x.tenants and x.device == device and x.state in (State.RESIDENT, State.LOADING)}.values())


def tenant_pins(entries: Iterable[Entry], tenant: str) -> set[str]:
    """The models of ``tenant`` that are pinned (a sharded model once)."""
    return {model_of(x.name) for x in entries if tenant in x.tenants and x.pinned}


class Parses:
    """The parses running for tenants, and the bytes each is charged (Note [quotas])."""

    def __init__(self) -> None:
        self._running: dict[int, tuple[tuple[str, ...], str, int]] = {}  # token -> (tenants, device, bytes)
        self._next = 0

    def bytes(self, tenant: str, device: str) -> int:
        return sum(n for tenants, dev, n in self._running.values() if dev == device and tenant in tenants)

    def tenants(self) -> set[str]:
        return {tenants[0] for tenants, _dev, _n in self._running.values() if tenants}

    def charge(self, entries: Iterable[Entry], quotas: dict[str, Quota], tenants: tuple[str, ...], device: str,
               nbytes: int, what: str) -> int:
        """Charge a parse of ``nbytes`` to ``tenants`` on ``device``: a token for ``release``,
        or NoSpace naming the first quota it does not fit."""
        entries = list(entries)
        for t in tenants:
            q = quotas.get(t)
            limit = q.nbytes.get(device) if q is not None else None
            if limit is None:
                continue
            kept = sum({arena_key(x): x.nbytes for x in entries if t in x.tenants and x.device == device
                        and x.state in (State.RESIDENT, State.LOADING) and not x.evictable}.values())
            parsing = self.bytes(t, device)
            if kept + parsing + nbytes > limit:
                assert q is not None
                raise NoSpace(
                    f"parsing {what} holds ~{format_size(nbytes)} while it runs, charged to {t} on {device}: over its "
                    f"quota ({q.where()}.bytes = {format_size(limit)}), of which its models that cannot leave now hold "
                    f"{format_size(kept)} and its other parses {format_size(parsing)}",
                    model=what, device=device, needed=nbytes, quota=t, quota_bytes=limit, quota_used=kept + parsing,
                    fits_ever=nbytes <= limit)
        self._next += 1
        self._running[self._next] = (tenants, device, nbytes)
        return self._next

    def release(self, token: int) -> None:
        self._running.pop(token, None)


def tenant_usage(entries: Iterable[Entry], quotas: dict[str, Quota], devices: dict[str, DeviceAccount],
                 parses: Parses) -> dict[str, dict[str, Any]]:
    """Per tenant that has a quota, holds a model or parses one: bytes per device (its
    parses' among them, also apart as ``parsing``), pins, and the quota (None where not
    limited)."""
    entries = list(entries)
    tenants = set(quotas) | {t for x in entries for t in x.tenants[:1]} | parses.tenants()  # owners' uids
    out = {}
    for t in sorted(tenants):
        q = quotas.get(t)
        out[t] = {
            "devices": {dev: {"used": tenant_bytes(entries, t, dev) + parses.bytes(t, dev), "parsing": parses.bytes(t, dev),
                              "quota": q.nbytes.get(dev) if q else None}
                        for dev in devices},
            "pins": len(tenant_pins(entries, t)), "pins_quota": q.pins if q else None,
        }
    return out


def pins_limited(quotas: dict[str, Quota], tenants: tuple[str, ...]) -> bool:
    """Whether a pins quota covers a model of ``tenants`` (its owner may then pin it, within the quota)."""
    return any(q.pins is not None for t in tenants if (q := quotas.get(t)) is not None)


def check_pin_quota(entries: Iterable[Entry], quotas: dict[str, Quota], name: str, tenants: tuple[str, ...]) -> None:
    """NoSpace naming the quota if pinning ``name`` gives one of ``tenants`` more pinned
    models than its quota allows (another rank of a model already pinned is no new pin)."""
    entries = list(entries)
    for t in tenants:
        q = quotas.get(t)
        if q is None or q.pins is None:
            continue
        pinned = tenant_pins(entries, t)
        if model_of(name) not in pinned and len(pinned) >= q.pins:
            raise NoSpace(f"{t} has {len(pinned)} pinned model(s), its quota ({q.where()}.pins = {q.pins}); "
                          f"unpin one before pinning {model_of(name)!r}",
                          model=model_of(name), quota=t, quota_pins=q.pins, pinned=len(pinned), fits_ever=False)


def over_quota(entries: Iterable[Entry], e: Entry, nbytes: int, t: str, q: Quota, limit: int, used: int) -> NoSpace:
    """The refusal of a load of ``nbytes`` for ``e`` that tenant ``t``'s own evictable
    models cannot bring under its quota ``q`` (``limit`` bytes on the device, ``used``
    held now); ``fits_ever`` if its pinned models leave room for it under the quota."""
    kept = sum({arena_key(x): x.nbytes for x in entries
                if t in x.tenants and x.device == e.device and x.pinned and x.state is State.RESIDENT}.values())
    return NoSpace(
        f"model {e.name!r} needs {format_size(nbytes)} on {e.device}, over the quota of {t}: its models may hold "
        f"{format_size(limit)} there ({q.where()}.bytes), hold {format_size(used)} now, and not enough of "
        "that is unattached to make room",
        model=e.name, device=e.device, needed=nbytes, quota=t, quota_bytes=limit, quota_used=used,
        fits_ever=nbytes <= limit - kept)
