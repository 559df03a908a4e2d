"""The cache policy: budgets, states, eviction (eviction.py: LRU, or GDSF), pins, keep-alive
and leases. Pure: no I/O, no await, no torch. The server asks it what to do, carries the
plan out, and reports back (``finish_load``, ``observe_load``).

``CacheCore`` is the one door; its rooms, each with its own Note: eviction.py (the
records and plans, tenants' quotas, and everything an eviction decision runs: the policy,
names on one arena, which victims a load or a lowered limit needs, the step down and the
host tier), names.py (how entry names and arena keys are spelled). The lease book
(``LeaseBook``) is here, with the core that decides when a lease begins and ends.

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
from collections.abc import Callable, Hashable
from typing import Any

from ..errors import Attached, BadRequest, NoSpace, Pinned, UnknownModel
from .eviction import (
    Admission,
    DeviceAccount,
    Entry,
    EntryEvent,
    EvictionPolicy,
    HostTier,
    Lease,
    LoadPlan,
    LoadRates,
    PolicyName,
    Quota,
    Shares,
    Source,
    State,
    StepDown,
    arena_key,
    check_pin_quota,
    make_policy,
    pins_limited,
    tenant_bytes,
    tenant_usage,
)
from .names import ArenaKey

# Frequencies age TinyLFU's way: when the attaches counted on a device reach this many per
# model registered there, every count on it is halved (and the tally with them), so a model
# popular an hour ago does not outweigh one popular now. Replaying Zipf traces through this
# core (`python tests/test_policy.py`, docs/architecture.md), GDSF with counts kept so took
# 0.77-0.91 of LRU's miss time; never aged 0.76-0.96 (worst where popularity shifted);
# forgotten whenever the model left the cache and never aged, GreedyDual's own rule,
# 0.82-1.04: worse than LRU after a shift, as the newly popular model kept starting from
# nothing while the old favourite, still resident, kept its count.
AGING_USES_PER_MODEL = 16


class LeaseBook:
    """The lease book: every live lease by id and by the connection that holds it, so that
    a connection's count and its drop at close cost what it holds, not what all hold.
    ``CacheCore`` decides when a lease may begin and what its end changes; this keeps the
    books."""

    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self._by_conn: dict[int, set[int]] = {}  # connection -> its lease ids (O(1) counts and drops)
        # entry -> connection -> its lease ids there, oldest first (ids rise): who holds a model
        # costs the connections holding it, not the leases. A peer pipelining attaches held
        # 4096 leases on one model, and every `models` and `status` that sorted them and
        # described each holder stalled the loop 15-46 ms (python -m benchmarks abuse).
        self._holding: dict[str, dict[int, dict[int, None]]] = {}
        self._ids = itertools.count(1)

    def begin(self, e: Entry, conn: int, since: float) -> Lease:
        lease = Lease(id=next(self._ids), model=e.name, conn=conn, since=since)
        self.leases[lease.id] = lease
        self._by_conn.setdefault(conn, set()).add(lease.id)
        e.leases.add(lease.id)
        self._holding.setdefault(e.name, {}).setdefault(conn, {})[lease.id] = None
        return lease

    def held_by(self, lease_id: int, conn: int) -> Lease:
        """Lease ``lease_id``, if ``conn`` holds it; else BAD_REQUEST."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.conn != conn:
            raise BadRequest(f"no lease {lease_id} held by this connection", lease=lease_id)
        return lease

    def of_conn(self, conn: int) -> list[Lease]:
        """The leases ``conn`` holds, oldest first."""
        return [self.leases[i] for i in sorted(self._by_conn.get(conn, ()))]

    def count(self, conn: int) -> int:
        return len(self._by_conn.get(conn, ()))

    def holders(self, e: Entry) -> list[tuple[int, int, Lease]]:
        """Each connection holding leases on ``e``: (connection, how many, its oldest),
        by their oldest lease."""
        rows = [(conn, len(ids), self.leases[next(iter(ids))]) for conn, ids in self._holding.get(e.name, {}).items()]
        return sorted(rows, key=lambda row: row[2].id)

    def end(self, lease: Lease, e: Entry) -> None:
        del self.leases[lease.id]
        held = self._by_conn[lease.conn]
        held.discard(lease.id)
        if not held:
            del self._by_conn[lease.conn]
        e.leases.discard(lease.id)
        holding = self._holding[e.name]
        ids = holding[lease.conn]
        del ids[lease.id]
        if not ids:
            del holding[lease.conn]
            if not holding:
                del self._holding[e.name]

    def check_invariants(self, entries: dict[str, Entry]) -> None:
        """Note [invariants] 2 (core.py): the attach counts are the live leases, each on a
        RESIDENT entry, each listed under the connection that holds it."""
        for e in entries.values():
            assert all(self.leases[i].model == e.name for i in e.leases)
            assert not e.leases or e.state is State.RESIDENT, e.name
        assert sum(e.attach_count for e in entries.values()) == len(self.leases)
        assert {i for held in self._by_conn.values() for i in held} == set(self.leases)
        assert all(self.leases[i].conn == conn and held for conn, held in self._by_conn.items() for i in held)
        assert {(name, conn, i) for name, h in self._holding.items() for conn, ids in h.items() for i in ids} == \
            {(lease.model, lease.conn, lease.id) for lease in self.leases.values()}
        assert all(list(ids) == sorted(ids) and ids for h in self._holding.values() for ids in h.values())


class CacheCore:
    def __init__(self, budgets: dict[str, int], clock: Callable[[], float] = time.monotonic, host_budget: int = 0,
                 policy: PolicyName = "lru", max_loaded: dict[str, int] | None = None) -> None:
        self.devices = {dev: DeviceAccount(budget=b) for dev, b in budgets.items()}
        # device -> the most models RESIDENT or LOADING on it at once (daemon.max_loaded_models)
        self.max_loaded = dict(max_loaded or {})
        self.entries: dict[str, Entry] = {}
        self.shares = Shares(self.entries)  # Note [shared arenas] in eviction.py
        self.tier = HostTier(host_budget, self.devices, self.entries, self.shares)  # Note [kept host copies] in eviction.py
        self.host = self.tier.account  # the pinned host tier (0: disabled)
        self.book = LeaseBook()
        self._clock = clock
        self.rates = LoadRates()  # learned under every policy: reload_cost means the same under each
        self.policy: EvictionPolicy = make_policy(policy, self.rates, self.tier.comes_back_from)
        self._models_on: dict[str, int] = dict.fromkeys(budgets, 0)  # device -> models registered on it
        self._uses: dict[str, int] = dict.fromkeys(budgets, 0)  # device -> attaches tallied towards aging
        self.admission = Admission(self.entries, self.devices, self.shares, self.policy, self.max_loaded)
        # Called when a keep_alive deadline comes earlier than the one the keep-alive sweeper
        # sleeps towards (``next_expiry``): the server wakes its sweeper.
        self.on_deadline: Callable[[], None] = lambda: None
        self._sweep_at: float | None = None  # the sweeper's wake-up, by the clock (None: none set)

    # -- registry -------------------------------------------------------------------
    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise UnknownModel(f"no model named {name!r} is registered", model=name) from None

    def register(self, name: str, device: str, *, pinned: bool = False, keep_alive: float | None = None,
                 share: Hashable | None = None, tenants: tuple[str, ...] = (), model: str | None = None,
                 staging: bool = False) -> Entry:
        """``share``: a key naming the bytes (same files, owner): entries of one key hold
        one arena between them per device (Note [shared arenas]). ``model``: the model the
        entry belongs to (its own name by default); ``staging``: a publish's staging entry."""
        if name in self.entries:
            raise BadRequest(f"model {name!r} is already registered", model=name)
        if device not in self.devices:
            raise BadRequest(f"device {device!r} has no budget; configured: {sorted(self.devices)}", device=device)
        key = None if share is None else ArenaKey.shared(device, share)
        if pinned:
            check_pin_quota(self.entries.values(), self.quotas, model or name, tenants)
        e = Entry(name=name, device=device, pinned=pinned, keep_alive=keep_alive, configured_keep_alive=keep_alive, share=key,
                  tenants=tenants, model=model or name, staging=staging)
        self.entries[name] = e
        self._models_on[device] += 1
        self.shares.add(e)
        return e

    # -- shared arenas (Note [shared arenas] in eviction.py) --------------------------------
    def siblings(self, name: str) -> list[Entry]:
        """The other entries that share ``name``'s arena key."""
        return self.shares.siblings(self.entry(name))

    def sharing(self, share: ArenaKey) -> list[str]:
        """The entries registered with the arena key ``share`` (an ``Entry.share``)."""
        return self.shares.names(share)

    def resident_sibling(self, name: str) -> str | None:
        """A RESIDENT entry whose arena ``name`` may take instead of loading, or None."""
        x = self.shares.sibling_in(self.entry(name), State.RESIDENT)
        return None if x is None else x.name

    def join(self, name: str) -> StepDown:
        """Make ``name`` RESIDENT on a resident sibling's arena: no load, no bytes (they are
        counted once, for the arena). A host copy it still had is dropped (the StepDown)."""
        e = self.entry(name)
        sib = self.shares.sibling_in(e, State.RESIDENT)
        if sib is None or e.state in (State.LOADING, State.RESIDENT):
            raise BadRequest(f"model {name!r} cannot share an arena now (state {e.state})", model=name)
        drop: list[str] = []
        if e.state is State.HOST:
            self.tier.drop_copy(e)
            drop.append(name)
        if sib.host_copy:  # kept from its promotion; a shared arena has none (Note [shared arenas])
            self.tier.drop_copy(sib)
            drop.append(sib.name)
        e.nbytes = sib.nbytes
        e.move(EntryEvent.JOIN)
        self._used(e)
        return StepDown(drop_host=tuple(drop))

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
        if e.state is State.RESIDENT and self.shares.sibling_in(e, State.RESIDENT) is None:  # else a sibling keeps the bytes
            self.devices[e.device].used -= e.nbytes
        if e.host_copy:
            self.host.used -= e.nbytes
        del self.entries[name]
        self._models_on[e.device] -= 1
        self.shares.discard(e)
        self.rates.forget(name)
        return e

    def rename(self, name: str, new: str) -> Entry:
        """Give an unattached entry another name (a publish swaps its staged copy in): it is
        the model ``new`` now, no staging entry."""
        e = self.entry(name)
        if new in self.entries:
            raise BadRequest(f"model {new!r} is already registered", model=new)
        if e.leases:
            raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name, attach_count=e.attach_count)
        del self.entries[name]
        e.name, e.model, e.staging = new, new, False
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
        self._deadline_moved(e)

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
            check_pin_quota(self.entries.values(), self.quotas, e.model, e.tenants)
        e.pinned = pinned
        self._deadline_moved(e)
        return e

    def set_keep_alive(self, name: str, seconds: float | None) -> Entry:
        """A request's keep_alive (None: never expire; 0: expire as soon as unattached)
        replaces the one in force until the next request sets it (ollama's rule)."""
        if seconds is not None and not seconds >= 0:
            raise BadRequest(f"keep_alive must be >= 0 seconds or never, not {seconds!r}", argument="keep_alive")
        e = self.entry(name)
        e.keep_alive = seconds
        self._deadline_moved(e)
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
        own, others = self.admission.choose(e, nbytes, commit=True)
        if others is None:
            raise self.admission.no_space(e, nbytes)
        if own:  # only now that the load is admitted: a refused one must not move GDSF's clock (5)
            self.policy.evicted(e.device, own)
        victims = own + others
        step = self.tier.step_down(victims, keep=e)
        e.move(EntryEvent.LOAD)
        e.nbytes = nbytes
        acct.reserved += nbytes
        return LoadPlan(name=name, nbytes=nbytes, step_down=step, promote=e.host_copy)

    def could_admit(self, name: str, nbytes: int) -> bool:
        """Whether ``begin_load(name, nbytes)`` would admit the load now, changing nothing:
        what a request waiting for room asks before it is woken (server/residency/flight.py,
        SpaceFreed), so that a detach that frees too little wakes nobody."""
        e = self.entries.get(name)
        if e is None or e.state in (State.LOADING, State.RESIDENT):
            return True  # not a wait for room any more: let it find out
        try:
            return self.admission.choose(e, nbytes, commit=False)[1] is not None
        except NoSpace:
            return False

    def set_budget(self, device: str, budget: int) -> StepDown:
        """Change a device's budget (config reload). Lowering it evicts unattached,
        unpinned models in the policy's order until everything fits; if attached or pinned
        models hold too much, nothing changes and NoSpace says what holds the memory."""
        step = self.tier.step_down(self.admission.to_lower_budget(device, budget))
        self.devices[device].budget = budget
        return step

    def set_max_loaded(self, device: str, limit: int | None) -> StepDown:
        """Change a device's max_loaded count (config reload; None: no count). Lowering it
        evicts unattached, unpinned models in the policy's order down to the count, as a
        lowered budget does; if attached or pinned models are more than the count,
        nothing changes and NoSpace names them."""
        if device not in self.devices:
            raise BadRequest(f"device {device!r} has no budget; configured: {sorted(self.devices)}", device=device)
        step = self.tier.step_down(self.admission.to_lower_count(device, limit))
        if limit is None:
            self.max_loaded.pop(device, None)
        else:
            self.max_loaded[device] = limit
        return step

    def drop_host(self, name: str) -> Entry:
        """Forget a HOST model's host copy (e.g. its files changed); the caller frees it."""
        e = self.entry(name)
        if e.state is not State.HOST:
            raise BadRequest(f"model {name!r} has no host copy (state {e.state})", model=name)
        self.tier.drop_copy(e)
        return e

    def finish_load(self, name: str) -> Entry:
        e = self._loading(name)
        acct = self.devices[e.device]
        acct.reserved -= e.nbytes
        acct.used += e.nbytes
        if e.host_copy:  # promoted: the host copy is kept (Note [kept host copies])
            e.promotions += 1
            if not self.tier.demotable(e):  # a second name of its files came meanwhile: the caller frees it
                self.tier.drop_copy(e)
        e.move(EntryEvent.LOADED)
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
        return self.rates.cost(e.device, e.name, self.tier.comes_back_from(e), e.nbytes)

    def priority(self, name: str) -> float:
        """The policy's eviction priority of ``name``: lowest goes first (LRU: the time of
        its last use; GDSF: H)."""
        return self.policy.priority(self.entry(name))

    def abort_load(self, name: str) -> Entry:
        """Roll a failed load back: the reservation is returned, the budget is as before."""
        e = self._loading(name)
        self.devices[e.device].reserved -= e.nbytes
        e.move(EntryEvent.PROMOTION_FAILED if e.host_copy else EntryEvent.RELOAD_FAILED if e.loads else EntryEvent.FIRST_LOAD_FAILED)
        return e

    def _loading(self, name: str) -> Entry:
        e = self.entry(name)
        if e.state is not State.LOADING:
            raise BadRequest(f"model {name!r} is not loading (state {e.state})", model=name)
        return e

    # -- quotas (Note [quotas] in eviction.py) -----------------------------------------------
    def set_quotas(self, quotas: dict[str, Quota]) -> None:
        """The tenants' quotas (start, reload). A lowered quota evicts nothing now: the
        tenant's next load makes room among its own models first, or is refused."""
        self.admission.quotas = dict(quotas)

    @property
    def quotas(self) -> dict[str, Quota]:
        return self.admission.quotas

    def loaded_on(self, device: str) -> int:
        """Models counted against ``device``'s max_loaded: RESIDENT or LOADING there, a
        shared arena once."""
        return self.admission.loaded_on(device)

    def tenant_bytes(self, tenant: str, device: str) -> int:
        """Bytes ``tenant``'s models hold on ``device``, resident or loading (a shared arena once)."""
        return tenant_bytes(self.entries.values(), tenant, device)

    def tenant_usage(self) -> dict[str, dict[str, Any]]:
        """Per tenant that has a quota or holds a model: bytes per device, pins, and the
        quota (None where not limited)."""
        return tenant_usage(self.entries.values(), self.quotas, self.devices, self.admission.parses)

    def charge_parse(self, tenants: tuple[str, ...], device: str, nbytes: int, what: str) -> int:
        """A running parse charged to quotas (Note [quotas]): a token for release_parse, or NoSpace."""
        return self.admission.parses.charge(self.entries.values(), self.quotas, tenants, device, nbytes, what)

    def release_parse(self, token: int) -> None:
        self.admission.parses.release(token)

    def pins_limited(self, name: str) -> bool:
        """Whether a pins quota covers ``name`` (its owner may then pin it, within the quota)."""
        return pins_limited(self.quotas, self.entry(name).tenants)

    # -- eviction -------------------------------------------------------------------
    def evict(self, name: str, *, ignore_pin: bool = False, demote: bool = True) -> StepDown:
        """Move a model one tier down: a RESIDENT one to the host tier (if enabled, it
        fits, and ``demote``) or out; a HOST one out. The caller carries out the StepDown.
        ``ignore_pin`` is for stale bytes (checkpoint changed on disk): the pin stays."""
        e = self.entry(name)
        if e.state is State.HOST:
            self.tier.drop_copy(e)
            return StepDown(drop_host=(name,))
        self.check_evictable(name, ignore_pin=ignore_pin)
        if not demote:
            if self.shares.sibling_in(e, State.RESIDENT) is None:  # else a sibling keeps the bytes
                self.devices[e.device].used -= e.nbytes
            e.evictions += 1
            e.move(EntryEvent.EVICT)
            if e.host_copy:  # a kept copy goes with the device's (stale bytes, Note [kept host copies])
                self.tier.drop_copy(e)
                return StepDown(evict=(name,), drop_host=(name,))
            return StepDown(evict=(name,))
        return self.tier.step_down([e])

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
            self.tier.drop_copy(e)
            e.demotions -= 1
        return e

    def expired(self) -> list[str]:
        """Unattached, unpinned resident models whose keep_alive has run out."""
        return [name for name in self.entries if self.is_expired(name)]

    def is_expired(self, name: str) -> bool:
        """Whether ``name`` is registered, unattached, unpinned, resident and past its keep_alive."""
        e = self.entries.get(name)
        at = None if e is None else e.expires_at
        return at is not None and self._clock() >= at

    def hold(self, name: str) -> Entry:
        """A request is on its way to use ``name``: its keep_alive waits until ``release``."""
        e = self.entry(name)
        e.wanted += 1
        return e

    def release(self, e: Entry) -> None:
        """The request ``hold`` counted is done with ``e`` (attached it, or gave up)."""
        e.wanted -= 1
        self._deadline_moved(e)

    def next_expiry(self) -> float | None:
        """Seconds until the earliest keep_alive runs out (0: one has), None if none can:
        how long the keep-alive sweeper may sleep. Until then ``on_deadline`` is called
        whenever a deadline comes earlier (a detach, a load, a shorter keep_alive, an unpin)."""
        deadlines = [at for e in self.entries.values() if (at := e.expires_at) is not None]
        self._sweep_at = min(deadlines, default=None)
        return None if self._sweep_at is None else max(0.0, self._sweep_at - self._clock())

    def _deadline_moved(self, e: Entry) -> None:
        at = e.expires_at
        if at is not None and (self._sweep_at is None or at < self._sweep_at):
            self._sweep_at = at
            self.on_deadline()

    # -- leases ---------------------------------------------------------------------
    def attach(self, name: str, conn: int) -> Lease:
        e = self.entry(name)
        if e.state is not State.RESIDENT:
            raise BadRequest(f"model {name!r} is not resident (state {e.state})", model=name)
        lease = self.book.begin(e, conn, since=self._clock())
        self._count_use(e)
        self._used(e)
        return lease

    @property
    def leases(self) -> dict[int, Lease]:
        """Every live lease, by id."""
        return self.book.leases

    def holders_on(self, name: str) -> list[tuple[int, int, float]]:
        """Each connection holding leases on ``name``: (connection, how many, the age in
        seconds of its oldest), oldest first. The core knows only connection ids; the
        server says who is behind them."""
        now = self._clock()
        return [(conn, n, now - oldest.since) for conn, n, oldest in self.book.holders(self.entry(name))]

    def leases_held(self, conn: int) -> int:
        return self.book.count(conn)

    def detach(self, lease_id: int, conn: int) -> Lease:
        return self._end_lease(self.book.held_by(lease_id, conn))

    def drop_connection(self, conn: int) -> list[Lease]:
        """End every lease the connection held (it closed, or its engine died)."""
        return [self._end_lease(lease) for lease in self.book.of_conn(conn)]

    def _end_lease(self, lease: Lease) -> Lease:
        e = self.entries[lease.model]
        self.book.end(lease, e)
        # Detaching counts as use: keep_alive runs from here, and under GDSF a model in use
        # while others were evicted does not come out of its lease behind the clock.
        self._used(e)
        return lease

    # -- introspection --------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert Note [invariants]: each room checks its own (leases 2, host tier 4)."""
        for dev, acct in self.devices.items():
            mine = [e for e in self.entries.values() if e.device == dev]
            arenas = {arena_key(e): e.nbytes for e in mine if e.state is State.RESIDENT}  # a shared one once
            assert acct.used == sum(arenas.values()), dev
            assert acct.reserved == sum(e.nbytes for e in mine if e.state is State.LOADING), dev
            assert acct.used + acct.reserved <= acct.budget, dev
            if dev in self.max_loaded:
                assert self.admission.loaded_on(dev) <= self.max_loaded[dev], dev
            for key in {e.share for e in mine if e.share is not None}:
                held = [e for e in mine if e.share == key and e.state in (State.RESIDENT, State.LOADING)]
                # one arena: resident names all of one size, or a single load and nothing resident
                assert len({e.nbytes for e in held}) <= 1 and (len(held) <= 1 or all(e.state is State.RESIDENT for e in held)), key
        for e in self.entries.values():
            assert e.clock_base <= self.policy.clock(e.device), e.name
            assert e.refs >= 0, e.name
        assert self._models_on == {dev: sum(e.device == dev for e in self.entries.values()) for dev in self.devices}
        self.book.check_invariants(self.entries)
        self.tier.check_invariants()

    def device_summary(self) -> dict[str, dict[str, Any]]:
        out = {dev: {"budget": a.budget, "used": a.used, "reserved": a.reserved, "free": a.free} for dev, a in self.devices.items()}
        if self.host.budget:
            out["host"] = {"budget": self.host.budget, "used": self.host.used, "reserved": 0, "free": self.host.free}
        return out
