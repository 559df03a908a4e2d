"""Rate-limited log lines for what an untrusted party causes: a peer on the Unix socket
(a refused connection, a non-admin's admin op, a limit broken), a tenant's refused load,
a daemon on the peer port (a failed proof, a broken frame). The daemon's connections,
its loads and the peer port share one policy, so it sits below all of them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any


class PeerEventLog:
    """Log lines for events a peer causes (a refused connection, a non-admin's admin op, a
    connection dropped for breaking a limit): at most ``burst`` lines per (event, uid)
    and ``total`` per event over all uids in each ``window`` seconds; the rest are
    counted, and one line per event says how many were left out, once the window ends
    (at the next such event, a timer, or ``flush`` at shutdown). One warning per event
    let a peer write 1.76 MiB of log in 5 s with 14,653 refused connects, 4.2 MiB with
    pipelined ``evict``s: 30-70 GB a day unless journald limits it.

    The daemon keeps one (``Fill.peer_log``), shared by connections, loads and
    registers, so that ``flush`` at shutdown says what every one of them left out. The
    share is keyed by who caused the line: a uid, or a name the operator chose (a
    configured model's, so that one broken model of the config cannot hide another's)."""

    def __init__(self, logger: logging.Logger, burst: int = 10, total: int = 50, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.burst, self.total, self.window, self.clock = logger, burst, total, window, clock
        self._start: dict[str, float] = {}  # event -> when its window began
        self._lines: Counter[tuple[str, int | str]] = Counter()  # (event, uid) -> lines logged this window
        self._logged: Counter[str] = Counter()  # event -> lines logged this window, all uids
        self._left_out: dict[str, Counter[int | str]] = {}  # event -> uid -> lines left out this window
        self._left_level: dict[str, int] = {}  # event -> the highest level of the lines left out
        self._timer: asyncio.TimerHandle | None = None

    def log(self, level: int, event: str, uid: int | str, msg: str, *args: Any, **kwargs: Any) -> bool:
        """Log ``msg % args`` unless this window's share is spent; True if it was logged.
        ``uid``: whose share it spends (a str: a name of the operator's, see above)."""
        now = self.clock()
        start = self._start.get(event)
        if start is None or now - start >= self.window:
            self._end_window(event)
            self._start[event] = now
        if self._lines[(event, uid)] >= self.burst or self._logged[event] >= self.total:
            self._left_out.setdefault(event, Counter())[uid] += 1
            self._left_level[event] = max(level, self._left_level.get(event, level))
            self._arm()
            return False
        self._lines[(event, uid)] += 1
        self._logged[event] += 1
        self.logger.log(level, msg, *args, **kwargs)
        return True

    def suppressed(self, event: str) -> int:
        return sum(self._left_out.get(event, Counter()).values())

    def flush(self) -> None:
        """Say what was left out in every window, ended or not (shutdown; the timer)."""
        for event in list(self._start):
            self._end_window(event)

    def _end_window(self, event: str) -> None:
        left = self._left_out.pop(event, None)
        level = max(logging.WARNING, self._left_level.pop(event, logging.WARNING))  # errors left out: an error line
        for key in [k for k in self._lines if k[0] == event]:
            del self._lines[key]
        self._logged.pop(event, None)
        self._start.pop(event, None)
        if left:
            top = ", ".join(f"uid {u}: {n}" if isinstance(u, int) else f"{u}: {n}" for u, n in left.most_common(5))
            self.logger.log(level, "%d more %r line(s) left out in the last %.0f s (%s%s)", sum(left.values()), event,
                                self.window, top, ", ..." if len(left) > 5 else "",
                                extra={"event": event, "suppressed": sum(left.values())})

    def _arm(self) -> None:
        # A timer, so that a burst followed by silence is still summed up within a window.
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(self.window, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = self.clock()
        for event, start in list(self._start.items()):
            if now - start >= self.window:
                self._end_window(event)
        if self._left_out:
            self._arm()
