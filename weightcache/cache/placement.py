"""Where a model configured with ``device = "auto"`` goes. Pure, like the core:
the server builds a ``DeviceView`` per candidate device (``views``), asks ``place`` (one
rank) or ``place_ranks`` (a tensor-parallel model), logs the ``Placement`` and carries
it out through the ordinary load path, which admits it exactly as any other load.

Note [placement]
----------------
An auto model has one cache entry per candidate device and rank (a *replica*; the
server names them ``model@cuda:1``, or ``model@0@cuda:1`` for rank 0 of a sharded one:
docs/architecture.md, "Placement"). Each replica is an ordinary entry: its own budget
account, leases, LRU place and host copy. Placing a rank picks which replica serves a
request that names no device, in this order:

1. a device where the replica is RESIDENT (no bytes move), the most recently used first;
2. one where it is LOADING (join that load);
3. one with free budget for its bytes, and under its ``max_loaded`` count, whose real
   free memory (other processes' allocations count: the same check NO_SPACE makes) also
   holds them; a device holding a host-tier copy of this replica first (a promotion),
   then the most free budget (spreading models keeps room for the next big one on
   every device, where best fit would fill one GPU's engines first);
4. one where making room evicts the least: the fewest bytes taken from evictable
   (unattached, unpinned, RESIDENT) models, least recently used first as the default
   policy would, then the least recent use among those victims, then the device's
   order. Only devices where the victims' bytes and count really make room, within the
   budget and the real free memory, qualify.

Rules 3 and 4 look first at the devices where the model's tenants' byte quotas leave
room for it (``quota_free``), then at the others: there the load must first evict the
tenant's own models, or is refused NO_SPACE naming the quota, so a device within the
quota wins even where another has more free budget.

No device qualifies: ``place`` returns the device whose budget could ever hold it
(budget minus pinned bytes, the most first), marked ``fits=False``; the load there then
fails NO_SPACE or waits for detaches like any load, so a placement never exceeds a
budget: the core's admission is the one that reserves bytes. A tensor-parallel model's
ranks are placed one after another, each excluding the devices earlier ranks took, the
ranks already resident or loading somewhere first, so they keep their devices; fewer
candidate devices than ranks is a ValueError (the config check reports it).

The size of a model never loaded is not known (its headers are read by the load): the
server passes its files' total size instead (server/registry.py, ``checkpoint_bytes``),
and 0 where it cannot tell; with 0, rules 1-3 still apply (the most free budget).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .eviction import State, arena_key
from .names import ArenaKey

if TYPE_CHECKING:
    from .core import CacheCore

# Where the replica on a device stands, as placement sees it.
ReplicaState = Literal["resident", "loading", "host", "absent"]
Reason = Literal["named", "resident", "loading", "free", "evicts", "no room"]


@dataclass(frozen=True)
class Victim:
    """An evictable model on a device: what making room there would cost."""

    name: str
    nbytes: int
    last_used: float


@dataclass(frozen=True)
class DeviceView:
    """One candidate device, as the core and the backend see it now."""

    device: str
    budget: int
    used: int  # bytes of RESIDENT arenas
    reserved: int  # bytes of loads in flight
    replica: ReplicaState = "absent"  # this model's replica there
    replica_last_used: float = 0.0
    free_memory: int | None = None  # real free bytes on the device; None: not known (the CPU)
    max_loaded: int | None = None  # daemon.max_loaded_models there
    loaded: int = 0  # arenas RESIDENT or LOADING there
    evictable: tuple[Victim, ...] = ()
    pinned_bytes: int = 0  # RESIDENT and pinned: memory no detach frees
    # What the model's tenants may still add there under their byte quotas (the least of
    # them); None: no quota limits it there (Note [quotas] in eviction.py)
    quota_free: int | None = None

    @property
    def free(self) -> int:
        return self.budget - self.used - self.reserved


@dataclass(frozen=True)
class Placement:
    device: str
    reason: Reason
    fits: bool = True  # False: nothing fits now; the load there fails NO_SPACE or waits
    evicts: tuple[str, ...] = ()  # the victims rule 4 expects (the core's policy chooses the real ones)
    evict_bytes: int = 0
    considered: tuple[str, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        """One line for the log and ``models``: where, and why there."""
        if self.reason == "named":
            return f"{self.device}: named by the request"
        if self.reason == "resident":
            return f"{self.device}: already resident there"
        if self.reason == "loading":
            return f"{self.device}: already loading there"
        if self.reason == "free":
            return f"{self.device}: free budget there"
        if self.reason == "evicts":
            return (f"{self.device}: making room there evicts the least ({self.evict_bytes} B in "
                    f"{len(self.evicts)} model(s): {', '.join(self.evicts)})")
        return f"{self.device}: no device has room now; the budget there could hold it once detached"


def _room_by_evicting(v: DeviceView, nbytes: int) -> tuple[Victim, ...] | None:
    """The victims, least recently used first, that make room for ``nbytes`` on ``v``:
    bytes within the budget and the real free memory, and a place under max_loaded.
    None if all evictable models there would not."""
    count = 0 if v.max_loaded is None else v.loaded + 1 - v.max_loaded
    victims: list[Victim] = []
    freed = 0

    def fits() -> bool:
        real = v.free_memory is None or v.free_memory + freed >= nbytes
        return v.free + freed >= nbytes and len(victims) >= count and real

    for x in sorted(v.evictable, key=lambda x: (x.last_used, x.name)):
        if fits():
            break
        victims.append(x)
        freed += x.nbytes
    return tuple(victims) if fits() else None


def place(views: Sequence[DeviceView], nbytes: int, exclude: Iterable[str] = ()) -> Placement:
    """Where one rank goes (Note [placement]); ValueError when no device is left."""
    skip = set(exclude)
    cands = [v for v in views if v.device not in skip]
    if not cands:
        raise ValueError(f"no device to place on: candidates {[v.device for v in views]}, all taken by other ranks")
    considered = tuple(v.device for v in cands)
    order = {v.device: i for i, v in enumerate(cands)}
    resident = [v for v in cands if v.replica == "resident"]
    if resident:
        best = max(resident, key=lambda v: (v.replica_last_used, -order[v.device]))
        return Placement(best.device, "resident", considered=considered)
    loading = [v for v in cands if v.replica == "loading"]
    if loading:
        return Placement(loading[0].device, "loading", considered=considered)
    within_quota = [v for v in cands if v.quota_free is None or v.quota_free >= nbytes]
    for tier in (within_quota, [v for v in cands if v not in within_quota]):
        free = [v for v in tier if _room_by_evicting(v, nbytes) == ()]
        if free:
            best = min(free, key=lambda v: (v.replica != "host", -v.free, order[v.device]))
            return Placement(best.device, "free", considered=considered)
        costs = []
        for v in tier:
            victims = _room_by_evicting(v, nbytes)
            if victims is not None:
                costs.append((sum(x.nbytes for x in victims), max(x.last_used for x in victims), order[v.device], v, victims))
        if costs:
            freed, _recent, _i, v, victims = min(costs, key=lambda c: c[:3])
            return Placement(v.device, "evicts", evicts=tuple(x.name for x in victims), evict_bytes=freed,
                             considered=considered)
    best = max(cands, key=lambda v: (v.budget - v.pinned_bytes, -order[v.device]))
    return Placement(best.device, "no room", fits=False, considered=considered)


def place_ranks(ranks: Sequence[Sequence[DeviceView]], nbytes: Sequence[int]) -> list[Placement]:
    """Distinct devices for a tensor-parallel model's ranks (``ranks[i]``: rank i's views,
    one per candidate device). Ranks already resident or loading somewhere are placed
    first, so they keep their devices; ValueError if there are fewer devices than ranks."""
    if len(ranks) != len(nbytes):
        raise ValueError(f"{len(ranks)} ranks but {len(nbytes)} sizes")
    devices = {v.device for views in ranks for v in views}
    if len(devices) < len(ranks):
        raise ValueError(f"{len(ranks)} ranks need as many devices; candidates: {sorted(devices)}")
    out: dict[int, Placement] = {}
    taken: list[str] = []
    here = [i for i, views in enumerate(ranks) if any(v.replica in ("resident", "loading") for v in views)]
    for i in here + [i for i in range(len(ranks)) if i not in here]:
        p = place(ranks[i], nbytes[i], exclude=taken)
        out[i] = p
        taken.append(p.device)
    return [out[i] for i in range(len(ranks))]


def views(core: CacheCore, replicas: dict[str, str], free_memory: dict[str, int | None]) -> list[DeviceView]:
    """The core's view of each candidate device for one rank: ``replicas`` maps each
    candidate device to this rank's entry there; ``free_memory`` the backends' real free
    bytes (None where not known)."""
    out = []
    for device, name in replicas.items():
        acct = core.devices[device]
        e = core.entry(name)
        state: ReplicaState = {State.RESIDENT: "resident", State.LOADING: "loading",
                               State.HOST: "host"}.get(e.state, "absent")  # type: ignore[assignment]
        victims: dict[ArenaKey, Victim] = {}  # a shared arena once (cache/core.py, Note [shared arenas])
        pinned = 0
        for x in core.entries.values():
            if x.device != device or x.state is not State.RESIDENT:
                continue
            if x.pinned:
                pinned += x.nbytes
            if x.evictable and all(s.evictable for s in core.siblings(x.name) if s.state is State.RESIDENT):
                key = arena_key(x)
                old = victims.get(key)
                if old is None or x.last_used > old.last_used:
                    victims[key] = Victim(x.name, x.nbytes, x.last_used)
        room = [lim - core.tenant_bytes(t, device) for t in e.tenants
                if (q := core.quotas.get(t)) is not None and (lim := q.nbytes.get(device)) is not None]
        out.append(DeviceView(device=device, budget=acct.budget, used=acct.used, reserved=acct.reserved, replica=state,
                              replica_last_used=e.last_used, free_memory=free_memory.get(device),
                              max_loaded=core.max_loaded.get(device), loaded=core.loaded_on(device),
                              evictable=tuple(victims.values()), pinned_bytes=pinned,
                              quota_free=min(room) if room else None))
    return out
