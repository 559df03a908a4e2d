"""Carrying out the cache core's plans: loads, promotions, publishes' copies, evictions,
demotions, preloads and keep-alive.

The core decides (``begin_load`` returns the victims and the reservation); this room
does the I/O: frees and demotes the victims, allocates an arena, fills it with one of
the ``fills`` strategies in a thread, seals it, and reports ``finish_load`` or
``abort_load``. Loads are single-flight tasks that belong to the daemon, not to the
request that started them: a client that disconnects mid-load does not cancel a load
that others wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import itertools
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgpack

from ..backends import Arena, Backend
from ..cache import CacheCore, LoadPlan, State, StepDown
from ..config import DaemonConfig, ModelConfig
from ..errors import LoadFailed, NoSpace, WeightcacheError
from ..loader import Checkpoint, OpenedSource, Progress, open_source, parse_checkpoint
from ..loader.checkpoint import release_gradually
from ..loader.published import _gc_paused
from ..loader.sources import unindexed_note
from ..protocol.messages import tenant_fingerprint
from . import placing
from .fills import FillStrategy, PeerCopy, Promote, ReadFiles
from .registry import Model, Registry

log = logging.getLogger("weightcache.daemon")
T = TypeVar("T")


# Row 5 of issue 25: the GIL is the daemon's one CPU, shared by the event loop and every
# thread. One tenant's loads of 100k-tensor headers pushed another tenant's attach p99
# from ~6 to 332 ms (scripts/stress_abuse.py --only headerbomb): in a thread that parses
# such a header the cyclic collector ran 20 full collections per parse, each holding the
# GIL for up to 250 ms against the loop (the loop's sleep(1 ms) late by 253 ms; 22 ms
# with the collector paused), and msgpack packed the whole table in one C call (62-180
# ms). So the work a big checkpoint makes is done with the collector paused (nothing it
# builds forms a cycle), the table is packed in slices, and each tenant gets a bounded
# share of the io pool (TENANT_IO_SHARE).
TABLE_SLICE = 4096  # rows packed per C call: ~2 ms each, after which the loop may take the GIL
MANY_TENSORS = 4096  # checkpoints with more are filled with the collector paused, and queue for the device's fill
SMALL_FILL_BYTES = 64 * 2**20  # fills of at most this (and few tensors) do not wait for the device's fill lock


def encode_table(ckpt: Checkpoint) -> bytes:
    rows = ckpt.wire_tensors()
    if len(rows) <= TABLE_SLICE:
        return msgpack.packb(rows, use_bin_type=True)  # type: ignore[no-any-return]
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_array_header(len(rows))]  # the same bytes as packb(rows)
    for i in range(0, len(rows), TABLE_SLICE):
        parts.append(b"".join([packer.pack(r) for r in rows[i : i + TABLE_SLICE]]))
    release_gradually(rows)  # freed at once, 100k rows held the lock ~20 ms
    return b"".join(parts)


def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _libc_malloc_trim()


def collector_paused(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` run with the cyclic collector paused (counted across threads: loader/published.py)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        with _gc_paused():
            return fn(*args, **kwargs)

    return run


# Daemon-wide totals for ``status`` and the metrics (per-model ones live on the core's
# entries, and go when a model is unregistered).
COUNTERS = ("loads", "promotions", "evictions", "demotions", "kept_copy_demotions", "failed_demotions", "failed_loads",
            "wasted_loads", "cancelled_loads")
# The connection id of the daemon's own leases (a peer copy's source): real connections count from 1.
INTERNAL_CONN = -1
# Parses kept by loads waiting for room (Loads._may_keep_parse), at most, in all; a quarter
# of it per tenant. 256 MiB is ~7 parked 100k-tensor headers, or thousands of real ones
# (a 183-tensor checkpoint's parse holds ~60 KiB).
PARKED_PARSE_BYTES = 256 * 2**20
SWITCH_INTERVAL_S = 0.0005
# The most of the io pool's threads one tenant's calls hold at once (Loads.io): one of the
# default four. Beside two connections of one tenant loading 100k-tensor files, a share of
# half let both parse at once: the daemon's RSS peaked 317 MiB above its start, 175 MiB
# with a quarter, and another tenant's attach p50 went 4.2 -> 3.2 ms (stress_abuse.py
# --only headerbomb; p99 25-34 ms either way, within run-to-run noise).
TENANT_IO_SHARE = 0.25
# An orphaned load (every waiter gone) further along than this finishes: throwing away
# more than half the work to save the rest is the worse bet if anyone asks again.
FINISH_ORPHAN_AFTER = 0.5


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


@dataclass
class LoadJob:
    """One load in flight: the requests waiting on it, and whether it was given up."""

    name: str
    source: str = "files"  # where its bytes come from: "files", "host" (a promotion), "peer" (another GPU), "neighbour" (another daemon)
    waiters: int = 0
    # Set when every waiter went and the load was not worth finishing: the filling
    # threads check it between chunks, the load task between phases.
    abandoned: threading.Event = field(default_factory=threading.Event)
    task: asyncio.Task[str] | None = None


class NeighbourFills(Protocol):
    """Fills from a neighbour daemon's copy (weightcache/peers/, issue 27), tried for a
    load that missed here before the files are read."""

    async def fill(self, job: LoadJob, model: Model, backend: Backend, ckpt: Checkpoint, opened: OpenedSource,
                   fill_new_arena: Callable[..., Awaitable[None]]) -> bool:
        """True once ``job.name`` is resident from a peer's bytes (checked against its
        fingerprint), filled through ``fill_new_arena``; False where no peer could, and
        the files are read instead."""


class SpaceFreed:
    """Requests waiting for room, woken in the order they first waited: one that is
    refused again keeps its place instead of going to the back (asyncio.Condition would
    re-queue it behind later arrivals).

    Waiters for the same model (``key``) would all be refused or all admitted alike, so a
    notification wakes only the oldest of each key; the others follow when it gets its
    model or fails with an error of the model's own, and the next oldest when it is
    cancelled (``settle``). Every detach notifies: with all woken, 1,920 loads waiting for
    one model made a detach take 28-50 ms of the event loop on the CI VM, one refused
    retry each (scripts/waiter_herd.py)."""

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


class Loads:
    def __init__(self, settings: DaemonConfig, core: CacheCore, registry: Registry, backends: dict[str, Backend],
                 shutting_down: Callable[[], bool]) -> None:
        self.settings = settings
        self.core = core
        self.registry = registry
        self.backends = backends
        self._shutting_down = shutting_down
        self.jobs: dict[str, LoadJob] = {}  # entry -> its load in flight
        self.demotions: dict[str, asyncio.Task[None]] = {}  # entry -> its host copy in flight
        self.progress: dict[str, Progress] = {}
        self.last_load_rate: dict[str, float] = {}  # bytes/s of each model's last load (metrics)
        # Preloads decide readiness (the health op): pending until every rank is resident,
        # failed with the error until a later preload of that model succeeds.
        self.preloads_pending: set[str] = set()
        self.preloads_failed: dict[str, str] = {}
        self.space_freed = SpaceFreed()
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.background: set[asyncio.Task[Any]] = set()
        self._releasing: set[asyncio.Task[Any]] = set()  # arenas being freed in threads
        # One fill at a time per device: on the H200 two 3 GiB loads from page cache run
        # together took 256 ms each, one after the other 109 + 104 ms (same for promotions:
        # 131 ms each vs 73 + 66); queued, the first is ready sooner and neither is later.
        self._fill_locks: dict[str, asyncio.Lock] = {}
        self.neighbours: NeighbourFills | None = None  # [peers]: a miss filled from another daemon (weightcache/peers/)
        # Bytes and seconds of the fills that made models resident, by where the bytes came from (metrics).
        self.filled_bytes: Counter[str] = Counter()
        self.filled_seconds: dict[str, float] = {}
        # (target, source) GPUs whose peer copy failed: loads from the files there instead
        self.no_peer_copy: set[tuple[str, str]] = set()
        # Opening and parsing what peers name or send: bounded, and apart from the loads.
        self.io_pool = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="wc-io")
        self._io_shares: dict[int, list[Any]] = {}  # tenant uid -> [its semaphore, calls holding or waiting for it]
        self._trim_at = 0.0  # when memory was last given back to the kernel (trim_soon)
        # The GIL is handed to a waiting thread after this long (CPython's default: 5 ms).
        # The event loop waits that long for it at each wake-up while a thread runs Python
        # (a parse, a fill of many tensors): another tenant's attach, several wake-ups,
        # had p99 161 ms beside 100k-tensor loads; 56 ms at 0.5 ms (stress_abuse.py --only
        # headerbomb, 2-core VM). Process-wide, set once here where the threads are made.
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # -- making models resident -----------------------------------------------------
    @property
    def tasks(self) -> list[asyncio.Task[str]]:
        """The loads in flight (shutdown waits for them)."""
        return [j.task for j in self.jobs.values() if j.task is not None]

    async def ensure_resident(self, name: str, wait_s: float, waits: list[float] | None = None,
                              gone: asyncio.Future[None] | None = None) -> str:
        """Return once ``name`` is resident: at once if it is, else by joining the one
        load in flight or starting it. Returns where the bytes came from: "resident"
        (already there), "host" (promoted from the host tier) or "files".

        A load never waits for room itself: it fails NO_SPACE at once, and each caller
        waits up to its own ``wait_s`` for detaches, then tries again; callers waiting
        for room are woken oldest first. So no request can make the others that join its
        load wait longer than they asked to. Each wait's seconds go in ``waits`` (the
        attach reply's ``waited_s``).

        ``gone`` is done once the requester's connection closed: a load it started or
        joined still finishes, but it waits for room no more (a peer could otherwise
        leave requests waiting up to request_timeout_s, without end, each woken to try
        again by every detach)."""
        deadline = time.monotonic() + wait_s
        ticket: int | None = None
        try:
            while True:
                generation = self.space_freed.generation
                try:
                    source = await self._resident_once(name)
                except NoSpace as exc:
                    left = deadline - time.monotonic()
                    if left <= 0 or not exc.fits_ever or (gone is not None and gone.done()):
                        raise
                    if self.space_freed.generation != generation:
                        continue  # room was freed while the refusal travelled back: try again now
                    if ticket is None:
                        ticket = self.space_freed.ticket()  # kept across retries: our place in line
                    waited_from = time.monotonic()
                    needed = exc.details.get("needed")
                    fits = None if not isinstance(needed, int) else functools.partial(self.core.could_admit, name, needed)
                    await self.space_freed.wait(ticket, left, gone, key=name, fits=fits)
                    if waits is not None:
                        waits.append(time.monotonic() - waited_from)
                else:
                    self.space_freed.settle(name, everyone=True)  # the others waiting for it join now
                    return source
        except NoSpace:
            raise  # the others waiting for this model would be refused too: they sleep on
        except Exception:
            # The model's own error (its files no longer parse, the io timeout, removed):
            # all of them try now and join one load, as when every waiter was woken. The
            # next oldest alone made each waiter run its own failed load in turn.
            self.space_freed.settle(name, everyone=True)
            raise
        except BaseException:
            self.space_freed.settle(name, everyone=False)  # cancelled: the next one tries in its place
            raise

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
        return m.checkpoint is not None and (attached or m.unchanged())

    async def _drop_stale(self, name: str) -> None:
        """The files changed since ``name`` was loaded and nobody holds the old bytes: drop
        them (under every name on the arena) so the new checkpoint is what gets served."""
        log.warning("model %s changed on disk; reloading it", name, extra={"model": name})
        for x in [name, *(s.name for s in self.core.siblings(name) if s.state is State.RESIDENT)]:
            # a pin keeps a model, not stale bytes; and stale bytes do not go to the host tier
            await self.carry_out(self.core.evict(x, ignore_pin=True, demote=False), reason="changed on disk")

    async def _join(self, name: str, sibling: str) -> None:
        """``name`` becomes RESIDENT on ``sibling``'s arena: the same bytes, no load."""
        step = self.core.join(name)
        m, s = self.registry.models[name], self.registry.models[sibling]
        m.arena, m.checkpoint, m.table, m.last_error = s.arena, s.checkpoint, s.table, None
        m.held, m.seen, m.source = s.held, s.seen, s.source
        log.info("%s shares the arena of %s (the same files): no second copy", name, sibling,
                 extra={"model": name, "bytes": self.core.entry(name).nbytes})
        if step.drop_host:
            await self.carry_out(step, reason=f"{name} shares the arena of {sibling}")

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
        progress = self.progress.get(job.name)
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

    async def _load(self, job: LoadJob) -> str:
        """Decide where the bytes come from (the host tier, the files), then fill."""
        name = job.name
        model = self.registry.models[name]
        entry = self.core.entry(name)
        backend = self.backends[entry.device]
        if name in self.demotions:
            await asyncio.shield(self.demotions[name])  # its host copy is still being made
        if entry.state is State.HOST and (model.host is None or not model.unchanged()):
            log.warning("host copy of %s is stale or missing; loading from disk", name)
            self.core.drop_host(name)
            await self.carry_out(StepDown(drop_host=(name,)), reason="stale")
        if entry.state is State.HOST:
            assert model.checkpoint is not None and model.host is not None
            job.source = "host"
            await self.fill_new_arena(name, model.checkpoint, entry.nbytes - model.held, 0, Promote(backend, model.host),
                                      verb="promoted", job=job, held=model.held)  # the entry's size, as the core requires
            return job.source
        if (peer := self._peer_source(name)) is not None:
            job.source = "peer"
            try:
                await self._copy_from_peer(job, peer)
                return job.source
            except NoSpace:
                raise  # the caller waits for room and tries again
            except WeightcacheError as exc:
                if job.abandoned.is_set() or self._shutting_down():
                    raise
                # The copy was rolled back (fill_new_arena); the files still serve. A pair
                # of GPUs whose copy failed once is not tried again (no_peer_copy).
                pair = (entry.device, self.core.entry(peer).device)
                self.no_peer_copy.add(pair)
                log.warning("copy of %s from %s to %s failed (%s); loading from the files, and no more peer copies "
                            "between these two GPUs", name, pair[1], pair[0], exc, extra={"model": name})
                job.source = "files"
        if model.published:
            raise LoadFailed(f"model {name!r} was published by an engine and has since been evicted; publish it again",
                             model=name, reason="published model evicted")
        d = self.settings
        opened, model.parked = model.files or model.parked, None
        kept, model.parked_parse = model.parked_parse, None
        t_open = time.monotonic()
        try:
            if opened is None:  # the daemon opens the files itself: the operator's or an admin's paths
                opened = await self.io(open_source, model.path, roots=d.model_roots or None,
                                       follow_symlinks=d.follow_symlinks, cleanup=OpenedSource.close, tenant=model.owner)
            if kept is not None and kept.matches(opened):
                # Parsed when the load was first refused for room, from these same fds,
                # unchanged since (fstat): a wait for room costs one parse, not one per retry.
                ckpt = kept
                log.info("load %s: reusing the parse kept while it waited for room", name, extra={"model": name})
            else:
                # its fingerprint comes with the bytes, in the fill
                ckpt = await self.io(collector_paused(parse_checkpoint), opened, tenant=model.owner)
        except Exception as exc:
            if opened is not None and opened is not model.files:
                opened.close()
            err = exc if isinstance(exc, WeightcacheError) else LoadFailed(f"{name}: {type(exc).__name__}: {exc}", model=name)
            model.last_error = err.to_wire()
            self.counters["failed_loads"] += 1  # opening or parsing failed: a load that failed before it filled
            log.error("load %s refused: %s", name, err, extra={"model": name, "code": err.code})
            raise err from None
        opening = time.monotonic() - t_open
        try:
            if self.neighbours is not None and await self.neighbours.fill(job, model, backend, ckpt, opened, self.fill_new_arena):
                return job.source
            await self.fill_new_arena(name, ckpt, backend.capacity(ckpt.arena_bytes), 0,
                                      ReadFiles(backend, d, opened, label=name,
                                                cancelled=lambda: self._shutting_down() or job.abandoned.is_set()),
                                      verb="loaded", job=job, phases={"open": opening})
            return job.source
        except NoSpace:
            if opened is not model.files:
                model.parked = opened  # the caller waits for room, then retries with these same files
            if self._may_keep_parse(model, ckpt):
                model.parked_parse = ckpt
            else:
                self.trim_soon(len(ckpt.tensors))
            raise
        finally:
            if opened is not model.files and opened is not model.parked:
                opened.close()

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

    async def check_files(self, mc: ModelConfig, sources: list[OpenedSource] | None = None,
                          tenant: int | None = None) -> WeightcacheError | None:
        """Why ``mc``'s checkpoints cannot be loaded, as a load would say it (the files
        opened as a load opens them, or a peer's own ``sources``, and every header parsed,
        in the io pool), or None when they can. One check for every way a model arrives:
        the config at start and reload, and ``register`` (issue 24: a pickle registered
        fine and failed only at its load)."""
        d = self.settings
        for i, (path, _device) in enumerate(mc.parts):
            opened = None
            try:
                # As a load parses (its tenant's share of the io pool, the collector paused).
                if sources is not None:
                    await self.io(collector_paused(parse_checkpoint), sources[i], tenant=tenant)
                else:
                    opened = await self.io(open_source, path, roots=d.model_roots or None,
                                           follow_symlinks=d.follow_symlinks, cleanup=OpenedSource.close, tenant=tenant)
                    await self.io(collector_paused(parse_checkpoint), opened, tenant=tenant)
                    note = await self.io(unindexed_note, path)
                    if note is not None:  # merged as it always was, but not silently
                        log.warning("model %s: %s", mc.name, note, extra={"model": mc.name})
            except WeightcacheError as exc:
                return exc
            except Exception as exc:  # an OSError and the like: the reason, not a traceback
                return LoadFailed(f"{type(exc).__name__}: {exc}", model=mc.name)
            finally:
                if opened is not None:
                    opened.close()
        return None

    async def learn_sizes(self, name: str) -> None:
        """Before an auto model is first placed: how big each rank is, from its files'
        sizes (in the io pool), so that placement can tell which devices have room for it
        (server/placing.py). Known sizes (an earlier load's arena, an earlier hint) are kept."""
        for slot in self.registry.slots.get(name, ()):
            replicas = self.registry.replicas.get(slot)
            if not replicas or slot in self.registry.size_hint:
                continue
            if any(self.core.entry(e).nbytes for e in replicas.values()):
                continue
            m = self.registry.models[next(iter(replicas.values()))]
            fds = [f.fd for f in m.files.files] if m.files is not None else None
            try:
                self.registry.size_hint[slot] = await self.io(placing.checkpoint_bytes, m.path, fds)
            except LoadFailed:  # the io pool's timeout: placed as of unknown size
                self.registry.size_hint[slot] = 0

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

    async def _copy_from_peer(self, job: LoadJob, source: str) -> None:
        """Fill ``job``'s replica from the replica resident on another GPU (fills.PeerCopy).
        The source is held by a lease of the daemon's own while the copy runs (an
        attached model is never a victim); afterwards it is an ordinary resident model,
        kept or evicted by the budgets like any other."""
        src = self.registry.models[source]
        assert src.arena is not None and src.checkpoint is not None
        lease = self.core.attach(source, INTERNAL_CONN)
        try:
            fill = PeerCopy(self.backends[self.registry.models[job.name].device], self.backends[src.device], src.arena)
            await self.fill_new_arena(job.name, src.checkpoint, fill.backend.capacity(src.checkpoint.arena_bytes), 0, fill,
                                      verb=f"copied from {src.device} (peer) to", job=job)
        finally:
            self.core.detach(lease.id, INTERNAL_CONN)
            await self.notify_space()

    async def io(self, fn: Callable[..., T], *args: Any, cleanup: Callable[[T], object] | None = None,
                 tenant: int | None = None, **kwargs: Any) -> T:
        """Run ``fn`` in the bounded io pool, for at most io_timeout_s: opening and parsing
        what a peer names or sends. A call that overruns is abandoned (a thread cannot be
        killed); ``cleanup`` then releases what it returns when it finally does.

        ``tenant``: the uid the work is for (a peer's model or publish; None for the
        operator's): at most TENANT_IO_SHARE of the pool's threads work for one tenant at
        once, the rest of its calls wait their turn here (not counted in io_timeout_s), so
        another tenant's cold load never queues behind one tenant's parses."""
        if tenant is None:
            return await self._io(fn, args, kwargs, cleanup)
        share = self._io_shares.get(tenant)
        if share is None:
            share = self._io_shares[tenant] = [asyncio.Semaphore(max(1, int(self.settings.io_threads * TENANT_IO_SHARE))), 0]
        share[1] += 1
        try:
            async with share[0]:
                return await self._io(fn, args, kwargs, cleanup)
        finally:
            share[1] -= 1
            if not share[1]:
                del self._io_shares[tenant]

    async def _io(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
                  cleanup: Callable[[T], object] | None) -> T:
        fut = asyncio.get_running_loop().run_in_executor(self.io_pool, functools.partial(fn, *args, **kwargs))
        timeout = self.settings.io_timeout_s

        def abandoned(f: asyncio.Future[T]) -> None:
            # Nobody awaits it any more: retrieve its error (else asyncio logs "never
            # retrieved"), and release what it opened.
            if f.cancelled() or f.exception() is not None:
                return
            if cleanup is not None:
                cleanup(f.result())

        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.CancelledError:
            fut.add_done_callback(abandoned)  # the caller went (shutdown, a cancelled check)
            raise
        except TimeoutError:
            fut.add_done_callback(abandoned)
            log.error("%s did not finish within io_timeout_s=%gs; abandoned", getattr(fn, "__name__", fn), timeout)
            raise LoadFailed(f"opening or parsing did not finish within {timeout:g}s (io_timeout_s)",
                             reason="io timeout") from None

    async def fill_new_arena(self, name: str, ckpt: Checkpoint, nbytes: int, wait_s: float, fill: FillStrategy,
                             verb: str, job: LoadJob | None = None, phases: dict[str, float] | None = None,
                             held: int | None = None) -> None:
        """Admit (evicting as planned), allocate, ``fill`` in a thread, seal, and make the
        model resident; on any failure free the arena and return the reservation, so the
        budget is exactly as before. Loads, promotions and publishes all come here.

        Every phase is timed and logged with the load: the fixed costs a small model pays
        (making room, allocating, sealing) are hidden in a big one's GB/s (issue 12).

        ``nbytes`` is the arena's size; the load is admitted for that plus what the
        daemon holds for the checkpoint besides (``held``, by default its ``held_bytes``:
        Note [held bytes] in loader/checkpoint.py), so the device's budget and the owner's
        quota count both."""
        model = self.registry.models[name]
        backend = self.backends[self.core.entry(name).device]
        phases = dict(phases or {})
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
        try:
            plan = await self._admit(name, nbytes + held, wait_s)
        except WeightcacheError as exc:
            model.last_error = exc.to_wire()
            # NO_SPACE that detaches could cure is routine: callers wait and try again.
            level = logging.INFO if isinstance(exc, NoSpace) and exc.fits_ever else logging.ERROR
            log.log(level, "load %s refused: %s", name, exc, extra={"model": name, "code": exc.code})
            raise
        # Admitted: the others waiting for room for it join this load now, as when every
        # waiter was woken, rather than at its end (their waited_s would count the load).
        self.space_freed.settle(name, everyone=True)
        phase("admit")
        arena: Arena | None = None
        demotions: list[asyncio.Task[None]] = []
        try:
            # The victims' demotions run while this arena fills: each victim chunk copied
            # out gives its bytes back to the device's room, which the new arena's chunks
            # take as it grows (backends/base.py, Room).
            lazy = bool(plan.step_down.demote)
            demotions = self.start_step_down(plan.step_down, f"{self.settings.eviction_policy.upper()}, to make room for {name}")
            progress = self.progress[name] = Progress(ckpt.data_bytes)
            if self._releasing:
                # Evicted victims' memory must be back before the allocation checks the device's free memory.
                await asyncio.wait(list(self._releasing))
                phase("wait for frees")
            many = len(ckpt.tensors) > MANY_TENSORS
            # A small fill takes no bandwidth worth queueing for: behind one tenant's 100k-tensor
            # fill (~1 s of per-tensor work) another's 4 KiB cold load waited for all of it.
            small = nbytes <= SMALL_FILL_BYTES and not many
            async with contextlib.nullcontext() if small else self._fill_locks.setdefault(backend.device, asyncio.Lock()):
                phase("queued")
                check_wanted()
                allocate = backend.allocate_as_room_frees if lazy else backend.allocate
                arena = await _to_thread_finished(allocate, nbytes, name, cleanup=self.release)
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
            table = await asyncio.to_thread(collector_paused(encode_table) if len(ckpt.tensors) > MANY_TENSORS else encode_table, ckpt)
            phase("table")
        except BaseException as exc:
            await asyncio.gather(*(asyncio.shield(t) for t in demotions), return_exceptions=True)
            if arena is not None:
                self.release(arena)
            self.core.abort_load(name)
            err = exc if isinstance(exc, WeightcacheError) else LoadFailed(f"{name}: {type(exc).__name__}: {exc}", model=name)
            if job is not None and job.abandoned.is_set() and not self._shutting_down():
                self.counters["cancelled_loads"] += 1
                log.info("load %s cancelled after %.2fs: no one waits for it; its reservation is returned",
                         name, time.monotonic() - t0,
                         extra={"model": name, "code": "LOAD_FAILED", "reason": "cancelled", "seconds": round(time.monotonic() - t0, 6)})
                err = LoadFailed(f"load of {name!r} cancelled: no one waits for it", model=name, reason="cancelled")
            else:
                model.last_error = err.to_wire()
                self.counters["failed_loads"] += 1
                log.error("load %s failed: %s", name, err,
                          extra={"model": name, "code": err.code, "seconds": round(time.monotonic() - t0, 6)})
            await self.notify_space()
            if err is exc or isinstance(exc, asyncio.CancelledError):
                raise
            raise err from exc
        finally:
            self.progress.pop(name, None)
        model.arena, model.checkpoint, model.table, model.last_error = arena, ckpt, table, None
        model.held, model.seen = held, (ckpt.fingerprint, len(ckpt.tensors))
        model.check_failed = None
        if not self.core.finish_load(name).host_copy:  # a promotion's copy the core did not keep
            self.drop_host_copy(model)
        if verb in ("loaded", "promoted"):  # what the cost-aware policy prices a return with
            # The fill's own time: waiting in the queue or for frees is not the model's cost.
            own = ("open", "allocate", "fill", "seal", "table")
            self.core.observe_load(name, "host" if plan.promote else "files", nbytes, sum(phases.get(k, 0.0) for k in own))
        self.counters["loads"] += 1  # from files or the host tier, as the core counts them per model
        if plan.promote:  # the host copy stays (Note [kept host copies] in cache/core.py)
            self.counters["promotions"] += 1
        dt = time.monotonic() - t0
        model.source = job.source if job is not None else "publish"
        self.filled_bytes[model.source] += ckpt.data_bytes
        self.filled_seconds[model.source] = self.filled_seconds.get(model.source, 0.0) + dt
        # Keyed by the entry a publish ends as (its staging entry is renamed), and only for
        # entries still registered: removed models' rates go (the dict grew with every name).
        self.last_load_rate = {k: v for k, v in self.last_load_rate.items() if k in self.registry.models}
        self.last_load_rate[name.partition("#")[0]] = ckpt.data_bytes / max(dt, 1e-9)
        wasted = job is not None and not job.waiters
        if wasted:
            self.counters["wasted_loads"] += 1
        log.info("%s %s: %d tensors, %d bytes in %.3fs (%.2f GB/s; %s)%s", verb, name.partition("#")[0],  # staged publish
                 len(ckpt.tensors), ckpt.data_bytes, dt, ckpt.data_bytes / max(dt, 1e-9) / 1e9,
                 ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()),
                 "; finished with no one waiting for it" if wasted else "",
                 extra={"model": name.partition("#")[0], "bytes": ckpt.data_bytes, "seconds": round(dt, 6),
                        "tensors": len(ckpt.tensors)})

    async def _admit(self, name: str, nbytes: int, wait_s: float) -> LoadPlan:
        """Reserve room, evicting LRU models; on NO_SPACE wait up to ``wait_s`` for
        detaches if waiting could ever help."""
        deadline = time.monotonic() + wait_s
        ticket: int | None = None
        while True:
            try:
                return self.core.begin_load(name, nbytes)
            except NoSpace as exc:
                left = deadline - time.monotonic()
                if left <= 0 or not exc.fits_ever:
                    raise
                if ticket is None:
                    ticket = self.space_freed.ticket()
                await self.space_freed.wait(ticket, left, fits=functools.partial(self.core.could_admit, name, nbytes))

    # -- preloads and keep-alive ----------------------------------------------------
    def start_preload(self, name: str, gates: bool = True) -> None:
        """Load ``name`` in the background. Only the operator's and the admins' preloads
        decide readiness (``gates``): a tenant's broken one must not take the node out of service."""
        if gates:
            self.preloads_pending.add(name)  # before the task runs: a health request may come first
        self.spawn(self._preload(name, gates))

    async def _preload(self, name: str, gates: bool) -> None:
        try:
            try:
                await self.learn_sizes(name)
                # An auto model's ranks where placement puts them, not on every candidate device.
                placed = (placing.entries_for(self.core, self.registry, self.backends, name, None, None)
                          if name in self.registry.groups else [])
            except WeightcacheError as exc:
                log.error("preload of %s failed: %s", name, exc, extra={"model": name, "code": exc.code})
                if gates:
                    self.preloads_failed[name] = str(exc)
                return
            for entry in placed:
                try:
                    await self.ensure_resident(entry, self.settings.no_space_wait_s)
                except Exception as exc:  # any failure, not only ours: readiness must not lie
                    log.error("preload of %s failed: %s", entry, exc, extra={"model": entry, "code": getattr(exc, "code", "INTERNAL")})
                    if gates:
                        self.preloads_failed[name] = str(exc) if entry == name else f"{entry}: {exc}"
                    return
            self.preloads_failed.pop(name, None)
        finally:
            self.preloads_pending.discard(name)

    def forget_preload(self, name: str) -> None:
        self.preloads_pending.discard(name)
        self.preloads_failed.pop(name, None)

    async def keep_alive_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for name in self.core.expired():
                # An eviction may wait for its demotion (a GPU model's copy to the host
                # tier): a model listed may have been attached, used, or removed since,
                # and evicting it then raised, ending this loop for good.
                if not self.core.is_expired(name):
                    continue
                await self.carry_out(self.core.evict(name), reason="keep_alive expired")
                await self.notify_space()

    # -- freeing --------------------------------------------------------------------
    async def carry_out(self, step: StepDown, reason: str) -> None:
        """Do what the core decided and wait for the demotions to finish."""
        await asyncio.gather(*self.start_step_down(step, reason))

    def start_step_down(self, step: StepDown, reason: str) -> list[asyncio.Task[None]]:
        """Drop host copies, free the evicted arenas and those whose host copy was kept,
        and start the demotions (a device-to-host copy each, chunk by chunk; a chunk is
        freed once its bytes are safe, and given back to the device's room). Returns the
        demotions' tasks. A demotion that fails becomes an eviction."""
        for name in step.drop_host:
            log.info("dropped host copy of %s: %s", name, reason, extra={"model": name, "reason": reason})
            self.drop_host_copy(self.registry.models[name])
        self.counters["evictions"] += len(step.leaving)
        for name in step.evict:
            self._free_arena(name, reason)
        for name in step.release:  # no copy to make: counted as the demotion it is
            self.counters["demotions"] += 1
            self.counters["kept_copy_demotions"] += 1
            self._free_arena(name, reason, kept_host_copy=True)
        tasks = []
        for name in step.demote:
            task = self.demotions[name] = self.spawn(self._demote(name, reason))
            task.add_done_callback(functools.partial(self._demotion_done, name))
            tasks.append(task)
        return tasks

    def _demotion_done(self, name: str, task: asyncio.Task[None]) -> None:
        if self.demotions.get(name) is task:
            del self.demotions[name]

    async def _demote(self, name: str, reason: str) -> None:
        model = self.registry.models[name]
        arena, model.arena = model.arena, None
        assert arena is not None
        backend = self.backends[arena.device]
        t = time.monotonic()
        try:
            # The backend frees the arena as it copies, whether the copy succeeds or not.
            copy = await asyncio.to_thread(backend.demote, arena)
            entry = self.core.entries.get(name)
            if entry is None or not entry.host_copy or self.registry.models.get(name) is not model:
                # The core dropped this host copy (to make room for another) or the model
                # went while the copy was made: kept, its pool bytes would leak, and the
                # next demotion, counting them free, would not find them.
                backend.free_host(copy)
                log.info("demoted %s, but its host copy was dropped meanwhile; freed it", name, extra={"model": name})
                return
            model.host = copy
        except Exception as exc:
            log.error("demoting %s to the host tier failed (%s); evicting it instead", name, exc,
                      extra={"model": name, "reason": str(exc)})
            self.core.demotion_failed(name)
            model.drop_parsed()  # evicted after all: no promotion needs them
            self.counters["failed_demotions"] += 1
        else:
            self.counters["demotions"] += 1
            dt = time.monotonic() - t
            log.info("demoted %s to the host tier (%d bytes, %.1f GB/s): %s", name, arena.nbytes,
                     arena.nbytes / max(dt, 1e-9) / 1e9, reason,
                     extra={"model": name, "bytes": arena.nbytes, "seconds": round(dt, 6), "reason": reason})

    def forget(self, models: list[Model]) -> None:
        """Free what unregistered entries held: arenas (a shared one once its last name
        goes), host copies, a peer's files."""
        for model in models:
            self.trim_soon(max(len(c.tensors) for c in (model.checkpoint, model.parked_parse) if c is not None)
                           if model.checkpoint is not None or model.parked_parse is not None else 0)
            arena, model.arena = model.arena, None
            if arena is not None and not self._in_use(arena):
                self.release(arena)
            self.drop_host_copy(model)
            model.parked_parse = None
            for files in (model.files, model.parked):
                if files is not None:
                    files.close()

    def trim_soon(self, ntensors: int) -> None:
        """After a checkpoint of many tensors was freed (its parse, its table): give the
        heap's free pages back to the kernel (glibc's malloc_trim, in a thread, at most once
        a second). Without it the daemon's RSS stayed ~230 MiB above its start after 100k-
        tensor loads had all gone: glibc keeps freed memory for reuse."""
        now = time.monotonic()
        if ntensors <= MANY_TENSORS or now - self._trim_at < 1.0 or _malloc_trim is None:
            return
        self._trim_at = now
        self.spawn(asyncio.to_thread(_malloc_trim, 0))

    def drop_host_copy(self, model: Model) -> None:
        # At once, on the loop: the core counts the bytes free as soon as it decides, and a
        # demotion right after must find them in the pool (freed in a thread, they were
        # not yet: 71 demotions failed in a 45 s H200 workload). It is list bookkeeping.
        if model.host is not None:
            host, model.host = model.host, None
            self.backends[model.device].free_host(host)

    def _free_arena(self, name: str, reason: str, kept_host_copy: bool = False) -> None:
        model = self.registry.models[name]
        arena, model.arena = model.arena, None
        if not kept_host_copy:
            self.trim_soon(len(model.checkpoint.tensors) if model.checkpoint is not None else 0)
            model.drop_parsed()  # its tensors and table go with the arena (Note [held bytes])
        if arena is None:
            return
        if self._in_use(arena):  # another name on the same arena (Note [shared arenas]) keeps it
            log.info("evicted %s: %s; its arena stays, shared with %s", name, reason,
                     ", ".join(x.name for x in self.core.siblings(name) if x.state is State.RESIDENT),
                     extra={"model": name, "reason": reason})
            return
        if kept_host_copy:
            log.info("demoted %s to the host tier (%d bytes, its host copy kept since its promotion: no copy): %s",
                     name, arena.nbytes, reason, extra={"model": name, "bytes": arena.nbytes, "reason": reason})
        else:
            log.info("evicted %s (%d bytes): %s", name, arena.nbytes, reason,
                     extra={"model": name, "bytes": arena.nbytes, "reason": reason})
        self.release(arena)

    def _in_use(self, arena: Arena) -> bool:
        """Whether a registered name still holds ``arena`` (a shared one)."""
        return any(m.arena is arena for m in self.registry.models.values())

    def release(self, arena: Arena) -> None:
        """Free an arena off the event loop: the kernel takes ~63 ms per GiB to release a
        memfd's pages (measured on the CI machine), which would stall every connection.
        The core has already stopped counting these bytes."""
        task = self.spawn(asyncio.to_thread(self.backends[arena.device].free, arena))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

        def freed(t: asyncio.Task[Any]) -> None:  # what a test waits for (test_gpu_client): the free has run
            if not t.cancelled() and t.exception() is None:
                log.debug("freed an arena of %d bytes on %s", arena.nbytes, arena.device)

        task.add_done_callback(freed)

    async def notify_space(self) -> None:
        self.space_freed.notify()

    async def close(self) -> None:
        """At shutdown, after every request ended: stop background work, free everything."""
        for t in list(self.background):
            t.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        for model in self.registry.models.values():
            arena, model.arena = model.arena, None
            if arena is not None and not self._in_use(arena):  # a shared arena once, with its last name
                self.backends[arena.device].free(arena)
            if model.host is not None:
                self.backends[model.device].free_host(model.host)
                model.host = None
            for files in (model.files, model.parked):
                if files is not None:
                    files.close()
        self.io_pool.shutdown(wait=False, cancel_futures=True)
