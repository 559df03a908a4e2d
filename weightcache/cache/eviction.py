"""The cache's records and its eviction, in one room: everything one eviction decision
runs, read top to bottom.

A load that needs room (``CacheCore.begin_load``), a lowered budget or count asks
``Admission`` for victims; the ``EvictionPolicy`` (LRU or GDSF) ranks the evictable models
of the device, a shared arena counting as one candidate (``Shares``); ``HostTier.step_down``
then says where each victim goes: into the host tier (dropping host copies to make room)
or out. Pure, like the core: no I/O, no await; the core asks, this answers. The sections,
each under its banner:

1. THE RECORDS: an entry's states, the moves between them (``MOVES``) and its fields, a
   device's account, a lease, and the plans the core hands the server (``StepDown``,
   ``LoadPlan``). Data only.
2. QUOTAS: what one tenant's models may hold (Note [quotas]).
3. THE POLICY: ``LRU``, ``GDSF``, and ``LoadRates``, what bringing a model back costs.
4. SHARED ARENAS: names on one arena (Note [shared arenas]).
5. ADMISSION: the victims a load or a lowered limit needs, or the NO_SPACE naming holders.
6. THE STEP DOWN: the host tier (Note [kept host copies]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol, TypeVar, get_args

from ..errors import InternalError, NoSpace
from ..units import format_size
from .names import ArenaKey

# ===============================================================================================
# THE RECORDS: an entry's states and moves, a device's account, a lease, the plans
# ===============================================================================================

class State(StrEnum):
    REGISTERED = "registered"  # known, never loaded
    LOADING = "loading"  # reservation held, bytes being read into an arena
    RESIDENT = "resident"  # arena filled and sealed; attachable
    HOST = "host"  # demoted: its bytes wait in pinned host memory; a load promotes them
    EVICTED = "evicted"  # was resident, arena freed; a load brings it back


class EntryEvent(StrEnum):
    """What happens to an entry; ``MOVES`` says from which states, and to which."""

    LOAD = "load"  # a load was admitted: bytes reserved, an arena to fill (from its files or host copy)
    LOADED = "loaded"  # the arena is filled and sealed
    JOIN = "join"  # it took a resident sibling's arena (Note [shared arenas], below)
    # A load failed; where it leaves the entry depends on what it had (CacheCore.abort_load).
    PROMOTION_FAILED = "promotion_failed"  # its host copy is still there
    RELOAD_FAILED = "reload_failed"  # loaded before: evicted again
    FIRST_LOAD_FAILED = "first_load_failed"  # never filled an arena of its own
    EVICT = "evict"  # its arena is freed, no copy kept (or a sibling keeps the bytes)
    DEMOTE = "demote"  # its arena is freed, its bytes in the host tier (copied, or kept)
    DROP_COPY = "drop_copy"  # the host tier forgot its copy


# Every legal move: state -> event -> new state. ``Entry.move`` is the one way an entry's
# state changes, and anything not listed here is a bug in the core (``IllegalMove``).
# docs/architecture.md ("An entry's states") shows the same table.
MOVES: dict[State, dict[EntryEvent, State]] = {
    State.REGISTERED: {EntryEvent.LOAD: State.LOADING, EntryEvent.JOIN: State.RESIDENT},
    State.LOADING: {EntryEvent.LOADED: State.RESIDENT, EntryEvent.PROMOTION_FAILED: State.HOST,
                    EntryEvent.RELOAD_FAILED: State.EVICTED, EntryEvent.FIRST_LOAD_FAILED: State.REGISTERED},
    State.RESIDENT: {EntryEvent.EVICT: State.EVICTED, EntryEvent.DEMOTE: State.HOST},
    State.HOST: {EntryEvent.LOAD: State.LOADING, EntryEvent.DROP_COPY: State.EVICTED},
    State.EVICTED: {EntryEvent.LOAD: State.LOADING, EntryEvent.JOIN: State.RESIDENT},
}


class IllegalMove(InternalError):
    """An entry was asked to make a move ``MOVES`` does not list: the core's bookkeeping
    is wrong. Raised before anything about the entry changes."""


@dataclass
class Entry:
    name: str
    device: str
    pinned: bool = False
    keep_alive: float | None = None  # seconds unused and unattached before eviction (None: never)
    # The model's configured keep_alive. ``keep_alive`` is what applies now: a load or
    # attach that passes keep_alive replaces it until the next one does (set_keep_alive).
    configured_keep_alive: float | None = None
    state: State = State.REGISTERED
    nbytes: int = 0  # arena size; set when a load is admitted
    last_used: float = 0.0
    # GDSF's frequency: attaches since registration, halved on the whole device as its
    # attaches pass AGING_USES_PER_MODEL per model (CacheCore._count_use).
    refs: int = 0
    clock_base: float = 0.0  # the device's GDSF clock L when it was last used (0 under LRU)
    leases: set[int] = field(default_factory=set)
    # bytes held in the host tier: HOST, LOADING while promoting, or RESIDENT having kept the
    # copy it was promoted from (Note [kept host copies])
    host_copy: bool = False
    loads: int = 0  # fills of a device arena, from files or from the host tier
    evictions: int = 0  # times it left its device (demoted or not)
    demotions: int = 0  # of those, into the host tier
    promotions: int = 0  # loads served from the host tier
    # Entries of one share key hold one arena between them (Note [shared arenas]); None: its own.
    share: ArenaKey | None = None
    # The model it belongs to (a rank's, a replica's, a staging entry's model): pins are
    # counted per model, so a sharded model pinned is one pin. Its own name by default.
    model: str = ""
    staging: bool = False  # a publish's staging entry: nobody reaches it by name, it is shown as its model
    # The tenants whose quotas it counts against ("uid:N", "gid:N": QUOTAS below); () for the
    # operator's configured models, which count against none (Note [quotas]).
    tenants: tuple[str, ...] = ()
    # Requests on their way to use it (CacheCore.hold): its keep_alive waits for them, so a
    # model loaded for an attach is not expired before the attach takes its lease.
    wanted: int = 0

    def __post_init__(self) -> None:
        self.model = self.model or self.name

    @property
    def shown(self) -> str:
        """The name it is shown under: a staging entry's model (what its publish will
        replace), or its own name."""
        return self.model if self.staging else self.name

    def move(self, event: EntryEvent) -> State:
        """Apply ``event`` to the entry's state by ``MOVES``; IllegalMove if it lists none."""
        new = MOVES[self.state].get(event)
        if new is None:
            raise IllegalMove(f"model {self.name!r}: no move on {event} from state {self.state}",
                              model=self.name, state=str(self.state), event=str(event))
        self.state = new
        return new

    @property
    def attach_count(self) -> int:
        return len(self.leases)

    @property
    def evictable(self) -> bool:
        return self.state is State.RESIDENT and not self.leases and not self.pinned

    @property
    def expires_at(self) -> float | None:
        """When its keep_alive runs out, by the core's clock; None while it cannot expire
        (not evictable, wanted, or keep_alive never)."""
        if not self.evictable or self.keep_alive is None or self.wanted:
            return None
        return self.last_used + self.keep_alive


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
    since: float = 0.0  # when it began, by the core's clock (`weightcache ps` shows its age)


@dataclass(frozen=True)
class StepDown:
    """Arenas leaving a device, in the order the server must handle them: first free the
    host copies in ``drop_host`` (room in the host tier), then copy each ``demote``
    arena to the host tier and free it, free each ``evict`` arena outright, and free each
    ``release`` arena, whose bytes the host tier holds already (Note [kept host copies])."""

    demote: tuple[str, ...] = ()
    evict: tuple[str, ...] = ()
    drop_host: tuple[str, ...] = ()
    release: tuple[str, ...] = ()

    @property
    def leaving(self) -> tuple[str, ...]:
        """Every model whose device arena this frees (demoted or not)."""
        return self.demote + self.evict + self.release


@dataclass(frozen=True)
class LoadPlan:
    """What the server must do to admit a load: the step down that makes room, then fill
    a new arena, from the host tier if ``promote`` else from the files."""

    name: str
    nbytes: int
    step_down: StepDown
    promote: bool

    @property
    def evict(self) -> tuple[str, ...]:
        """Every model whose device arena this plan frees (demoted or not)."""
        return self.step_down.leaving


def arena_key(e: Entry) -> ArenaKey:
    """What counts once: the share key (Note [shared arenas], below), or the entry itself."""
    return e.share if e.share is not None else ArenaKey.own(e.device, e.name)


# ===============================================================================================
# QUOTAS: what one tenant's models may hold
# ===============================================================================================
# Per-tenant quotas: what one uid's or group's models may hold, and the
# rules that the core (core.py) applies with them. Pure: no I/O.
#
# A tenant is named ``"uid:N"`` or ``"gid:N"``. A model registered or published by a peer
# belongs to every tenant its owner was at that moment: its uid and each of its groups
# (``tenant_keys``). The operator's configured models belong to no tenant and count
# against no quota.
#
# Note [quotas]
# -------------
# A tenant ("uid:N" or "gid:N") may have a quota: bytes per device and a number
# of pins. An entry counts against the quotas of its ``tenants`` (its owner's uid and
# groups; none for the operator's configured models). Bytes are those of its RESIDENT and
# LOADING arenas on the device (a shared one once); the host tier is not counted. The
# eviction rule: a load that would put one of its tenants over that tenant's quota on the
# device first evicts, in the policy's order, that tenant's own evictable models there
# until it fits the quota; other tenants' models cannot bring it under its quota, so they
# are never taken for it. Only then, if the device's budget is still short, does the
# policy choose among every evictable model on the device (the tenant's own included) as
# it always does. If the tenant's own evictable models cannot make room under its quota,
# NoSpace names the quota (``details["quota"]``), and nothing is evicted. A pin that would
# give a tenant more pinned models than its ``pins`` (a sharded model is one) is refused
# with NoSpace naming it, whoever asks (the server lets an owner pin its own model only
# where a pins quota covers it: ``pins_limited``). Quotas are checked when bytes or pins are taken: lowering a
# quota evicts nothing by itself. So, in addition to (1): once ``begin_load`` admits a
# load, each of its tenants with a byte quota on the device holds at most that quota there
# (a tenant over a lowered quota must get under it before it loads more).
#
# A parse of a tenant's checkpoint (its register, or a load's) holds memory too, for as
# long as it runs: what its headers cost to parse (loader/checkpoint.parse_cost), counted
# from their length fields before any is read. It is charged to the same quotas, on the
# model's device, while it runs (``Parses``): it counts in the tenant's ``used`` and in
# the room its loads see, and a parse that does not fit beside what the tenant holds that
# cannot leave now (attached, pinned or loading models, its other parses) is refused with
# NoSpace naming the quota. It evicts nothing: it is over in seconds.


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
    return {x.model for x in entries if tenant in x.tenants and x.pinned}


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


def check_pin_quota(entries: Iterable[Entry], quotas: dict[str, Quota], model: str, tenants: tuple[str, ...]) -> None:
    """NoSpace naming the quota if pinning an entry of ``model`` gives one of ``tenants``
    more pinned models than its quota allows (another rank of a model already pinned is no
    new pin)."""
    entries = list(entries)
    for t in tenants:
        q = quotas.get(t)
        if q is None or q.pins is None:
            continue
        pinned = tenant_pins(entries, t)
        if model not in pinned and len(pinned) >= q.pins:
            raise NoSpace(f"{t} has {len(pinned)} pinned model(s), its quota ({q.where()}.pins = {q.pins}); "
                          f"unpin one before pinning {model!r}",
                          model=model, quota=t, quota_pins=q.pins, pinned=len(pinned), fits_ever=False)


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


# ===============================================================================================
# THE POLICY: which evictable models leave a device (LRU, GDSF) and what a load costs
# ===============================================================================================
# Eviction policies: which evictable models leave a device when a load needs room. Pure,
# like the core: no I/O, no await; the core asks, the policy answers.
#
# - ``LRU`` (the default): least recently used first, until there is room.
# - ``GDSF`` (GreedyDual-Size-Frequency, Cherkasova 1998): lowest priority first, where
#
#       H = L + frequency x cost / size
#
#   ``cost`` is the time it would take to bring the model back from where it would go if
#   evicted now (the host tier or its files; ``LoadRates``), ``size`` its arena's bytes,
#   ``frequency`` its attaches, aged (``Entry.refs``; at least 1), and ``L`` the device's
#   clock: the priority of the last victim, taken by a model each time it is used
#   (``Entry.clock_base``). A model not used while others are evicted falls behind the
#   rising clock, so what was popular once and no longer is goes in the end.
#
# A policy chooses only what leaves a device. Which host copy the host tier drops to take a
# demotion stays least recently used under both (``HostTier.step_down``, below);
# a cost-aware choice there (a dropped copy comes back from its files) is not made yet.

PolicyName = Literal["lru", "gdsf"]
POLICIES: tuple[str, ...] = get_args(PolicyName)
Source = Literal["files", "host"]
SOURCES: tuple[str, ...] = get_args(Source)


class Candidate(Protocol):
    """What a policy reads of an entry (``Entry``, above; a Protocol, so that a policy can rank any such record)."""

    @property
    def name(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def last_used(self) -> float: ...
    @property
    def refs(self) -> int: ...
    @property
    def clock_base(self) -> float: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class DeviceRates:
    files: float  # bytes/s from the checkpoint's files
    host: float  # bytes/s promoted from the pinned host tier
    overhead_s: float  # fixed cost of one load, whatever its size


# What a load costs before anything was measured on this machine.
# GPU: docs/benchmarks.md, H200 run 7 (9.15 GiB): the loader from the page cache at 31.5 GB/s
# (34.6 GB/s for 3 GiB isolated, 28.8 under churn: ~30) and promotion from the host tier at
# 46.7 GB/s (50 for 3 GiB). The fixed cost is the phases of a load that do not grow with its
# size, as the daemon logged them ("where a miss's time goes under churn"): open 1 ms,
# allocate 0.7-1.3, seal 1-2, the attach table 0.3, waiting for freed arenas 2-4: ~5 ms.
# (A victim's demotion, 60-100 ms a load when it ran before the fill, overlaps the fill.)
# Files not in the page cache are read at the disk's rate (1.9 GB/s there): a model whose
# files are cold shows it in its own measurement (``LoadRates.cost``), not in this guess.
GPU_DEFAULTS = DeviceRates(files=30e9, host=47e9, overhead_s=0.005)
# CPU: the memfd loader warm, 2.15 GB/s (weightcache bench on the 2-core VM); fixed
# cost 2-3 ms (allocate + read + seal of 1-256 MiB checkpoints, warm, fitted as a + n/r on
# the 2-core CI-class VM). CPU models have no tier below, so their host rate is never used.
CPU_DEFAULTS = DeviceRates(files=2.15e9, host=2.15e9, overhead_s=0.003)


def defaults_for(device: str) -> DeviceRates:
    return CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS


# The phases of a fill that are its source's cost, not waiting for room or a turn: a
# load's rate (CacheCore.observe_load, which GDSF prices a return with) counts these and
# opening the files; a peer's fill rate (weightcache/peers/) these alone, its load having
# opened the files before either way.
OWN_PHASES = ("allocate", "fill", "seal", "table")


class LoadRates:
    """How fast each device brings models back, learned from the server's measurements.

    Two things are kept. Per model and source, its last rate: the best predictor of its
    next load from there (same size, same files, which may be cold or on a slow disk), so
    that model's cost is its last measured time, fixed overhead included. Per device and
    source, a smoothed rate for models never measured from there, whose cost is the fixed
    overhead plus their bytes at that rate; only loads taking over twice the overhead teach
    it (with the overhead taken out), so that a small load, whose time is mostly overhead,
    cannot teach an absurd rate.
    """

    # Weight of a new measurement in the smoothed rate: the last few loads dominate, since
    # the page cache and the loads running beside it change within minutes.
    SMOOTHING = 0.25

    def __init__(self) -> None:
        self._smoothed: dict[tuple[str, str], float] = {}  # (device, source) -> bytes/s
        self._last: dict[tuple[str, str], float] = {}  # (model, source) -> bytes/s of its last load

    def observe(self, device: str, name: str, source: str, nbytes: int, seconds: float) -> None:
        if source not in SOURCES:
            raise ValueError(f"load source must be one of {SOURCES}, not {source!r}")
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return  # no bytes or no time measured: nothing to learn
        self._last[(name, source)] = nbytes / seconds
        overhead = defaults_for(device).overhead_s
        if seconds > 2 * overhead:
            rate = nbytes / (seconds - overhead)
            old = self._smoothed.get((device, source))
            self._smoothed[(device, source)] = rate if old is None else old + self.SMOOTHING * (rate - old)

    def rate(self, device: str, source: str) -> float:
        """Bytes/s for a model never measured from ``source``: smoothed, else the default."""
        default = defaults_for(device)
        return self._smoothed.get((device, source), default.host if source == "host" else default.files)

    def last_rate(self, name: str, source: str) -> float | None:
        return self._last.get((name, source))

    def cost(self, device: str, name: str, source: str, nbytes: int) -> float:
        """Seconds to bring ``nbytes`` of model ``name`` back from ``source``."""
        own = self._last.get((name, source))
        if own is not None:
            return nbytes / own
        return defaults_for(device).overhead_s + nbytes / self.rate(device, source)

    def forget(self, name: str) -> None:
        for source in SOURCES:
            self._last.pop((name, source), None)

    def rename(self, name: str, new: str) -> None:
        self.forget(new)
        for source in SOURCES:
            if (name, source) in self._last:
                self._last[(new, source)] = self._last.pop((name, source))


class EvictionPolicy(Protocol):
    name: str

    def clock(self, device: str) -> float:
        """The value a model takes as ``clock_base`` when used (GDSF's L; 0 for LRU)."""

    def priority(self, e: Candidate) -> float:
        """Lowest is evicted first."""

    def rank(self, e: Candidate) -> tuple[float, ...]:
        """Total order of eviction: priority, then ties broken."""

    def choose(self, candidates: Iterable[C], need: int, count: int = 0) -> list[C] | None:
        """Victims among ``candidates`` (all evictable, one device) freeing at least
        ``need`` bytes, and at least ``count`` of them (the device's max_loaded_models),
        in eviction order; None if all of them would not."""

    def evicted(self, device: str, victims: list[C]) -> None:
        """``victims`` (chosen by ``choose``) are about to leave ``device``."""


class LRU:
    """Least recently used first; exactly the policy weightcache has always had."""

    name = "lru"

    def clock(self, device: str) -> float:
        return 0.0

    def priority(self, e: Candidate) -> float:
        return e.last_used

    def rank(self, e: Candidate) -> tuple[float, ...]:
        return (e.last_used,)

    def choose(self, candidates: Iterable[C], need: int, count: int = 0) -> list[C] | None:
        victims: list[C] = []
        for v in sorted(candidates, key=lambda x: x.last_used):
            if need <= 0 and len(victims) >= count:
                break
            victims.append(v)
            need -= v.nbytes
        return victims if need <= 0 and len(victims) >= count else None

    def evicted(self, device: str, victims: list[C]) -> None:
        pass


class GDSF:
    """GreedyDual-Size-Frequency: H = L + frequency x cost / size (THE POLICY, above)."""

    name = "gdsf"

    def __init__(self, rates: LoadRates, comes_back_from: Callable[[Candidate], str]) -> None:
        self.rates = rates
        self._comes_back_from = comes_back_from  # the core's step-down rule: "host" or "files"
        self._clock: dict[str, float] = {}  # device -> L

    def clock(self, device: str) -> float:
        return self._clock.get(device, 0.0)

    def cost(self, e: Candidate) -> float:
        return self.rates.cost(e.device, e.name, self._comes_back_from(e), e.nbytes)

    def priority(self, e: Candidate) -> float:
        # A model loaded but not attached yet (a preload), or whose count aged to 0, counts once.
        return e.clock_base + max(1, e.refs) * self.cost(e) / max(1, e.nbytes)

    def rank(self, e: Candidate) -> tuple[float, ...]:
        # Equal priorities go least recently used first, as GreedyDual's ties are usually broken.
        return (self.priority(e), e.last_used)

    def choose(self, candidates: Iterable[C], need: int, count: int = 0) -> list[C] | None:
        if need <= 0 and count <= 0:
            return []
        victims: list[C] = []
        freed = 0
        for v in sorted(candidates, key=self.rank):
            if freed >= need and len(victims) >= count:
                break
            victims.append(v)
            freed += v.nbytes
        if freed < need or len(victims) < count:
            return None
        # The lowest priorities until there is room may take more than needed (a small model
        # first, then a large one that alone was enough). Spare every victim the others make
        # room without, the most valuable first; the last one taken is always needed.
        # Sparing one must leave enough victims for ``count`` too.
        spared: set[int] = set()
        for v in sorted(victims[:-1], key=self.rank, reverse=True):
            if freed - v.nbytes >= need and len(victims) - len(spared) - 1 >= count:
                spared.add(id(v))
                freed -= v.nbytes
        return [v for v in victims if id(v) not in spared]

    def evicted(self, device: str, victims: list[C]) -> None:
        # L becomes the priority of the last victim; max() keeps the clock from going back
        # when priorities were computed from older rates or before a pin or lease ended.
        if victims:
            self._clock[device] = max(self.clock(device), *(self.priority(v) for v in victims))


def make_policy(name: str, rates: LoadRates, comes_back_from: Callable[[Candidate], str]) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "gdsf":
        return GDSF(rates, comes_back_from)
    raise ValueError(f"eviction policy must be one of {POLICIES}, not {name!r}")


# ===============================================================================================
# SHARED ARENAS: names that hold one arena between them
# ===============================================================================================
# Names that hold one arena between them.
#
# Note [shared arenas]
# --------------------
# Entries registered with one ``share`` key (the server gives it to names whose checkpoint
# is the same files, on the same device and rank, for the same owner) hold one arena
# between them. Each keeps its own leases, pin, keep_alive, last use and counters; the
# arena is counted once (core.py's Note [invariants], 1) and loaded once: an entry whose
# sibling is RESIDENT ``join``s it instead of loading, and ``begin_load`` refuses while a
# sibling loads or is resident.
# Evicting one name (``evict``, keep_alive) makes that name EVICTED and frees nothing while
# a sibling is still RESIDENT; the arena's bytes go with its last resident name. The
# policy sees a shared arena as one candidate, only when none of its names is attached or
# pinned, ranked as its highest-priority name, and evicts every name on it. A shared
# arena is never demoted to the host tier (its names would have to return together).

class Shares:
    """The entries registered with each arena key (``Entry.share``), for the core."""

    def __init__(self, entries: dict[str, Entry]) -> None:
        self._entries = entries  # the core's, by name
        self._names: dict[ArenaKey, set[str]] = {}  # share key -> the entries registered with it

    def add(self, e: Entry) -> None:
        if e.share is not None:
            self._names.setdefault(e.share, set()).add(e.name)

    def discard(self, e: Entry) -> None:
        if e.share is not None:
            self._names[e.share].discard(e.name)
            if not self._names[e.share]:
                del self._names[e.share]

    def names(self, share: ArenaKey) -> list[str]:
        """The entries registered with the arena key ``share``."""
        return sorted(self._names.get(share, ()))

    def siblings(self, e: Entry) -> list[Entry]:
        """The other entries that share ``e``'s arena key."""
        if e.share is None:
            return []
        return [self._entries[n] for n in sorted(self._names[e.share]) if n != e.name]

    def sibling_in(self, e: Entry, state: State) -> Entry | None:
        return next((x for x in self.siblings(e) if x.state is state), None)

    def shared(self, e: Entry) -> bool:
        """Whether another name is registered on ``e``'s arena."""
        return e.share is not None and len(self._names[e.share]) > 1

    def keys(self) -> set[ArenaKey]:
        return set(self._names)


# ===============================================================================================
# ADMISSION: the victims a load, a lowered budget or a lowered count needs, or NO_SPACE
# ===============================================================================================
# Admission: which evictable models must leave a device for a load to fit there (its
# tenants' byte quotas first, then the budget and the max_loaded count, in the policy's
# order: Note [invariants] 3 in core.py) or for a lowered budget or count to hold, and the
# refusal, naming what holds the memory, when no choice of them can make room.

class Admission:
    def __init__(self, entries: dict[str, Entry], devices: dict[str, DeviceAccount], shares: Shares,
                 policy: EvictionPolicy, max_loaded: dict[str, int]) -> None:
        self.entries = entries  # the core's, as are the accounts and the count limits
        self.devices = devices
        self.shares = shares
        self.policy = policy
        self.max_loaded = max_loaded  # device -> the most models RESIDENT or LOADING on it at once
        self.quotas: dict[str, Quota] = {}  # tenant -> its quota (Note [quotas])
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
        groups: dict[ArenaKey, list[Entry]] = {}
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


# ===============================================================================================
# THE STEP DOWN: where a victim goes (the host tier, or out)
# ===============================================================================================
# The host tier, and the step down: where a model that leaves its device goes.
#
# Eviction moves a GPU model one tier down (Note [invariants] 4, core.py): to the host tier
# if that is enabled and the model fits, dropping host copies to make room, else out.
#
# Note [kept host copies]
# -----------------------
# A promotion keeps the model's host copy: the weights are read-only (engines map them
# read-only, nothing writes an arena once sealed), so the copy stays equal to the device's
# bytes for as long as the model is resident. Evicting it later is then a free of its device
# arena (``StepDown.release``) instead of a device-to-host copy: under churn on the H200 a
# promotion that needed a victim's room waited ~20 ms for the victim's first 1 GiB chunk to
# be copied out. The kept copy costs host-tier room only while nothing else
# needs it: making room in the host tier drops kept copies before any HOST model's (a kept
# copy's bytes are still on the device; a HOST model's are nowhere else but its files).
# Stale files drop both copies (``evict(demote=False)``). A shared arena keeps none (it is
# never demoted): ``finish_load``, ``join`` and the step down drop a copy whose model's
# files have a second name. Room is never made by dropping copies that together would not
# make it (the victim then leaves outright).

class HostTier:
    def __init__(self, budget: int, devices: dict[str, DeviceAccount], entries: dict[str, Entry], shares: Shares) -> None:
        self.account = DeviceAccount(budget=budget)  # the pinned host tier (0: disabled)
        self._devices = devices  # the core's accounts, which a step down takes bytes off
        self._entries = entries
        self.shares = shares

    def drop_copy(self, e: Entry) -> None:
        """Forget ``e``'s host copy: a HOST model is then EVICTED; a RESIDENT one that kept
        its copy stays resident."""
        self.account.used -= e.nbytes
        e.host_copy = False
        if e.state is State.HOST:
            e.move(EntryEvent.DROP_COPY)

    def demotable(self, e: Candidate) -> bool:
        """Whether evicting ``e`` now would move it to the host tier (the step down's rule).
        A shared arena is not demoted: its names would have to come back together."""
        shared = isinstance(e, Entry) and self.shares.shared(e)
        return e.device != "cpu" and 0 < e.nbytes <= self.account.budget and not shared

    def comes_back_from(self, e: Candidate) -> Source:
        """Where ``e`` would be brought back from, were it evicted now (the policy prices that)."""
        return "host" if self.demotable(e) else "files"

    def step_down(self, victims: list[Entry], keep: Entry | None = None) -> StepDown:
        """Move RESIDENT victims off their device: to the host tier where it is enabled and
        they fit (dropping its LRU copies, never ``keep``'s), else out."""
        demote: list[str] = []
        evict: list[str] = []
        drop_host: list[str] = []
        release: list[str] = []
        leaving = {id(v) for v in victims}  # a victim's kept copy is its way out: never dropped for another
        for v in victims:
            v.evictions += 1
            if v.host_copy and not self.demotable(v):  # never kept where it could not step down to
                self.drop_copy(v)
                drop_host.append(v.name)
            if self.shares.sibling_in(v, State.RESIDENT) is not None:  # a name still on the arena keeps its bytes
                v.move(EntryEvent.EVICT)
                evict.append(v.name)
                continue
            self._devices[v.device].used -= v.nbytes
            if v.host_copy:  # kept from its promotion: the host tier has its bytes already
                v.move(EntryEvent.DEMOTE)
                v.demotions += 1
                release.append(v.name)
                continue
            if self.demotable(v):
                # Kept copies of resident models first (their bytes are still on a device),
                # then HOST models' copies, each least recently used first; none at all if
                # dropping every one would not make room (they would go for nothing).
                droppable = sorted((x for x in self._entries.values()
                                    if x.host_copy and x is not keep and (x.state is State.HOST
                                                                          or (x.state is State.RESIDENT and id(x) not in leaving))),
                                   key=lambda x: (x.state is State.HOST, x.last_used))
                if self.account.free + sum(x.nbytes for x in droppable) < v.nbytes:
                    droppable = []
                while self.account.free < v.nbytes and droppable:
                    old = droppable.pop(0)
                    self.drop_copy(old)
                    drop_host.append(old.name)
                    if old.name in demote:  # demoted earlier in this very step: never copy it at all
                        demote.remove(old.name)
                        drop_host.remove(old.name)
                        evict.append(old.name)
                        old.demotions -= 1
                    elif old.name in release:  # moved to HOST by this very step: its arena just goes
                        release.remove(old.name)
                        evict.append(old.name)
                        old.demotions -= 1
                if self.account.free >= v.nbytes:
                    v.move(EntryEvent.DEMOTE)
                    v.host_copy = True
                    v.demotions += 1
                    self.account.used += v.nbytes
                    demote.append(v.name)
                    continue
            v.move(EntryEvent.EVICT)
            evict.append(v.name)
        return StepDown(demote=tuple(demote), evict=tuple(evict), drop_host=tuple(drop_host), release=tuple(release))

    def check_invariants(self) -> None:
        """Note [invariants] 4: the host tier's bytes are its copies', within its budget."""
        assert self.account.used == sum(e.nbytes for e in self._entries.values() if e.host_copy)
        assert self.account.used <= self.account.budget
        for e in self._entries.values():
            assert e.host_copy or e.state is not State.HOST, e.name
            assert not e.host_copy or e.state in (State.HOST, State.LOADING, State.RESIDENT), e.name
