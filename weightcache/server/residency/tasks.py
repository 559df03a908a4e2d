"""The daemon's own background tasks (frees, trims, preloads, the keep-alive sweep):
held so that they are not collected mid-run, logged if they fail, cancelled at close."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

log = logging.getLogger("weightcache.daemon")


class Tasks:
    def __init__(self) -> None:
        self.running: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.running.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    async def close(self) -> None:
        for t in list(self.running):
            t.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """Hold a task started elsewhere to its end (a closed connection's load, which
        shutdown must still await); its outcome is its owner's to report."""
        self.running.add(task)
        task.add_done_callback(self.running.discard)
