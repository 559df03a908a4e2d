"""An engine's exit, and what the supervisor does after it (:class:`RestartPolicy`: pure,
no clock, no I/O, so tested directly)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

from .. import engine as engine_api


@dataclass(frozen=True)
class EngineExit:
    pid: int
    status: int  # os.waitstatus_to_exitcode: the exit status, or -N for signal N
    uptime_s: float
    ready_s: float | None  # from fork to weightcache.engine.ready(), if it was called
    reason: str | None  # what weightcache.engine.restart() was given

    @property
    def planned(self) -> bool:
        return self.status == engine_api.RESTART_EXIT_CODE

    def describe(self) -> str:
        how = f"was killed by {signal.Signals(-self.status).name}" if self.status < 0 else f"exited with status {self.status}"
        text = f"engine pid {self.pid} {how} after {self.uptime_s:.2f} s"
        if self.reason is not None:
            text += f", asking for a restart: {self.reason}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "status": self.status, "uptime_s": round(self.uptime_s, 3),
                "ready_s": None if self.ready_s is None else round(self.ready_s, 3), "reason": self.reason,
                "kind": "planned" if self.planned else "finished" if self.status == 0 else "crash", "at": time.time()}


class RestartPolicy:
    """What to do after an engine exits; pure (no clock, no I/O), so tested directly.

    Status 0: the engine finished; stop. :data:`RESTART_EXIT_CODE`: restart now, and the
    crash streak ends. Anything else is a crash: the first of a streak restarts at once,
    the next ones wait 1, 2, 4 ... s up to ``backoff_max_s``. A crash after at least
    ``stable_after_s`` of running starts a new streak.

    Planned restarts are not free of limits either: an engine that asks for one at every
    start (a condition its restart never clears) was forked ~190 times a second, two log
    lines each, forever. So only ``PLANNED_BURST`` restarts in a row by engines that ran
    less than ``stable_after_s`` (planned or crashed) are at once; further ones wait 1,
    2, 4 ... s like crashes, until an engine runs ``stable_after_s``.
    """

    PLANNED_BURST = 3

    def __init__(self, backoff_max_s: float = 30.0, stable_after_s: float = 30.0) -> None:
        self.backoff_max_s = backoff_max_s
        self.stable_after_s = stable_after_s
        self.crash_streak = 0
        self.crashes = 0
        self.planned = 0
        self.quick_planned = 0  # planned restarts since an engine last ran stable_after_s

    def decide(self, ex: EngineExit) -> float | None:
        """Seconds to wait before the next fork, or None: stop."""
        if ex.status == 0:
            return None
        if ex.uptime_s >= self.stable_after_s:
            self.quick_planned = 0
        if ex.planned:
            self.planned += 1
            self.crash_streak = 0
            if ex.uptime_s >= self.stable_after_s:
                return 0.0
            self.quick_planned += 1
            over = self.quick_planned - self.PLANNED_BURST
            return 0.0 if over <= 0 else min(self.backoff_max_s, 2.0 ** (over - 1))
        self.crashes += 1
        self.crash_streak = 1 if ex.uptime_s >= self.stable_after_s else self.crash_streak + 1
        return 0.0 if self.crash_streak == 1 else min(self.backoff_max_s, 2.0 ** (self.crash_streak - 2))

