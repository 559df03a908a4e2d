"""Single flight: one load per entry, joined by every request that asks for it meanwhile,
and the choice of where its bytes come from (the host tier, a replica on another GPU, a
neighbour daemon's copy (``neighbours``, weightcache/peers/), the files). Loads are
tasks that belong to the daemon, not to the request that started them: a client that
disconnects mid-load does not cancel a load that others wait on.

Waiting for room (``RoomQueue``, ``SpaceFreed``): the one loop in which a load
(``SingleFlight.ensure_resident``) and a publish (``Fill.fill_new_arena`` with a wait)
retry an admission refused NO_SPACE, woken by detaches and frees in the order they first
waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from ...backends import Backend
from ...cache import CacheCore, State, StepDown
from ...config import DaemonConfig
from ...errors import LoadFailed, NoSpace, WeightcacheError
from ...loader import Checkpoint, OpenedSource, open_source
from ..registry import Model, Registry
from .fill import Fill, PeerCopy, Promote, ReadFiles
from .io import IoPool, parse_charged
from .job import LoadJob, ParsedFiles
from .pins import Pins
from .stats import Stats
from .stepdown import StepDowns

log = logging.getLogger("weightcache.daemon")

T = TypeVar("T")

# The connection id of the daemon's own leases (a peer copy's source): real connections count from 1.
INTERNAL_CONN = -1
# Parses kept by loads waiting for room (SingleFlight._may_keep_parse), at most, in all; a
# quarter of it per tenant. 256 MiB is ~7 parked 100k-tensor headers, or thousands of real
# ones (a 183-tensor checkpoint's parse holds ~60 KiB).
PARKED_PARSE_BYTES = 256 * 2**20
# An orphaned load (every waiter gone) further along than this finishes: throwing away
# more than half the work to save the rest is the worse bet if anyone asks again.
FINISH_ORPHAN_AFTER = 0.5


class NeighbourFills(Protocol):
    """Fills from a neighbour daemon's copy (weightcache/peers/), tried for a
    load that missed here before the files are read."""

    async def fill(self, job: LoadJob, model: Model, backend: Backend, ckpt: Checkpoint, opened: OpenedSource,
                   fill_new_arena: Callable[..., Awaitable[None]]) -> bool:
        """True once ``job.name`` is resident from a peer's bytes (checked against its
        fingerprint), filled through ``fill_new_arena``; False where no peer could, or
        the files are expected faster, and the files are read instead."""

    def observe_files(self, name: str, rate: float) -> None:
        """``name``, which ``fill`` chose for, was then loaded from its files at ``rate``
        bytes/s (what the choice compares a peer with)."""


class StoredModels(Protocol):
    """Published models kept on disk (server/store.py's PublishedStore): written at
    publish, read back for a load of one that is not resident, dropped at unregister."""

    def record_for(self, name: str) -> Any:
        """What ``read_back`` reads for the published model ``name``, or None if it is not stored."""

    async def read_back(self, job: LoadJob, record: Any) -> str:
        """Fill ``job``'s model from its stored copy, checked byte by byte; returns the source ("disk")."""

    async def keep(self, name: str) -> None:
        """Write the just published model ``name`` to disk."""

    async def forget(self, name: str, why: str) -> None:
        """``name`` was unregistered: its stored copy goes."""

    def status(self) -> dict[str, Any]:
        """The store's directory, budget, bytes used and models (the status op's ``published``)."""


# ===============================================================================================
# WAITING FOR ROOM: requests refused NO_SPACE wait here, woken in the order they first waited
# ===============================================================================================

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


# ===============================================================================================
# SINGLE FLIGHT: one load per entry, and where its bytes come from
# ===============================================================================================

class SingleFlight:
    def __init__(self, settings: DaemonConfig, core: CacheCore, registry: Registry, backends: dict[str, Backend],
                 io: IoPool, room: RoomQueue, step_down: StepDowns, fill: Fill, stats: Stats, pins: Pins,
                 shutting_down: Callable[[], bool]) -> None:
        self.settings = settings
        self.core = core
        self.registry = registry
        self.backends = backends
        self.io = io
        self.room = room
        self.step_down = step_down
        self.fill = fill
        self.stats = stats
        self.pins = pins
        self._shutting_down = shutting_down
        self.jobs: dict[str, LoadJob] = {}  # entry -> its load in flight
        # (target, source) GPUs whose peer copy failed: loads from the files there instead
        self.no_peer_copy: set[tuple[str, str]] = set()
        self.neighbours: NeighbourFills | None = None  # [peers]: a miss filled from another daemon (weightcache/peers/)
        self.store: StoredModels | None = None  # [published]: published models kept on disk (server/store.py)

    @property
    def tasks(self) -> list[asyncio.Task[str]]:
        """The loads in flight (shutdown waits for them)."""
        return [j.task for j in self.jobs.values() if j.task is not None]

    async def ensure_resident(self, name: str, wait_s: float, waits: list[float] | None = None,
                              gone: asyncio.Future[None] | None = None) -> str:
        """Return once ``name`` is resident: at once if it is, else by joining the one
        load in flight or starting it. Returns how: "resident" (it was, or it took a
        sibling's arena), "files", "host", "peer" or "disk" (where its load read the bytes; "disk":
        a published model's stored copy, server/store.py).

        A load refused NO_SPACE waits for room (RoomQueue.until_admitted) up to ``wait_s``
        and tries again, behind the older requests for the same model; each wait's
        seconds go in ``waits`` (the attach reply's ``waited_s``). So no request can make
        the others that join its load wait longer than they asked to. ``gone`` is done
        once the requester's connection closed: it then waits for room no more."""
        e = self.core.hold(name)  # nor expired by its keep_alive before the caller uses it
        try:
            return await self.room.until_admitted(name, functools.partial(self._resident_once, name), wait_s,
                                                  key=name, waits=waits, gone=gone)
        finally:
            self.core.release(e)

    async def _resident_once(self, name: str) -> str:
        e = self.core.entry(name)
        if e.state is State.RESIDENT:
            if self._current(name):
                self.core.touch(name)
                return "resident"
            await self._drop_stale(name)
        elif (sibling := self.core.resident_sibling(name)) is not None:
            # Another name of the same files holds them (Note [shared arenas]): take its
            # arena rather than a second copy, if its bytes are still the files'.
            if self._current(sibling):
                await self._join(name, sibling)
                return "resident"
            await self._drop_stale(sibling)
        elif (sibling := self._sibling_loading(name)) is not None:
            await self._wait_for(self.jobs[sibling])  # its arena will be ours too
            return await self._resident_once(name)
        job = self.jobs.get(name)
        if job is not None and job.abandoned.is_set():
            # Given up, and stopping at its next chunk: let it stop, then load afresh.
            with contextlib.suppress(Exception):
                await asyncio.shield(job.task)  # type: ignore[arg-type]
            if self.jobs.get(name) is job:
                # Its done callback (_load_done) has not run yet: awaiting a task that is
                # already done does not yield to the loop. Left here, the retry found the
                # same finished job again, forever (a RecursionError in the fuzz run).
                del self.jobs[name]
            return await self._resident_once(name)
        if job is None:
            job = self.jobs[name] = LoadJob(name)
            job.task = asyncio.ensure_future(self._load(job))
            job.task.add_done_callback(functools.partial(self._load_done, job))
        job.waiters += 1
        try:
            assert job.task is not None
            return await asyncio.shield(job.task)
        finally:
            job.waiters -= 1
            if not job.waiters and job.task is not None and not job.task.done():
                self._orphaned(job)

    def _sibling_loading(self, name: str) -> str | None:
        """Another name of the same files whose load is in flight. Told by its job, not by
        its state: an entry is LOADING only once admitted, after its files are opened and
        parsed, and a second load of the same files begun meanwhile was refused at its
        own admission (BAD_REQUEST "join it"). A finished job whose done callback has not
        run yet is not one: waiting on it does not yield, and the retry would find it again."""
        for x in self.core.siblings(name):
            job = self.jobs.get(x.name)
            if job is not None and job.task is not None and not job.task.done():
                return x.name
        return None

    def _current(self, name: str) -> bool:
        """Whether RESIDENT ``name``'s arena may be served: its files unchanged since it was
        loaded, or someone attached to the arena (under any of its names) holds the old
        bytes (they are served until nobody does, then reloaded)."""
        m = self.registry.models[name]
        attached = any(x.attach_count for x in (self.core.entry(name), *self.core.siblings(name))
                       if x.state is State.RESIDENT)
        return m.resident.checkpoint is not None and (attached or m.unchanged())

    async def _drop_stale(self, name: str) -> None:
        """The files changed since ``name`` was loaded and nobody holds the old bytes: drop
        them (under every name on the arena) so the new checkpoint is what gets served."""
        # A tenant may rewrite its own model's file between loads, again and again: its
        # share of the log (Fill.model_event); the operator's models keep a share each.
        self.fill.model_event(self.registry.models[name], logging.WARNING, "changed on disk",
                              "model %s changed on disk; reloading it", name, extra={"model": name})
        for x in [name, *(s.name for s in self.core.siblings(name) if s.state is State.RESIDENT)]:
            # a pin keeps a model, not stale bytes; and stale bytes do not go to the host tier
            await self.step_down.carry_out(self.core.evict(x, ignore_pin=True, demote=False), reason="changed on disk")

    async def _join(self, name: str, sibling: str) -> None:
        """``name`` becomes RESIDENT on ``sibling``'s arena: the same bytes, no load."""
        step = self.core.join(name)
        self.registry.joined(name)  # the arena's record is the sibling's (Note [one record per arena])
        log.info("%s shares the arena of %s (the same files): no second copy", name, sibling,
                 extra={"model": name, "bytes": self.core.entry(name).nbytes})
        if step.drop_host:
            await self.step_down.carry_out(step, reason=f"{name} shares the arena of {sibling}")

    async def _wait_for(self, job: LoadJob) -> None:
        """Wait for another name's load as one of its waiters (its outcome is seen by the retry)."""
        job.waiters += 1
        try:
            with contextlib.suppress(Exception):
                await asyncio.shield(job.task)  # type: ignore[arg-type]
        finally:
            job.waiters -= 1
            if not job.waiters and job.task is not None and not job.task.done():
                self._orphaned(job)

    def _orphaned(self, job: LoadJob) -> None:
        """Every request waiting on this load went away (their engines died or gave up):
        cancel it, or finish it if that is cheaper; the log says which."""
        progress = self.stats.progress.get(job.name)
        done = progress.done / max(progress.total, 1) if progress is not None else 0.0
        if job.source in ("host", "peer"):
            log.info("load %s: no one waits for it any more; finishing it (one copy from the %s)", job.name,
                     "host tier" if job.source == "host" else "other GPU")
        elif done >= FINISH_ORPHAN_AFTER:
            log.info("load %s: no one waits for it any more; finishing it (%.0f%% done)", job.name, 100 * done)
        else:
            log.info("load %s: no one waits for it any more; cancelling it (%.0f%% done)", job.name, 100 * done)
            job.abandoned.set()

    def _load_done(self, job: LoadJob, task: asyncio.Task[str]) -> None:
        # The load may outlive every request that waited on it; its error is already
        # logged and kept in last_error, so mark it retrieved here.
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        if not task.cancelled():
            task.exception()

    # -- where the bytes come from ----------------------------------------------------
    # Note [where the bytes come from]
    # -------------------------------
    # A load's sources, tried in ``SOURCES`` order: each row's method returns the source it
    # filled the arena from (``job.source``), or None where it has nothing to offer (no
    # host copy, no replica on another GPU, not a published model, no neighbour holding
    # the files' content), and the next row is asked. A row that fails either raises (the
    # host tier's copy, the published store: nothing else holds those bytes) or, where the
    # files still serve, says so and falls through (a replica on another GPU, a neighbour
    # daemon). The files' row always answers. The neighbour's row and the files' row read
    # the same parse (``_parsed_files``, once per load): a neighbour's copy is verified
    # against what the files hold, so the files are opened and parsed before it is asked.
    # The files a load opened are closed when it ends, unless a load refused for room
    # keeps them for its retry (``model.parked``).

    async def _load(self, job: LoadJob) -> str:
        """Where the bytes come from (``SOURCES``, Note [where the bytes come from]), then fill."""
        name = job.name
        model = self.registry.models[name]
        backend = self.backends[self.core.entry(name).device]
        if name in self.step_down.demotions:
            await asyncio.shield(self.step_down.demotions[name])  # its host copy is still being made
        try:
            for source in SOURCES:
                got = await source(self, job, model, backend)
                if got is not None:
                    return got
            raise AssertionError(f"no source answered for {name}")  # the files' row always does
        except NoSpace:
            if (files := job.files) is not None:
                if files.opened is not model.files:
                    model.parked = files.opened  # the caller waits for room, then retries with these same files
                if self._may_keep_parse(model, files.ckpt):
                    model.parked_parse = files.ckpt
                else:
                    self.step_down.trim_soon(len(files.ckpt.tensors))
            raise
        finally:
            if (files := job.files) is not None and files.opened is not model.files and files.opened is not model.parked:
                files.opened.close()

    async def _from_host(self, job: LoadJob, model: Model, backend: Backend) -> str | None:
        """A HOST model is promoted from its copy in the host tier (if it is current)."""
        name = job.name
        entry = self.core.entry(name)
        res = model.resident
        if entry.state is State.HOST and (res.host_copy_of(name) is None or not model.unchanged()):
            log.warning("host copy of %s is stale or missing; loading from disk", name)
            self.core.drop_host(name)
            await self.step_down.carry_out(StepDown(drop_host=(name,)), reason="stale")
        if entry.state is not State.HOST:
            return None
        host = res.host_copy_of(name)
        assert res.checkpoint is not None and host is not None
        job.source = "host"
        await self.fill.fill_new_arena(name, res.checkpoint, entry.nbytes - res.held, 0, Promote(backend, host),
                                       verb="promoted", job=job, held=res.held)  # the entry's size, as the core requires
        return job.source

    async def _from_peer_gpu(self, job: LoadJob, model: Model, backend: Backend) -> str | None:
        """A replica resident on another GPU is copied; a failed copy falls through to the files."""
        name = job.name
        if (peer := self._peer_source(name)) is None:
            return None
        job.source = "peer"
        try:
            await self._copy_from_peer(job, model, peer)
            return job.source
        except NoSpace:
            raise  # the caller waits for room and tries again
        except WeightcacheError as exc:
            if job.abandoned.is_set() or self._shutting_down():
                raise
            # The copy was rolled back (fill_new_arena); the files still serve. A pair
            # of GPUs whose copy failed once is not tried again (no_peer_copy).
            pair = (self.core.entry(name).device, self.core.entry(peer).device)
            self.no_peer_copy.add(pair)
            log.warning("copy of %s from %s to %s failed (%s); loading from the files, and no more peer copies "
                        "between these two GPUs", name, pair[1], pair[0], exc, extra={"model": name})
            job.source = "files"
            return None

    async def _from_store(self, job: LoadJob, model: Model, backend: Backend) -> str | None:
        """A published model has no files: read back from the published store, or refused."""
        if not model.published:
            return None
        name = job.name
        if self.store is not None and (stored := self.store.record_for(name)) is not None:
            job.source = "disk"
            return await self.store.read_back(job, stored)
        raise LoadFailed(f"model {name!r} was published by an engine and has since been evicted; publish it again",
                         model=name, reason="published model evicted")

    async def _from_neighbour(self, job: LoadJob, model: Model, backend: Backend) -> str | None:
        """A neighbour daemon holding the content the files hold (weightcache/peers/),
        verified against the files' pinned fingerprint; a failed fill falls through to the files."""
        if self.neighbours is None:
            return None
        files = await self._parsed_files(job, model)
        # A pinned fingerprint only for the files it was found to match (Note [pinned
        # fingerprints] in pins.py); a neighbour's fill is verified against them.
        if not self.pins.trusted(job.name, files.opened):
            return None
        if not await self.neighbours.fill(job, model, backend, files.ckpt, files.opened, self.fill.fill_new_arena):
            return None
        self.pins.verify_soon(job.name)
        return job.source

    async def _from_files(self, job: LoadJob, model: Model, backend: Backend) -> str:
        """The files, opened and parsed (or the peer's own fds), read into a new arena."""
        name = job.name
        files = await self._parsed_files(job, model)
        await self.fill.fill_new_arena(name, files.ckpt, backend.capacity(files.ckpt.arena_bytes), 0,
                                       ReadFiles(backend, self.settings, files.opened, label=name,
                                                 cancelled=lambda: self._shutting_down() or job.abandoned.is_set()),
                                       verb="loaded", job=job, phases={"open": files.opening_s})
        if (loaded := model.resident.checkpoint) is not None:
            self.pins.found(name, model, files.opened, loaded.fingerprint)
        if self.neighbours is not None and (rate := self.core.rates.last_rate(name, "files")) is not None:
            self.neighbours.observe_files(name, rate)  # the load's own rate (fill.py, observe_load)
        return job.source

    async def _parsed_files(self, job: LoadJob, model: Model) -> ParsedFiles:
        """The load's files, opened and parsed on first need (the parse kept by a load
        refused for room, if these are its files unchanged); a failure is the load's error,
        counted and logged."""
        if job.files is not None:
            return job.files
        name = job.name
        d = self.settings
        opened, model.parked = model.files or model.parked, None
        kept, model.parked_parse = model.parked_parse, None
        t_open = time.monotonic()
        try:
            if opened is None:  # the daemon opens the files itself: the operator's or an admin's paths
                opened = await self.io.run(open_source, model.path, roots=d.model_roots or None,
                                           follow_symlinks=d.follow_symlinks, cleanup=OpenedSource.close, tenant=model.owner)
            if kept is not None and kept.matches(opened):
                # Parsed when the load was first refused for room, from these same fds,
                # unchanged since (fstat): a wait for room costs one parse, not one per retry.
                ckpt = kept
                log.info("load %s: reusing the parse kept while it waited for room", name, extra={"model": name})
            else:
                # its fingerprint comes with the bytes, in the fill
                e = self.core.entry(name)
                ckpt = await parse_charged(self.io, self.core, opened, uid=model.owner, tenants=e.tenants, device=e.device,
                                           what=name)
        except Exception as exc:
            if opened is not None and opened is not model.files:
                opened.close()
            err = exc if isinstance(exc, WeightcacheError) else LoadFailed(f"{name}: {type(exc).__name__}: {exc}", model=name)
            model.last_error = err.to_wire()
            self.stats.counters["failed_loads"] += 1  # opening or parsing failed: a load that failed before it filled
            # Rate-limited by whose model it is (Fill.model_event): a tenant's unreadable
            # or rewritten file is its own doing, a configured one's stays an ERROR.
            self.fill.model_event(model, logging.ERROR, "load refused", "load %s refused: %s", name, err,
                                  extra={"model": name, "code": err.code, "owner": model.owner})
            raise err from None
        job.files = ParsedFiles(opened, ckpt, time.monotonic() - t_open)
        return job.files

    def _may_keep_parse(self, model: Model, ckpt: Checkpoint) -> bool:
        """Whether a load refused for room may keep its parse while it waits: within a fixed
        cache (PARKED_PARSE_BYTES in all, a quarter of it per owner), so waiting loads
        cannot make the daemon hold unbounded, uncounted memory. Past it the retry parses
        again, which a wait pays once per wake-up that fits (SpaceFreed)."""
        held = ckpt.held_bytes
        total = mine = 0
        for m in self.registry.models.values():
            if m.parked_parse is not None and m is not model:
                total += m.parked_parse.held_bytes
                if m.owner == model.owner:
                    mine += m.parked_parse.held_bytes
        return total + held <= PARKED_PARSE_BYTES and (model.owner is None or mine + held <= PARKED_PARSE_BYTES // 4)

    def _peer_source(self, name: str) -> str | None:
        """A replica of the same rank (device = "auto") RESIDENT on another GPU, with its
        files unchanged, that this device can copy from directly (backends' can_copy_from:
        peer access, NVLink or PCIe P2P); None: load from the host tier or the files."""
        m = self.registry.models[name]
        if m.slot is None:
            return None
        backend = self.backends[m.device]
        for dev, other in self.registry.replicas.get(m.slot, {}).items():
            if (other != name and self.core.entry(other).state is State.RESIDENT and self._current(other)
                    and (m.device, dev) not in self.no_peer_copy and backend.can_copy_from(self.backends[dev])):
                return other
        return None

    async def _copy_from_peer(self, job: LoadJob, model: Model, source: str) -> None:
        """Fill ``job``'s replica from the replica resident on another GPU (fills.PeerCopy).
        The source is held by a lease of the daemon's own while the copy runs (an
        attached model is never a victim); afterwards it is an ordinary resident model,
        kept or evicted by the budgets like any other."""
        src = self.registry.models[source]
        arena, ckpt = src.resident.arena, src.resident.checkpoint
        assert arena is not None and ckpt is not None
        lease = self.core.attach(source, INTERNAL_CONN)
        try:
            fill = PeerCopy(self.backends[model.device], self.backends[src.device], arena)
            await self.fill.fill_new_arena(job.name, ckpt, fill.backend.capacity(ckpt.arena_bytes), 0,
                                           fill, verb=f"copied from {src.device} (peer) to", job=job)
        finally:
            self.core.detach(lease.id, INTERNAL_CONN)
            self.room.notify()


# Note [where the bytes come from]: the rows in order; the files' row always answers.
SOURCES: tuple[Callable[[SingleFlight, LoadJob, Model, Backend], Awaitable[str | None]], ...] = (
    SingleFlight._from_host,
    SingleFlight._from_peer_gpu,
    SingleFlight._from_store,
    SingleFlight._from_neighbour,
    SingleFlight._from_files,
)
