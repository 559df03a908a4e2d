"""Residency: carrying out the cache core's plans, so that models are resident when asked
for and step down when the core says so. The core decides (``begin_load`` returns the
victims and the reservation); these rooms do the I/O, each one job:

- ``flight.py``: single flight. One load per entry, joined by every request for it;
  where its bytes come from (host tier, another GPU, the files); and the one
  wait-for-room loop (loads and publishes refused NO_SPACE, ``RoomQueue``), with
  ``SpaceFreed``, which wakes them oldest first when room may have been freed.
- ``fill.py``: filling a new arena (admit, allocate, one of its strategies in a
  thread, seal, encode the table) or rolling it back. Loads and publishes come here.
- ``stepdown.py``: demotions, evictions, host copies dropped, arenas freed off the loop.
- ``background.py``: preloads (readiness) and the keep-alive sweep.
- ``checks.py``: reading checkpoints without loading them (start/reload/register
  checks); ``io.py``: the bounded io pool those reads run in, and a tenant's parse
  charged to its quota while it runs.
- ``job.py``, ``stats.py``, ``tasks.py``: a load in flight; the counters and progress
  they report; their tasks.

``Residency`` builds them and hands each the others it uses; callers use the room
whose job they need (``residency.flights.ensure_resident``, ``residency.room.notify``).
"""

from __future__ import annotations

from collections.abc import Callable

from ...backends import Backend
from ...cache import CacheCore
from ...config import DaemonConfig
from ..registry import Registry
from .background import Preloads, keep_alive_loop
from .checks import Checks
from .fill import Fill
from .flight import RoomQueue, SingleFlight, SpaceFreed
from .io import IoPool
from .job import LoadJob
from .pins import Pins
from .stats import COUNTERS, Stats
from .stepdown import StepDowns
from .tasks import Tasks

__all__ = ["COUNTERS", "LoadJob", "Residency", "SpaceFreed"]


class Residency:
    def __init__(self, settings: DaemonConfig, core: CacheCore, registry: Registry, backends: dict[str, Backend],
                 shutting_down: Callable[[], bool]) -> None:
        self.core = core
        self.stats = Stats()
        self.tasks = Tasks()
        self.io = IoPool(settings)
        self.room = RoomQueue(core)
        self.step_down = StepDowns(core, registry, backends, self.tasks, self.stats)
        self.fill = Fill(settings, core, registry, backends, self.room, self.step_down, self.stats, shutting_down)
        self.pins = Pins(settings, core, registry, self.step_down, self.tasks, self.stats, shutting_down)
        self.flights = SingleFlight(settings, core, registry, backends, self.io, self.room, self.step_down, self.fill,
                                    self.stats, self.pins, shutting_down)
        self.checks = Checks(settings, core, registry, self.io)
        self.preloads = Preloads(settings, core, registry, backends, self.flights, self.io, self.tasks)

    async def keep_alive_loop(self) -> None:
        await keep_alive_loop(self.core, self.step_down, self.room)

    async def close(self) -> None:
        """At shutdown, after every request ended: stop background work, free everything."""
        await self.tasks.close()
        self.step_down.close()
        self.io.close()
        self.pins.close()
