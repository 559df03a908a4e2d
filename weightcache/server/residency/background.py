"""Work the daemon starts itself: preloads (which decide readiness, the health op) and
the keep-alive sweep that evicts models unused for their keep_alive, each when it runs out."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ...backends import Backend
from ...cache import CacheCore
from ...config import DaemonConfig
from ...errors import WeightcacheError
from ..registry import Registry, entries_for, learn_sizes
from .flight import RoomQueue, SingleFlight
from .io import IoPool
from .stepdown import StepDowns
from .tasks import Tasks

log = logging.getLogger("weightcache.daemon")


class Preloads:
    def __init__(self, settings: DaemonConfig, core: CacheCore, registry: Registry, backends: dict[str, Backend],
                 flights: SingleFlight, io: IoPool, tasks: Tasks) -> None:
        self.settings = settings
        self.core = core
        self.registry = registry
        self.backends = backends
        self.flights = flights
        self.io = io
        self.tasks = tasks
        # Preloads decide readiness (the health op): pending until every rank is resident,
        # failed with the error until a later preload of that model succeeds.
        self.pending: set[str] = set()
        self.failed: dict[str, str] = {}

    def start(self, name: str, gates: bool = True) -> None:
        """Load ``name`` in the background. Only the operator's and the admins' preloads
        decide readiness (``gates``): a tenant's broken one must not take the node out of service."""
        if gates:
            self.pending.add(name)  # before the task runs: a health request may come first
        self.tasks.spawn(self._preload(name, gates))

    async def _preload(self, name: str, gates: bool) -> None:
        try:
            try:
                await learn_sizes(self.core, self.registry, self.io.run, name)
                # An auto model's ranks where placement puts them, not on every candidate device.
                placed = (entries_for(self.core, self.registry, self.backends, name, None, None)
                          if name in self.registry.groups else [])
            except WeightcacheError as exc:
                log.error("preload of %s failed: %s", name, exc, extra={"model": name, "code": exc.code})
                if gates:
                    self.failed[name] = str(exc)
                return
            for entry in placed:
                try:
                    await self.flights.ensure_resident(entry, self.settings.no_space_wait_s)
                except Exception as exc:  # any failure, not only ours: readiness must not lie
                    log.error("preload of %s failed: %s", entry, exc, extra={"model": entry, "code": getattr(exc, "code", "INTERNAL")})
                    if gates:
                        self.failed[name] = str(exc) if entry == name else f"{entry}: {exc}"
                    return
            self.failed.pop(name, None)
        finally:
            self.pending.discard(name)

    def forget(self, name: str) -> None:
        self.pending.discard(name)
        self.failed.pop(name, None)


async def keep_alive_loop(core: CacheCore, step_down: StepDowns, room: RoomQueue) -> None:
    """Evict each model whose keep_alive ran out, as it runs out (mini-redis's purge task):
    sleep until the earliest deadline (``CacheCore.next_expiry``), or until the core says
    one came earlier (``on_deadline``: a detach, a load, a shorter keep_alive, an unpin)."""
    wake = asyncio.Event()
    core.on_deadline = wake.set
    while True:
        wake.clear()  # before the sweep: a deadline moved while it awaits wakes the next sleep
        for name in core.expired():
            # An eviction may wait for its demotion (a GPU model's copy to the host
            # tier): a model listed may have been attached, used, or removed since,
            # and evicting it then raised, ending this loop for good.
            if not core.is_expired(name):
                continue
            await step_down.carry_out(core.evict(name), reason="keep_alive expired")
            room.notify()
        delay = core.next_expiry()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), delay)
