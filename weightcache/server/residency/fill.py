"""Filling a new arena: admit (the core's plan, its victims stepped down), allocate, fill
with one of the strategies below in a thread, seal, encode the attach table, and make the
entry resident; or roll all of it back. Loads, promotions, peer copies and publishes all
come here.

The sections, each under its banner: THE STRATEGIES (the four ways an arena gets its
bytes), TURNS (a device's fill, shared fairly between tenants), and THE FILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ...backends import Arena, Backend
from ...cache import CacheCore, LoadPlan, StepDown
from ...cache.eviction import OWN_PHASES
from ...config import DaemonConfig
from ...errors import LoadFailed, NoSpace, WeightcacheError
from ...loader import Checkpoint, OpenedSource, Progress, read_checkpoint
from ...peer_log import PeerEventLog
from ...protocol import tenant_fingerprint
from ..registry import Model, Registry
from .io import MANY_TENSORS, collector_paused
from .job import LoadJob
from .stats import Stats
from .stepdown import StepDowns

log = logging.getLogger("weightcache.daemon")
T = TypeVar("T")

SMALL_FILL_BYTES = 64 * 2**20  # fills of at most this (and few tensors) do not wait for the device's fill lock


async def _to_thread_finished(fn: Callable[..., T], *args: Any, cleanup: Callable[[T], object] | None = None) -> T:
    """``fn(*args)`` in a thread, as ``asyncio.to_thread``, except that a caller cancelled
    meanwhile (a publish whose peer closed its connection, shutdown) waits for the thread
    before it goes on: a thread cannot be stopped, and the caller's next step frees the
    arena the thread works on. Freed under it, a CPU fill or seal made a new memfd of the
    arena's size for an arena already freed (counted by no budget, never freed), and an
    allocation that finished after its caller left was never freed: ``cleanup`` frees
    what such a thread returns."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        if not fut.cancelled() and fut.exception() is None and cleanup is not None:
            cleanup(fut.result())
        raise


# ===============================================================================================
# THE STRATEGIES: how a new arena gets its bytes
# ===============================================================================================
# How a new arena gets its bytes: the four ways a model becomes resident.
#
# ``Fill.fill_new_arena`` (below) admits, allocates, calls one of these in a
# thread, seals and rolls back on failure; what differs between a load from the files, a
# promotion from the host tier, a copy from another GPU and a copy of an engine's published
# memory is only this step.


class FillStrategy(Protocol):
    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        """Fill ``arena`` (allocated, unsealed) with ``ckpt``'s bytes; blocking. Returns
        the content fingerprint of what it read, or None where ``ckpt``'s stands (a
        promotion's bytes were hashed when first loaded; a publish names its own)."""


@dataclass(frozen=True)
class ReadFiles:
    """Parallel reads from the files the checkpoint was parsed from (the same fds)."""

    backend: Backend
    settings: DaemonConfig
    files: OpenedSource
    cancelled: Callable[[], bool]
    label: str

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        d = self.settings
        self.backend.bind_files(arena, ckpt, self.files)  # CPU: the page cache itself, where it can be trusted
        return read_checkpoint(
            ckpt, self.files, self.backend.writer(arena, d.load_chunk_bytes), threads=d.load_threads,
            chunk=d.load_chunk_bytes, nice=d.load_nice, progress=progress, cancelled=self.cancelled,
            direct_io=d.load_direct_io, log=lambda msg: log.info("load %s: %s", self.label, msg),
        )


@dataclass(frozen=True)
class Promote:
    """One host-to-device copy from the pinned host tier."""

    backend: Backend
    host: Any  # the backend's host copy

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        self.backend.promote(self.host, arena)
        progress.add(ckpt.data_bytes)
        return None


@dataclass(frozen=True)
class CopyPublished:
    """A copy of the memory an engine published (opened read-only by the backend)."""

    backend: Backend
    source: Any  # what Backend.open_published returned
    nbytes: int

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        self.backend.copy_published(self.source, arena, self.nbytes)
        progress.add(ckpt.data_bytes)
        return None


@dataclass(frozen=True)
class PeerCopy:
    """A device-to-device copy from the same rank's replica resident on another GPU
    (device = "auto" models; NVLink or PCIe P2P), instead of the host tier or the files.
    The bytes are the source's, already fingerprinted: its checkpoint stands."""

    backend: Backend  # the target's
    source_backend: Backend
    source: Arena

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        self.backend.copy_from_peer(self.source_backend, self.source, arena, min(self.source.nbytes, arena.nbytes))
        progress.add(ckpt.data_bytes)
        return None


# ===============================================================================================
# TURNS: a device's fill, shared fairly between tenants
# ===============================================================================================
# Turns at a device's fill, shared fairly between tenants.
#
# A device fills one arena at a time (``Fill`` says why). With a plain
# ``asyncio.Lock`` the turns go first come, first served, so a tenant that queues ten big
# fills makes another tenant's one big fill wait for all ten. Here the waiters are served
# round-robin by tenant (the model's owner; None is the operator's own models), first come,
# first served within a tenant: another tenant waits for at most one fill of each tenant
# queued ahead of it.


class FairTurns:
    """One holder at a time; waiters served round-robin by key (TURNS, above)."""

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


# ===============================================================================================
# THE FILL
# ===============================================================================================

class Settles(Protocol):
    def settle(self, key: str, everyone: bool) -> None: ...


class Room(Protocol):
    """What a fill uses of the wait for room (residency/flight.py's ``RoomQueue``, which
    imports this module): a publish waits there, and each fill's end wakes the waiters."""

    @property
    def freed(self) -> Settles: ...

    def notify(self) -> None: ...

    async def until_admitted(self, name: str, attempt: Callable[[], Awaitable[T]], wait_s: float, *,
                             key: str | None) -> T: ...


class Fill:
    def __init__(self, settings: DaemonConfig, core: CacheCore, registry: Registry, backends: dict[str, Backend],
                 room: Room, step_down: StepDowns, stats: Stats, shutting_down: Callable[[], bool]) -> None:
        self.settings = settings
        self.core = core
        self.registry = registry
        self.backends = backends
        self.room = room
        self.step_down = step_down
        self.stats = stats
        self.counters = stats.counters
        self._shutting_down = shutting_down
        # One fill at a time per device: on the H200 two 3 GiB loads from page cache run
        # together took 256 ms each, one after the other 109 + 104 ms (same for promotions:
        # 131 ms each vs 73 + 66); queued, the first is ready sooner and neither is later.
        # The turns go round-robin by the model's owner (``FairTurns``), so one tenant's queue of
        # big fills does not hold back another's.
        self._fill_turns: dict[str, FairTurns] = {}
        # The daemon's one log of what peers cause (peer_log.PeerEventLog): these loads' refusals
        # and failures (model_event), flight.py's and register's, and connections.py's.
        self.peer_log = PeerEventLog(log)

    def model_event(self, model: Model, level: int, event: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        """A line about ``model`` that anyone may cause again and again by asking for it
        (a load refused or failed, its files changed), rate-limited by whose model it is;
        True if it was written (peer_log.PeerEventLog has the rest counted and summed up).

        A tenant's model (registered or published by a uid that is not an administrator
        by uid; one by group only is taken for a tenant here, its lines still written):
        its quota, its files, its header, so its owner's doing and its owner's share of
        ``event``, and at most WARNING: nothing the operator must fix. A tenant that asked
        for 300 loads of a model over its quota wrote 300 ERROR lines.

        The operator's (configured, or an administrator's): a corrupt configured checkpoint
        or a model bigger than the budget is the daemon's own failure and stays at its
        level, under an event of its own per model and level: no tenant's flood of its own
        models' lines spends it, one broken model cannot hide another's first line, and
        routine INFO lines (a load that waits for room) cannot spend an ERROR's share.
        Still a share, not every line: any peer allowed to use such a model may ask for its
        load as often as it likes; what is left out is summed up at the highest level it
        had (peer_log.PeerEventLog)."""
        owner = model.owner
        if owner is None or model.origin == "config" or owner == 0 or owner in self.registry.access.admin_uids:
            name = model.config.name
            return self.peer_log.log(level, f"{event} ({logging.getLevelName(level)}, operator model {name})", name,
                                     msg, *args, **kwargs)
        return self.peer_log.log(min(level, logging.WARNING), event, owner, msg, *args, **kwargs)

    async def fill_new_arena(self, name: str, ckpt: Checkpoint, nbytes: int, wait_s: float, fill: FillStrategy,
                             verb: str, job: LoadJob | None = None, phases: dict[str, float] | None = None,
                             held: int | None = None) -> None:
        """Admit (evicting as planned), allocate, ``fill`` in a thread, seal, and make the
        model resident; on any failure free the arena and return the reservation, so the
        budget is exactly as before. Loads, promotions and publishes all come here.

        Every phase is timed and logged with the load: the fixed costs a small model pays
        (making room, allocating, sealing) are hidden in a big one's GB/s. A
        caller that passes ``phases`` (seconds by phase, e.g. the files' "open") finds
        them all there afterwards (a peer's fill rate is measured from them).

        ``nbytes`` is the arena's size; the load is admitted for that plus what the
        daemon holds for the checkpoint besides (``held``, by default its ``held_bytes``:
        Note [held bytes] in loader/checkpoint.py), so the device's budget and the owner's
        quota count both. A publish waits up to ``wait_s`` for room (RoomQueue); a load
        waits in SingleFlight.ensure_resident instead, with the others asking for it."""
        model = self.registry.models[name]
        backend = self.backends[self.core.entry(name).device]
        phases = {} if phases is None else phases  # the caller's dict, if given, holds every phase once done
        t0 = mark = time.monotonic()

        def phase(label: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[label] = phases.get(label, 0.0) + now - mark
            mark = now

        def check_wanted() -> None:
            if job is not None and job.abandoned.is_set():
                raise LoadFailed(f"load of {name!r} cancelled: no one waits for it", model=name, reason="cancelled")

        check_wanted()
        if held is None:
            held = (await asyncio.to_thread(collector_paused(lambda: ckpt.held_bytes)) if len(ckpt.tensors) > MANY_TENSORS
                    else ckpt.held_bytes)
        charged = nbytes + held

        async def admit() -> LoadPlan:
            return self.core.begin_load(name, charged)

        try:
            plan = await self.room.until_admitted(name, admit, wait_s, key=None)
        except WeightcacheError as exc:
            model.last_error = exc.to_wire()
            # NO_SPACE that detaches could cure is routine: callers wait and try again.
            level = logging.INFO if isinstance(exc, NoSpace) and exc.fits_ever else logging.ERROR
            self.model_event(model, level, "load refused", "load %s refused: %s", name, exc,
                             extra={"model": name, "code": exc.code, "owner": model.owner})
            raise
        # Admitted: the others waiting for room for it join this load now, as when every
        # waiter was woken, rather than at its end (their waited_s would count the load).
        self.room.freed.settle(name, everyone=True)
        phase("admit")
        arena: Arena | None = None
        demotions: list[asyncio.Task[None]] = []
        try:
            # The victims' demotions run while this arena fills: each victim chunk copied
            # out gives its bytes back to the device's room, which the new arena's chunks
            # take as it grows (backends/base.py, Room).
            # Evicted victims' chunks are freed in threads (StepDown.release). Where the
            # backend gates each new piece on the budget's room, the arena grows as they
            # come back, and the fill starts now: waiting for the whole free cost a 9.8 GB
            # load 4-10 ms on an H100 (docs/benchmarks.md, "The chunk loop through the
            # daemon"). Elsewhere they must be back before the allocation.
            demotions = self.step_down.start(plan.step_down,
                                             f"{self.settings.eviction_policy.upper()}, to make room for {name}")
            lazy = bool(plan.step_down.demote) or (backend.allocates_as_room_frees and bool(self.step_down.releasing))
            progress = self.stats.progress[name] = Progress(ckpt.data_bytes)
            if self.step_down.releasing and not lazy:
                await asyncio.wait(list(self.step_down.releasing))
                phase("wait for frees")
            many = len(ckpt.tensors) > MANY_TENSORS
            # A small fill takes no bandwidth worth queueing for: behind one tenant's 100k-tensor
            # fill (~1 s of per-tensor work) another's 4 KiB cold load waited for all of it.
            small = nbytes <= SMALL_FILL_BYTES and not many
            turns = self._fill_turns.setdefault(backend.device, FairTurns())
            async with contextlib.nullcontext() if small else turns.turn(model.owner):
                phase("queued")
                check_wanted()
                allocate = backend.allocate_as_room_frees if lazy else backend.allocate
                arena = await _to_thread_finished(allocate, nbytes, name, cleanup=self.step_down.release)
                phase("allocate")
                content = await _to_thread_finished(collector_paused(fill) if many else fill, ckpt, arena, progress)
                phase("fill")
                if content is not None:  # read from files: the fingerprint of the bytes just read
                    # A peer's model: nobody may pass it off as the operator's (tenant_fingerprint).
                    ckpt = dataclasses.replace(ckpt, fingerprint=content if model.owner is None
                                               else tenant_fingerprint(content, model.owner))
                if arena.room_wait_s:
                    # Part of "fill", not a phase of its own: while the fill waits for a
                    # victim's next chunk, the chunks it already has are still copying.
                    phases["room wait in fill"] = arena.room_wait_s
                check_wanted()
                await _to_thread_finished(backend.seal, arena)
                phase("seal")
            # Encoded once, spliced into every attach reply: a 600,000-row table encoded
            # per attach cost ~2 s of loop time each.
            encode = Checkpoint.encoded_tables
            tables = await asyncio.to_thread(collector_paused(encode) if len(ckpt.tensors) > MANY_TENSORS else encode, ckpt)
            phase("table")
        except BaseException as exc:
            await asyncio.gather(*(asyncio.shield(t) for t in demotions), return_exceptions=True)
            if arena is not None:
                self.step_down.release(arena)
            self.core.abort_load(name)
            err = exc if isinstance(exc, WeightcacheError) else LoadFailed(f"{name}: {type(exc).__name__}: {exc}", model=name)
            if job is not None and job.abandoned.is_set() and not self._shutting_down():
                self.counters["cancelled_loads"] += 1
                # a peer that asks for a load and hangs up, again and again: one line each before
                self.model_event(model, logging.INFO, "load cancelled",
                                 "load %s cancelled after %.2fs: no one waits for it; its reservation is returned",
                                 name, time.monotonic() - t0,
                                 extra={"model": name, "code": "LOAD_FAILED", "reason": "cancelled", "owner": model.owner,
                                        "seconds": round(time.monotonic() - t0, 6)})
                err = LoadFailed(f"load of {name!r} cancelled: no one waits for it", model=name, reason="cancelled")
            else:
                model.last_error = err.to_wire()
                self.counters["failed_loads"] += 1
                self.model_event(model, logging.ERROR, "load failed", "load %s failed: %s", name, err,
                                 extra={"model": name, "code": err.code, "owner": model.owner,
                                        "seconds": round(time.monotonic() - t0, 6)})
            self.room.notify()
            if err is exc or isinstance(exc, asyncio.CancelledError):
                raise
            raise err from exc
        finally:
            self.stats.progress.pop(name, None)
        source = job.source if job is not None else "publish"  # shown in ``models``; the metrics' label
        self.registry.filled(name, arena, ckpt, tables, held, source)
        model.check_failed = None
        if not self.core.finish_load(name).host_copy:  # a promotion's copy the core did not keep
            self.step_down.drop_host_copy(name)
        for x in self.core.siblings(name):
            if x.host_copy:
                # A name demoted before this second name of its files was registered: its
                # host copy would be a second version of the bytes this record now holds
                # (Note [one record per arena] in server/registry.py), and a shared arena keeps none.
                self.core.drop_host(x.name)
                self.step_down.start(StepDown(drop_host=(x.name,)), f"{self.core.entry(name).shown} holds the same files' arena now")
        if verb in ("loaded", "promoted"):  # what the cost-aware policy prices a return with
            # The fill's own time: waiting in the queue or for frees is not the model's cost.
            own = ("open", *OWN_PHASES)
            self.core.observe_load(name, "host" if plan.promote else "files", nbytes, sum(phases.get(k, 0.0) for k in own))
        self.counters["loads"] += 1  # from files or the host tier, as the core counts them per model
        if plan.promote:  # the host copy stays (Note [kept host copies] in cache/eviction.py)
            self.counters["promotions"] += 1
        dt = time.monotonic() - t0
        self.stats.filled_bytes[source] += ckpt.data_bytes
        self.stats.filled_seconds[source] = self.stats.filled_seconds.get(source, 0.0) + dt
        shown = self.core.entry(name).shown  # a publish's staging entry is renamed to the model
        # Only for entries still registered: removed models' rates go (the dict grew with every name).
        rates = self.stats.last_load_rate = {k: v for k, v in self.stats.last_load_rate.items() if k in self.registry.models}
        rates[shown] = ckpt.data_bytes / max(dt, 1e-9)
        wasted = job is not None and not job.waiters
        if wasted:
            self.counters["wasted_loads"] += 1
        log.info("%s %s: %d tensors, %d bytes in %.3fs (%.2f GB/s; %s)%s", verb, shown,
                 len(ckpt.tensors), ckpt.data_bytes, dt, ckpt.data_bytes / max(dt, 1e-9) / 1e9,
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()),
                 "; finished with no one waiting for it" if wasted else "",
                 extra={"model": shown, "bytes": ckpt.data_bytes, "seconds": round(dt, 6), "tensors": len(ckpt.tensors)})
