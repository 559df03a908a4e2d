"""How late the event loop runs, and where it was when it stalled.

Every request waits for the loop: whatever holds it for 30 ms (a computation on the
loop, a big frame copied, a worker thread holding the GIL) is 30 ms on every peer's
attach at that moment. The abuse stress measured another tenant's attach p99 at 23-37 ms beside
every abuser, 4-9 ms alone, and a whole-run profile (py-spy) was too diffuse to name the
spikes; an operator sees only the slow replies. So the daemon watches itself:

- a beat on the loop, a timer every BEAT_S, measures how late each one fires
  (``weightcache_loop_lag_seconds``): what a request arriving then waited before the
  loop could read it;
- a watcher thread looks at the pending beat every POLL_S; once it is half ``stall_s``
  late (so that a stall just over ``stall_s`` is still seen before it ends), it takes
  the stack of the loop's thread and of the other threads not parked in a wait
  (``sys._current_frames``), once per stall, and then the loop's alone at every poll
  while the stall lasts (up to MAX_LATER): a stall is often many callbacks, and one
  stack names only one of them;
- a beat ``stall_s`` or more late is a stall: the last KEEP are kept (``status``, for
  administrators: stacks name the daemon's code) and one warning line at most every
  LOG_EVERY_S gives the longest since the last line, with its stacks.

Each stall also says where the loop's thread spent that time, from the kernel's counts
for it (``/proc/self/task/<tid>/schedstat``, from the watcher's last look before the beat
was due to the beat): on a CPU (the loop's own work, or C code it called), runnable but
waiting for a CPU (the host is oversubscribed: other processes had the cores), or
neither (blocked: waiting for the GIL that another thread holds, or in a blocking call).
The stack says where; these say which of the three to fix.

The watcher needs the GIL to take a stack. A stall in C code that holds the GIL is
sampled when the code lets go (at the switch interval between bytecodes, at the C call's
return otherwise): the stack names the call that held it, or the line after. A stall
that is another thread holding the GIL shows the loop in its poll and that thread busy.
Cost: 100 timers a second on the loop and 100 polls in the thread, measured with the
abuse stress (python -m benchmarks abuse).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("weightcache.daemon")

BEAT_S = 0.01
POLL_S = 0.005
KEEP = 16
LOG_EVERY_S = 10.0
FRAMES = 8  # the innermost frames of the loop's stack kept per stall
BUSY_FRAMES = 3  # and of each busy thread's
MAX_BUSY = 6
MAX_LATER = 15  # samples of the loop's stack after the first, one a poll, per stall (75 ms of it)

# Where a thread that waits for work sits: its innermost Python frame is in one of these
# files (a pool worker blocked in SimpleQueue.get shows as concurrent/futures/thread.py).
_IDLE_FILES = ("threading.py", "queue.py", "selectors.py", "socketserver.py", "concurrent/futures/thread.py")


@dataclass(frozen=True)
class Sample:
    due: float  # the beat it was taken for
    loop: tuple[str, ...]  # the loop thread's frames, outermost first
    busy: dict[str, tuple[str, ...]] = field(default_factory=dict)  # thread name -> frames


@dataclass(frozen=True)
class Spent:
    """Where the loop's thread spent a window of wall time, in seconds (schedstat)."""

    window: float
    on_cpu: float
    runnable: float  # ready to run, no CPU free

    @property
    def blocked(self) -> float:  # neither: waiting for the GIL, or in a blocking call
        return max(0.0, self.window - self.on_cpu - self.runnable)

    def as_dict(self) -> dict[str, float]:
        return {"window_ms": round(self.window * 1e3, 1), "on_cpu_ms": round(self.on_cpu * 1e3, 1),
                "runnable_ms": round(self.runnable * 1e3, 1), "blocked_ms": round(self.blocked * 1e3, 1)}


@dataclass(frozen=True)
class Stall:
    n: int  # its number since the start
    ended: float  # time.time()
    seconds: float  # how late the beat fired
    sample: Sample | None  # None: the stall ended before the watcher could take a stack
    spent: Spent | None = None  # None: the kernel keeps no schedstat, or the watcher had no look before it
    later: tuple[tuple[str, ...], ...] = ()  # the loop's frames at the polls after the first sample

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"n": self.n, "ms": round(self.seconds * 1e3, 1), "ago_s": round(now - self.ended, 1),
                "spent": self.spent.as_dict() if self.spent else None,
                "loop": list(self.sample.loop) if self.sample else [],
                "busy": {k: list(v) for k, v in self.sample.busy.items()} if self.sample else {},
                "later": [list(f) for f in self.later]}


def sched_times(path: str) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable without one) of the thread whose schedstat is
    ``path``; None where the kernel keeps none (CONFIG_SCHED_INFO off)."""
    try:
        with open(path, "rb") as f:
            on_cpu, runnable = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(runnable) / 1e9


class LoopWatch:
    def __init__(self, stall_s: float, observe: Callable[[float], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self._observe = observe
        self._clock = clock
        self.stalls = 0
        self.longest = 0.0
        self.recent: collections.deque[Stall] = collections.deque(maxlen=KEEP)
        self._due = float("inf")  # the pending beat's due time; read by the watcher
        self._sample: Sample | None = None  # written by the watcher, taken by the beat
        self._later: tuple[float, list[tuple[str, ...]]] = (0.0, [])  # (due, loop frames), the same
        self._loop_thread = threading.get_ident()
        self._loop_sched = ""  # the loop thread's schedstat, read by the watcher
        # (due, clock, sched_times) at the watcher's last look before the pending beat was due
        self._mark: tuple[float, float, tuple[float, float] | None] | None = None
        self.spent_total = Spent(0.0, 0.0, 0.0)  # summed over the stalls whose time is known
        self._stop = threading.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._unlogged = 0  # stalls since the last warning line
        self._worst: Stall | None = None  # the longest of them
        self._logged_at = -LOG_EVERY_S

    def start(self) -> None:
        """On the loop's thread, with the loop running."""
        self._loop_thread = threading.get_ident()
        self._loop_sched = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._task = asyncio.ensure_future(self._beat())
        self._thread = threading.Thread(target=self._watch, name="wc-loop-watch", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 1.0)

    async def _beat(self) -> None:
        while True:
            due = self._due = self._clock() + BEAT_S
            await asyncio.sleep(BEAT_S)
            lag = max(0.0, self._clock() - due)
            self._observe(lag)
            if lag >= self.stall_s:
                sample, self._sample = self._sample, None
                later_due, later = self._later
                self._record(Stall(self.stalls + 1, time.time(), lag, sample if sample is not None and sample.due == due else None,
                                   self._spent_since(due), tuple(later) if later_due == due else ()))

    def _spent_since(self, due: float) -> Spent | None:
        """On the loop's thread, as a stalled beat fires: its time since the watcher's mark."""
        mark, now, after = self._mark, self._clock(), sched_times(self._loop_sched)
        if mark is None or mark[0] != due or mark[2] is None or after is None:
            return None
        return Spent(now - mark[1], after[0] - mark[2][0], after[1] - mark[2][1])

    def _watch(self) -> None:
        sampled = None
        while not self._stop.wait(POLL_S):
            due, now = self._due, self._clock()
            if now < due:  # not late yet: where the loop's time stands, should this beat stall
                self._mark = (due, now, sched_times(self._loop_sched))
            elif now - due >= self.stall_s / 2:
                if due != sampled:
                    self._sample = self._take(due)
                    self._later = (due, [])
                    sampled = due
                elif len(later := self._later[1]) < MAX_LATER:  # where the loop went on: one stack a poll
                    loop = sys._current_frames().get(self._loop_thread)
                    later.append(_where(loop, FRAMES) if loop is not None else ())

    def _take(self, due: float) -> Sample:
        frames = sys._current_frames()
        names = {t.ident: t.name for t in threading.enumerate()}
        loop = frames.get(self._loop_thread)
        busy: dict[str, tuple[str, ...]] = {}
        for ident, frame in frames.items():
            if ident in (self._loop_thread, threading.get_ident()) or frame.f_code.co_filename.endswith(_IDLE_FILES):
                continue
            if len(busy) < MAX_BUSY:
                busy[names.get(ident, str(ident))] = _where(frame, BUSY_FRAMES)
        return Sample(due, _where(loop, FRAMES) if loop is not None else (), busy)

    def _record(self, stall: Stall) -> None:
        self.stalls += 1
        self.longest = max(self.longest, stall.seconds)
        self.recent.append(stall)
        if (spent := stall.spent) is not None:
            t = self.spent_total
            self.spent_total = Spent(t.window + spent.window, t.on_cpu + spent.on_cpu, t.runnable + spent.runnable)
        self._unlogged += 1
        if self._worst is None or stall.seconds > self._worst.seconds:
            self._worst = stall
        now = self._clock()
        if now - self._logged_at < LOG_EVERY_S:
            return
        worst, n = self._worst, self._unlogged
        self._worst, self._unlogged, self._logged_at = None, 0, now
        where = " <- ".join(reversed(worst.sample.loop[-3:])) if worst.sample else "not sampled"
        busy = "; ".join(f"{k}: {v[-1]}" for k, v in worst.sample.busy.items()) if worst.sample else ""
        log.warning("event loop stalled %.0f ms (the longest of %d stall(s) >= %.0f ms since the last such line)%s; "
                    "loop at %s%s (weightcache status --json, \"loop\", keeps the last %d)",
                    worst.seconds * 1e3, n, self.stall_s * 1e3, spent_text(worst.spent), where,
                    f"; busy threads: {busy}" if busy else "", KEEP,
                    extra={"seconds": worst.seconds, "stalls": n,
                           "stack": list(worst.sample.loop) if worst.sample else []})

    def status(self) -> dict[str, Any]:
        now = time.time()
        return {"stall_ms": self.stall_s * 1e3, "stalls": self.stalls, "longest_ms": round(self.longest * 1e3, 1),
                "spent": self.spent_total.as_dict(), "recent": [s.as_dict(now) for s in reversed(self.recent)]}


def spent_text(spent: Spent | dict[str, float] | None) -> str:
    """', of which on a CPU 12 ms, runnable 30 ms, blocked 8 ms' (empty when unknown)."""
    if spent is None:
        return ""
    d = spent.as_dict() if isinstance(spent, Spent) else spent
    return (f", of which on a CPU {d['on_cpu_ms']:.0f} ms, runnable without a CPU {d['runnable_ms']:.0f} ms, "
            f"blocked {d['blocked_ms']:.0f} ms (GIL or a blocking call)")


def _where(frame: Any, limit: int) -> tuple[str, ...]:
    """The innermost ``limit`` frames as 'path:line function', outermost first. Walked
    by hand: traceback.extract_stack would read source files, holding the GIL."""
    out: list[str] = []
    while frame is not None and len(out) < limit:
        out.append(f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(reversed(out))


def _short(path: str) -> str:
    """weightcache/server/x.py for the package's files, the last two parts for others."""
    i = path.rfind("/weightcache/")
    return path[i + 1:] if i >= 0 else "/".join(path.rsplit("/", 2)[-2:])
