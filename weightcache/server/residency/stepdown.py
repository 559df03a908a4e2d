"""Stepping down: carrying out the core's ``StepDown`` plans. Host copies dropped, arenas
freed (off the event loop), demotions copied to the host tier chunk by chunk, and what
unregistered entries held given back."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from ...backends import Arena, Backend
from ...cache import CacheCore, State, StepDown
from ...units import format_size
from ..registry import Dropped, HostHeld, Registry
from .io import MANY_TENSORS
from .stats import Stats
from .tasks import Tasks

log = logging.getLogger("weightcache.daemon")


def _libc_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _libc_malloc_trim()


class StepDowns:
    def __init__(self, core: CacheCore, registry: Registry, backends: dict[str, Backend], tasks: Tasks,
                 stats: Stats) -> None:
        self.core = core
        self.registry = registry
        self.backends = backends
        self.tasks = tasks
        self.counters = stats.counters
        self.demotions: dict[str, asyncio.Task[None]] = {}  # entry -> its host copy in flight
        self.releasing: set[asyncio.Task[Any]] = set()  # arenas being freed in threads
        self._trim_at = 0.0  # when memory was last given back to the kernel (trim_soon)

    async def carry_out(self, step: StepDown, reason: str) -> None:
        """Do what the core decided and wait for the demotions to finish."""
        await asyncio.gather(*self.start(step, reason))

    def start(self, step: StepDown, reason: str) -> list[asyncio.Task[None]]:
        """Drop host copies, free the evicted arenas and those whose host copy was kept,
        and start the demotions (a device-to-host copy each, chunk by chunk; a chunk is
        freed once its bytes are safe, and given back to the device's room). Returns the
        demotions' tasks. A demotion that fails becomes an eviction."""
        for name in step.drop_host:
            log.info("dropped host copy of %s: %s", name, reason, extra={"model": name, "reason": reason})
            self.drop_host_copy(name)
        self.counters["evictions"] += len(step.leaving)
        for name in step.evict:
            self._free_arena(name, reason)
        for name in step.release:  # no copy to make: counted as the demotion it is
            self.counters["demotions"] += 1
            self.counters["kept_copy_demotions"] += 1
            self._free_arena(name, reason, kept_host_copy=True)
        tasks = []
        for name in step.demote:
            task = self.demotions[name] = self.tasks.spawn(self._demote(name, reason))
            task.add_done_callback(functools.partial(self._demotion_done, name))
            tasks.append(task)
        return tasks

    def _demotion_done(self, name: str, task: asyncio.Task[None]) -> None:
        if self.demotions.get(name) is task:
            del self.demotions[name]

    async def _demote(self, name: str, reason: str) -> None:
        model = self.registry.models[name]
        res = model.resident
        arena = res.let_go(name)  # a demoted arena is never shared (Note [shared arenas]): its one name held it
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
            res.host = HostHeld(copy, name)
        except Exception as exc:
            log.error("demoting %s to the host tier failed (%s); evicting it instead", name, exc,
                      extra={"model": name, "reason": str(exc)})
            self.core.demotion_failed(name)
            res.drop_parsed()  # evicted after all: no promotion needs them
            self.counters["failed_demotions"] += 1
        else:
            self.counters["demotions"] += 1
            dt = time.monotonic() - t
            log.info("demoted %s to the host tier (%d bytes, %.1f GB/s): %s", name, arena.nbytes,
                     arena.nbytes / max(dt, 1e-9) / 1e9, reason,
                     extra={"model": name, "bytes": arena.nbytes, "seconds": round(dt, 6), "reason": reason})

    def forget(self, dropped: list[Dropped]) -> None:
        """Free what unregistered entries held: arenas (a shared one once its last name
        goes: Registry.drop_entry says), host copies, a peer's files."""
        for d in dropped:
            model, res = d.model, d.model.resident
            parsed = [c for c in (res.checkpoint, model.parked_parse) if c is not None]
            self.trim_soon(max(len(c.tensors) for c in parsed) if parsed else 0)
            if d.arena is not None:
                self.release(d.arena)
                if res.host is None:  # its other names, if any, hold nothing now: no promotion needs the parse
                    res.drop_parsed()
            if d.host is not None:
                self.backends[model.device].free_host(d.host)
            model.parked_parse = None
            model.close_files()

    def trim_soon(self, ntensors: int) -> None:
        """After a checkpoint of many tensors was freed (its parse, its table): give the
        heap's free pages back to the kernel (glibc's malloc_trim, in a thread, at most once
        a second). Without it the daemon's RSS stayed ~230 MiB above its start after 100k-
        tensor loads had all gone: glibc keeps freed memory for reuse."""
        now = time.monotonic()
        if ntensors <= MANY_TENSORS or now - self._trim_at < 1.0 or _malloc_trim is None:
            return
        self._trim_at = now
        self.tasks.spawn(asyncio.to_thread(_malloc_trim, 0))

    def drop_host_copy(self, name: str) -> None:
        # At once, on the loop: the core counts the bytes free as soon as it decides, and a
        # demotion right after must find them in the pool (freed in a thread, they were
        # not yet: 71 demotions failed in a 45 s H200 workload). It is list bookkeeping.
        model = self.registry.models[name]
        if (host := model.resident.take_host(name)) is not None:
            self.backends[model.device].free_host(host)

    def _free_arena(self, name: str, reason: str, kept_host_copy: bool = False) -> None:
        res = self.registry.models[name].resident
        holding = res.held_by(name) is not None
        arena = res.let_go(name)
        if res.holders:  # another name on the same arena (Note [shared arenas]) keeps it, and its parse
            if not holding:
                return
            log.info("evicted %s: %s; its arena stays, shared with %s", name, reason,
                     ", ".join(x.name for x in self.core.siblings(name) if x.state is State.RESIDENT),
                     extra={"model": name, "reason": reason})
            return
        if not kept_host_copy:
            self.trim_soon(len(res.checkpoint.tensors) if res.checkpoint is not None else 0)
            res.drop_parsed()  # its tensors and table go with the arena (Note [held bytes])
        if arena is None:
            return
        # The size the budget counted for it, as `models` and `ps` show it (the arena and
        # what the daemon held for its checkpoint), in the CLI's unit: one size everywhere.
        counted = self.core.entry(name).nbytes
        if kept_host_copy:
            log.info("demoted %s to the host tier (%s, its host copy kept since its promotion: no copy): %s",
                     name, format_size(counted), reason, extra={"model": name, "bytes": counted, "reason": reason})
        else:
            log.info("evicted %s (%s): %s", name, format_size(counted), reason,
                     extra={"model": name, "bytes": counted, "reason": reason})
        self.release(arena)

    def release(self, arena: Arena) -> None:
        """Free an arena off the event loop: the kernel takes ~63 ms per GiB to release a
        memfd's pages (measured on the CI machine), which would stall every connection.
        The core has already stopped counting these bytes."""
        task = self.tasks.spawn(asyncio.to_thread(self.backends[arena.device].free, arena))
        self.releasing.add(task)
        task.add_done_callback(self.releasing.discard)

        def freed(t: asyncio.Task[Any]) -> None:  # what a test waits for (test_gpu_client): the free has run
            if not t.cancelled() and t.exception() is None:
                log.debug("freed an arena of %d bytes on %s", arena.nbytes, arena.device)

        task.add_done_callback(freed)

    def close(self) -> None:
        """At shutdown, once the background tasks are stopped: free everything, at once."""
        for res in self.registry.arenas.values():  # a shared arena once
            arena, res.arena, res.holders = res.arena, None, set()
            if arena is not None:
                self.backends[arena.device].free(arena)
            if (held := res.host) is not None:
                res.host = None
                self.backends[self.registry.models[held.entry].device].free_host(held.copy)
        for model in self.registry.models.values():
            model.close_files()
