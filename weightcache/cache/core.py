"""The cache policy: budgets, states, eviction (policy.py: LRU, or GDSF), pins, keep-alive
and leases. Pure: no I/O, no await, no torch. The server asks it what to do, carries the
plan out, and reports back (``finish_load``, ``observe_load``).

Note [invariants]
-----------------
Held after every public method returns (``check_invariants`` asserts them; the property
tests in tests/test_core.py drive random operation sequences against them):

1. Per device, ``used`` is the sum of ``nbytes`` of its RESIDENT arenas (a shared one
   once) and ``reserved`` the sum of ``nbytes`` of its LOADING models; ``used + reserved
   <= budget``. Where the device has a ``max_loaded`` count, its RESIDENT and LOADING
   arenas number at most that.
2. A model's attach count is the number of live leases on it, never negative; only a
   RESIDENT model has leases.
3. A model with a lease, or pinned, is never chosen for eviction. Victims are evictable
   models of the loading model's device, taken in the policy's order and no more than
   needed: the highest-ranked victim was needed (the evictable models ranked below it
   could not make room without it; room is bytes, and a place under ``max_loaded``). LRU (the default) ranks by ``last_used``, oldest
   first, and takes the shortest such prefix. GDSF ranks by its priority H, then
   ``last_used``; it takes the shortest prefix that makes room, then spares every victim
   the others make room without (highest H first), so no victim could have been kept.
4. The host tier: ``host.used`` is the sum of ``nbytes`` of entries holding a host copy,
   within ``host.budget``; every HOST entry holds one, and otherwise only a LOADING entry
   being promoted from it or a RESIDENT one that kept it (Note [kept host copies]).
   Eviction moves a GPU model one tier down: to the host tier if that is enabled and the
   model fits (dropping host copies to make room: first those kept by resident models,
   then the host tier's own, least recently used first), else out. CPU models have no
   tier below.
5. GDSF's clock L, per device, never decreases, and every entry's ``clock_base`` (the L
   at its last use) is at most its device's L. Only victims the policy chose move L (to
   the highest H among them): explicit evictions, keep_alive expiries and host-tier
   drops are not the policy's choices and leave it alone. Frequencies (``refs``) are
   never negative and only attaches raise them.

Note [kept host copies]
-----------------------
A promotion keeps the model's host copy: the weights are read-only (engines map them
read-only, nothing writes an arena once sealed), so the copy stays equal to the device's
bytes for as long as the model is resident. Evicting it later is then a free of its device
arena (``StepDown.release``) instead of a device-to-host copy: under churn on the H200 a
promotion that needed a victim's room waited ~20 ms for the victim's first 1 GiB chunk to
be copied out (issue 12). The kept copy costs host-tier room only while nothing else
needs it: making room in the host tier drops kept copies before any HOST model's (a kept
copy's bytes are still on the device; a HOST model's are nowhere else but its files).
Stale files drop both copies (``evict(demote=False)``). A shared arena keeps none (it is
never demoted): ``finish_load``, ``join`` and the step down drop a copy whose model's
files have a second name. Room is never made by dropping copies that together would not
make it (the victim then leaves outright).

Note [shared arenas]
--------------------
Entries registered with one ``share`` key (the server gives it to names whose checkpoint
is the same files, on the same device and rank, for the same owner) hold one arena
between them. Each keeps its own leases, pin, keep_alive, last use and counters; the
arena is counted once (1) and loaded once: an entry whose sibling is RESIDENT ``join``s
it instead of loading, and ``begin_load`` refuses while a sibling loads or is resident.
Evicting one name (``evict``, keep_alive) makes that name EVICTED and frees nothing while
a sibling is still RESIDENT; the arena's bytes go with its last resident name. The
policy sees a shared arena as one candidate, only when none of its names is attached or
pinned, ranked as its highest-priority name, and evicts every name on it. A shared
arena is never demoted to the host tier (its names would have to return together).

Note [quotas]
-------------
A tenant ("uid:N" or "gid:N", quotas.py) may have a quota: bytes per device and a number
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

What the policy changes, and what it does not: the policy decides only *which* evictable
models leave a device, to admit a load (``begin_load``) or to lower a budget
(``set_budget``). Under both policies pins and leases keep a model (3), keep_alive
expires a model by time alone, ``evict`` moves exactly the model named, a victim steps
down one tier exactly as in 4 (to the host tier if enabled and it fits, else out), the
host tier drops its own copies least recently used first, loads are single-flight, and
NoSpace is raised, with the same ``fits_ever``, exactly when all evictable models
together could not make room. Rates (``observe_load``) and frequencies are kept under
LRU too, so the cost shown for a model means the same whichever policy runs.

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
from ..units import format_size
from .policy import Candidate, EvictionPolicy, LoadRates, PolicyName, Source, make_policy
from .quotas import Quota, model_of


class State(StrEnum):
    REGISTERED = "registered"  # known, never loaded
    LOADING = "loading"  # reservation held, bytes being read into an arena
    RESIDENT = "resident"  # arena filled and sealed; attachable
    HOST = "host"  # demoted: its bytes wait in pinned host memory; a load promotes them
    EVICTED = "evicted"  # was resident, arena freed; a load brings it back


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
    share: str | None = None
    # The tenants whose quotas it counts against ("uid:N", "gid:N": quotas.py); () for the
    # operator's configured models, which count against none (Note [quotas]).
    tenants: tuple[str, ...] = ()

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


# Frequencies age TinyLFU's way: when the attaches counted on a device reach this many per
# model registered there, every count on it is halved (and the tally with them), so a model
# popular an hour ago does not outweigh one popular now. Replaying Zipf traces through this
# core (`python tests/test_policy.py`, docs/architecture.md), GDSF with counts kept so took
# 0.77-0.91 of LRU's miss time; never aged 0.76-0.96 (worst where popularity shifted);
# forgotten whenever the model left the cache and never aged, GreedyDual's own rule,
# 0.82-1.04: worse than LRU after a shift, as the newly popular model kept starting from
# nothing while the old favourite, still resident, kept its count.
AGING_USES_PER_MODEL = 16


class CacheCore:
    def __init__(self, budgets: dict[str, int], clock: Callable[[], float] = time.monotonic, host_budget: int = 0,
                 policy: PolicyName = "lru", max_loaded: dict[str, int] | None = None) -> None:
        self.devices = {dev: DeviceAccount(budget=b) for dev, b in budgets.items()}
        # device -> the most models RESIDENT or LOADING on it at once (daemon.max_loaded_models)
        self.max_loaded = dict(max_loaded or {})
        self.host = DeviceAccount(budget=host_budget)  # the pinned host tier (0: disabled)
        self.entries: dict[str, Entry] = {}
        self.leases: dict[int, Lease] = {}
        self._by_conn: dict[int, set[int]] = {}  # connection -> its lease ids (O(1) counts and drops)
        self._clock = clock
        self._lease_ids = itertools.count(1)
        self.rates = LoadRates()  # learned under every policy: reload_cost means the same under each
        self.policy: EvictionPolicy = make_policy(policy, self.rates, self._comes_back_from)
        self._models_on: dict[str, int] = dict.fromkeys(budgets, 0)  # device -> models registered on it
        self._shares: dict[str, set[str]] = {}  # share key -> the entries registered with it
        self._uses: dict[str, int] = dict.fromkeys(budgets, 0)  # device -> attaches tallied towards aging
        self.quotas: dict[str, Quota] = {}  # tenant -> its quota (Note [quotas]; set_quotas)

    # -- registry -------------------------------------------------------------------
    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModel(f"no model named {name!r} is registered", model=name) from None

    def register(self, name: str, device: str, *, pinned: bool = False, keep_alive: float | None = None,
                 share: str | None = None, tenants: tuple[str, ...] = ()) -> Entry:
        """``share``: a key naming the bytes (same files, device, owner): entries of one key
        hold one arena between them (Note [shared arenas])."""
        if name in self.entries:
            raise BadRequest(f"model {name!r} is already registered", model=name)
        if device not in self.devices:
            raise BadRequest(f"device {device!r} has no budget; configured: {sorted(self.devices)}", device=device)
        key = None if share is None else f"{device}\0{share}"
        if pinned:
            self._check_pin_quota(name, tenants)
        e = Entry(name=name, device=device, pinned=pinned, keep_alive=keep_alive, configured_keep_alive=keep_alive, share=key,
                  tenants=tenants)
        self.entries[name] = e
        self._models_on[device] += 1
        if key is not None:
            self._shares.setdefault(key, set()).add(name)
        return e

    # -- shared arenas (Note [shared arenas]) -------------------------------------------
    def siblings(self, name: str) -> list[Entry]:
        """The other entries that share ``name``'s arena key."""
        e = self.entry(name)
        if e.share is None:
            return []
        return [self.entries[n] for n in sorted(self._shares[e.share]) if n != name]

    def sharing(self, share: str) -> list[str]:
        """The entries registered with the arena key ``share`` (an ``Entry.share``)."""
        return sorted(self._shares.get(share, ()))

    def _sibling_in(self, e: Entry, state: State) -> Entry | None:
        return next((x for x in self.siblings(e.name) if x.state is state), None)

    def resident_sibling(self, name: str) -> str | None:
        """A RESIDENT entry whose arena ``name`` may take instead of loading, or None."""
        x = self._sibling_in(self.entry(name), State.RESIDENT)
        return None if x is None else x.name

    def join(self, name: str) -> StepDown:
        """Make ``name`` RESIDENT on a resident sibling's arena: no load, no bytes (they are
        counted once, for the arena). A host copy it still had is dropped (the StepDown)."""
        e = self.entry(name)
        sib = self._sibling_in(e, State.RESIDENT)
        if sib is None or e.state in (State.LOADING, State.RESIDENT):
            raise BadRequest(f"model {name!r} cannot share an arena now (state {e.state})", model=name)
        drop: list[str] = []
        if e.state is State.HOST:
            self._drop_host_copy(e)
            drop.append(name)
        if sib.host_copy:  # kept from its promotion; a shared arena has none (Note [shared arenas])
            self._drop_host_copy(sib)
            drop.append(sib.name)
        e.nbytes, e.state = sib.nbytes, State.RESIDENT
        self._used(e)
        return StepDown(drop_host=tuple(drop))

    def _arena_key(self, e: Entry) -> str:
        """What counts once: the share key, or the entry itself."""
        return e.share if e.share is not None else "\0" + e.name

    def check_removable(self, name: str) -> Entry:
        """Raise what ``unregister`` would (ATTACHED, or BAD_REQUEST while loading); change nothing."""
        e = self.entry(name)
        if e.leases:
            raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name, attach_count=e.attach_count)
        if e.state is State.LOADING:
            raise BadRequest(f"model {name!r} is loading; unregister it when the load ends", model=name)
        return e

    def unregister(self, name: str) -> Entry:
        """Forget a model. Returns its entry; if it was RESIDENT the caller frees the arena."""
        e = self.check_removable(name)
        if e.state is State.RESIDENT and self._sibling_in(e, State.RESIDENT) is None:  # else a sibling keeps the bytes
            self.devices[e.device].used -= e.nbytes
        if e.host_copy:
            self.host.used -= e.nbytes
        del self.entries[name]
        self._models_on[e.device] -= 1
        if e.share is not None:
            self._shares[e.share].discard(name)
            if not self._shares[e.share]:
                del self._shares[e.share]
        self.rates.forget(name)
        return e

    def rename(self, name: str, new: str) -> Entry:
        """Give an unattached entry another name (a publish swaps its staged copy in)."""
        e = self.entry(name)
        if new in self.entries:
            raise BadRequest(f"model {new!r} is already registered", model=new)
        if e.leases:
            raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name, attach_count=e.attach_count)
        del self.entries[name]
        e.name = new
        self.entries[new] = e
        self.rates.rename(name, new)
        return e

    def touch(self, name: str) -> Entry:
        """A resident model was asked for: it is the most recently used now."""
        e = self.entry(name)
        self._used(e)
        return e

    def _used(self, e: Entry) -> None:
        e.last_used = self._clock()
        e.clock_base = self.policy.clock(e.device)

    def _count_use(self, e: Entry) -> None:
        """One more attach of ``e``: its frequency, aged per device (AGING_USES_PER_MODEL)."""
        e.refs += 1
        self._uses[e.device] += 1
        if self._uses[e.device] >= AGING_USES_PER_MODEL * self._models_on[e.device]:
            for x in self.entries.values():
                if x.device == e.device:
                    x.refs //= 2
            self._uses[e.device] //= 2

    def idle_s(self, name: str) -> float | None:
        """Seconds since ``name`` was last used (attached, detached, asked for), by the core's clock."""
        e = self.entry(name)
        return self._clock() - e.last_used if e.last_used else None

    def set_pinned(self, name: str, pinned: bool) -> Entry:
        e = self.entry(name)
        if pinned and not e.pinned:
            self._check_pin_quota(name, e.tenants)
        e.pinned = pinned
        return e

    def set_keep_alive(self, name: str, seconds: float | None) -> Entry:
        """A request's keep_alive (None: never expire; 0: expire as soon as unattached)
        replaces the one in force until the next request sets it (ollama's rule)."""
        if seconds is not None and not seconds >= 0:
            raise BadRequest(f"keep_alive must be >= 0 seconds or never, not {seconds!r}", argument="keep_alive")
        e = self.entry(name)
        e.keep_alive = seconds
        return e

    # -- loading --------------------------------------------------------------------
    def begin_load(self, name: str, nbytes: int) -> LoadPlan:
        """Admit a load of ``nbytes``: reserve them, evicting the policy's victims as needed.

        The victims are marked EVICTED and their bytes released at once; the caller frees
        their arenas. Raises NoSpace (naming the holders) when evicting everything
        evictable would still not make room; ``fits_ever`` (an attribute) says whether waiting
        for detaches could help.
        """
        e = self.entry(name)
        if e.state in (State.LOADING, State.RESIDENT):
            raise BadRequest(f"model {name!r} is already {e.state}", model=name)
        if any(x.state in (State.LOADING, State.RESIDENT) for x in self.siblings(name)):
            raise BadRequest(f"model {name!r} shares its arena with a model loading or resident: join it", model=name)
        if e.host_copy and nbytes != e.nbytes:
            raise BadRequest(f"model {name!r}: host copy is {e.nbytes} bytes, not {nbytes}; drop it first", model=name)
        acct = self.devices[e.device]
        own = self._quota_victims(e, nbytes)  # NoSpace naming the quota if the tenant's own cannot make room
        arenas = {self._arena_key(v): v.nbytes for v in own}  # a shared arena once
        taken = {v.name for v in own}
        others = self._victims(e.device, nbytes - acct.free - sum(arenas.values()), self._over_count(e.device) - len(arenas),
                               among=lambda x: x.name not in taken)
        if others is None:
            raise self._no_space(e, nbytes)
        if own:  # only now that the load is admitted: a refused one must not move GDSF's clock (5)
            self.policy.evicted(e.device, own)
        victims = own + others
        step = self._step_down(victims, keep=e)
        e.state = State.LOADING
        e.nbytes = nbytes
        acct.reserved += nbytes
        return LoadPlan(name=name, nbytes=nbytes, step_down=step, promote=e.host_copy)

    def could_admit(self, name: str, nbytes: int) -> bool:
        """Whether ``begin_load(name, nbytes)`` would admit the load now, changing nothing:
        what a request waiting for room asks before it is woken (server/residency/room.py,
        SpaceFreed), so that a detach that frees too little wakes nobody."""
        e = self.entries.get(name)
        if e is None or e.state in (State.LOADING, State.RESIDENT):
            return True  # not a wait for room any more: let it find out
        try:
            own = self._quota_victims(e, nbytes)
        except NoSpace:
            return False
        acct = self.devices[e.device]
        arenas = {self._arena_key(v): v.nbytes for v in own}
        taken = {v.name for v in own}
        return self._victims(e.device, nbytes - acct.free - sum(arenas.values()), self._over_count(e.device) - len(arenas),
                             among=lambda x: x.name not in taken, commit=False) is not None

    def loaded_on(self, device: str) -> int:
        """Models counted against ``device``'s max_loaded: RESIDENT or LOADING there, a
        shared arena once."""
        return len({self._arena_key(x) for x in self.entries.values()
                    if x.device == device and x.state in (State.RESIDENT, State.LOADING)})

    def _over_count(self, device: str) -> int:
        """How many models must leave ``device`` before one more may load there."""
        limit = self.max_loaded.get(device)
        return 0 if limit is None else self.loaded_on(device) + 1 - limit

    def _victims(self, device: str, need: int, count: int = 0,
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
                group = groups[x.share] = [y for y in (x, *self.siblings(x.name)) if y.state is State.RESIDENT]
                if all(y.evictable for y in group):
                    candidates.append(max(group, key=self.policy.priority))
        victims = self.policy.choose(candidates, need, count)
        if victims and commit:
            self.policy.evicted(device, victims)
            return [y for v in victims for y in (groups[v.share] if v.share is not None else [v])]
        return victims

    def _demotable(self, e: Candidate) -> bool:
        """Whether evicting ``e`` now would move it to the host tier (the step down's rule).
        A shared arena is not demoted: its names would have to come back together."""
        shared = isinstance(e, Entry) and e.share is not None and len(self._shares[e.share]) > 1
        return e.device != "cpu" and 0 < e.nbytes <= self.host.budget and not shared

    def _comes_back_from(self, e: Candidate) -> Source:
        return "host" if self._demotable(e) else "files"

    def _step_down(self, victims: list[Entry], keep: Entry | None = None) -> StepDown:
        """Move RESIDENT victims off their device: to the host tier where it is enabled and
        they fit (dropping its LRU copies, never ``keep``'s), else out."""
        demote: list[str] = []
        evict: list[str] = []
        drop_host: list[str] = []
        release: list[str] = []
        leaving = {id(v) for v in victims}  # a victim's kept copy is its way out: never dropped for another
        for v in victims:
            v.evictions += 1
            if v.host_copy and not self._demotable(v):  # never kept where it could not step down to
                self._drop_host_copy(v)
                drop_host.append(v.name)
            if self._sibling_in(v, State.RESIDENT) is not None:  # a name still on the arena keeps its bytes
                v.state = State.EVICTED
                evict.append(v.name)
                continue
            self.devices[v.device].used -= v.nbytes
            if v.host_copy:  # kept from its promotion: the host tier has its bytes already
                v.state = State.HOST
                v.demotions += 1
                release.append(v.name)
                continue
            if self._demotable(v):
                # Kept copies of resident models first (their bytes are still on a device),
                # then HOST models' copies, each least recently used first; none at all if
                # dropping every one would not make room (they would go for nothing).
                droppable = sorted((x for x in self.entries.values()
                                    if x.host_copy and x is not keep and (x.state is State.HOST
                                                                          or (x.state is State.RESIDENT and id(x) not in leaving))),
                                   key=lambda x: (x.state is State.HOST, x.last_used))
                if self.host.free + sum(x.nbytes for x in droppable) < v.nbytes:
                    droppable = []
                while self.host.free < v.nbytes and droppable:
                    old = droppable.pop(0)
                    self._drop_host_copy(old)
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
                if self.host.free >= v.nbytes:
                    v.state, v.host_copy = State.HOST, True
                    v.demotions += 1
                    self.host.used += v.nbytes
                    demote.append(v.name)
                    continue
            v.state = State.EVICTED
            evict.append(v.name)
        return StepDown(demote=tuple(demote), evict=tuple(evict), drop_host=tuple(drop_host), release=tuple(release))

    def set_budget(self, device: str, budget: int) -> StepDown:
        """Change a device's budget (config reload). Lowering it evicts unattached,
        unpinned models in the policy's order until everything fits; if attached or pinned
        models hold too much, nothing changes and NoSpace says what holds the memory."""
        acct = self.devices[device]
        victims = self._victims(device, acct.used + acct.reserved - budget)
        if victims is None:
            held = sorted(f"{x.name} ({format_size(x.nbytes)})" for x in self.entries.values()
                          if x.device == device and x.state in (State.RESIDENT, State.LOADING) and not x.evictable)
            raise NoSpace(f"cannot lower the {device} budget to {format_size(budget)}: {', '.join(held)} cannot be "
                          "evicted now (attached, pinned or loading)", device=device, budget=budget)
        step = self._step_down(victims)
        acct.budget = budget
        return step

    def set_max_loaded(self, device: str, limit: int | None) -> StepDown:
        """Change a device's max_loaded count (config reload; None: no count). Lowering it
        evicts unattached, unpinned models in the policy's order down to the count, as a
        lowered budget does; if attached or pinned models are more than the count,
        nothing changes and NoSpace names them."""
        if device not in self.devices:
            raise BadRequest(f"device {device!r} has no budget; configured: {sorted(self.devices)}", device=device)
        over = 0 if limit is None else self.loaded_on(device) - limit
        victims: list[Entry] = []
        if over > 0:
            found = self._victims(device, 0, over)
            if found is None:
                held = sorted(x.name for x in self.entries.values()
                              if x.device == device and x.state in (State.RESIDENT, State.LOADING) and not x.evictable)
                raise NoSpace(f"cannot lower max_loaded_models.{device} to {limit}: {self.loaded_on(device)} models are "
                              f"loaded and {', '.join(held)} cannot be evicted now",
                              device=device, max_loaded_models=limit, loaded=self.loaded_on(device))
            victims = found
        step = self._step_down(victims)
        if limit is None:
            self.max_loaded.pop(device, None)
        else:
            self.max_loaded[device] = limit
        return step

    def _drop_host_copy(self, e: Entry) -> None:
        """Forget ``e``'s host copy: a HOST model is then EVICTED; a RESIDENT one that kept
        its copy stays resident."""
        self.host.used -= e.nbytes
        e.host_copy = False
        if e.state is State.HOST:
            e.state = State.EVICTED

    def drop_host(self, name: str) -> Entry:
        """Forget a HOST model's host copy (e.g. its files changed); the caller frees it."""
        e = self.entry(name)
        if e.state is not State.HOST:
            raise BadRequest(f"model {name!r} has no host copy (state {e.state})", model=name)
        self._drop_host_copy(e)
        return e

    def finish_load(self, name: str) -> Entry:
        e = self._loading(name)
        acct = self.devices[e.device]
        acct.reserved -= e.nbytes
        acct.used += e.nbytes
        if e.host_copy:  # promoted: the host copy is kept (Note [kept host copies])
            e.promotions += 1
            if not self._demotable(e):  # a second name of its files came meanwhile: the caller frees it
                self._drop_host_copy(e)
        e.state = State.RESIDENT
        e.loads += 1
        self._used(e)
        return e

    def observe_load(self, name: str, source: Source, nbytes: int, seconds: float) -> None:
        """The server measured a load of ``name`` that succeeded: ``nbytes`` (its arena's
        size, ``LoadPlan.nbytes``) brought in from ``source`` ("files", or "host" for a
        promotion) in ``seconds`` (allocating, filling and sealing the arena; not the wait
        for room). GDSF's cost of evicting a model is learned from these (policy.LoadRates)."""
        self.rates.observe(self.entry(name).device, name, source, nbytes, seconds)

    def reload_cost(self, name: str) -> float:
        """Seconds it would take to bring ``name`` back if it were evicted now, from the
        host tier or its files (whichever the step down would leave it in)."""
        e = self.entry(name)
        return self.rates.cost(e.device, e.name, self._comes_back_from(e), e.nbytes)

    def priority(self, name: str) -> float:
        """The policy's eviction priority of ``name``: lowest goes first (LRU: the time of
        its last use; GDSF: H)."""
        return self.policy.priority(self.entry(name))

    def abort_load(self, name: str) -> Entry:
        """Roll a failed load back: the reservation is returned, the budget is as before."""
        e = self._loading(name)
        self.devices[e.device].reserved -= e.nbytes
        e.state = State.HOST if e.host_copy else State.EVICTED if e.loads else State.REGISTERED
        return e

    def _loading(self, name: str) -> Entry:
        e = self.entry(name)
        if e.state is not State.LOADING:
            raise BadRequest(f"model {name!r} is not loading (state {e.state})", model=name)
        return e

    def _no_space(self, e: Entry, nbytes: int) -> NoSpace:
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
        if limit is not None and self._over_count(e.device) > 0:
            # The count, not the bytes, may be what is full: say so, naming the key.
            count = {"max_loaded_models": limit, "loaded": self.loaded_on(e.device)}
            fits_ever = fits_ever and len(pinned) < limit
        return NoSpace.over_budget(model=e.name, needed=nbytes, device=e.device, budget=acct.budget, free=acct.free,
                                   held=held, holders=holders, fits_ever=fits_ever, **count)

    # -- quotas (Note [quotas]) ---------------------------------------------------------
    def set_quotas(self, quotas: dict[str, Quota]) -> None:
        """The tenants' quotas (start, reload). A lowered quota evicts nothing now: the
        tenant's next load makes room among its own models first, or is refused."""
        self.quotas = dict(quotas)

    def tenant_bytes(self, tenant: str, device: str) -> int:
        """Bytes ``tenant``'s models hold on ``device``, resident or loading (a shared arena once)."""
        return sum({self._arena_key(x): x.nbytes for x in self.entries.values()
                    if tenant in x.tenants and x.device == device and x.state in (State.RESIDENT, State.LOADING)}.values())

    def tenant_pins(self, tenant: str) -> set[str]:
        """The models of ``tenant`` that are pinned (a sharded model once)."""
        return {model_of(x.name) for x in self.entries.values() if tenant in x.tenants and x.pinned}

    def tenant_usage(self) -> dict[str, dict[str, Any]]:
        """Per tenant that has a quota or holds a model: bytes per device, pins, and the
        quota (None where not limited)."""
        tenants = set(self.quotas) | {t for x in self.entries.values() for t in x.tenants[:1]}  # owners' uids
        out = {}
        for t in sorted(tenants):
            q = self.quotas.get(t)
            out[t] = {
                "devices": {dev: {"used": self.tenant_bytes(t, dev), "quota": q.nbytes.get(dev) if q else None}
                            for dev in self.devices},
                "pins": len(self.tenant_pins(t)), "pins_quota": q.pins if q else None,
            }
        return out

    def pins_limited(self, name: str) -> bool:
        """Whether a pins quota covers ``name`` (its owner may then pin it, within the quota)."""
        return any(q.pins is not None for t in self.entry(name).tenants if (q := self.quotas.get(t)) is not None)

    def _quota_victims(self, e: Entry, nbytes: int) -> list[Entry]:
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
            going = sum({self._arena_key(v): v.nbytes for v in chosen if t in v.tenants}.values())
            used = self.tenant_bytes(t, e.device)
            over = used - going + nbytes - limit
            if over <= 0:
                continue
            def mine(x: Entry, t: str = t, taken: set[str] = taken) -> bool:
                return t in x.tenants and x.name not in taken

            victims = self._victims(e.device, over, among=mine, commit=False)
            if victims is None:
                assert q is not None
                kept = sum({self._arena_key(x): x.nbytes for x in self.entries.values()
                            if t in x.tenants and x.device == e.device and x.pinned and x.state is State.RESIDENT}.values())
                raise NoSpace(
                    f"model {e.name!r} needs {format_size(nbytes)} on {e.device}, over the quota of {t}: its models may hold "
                    f"{format_size(limit)} there ({q.where()}.bytes), hold {format_size(used)} now, and not enough of "
                    "that is unattached to make room",
                    model=e.name, device=e.device, needed=nbytes, quota=t, quota_bytes=limit, quota_used=used,
                    fits_ever=nbytes <= limit - kept)
            chosen += victims
        return chosen

    def _check_pin_quota(self, name: str, tenants: tuple[str, ...]) -> None:
        """NoSpace naming the quota if pinning ``name`` gives one of ``tenants`` more pinned
        models than its quota allows (another rank of a model already pinned is no new pin)."""
        for t in tenants:
            q = self.quotas.get(t)
            if q is None or q.pins is None:
                continue
            pinned = self.tenant_pins(t)
            if model_of(name) not in pinned and len(pinned) >= q.pins:
                raise NoSpace(f"{t} has {len(pinned)} pinned model(s), its quota ({q.where()}.pins = {q.pins}); "
                              f"unpin one before pinning {model_of(name)!r}",
                              model=model_of(name), quota=t, quota_pins=q.pins, pinned=len(pinned), fits_ever=False)

    # -- eviction -------------------------------------------------------------------
    def evict(self, name: str, *, ignore_pin: bool = False, demote: bool = True) -> StepDown:
        """Move a model one tier down: a RESIDENT one to the host tier (if enabled, it
        fits, and ``demote``) or out; a HOST one out. The caller carries out the StepDown.
        ``ignore_pin`` is for stale bytes (checkpoint changed on disk): the pin stays."""
        e = self.entry(name)
        if e.state is State.HOST:
            self._drop_host_copy(e)
            return StepDown(drop_host=(name,))
        self.check_evictable(name, ignore_pin=ignore_pin)
        if not demote:
            if self._sibling_in(e, State.RESIDENT) is None:  # else a sibling keeps the bytes
                self.devices[e.device].used -= e.nbytes
            e.evictions += 1
            e.state = State.EVICTED
            if e.host_copy:  # a kept copy goes with the device's (stale bytes, Note [kept host copies])
                self._drop_host_copy(e)
                return StepDown(evict=(name,), drop_host=(name,))
            return StepDown(evict=(name,))
        return self._step_down([e])

    def check_evictable(self, name: str, *, ignore_pin: bool = False) -> Entry:
        """Raise what ``evict`` of a RESIDENT model would (ATTACHED, PINNED); change nothing."""
        e = self.entry(name)
        if e.state is not State.RESIDENT:
            raise BadRequest(f"model {name!r} is not resident (state {e.state})", model=name)
        if e.leases:
            raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name, attach_count=e.attach_count)
        if e.pinned and not ignore_pin:
            raise Pinned(f"model {name!r} is pinned; unpin it first", model=name)
        return e

    def demotion_failed(self, name: str) -> Entry:
        """A demotion's copy to the host tier failed: the model was evicted after all."""
        e = self.entry(name)
        if e.state is State.HOST:
            self._drop_host_copy(e)
            e.demotions -= 1
        return e

    def expired(self) -> list[str]:
        """Unattached, unpinned resident models whose keep_alive has run out."""
        return [name for name in self.entries if self.is_expired(name)]

    def is_expired(self, name: str) -> bool:
        """Whether ``name`` is registered, unattached, unpinned, resident and past its keep_alive."""
        e = self.entries.get(name)
        return e is not None and e.evictable and e.keep_alive is not None and self._clock() - e.last_used >= e.keep_alive

    # -- leases ---------------------------------------------------------------------
    def attach(self, name: str, conn: int) -> Lease:
        e = self.entry(name)
        if e.state is not State.RESIDENT:
            raise BadRequest(f"model {name!r} is not resident (state {e.state})", model=name)
        lease = Lease(id=next(self._lease_ids), model=name, conn=conn, since=self._clock())
        self.leases[lease.id] = lease
        self._by_conn.setdefault(conn, set()).add(lease.id)
        e.leases.add(lease.id)
        self._count_use(e)
        self._used(e)
        return lease

    def leases_on(self, name: str) -> list[tuple[Lease, float]]:
        """The leases on ``name``, oldest first, each with its age in seconds. The core
        knows only connection ids; the server says who is behind them."""
        now = self._clock()
        return [(lease, now - lease.since) for lease in sorted((self.leases[i] for i in self.entry(name).leases),
                                                               key=lambda x: x.id)]

    def leases_held(self, conn: int) -> int:
        return len(self._by_conn.get(conn, ()))

    def detach(self, lease_id: int, conn: int) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or lease.conn != conn:
            raise BadRequest(f"no lease {lease_id} held by this connection", lease=lease_id)
        return self._end_lease(lease)

    def drop_connection(self, conn: int) -> list[Lease]:
        """End every lease the connection held (it closed, or its engine died)."""
        return [self._end_lease(self.leases[i]) for i in sorted(self._by_conn.get(conn, ()))]

    def _end_lease(self, lease: Lease) -> Lease:
        del self.leases[lease.id]
        held = self._by_conn[lease.conn]
        held.discard(lease.id)
        if not held:
            del self._by_conn[lease.conn]
        e = self.entries[lease.model]
        e.leases.discard(lease.id)
        # Detaching counts as use: keep_alive runs from here, and under GDSF a model in use
        # while others were evicted does not come out of its lease behind the clock.
        self._used(e)
        return lease

    # -- introspection --------------------------------------------------------------
    def check_invariants(self) -> None:
        for dev, acct in self.devices.items():
            mine = [e for e in self.entries.values() if e.device == dev]
            arenas = {self._arena_key(e): e.nbytes for e in mine if e.state is State.RESIDENT}  # a shared one once
            assert acct.used == sum(arenas.values()), dev
            assert acct.reserved == sum(e.nbytes for e in mine if e.state is State.LOADING), dev
            assert acct.used + acct.reserved <= acct.budget, dev
            if dev in self.max_loaded:
                assert self.loaded_on(dev) <= self.max_loaded[dev], dev
            for key in {e.share for e in mine if e.share is not None}:
                held = [e for e in mine if e.share == key and e.state in (State.RESIDENT, State.LOADING)]
                # one arena: resident names all of one size, or a single load and nothing resident
                assert len({e.nbytes for e in held}) <= 1 and (len(held) <= 1 or all(e.state is State.RESIDENT for e in held)), key
        for e in self.entries.values():
            assert all(self.leases[i].model == e.name for i in e.leases)
            assert not e.leases or e.state is State.RESIDENT, e.name
            assert e.host_copy or e.state is not State.HOST, e.name
            assert not e.host_copy or e.state in (State.HOST, State.LOADING, State.RESIDENT), e.name
            assert e.clock_base <= self.policy.clock(e.device), e.name
            assert e.refs >= 0, e.name
        assert self._models_on == {dev: sum(e.device == dev for e in self.entries.values()) for dev in self.devices}
        assert sum(e.attach_count for e in self.entries.values()) == len(self.leases)
        assert {i for held in self._by_conn.values() for i in held} == set(self.leases)
        assert all(self.leases[i].conn == conn and held for conn, held in self._by_conn.items() for i in held)
        assert self.host.used == sum(e.nbytes for e in self.entries.values() if e.host_copy)
        assert self.host.used <= self.host.budget

    def device_summary(self) -> dict[str, dict[str, Any]]:
        out = {dev: {"budget": a.budget, "used": a.used, "reserved": a.reserved, "free": a.free} for dev, a in self.devices.items()}
        if self.host.budget:
            out["host"] = {"budget": self.host.budget, "used": self.host.used, "reserved": 0, "free": self.host.free}
        return out
