"""The engine processes of ``weightcache workload``: one per trace slot, started once and
given one run per policy (each run names its daemon's socket), SIGKILLed and replaced on
demand.

Why one pool for every policy: an engine's start (Python, torch, a CUDA context) costs
seconds, and starting the pool before the first daemon keeps the engines' CUDA contexts
out of the device-memory comparisons: they exist at every reading. The engines wait on
stdin, idle, while the isolated rates are measured.

Protocol on the engine's stdin/stdout, one line each: the engine prints ``ready`` once
started; each JSON line it reads is a run (``socket``, ``results``, ``t0``, ``start``);
it prints ``done`` after each run; EOF ends it (status 0). See workload_engine.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .workload_engine import MISMATCH_EXIT

if TYPE_CHECKING:
    from .workload_setup import Prepared, WorkloadConfig


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by a SIGKILL, should one ever be
            out.append(json.loads(line))
    return out


class EnginePool:
    def __init__(self, cfg: WorkloadConfig, prep: Prepared) -> None:
        self.cfg, self.prep = cfg, prep
        self.slots = prep.trace.engines
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._buf: dict[int, bytes] = {}
        self.ready: set[int] = set()
        for old in prep.work.glob("engine-*.log"):  # an earlier invocation's
            old.unlink()

    def log(self, slot: int) -> Path:
        return self.prep.work / f"engine-{slot}.log"

    def spawn(self, slot: int) -> None:
        cmd = [sys.executable, "-m", "weightcache.tools.workload_engine", "--trace", str(self.prep.trace_path),
               "--refs", str(self.prep.refs_path), "--slot", str(slot), "--device", self.cfg.device, "--wait-s", str(self.cfg.wait_s)]
        if self.cfg.drain_s is not None:
            cmd += ["--deadline-s", str(self.prep.trace.duration_s + self.cfg.drain_s)]
        with self.log(slot).open("ab") as err:
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        assert p.stdout is not None
        os.set_blocking(p.stdout.fileno(), False)
        self.procs[slot], self._buf[slot] = p, b""
        self.ready.discard(slot)

    def lines(self, slot: int) -> list[str]:
        """The slot's complete stdout lines so far (never blocks); notes ``ready``."""
        p = self.procs[slot]
        assert p.stdout is not None
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(p.stdout.fileno(), 4096):
                self._buf[slot] += chunk
        *done, self._buf[slot] = self._buf[slot].split(b"\n")
        out = [x.decode(errors="replace").strip() for x in done]
        if "ready" in out:
            self.ready.add(slot)
        return out

    def tail(self, slot: int) -> str:
        log = self.log(slot)
        text = log.read_text(errors="replace").strip() if log.exists() else ""
        return text[-1500:] or f"no output (see {log})"

    def start(self, timeout: float = 300) -> None:
        """An engine in every slot that has none alive, each started (torch imported)."""
        for slot in range(self.slots):
            if slot not in self.procs or self.procs[slot].poll() is not None:
                self.spawn(slot)
        deadline = time.monotonic() + timeout
        while missing := [s for s in range(self.slots) if s not in self.ready]:
            for slot in missing:
                self.lines(slot)
                if slot not in self.ready and self.procs[slot].poll() is not None:
                    self.kill_all()
                    raise RuntimeError(f"engine {slot} exited while starting: {self.tail(slot)}")
            if time.monotonic() > deadline:
                self.kill_all()
                raise RuntimeError(f"engines {missing} had not started after {timeout:.0f} s")
            time.sleep(0.02)

    def send(self, slot: int, run: dict[str, Any]) -> None:
        stdin = self.procs[slot].stdin
        assert stdin is not None
        stdin.write((json.dumps(run) + "\n").encode())
        stdin.flush()

    def kill(self, slot: int) -> None:
        p = self.procs[slot]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()

    def kill_all(self) -> None:
        for slot in self.procs:
            self.kill(slot)

    def close(self, timeout: float = 20) -> None:
        """EOF on every engine's stdin (they exit), then SIGKILL for any still there."""
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill_all()


class Replay:
    """One policy's run of the trace over the pool: every slot from its first event; a
    killed engine's replacement from the event after the one it was in."""

    def __init__(self, pool: EnginePool, socket: str, run_dir: Path) -> None:
        self.pool, self.socket, self.dir = pool, socket, run_dir
        self.counts = [len(pool.prep.trace.for_engine(s)) for s in range(pool.slots)]
        self.starts: dict[int, int] = {}
        self.running: set[int] = set()
        self.failures: list[str] = []
        self.kills = 0
        self.t0 = 0.0

    def results(self, slot: int) -> Path:
        return self.dir / f"engine-{slot}.jsonl"

    def _go(self, slot: int, start: int) -> None:
        self.starts[slot] = start
        self.running.add(slot)
        self.pool.send(slot, {"socket": self.socket, "results": str(self.results(slot)), "t0": self.t0, "start": start})

    def start(self) -> float:
        self.pool.start()
        for slot in range(self.pool.slots):
            self.pool.lines(slot)  # nothing is left over from an earlier run
        self.t0 = time.monotonic() + 0.05
        for slot in range(self.pool.slots):
            self._go(slot, 0)
        return self.t0

    def poll(self) -> None:
        for slot in sorted(self.running):
            if "done" in self.pool.lines(slot):
                self.running.discard(slot)
            elif (rc := self.pool.procs[slot].poll()) is not None:
                self.running.discard(slot)
                why = "attached wrong bytes" if rc == MISMATCH_EXIT else f"exited with status {rc}"
                self.failures.append(f"engine {slot} {why}: {self.pool.tail(slot)}")

    def kill_and_replace(self, slot: int) -> None:
        """SIGKILL the slot's engine; a new one continues after the event it was in."""
        self.pool.kill(slot)
        self.kills += 1
        begun = [r["ev"] for r in read_records(self.results(slot)) if "begin" in r]
        start = max(self.starts[slot], max(begun, default=-1) + 1)
        self.pool.spawn(slot)  # always: the pool keeps one engine per slot for the next policy
        self.running.discard(slot)
        if start < self.counts[slot]:
            self._go(slot, start)

    def drive(self, cfg: WorkloadConfig) -> None:
        """Until every slot has run its events, killing one engine every ``kill_every``."""
        duration_s = self.pool.prep.trace.duration_s
        rng = random.Random(cfg.seed)
        next_kill = self.t0 + rng.uniform(*cfg.kill_every) if cfg.kill_every else float("inf")
        # A guard against a hung run, far above any run that makes progress.
        limit = duration_s + cfg.drain_s + cfg.wait_s + 120 if cfg.drain_s is not None else 10 * duration_s + 600
        while True:
            self.poll()
            if not self.running:
                return
            now = time.monotonic()
            if cfg.kill_every and now >= next_kill:
                if now < self.t0 + duration_s:
                    self.kill_and_replace(rng.choice(sorted(self.running)))
                next_kill = now + rng.uniform(*cfg.kill_every)
            if now > self.t0 + limit:
                self.pool.kill_all()
                self.failures.append(f"the engines had not finished {now - self.t0:.0f} s after the start: killed")
                return
            time.sleep(0.02)
