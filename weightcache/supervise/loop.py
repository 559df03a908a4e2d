"""The supervisor process (``weightcache supervise``, the package's docstring): preload
the template, fork engines, wait for them and for signals, restart by the policy, and
say where it stands (stderr, ``--status FILE``, systemd)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from .. import engine as engine_api
from ..errors import ConfigError
from ..safe_path import safe_sys_path
from ..systemd import StopRequests
from .command import EngineCommand, parse_command, run_engine
from .fork_safety import ForkUnsafe, check_fork_safe, driver_files, open_fds, reseed, socket_fds
from .policy import EngineExit, RestartPolicy

log = logging.getLogger("weightcache.supervisor")

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT})
FORWARDED_SIGNALS = frozenset({signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH})
WAITED_SIGNALS = STOP_SIGNALS | FORWARDED_SIGNALS | {signal.SIGCHLD}
# siginfo's si_code for a signal the kernel sent, e.g. a terminal's Ctrl-C or hang-up to its
# foreground process group. The engine is in that group too and got the signal already:
# passing it on would deliver it twice. Signals sent by a process (kill, systemd, docker
# stop) have SI_USER (0) or SI_QUEUE and are passed on. Not exported by Python's signal module.
SI_KERNEL = 0x80
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


@contextlib.contextmanager
def preload_path() -> Iterator[None]:
    """sys.path as the preloads see it: as ``python -P`` would have it (safe_sys_path:
    not the supervisor's script directory, not the working directory with ``-m``). The template imports the engine's dependencies, perhaps as root,
    perhaps started in a directory others can write: a torch.py planted there must not be
    what every engine forks with. The engine itself gets the sys.path[0] python would
    give it (command.run_engine) and keeps its working directory: its own code is its own
    (docs/deployment.md, "Supervisor")."""
    saved = list(sys.path)
    kept = safe_sys_path()
    sys.path[:] = kept
    try:
        yield
    finally:
        added = [p for p in sys.path if p not in kept]  # what a preload added (a .pth-like path hook) stays
        sys.path[:] = saved + [p for p in added if p not in saved]


@dataclass(frozen=True)
class SupervisorOptions:
    preload: tuple[str, ...] = ()  # imported before the first fork; a failure stops the supervisor
    record: str | None = None  # engines write their modules here at ready(); preloaded (failures logged) at start
    exclude: tuple[str, ...] = ()  # never preloaded from the record: these modules and their submodules
    status: str | None = None  # JSON status written at every change
    stop_timeout_s: float = 30.0  # from the stop signal to SIGKILL
    backoff_max_s: float = 30.0
    stable_after_s: float = 30.0  # an engine that ran this long before crashing starts a new crash streak


def _prctl(option: int, arg: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


@dataclass
class _Engine:
    pid: int
    started: float  # monotonic, just before the fork
    pipe: int  # read end of the engine's message pipe
    buffer: bytes = b""
    ready_s: float | None = None
    reason: str | None = None
    killed: bool = False


@dataclass
class _Counters:
    started_at: float = field(default_factory=time.time)
    forks: int = 0
    exits: list[dict[str, Any]] = field(default_factory=list)


class Supervisor:
    """One supervisor process: preload, then fork engines until told to stop."""

    def __init__(self, command: EngineCommand, options: SupervisorOptions) -> None:
        self.command = command
        self.options = options
        self.policy = RestartPolicy(options.backoff_max_s, options.stable_after_s)
        self.counters = _Counters()
        self.engine: _Engine | None = None
        self.state = "starting"
        self.stopping = False
        self.stops = StopRequests()
        self.stop_deadline = 0.0
        self.stop_status = 0
        self.next_start: float | None = None
        self.pid = os.getpid()
        self.preloaded = 0
        self.template_modules: frozenset[str] = frozenset()
        self.inherited_fds: set[int] = set()
        self.old_mask: set[int | signal.Signals] = set()

    # -- start -----------------------------------------------------------------------

    def preload(self) -> tuple[dict[str, int], str | None, str | None]:
        """Import the modules. Returns those during whose import threads appeared (and
        how many), the first after whose import the CUDA driver was initialised, and the first
        that left a socket open: the supervisor's message names them."""
        started_by: dict[str, int] = {}
        driver_by = socket_by = None
        names = list(dict.fromkeys(self.options.preload))
        explicit = set(names)
        if self.options.record:
            names += [n for n in engine_api.read_record(self.options.record) if n not in explicit and not self._excluded(n)]
        failed: list[str] = []
        t = time.perf_counter()
        for name in names:
            before = len(os.listdir("/proc/self/task"))
            fds_before = open_fds()
            try:
                with preload_path():
                    importlib.import_module(name)
            except Exception as exc:
                if name in explicit:
                    raise ConfigError(f"--preload {name}: cannot import it: {type(exc).__name__}: {exc} (preloads are "
                                      "imported as `python -P` would: not from the working directory or the "
                                      "supervisor's script directory)") from None
                failed.append(f"{name} ({type(exc).__name__})")
            after = len(os.listdir("/proc/self/task"))
            if after > before:
                started_by[name] = after - before
            if driver_by is None and driver_files():
                driver_by = name
            if socket_by is None and socket_fds(fds_before):
                socket_by = name
        self.preloaded = len(names) - len(failed)
        log.info("preloaded %d modules in %.2f s (%d named by --preload, %d from %s)%s", self.preloaded, time.perf_counter() - t,
                 len(explicit), len(names) - len(explicit), self.options.record or "no record",
                 f"; {len(failed)} from the record failed to import and were skipped: {', '.join(failed[:5])}" if failed else "")
        return started_by, driver_by, socket_by

    def _excluded(self, name: str) -> bool:
        return any(name == x or name.startswith(x + ".") for x in self.options.exclude)

    def run(self) -> int:
        """Preload, check, then supervise until stopped. The exit status of the supervisor:
        0 stopped or finished, 1 the engine had to be SIGKILLed, 2 could not start."""
        self.template_modules = frozenset(sys.modules)
        self.inherited_fds = open_fds()
        try:
            started_by, driver_by, socket_by = self.preload()
            check_fork_safe(self.inherited_fds, started_by, driver_by, socket_by)
        except ConfigError as exc:
            log.error("cannot start: %s", exc.message)
            return 2
        except ForkUnsafe as exc:
            log.error("cannot start: %s", exc)
            return 2
        # Objects imported so far are never freed: keep the collector from touching (and
        # so copying into each engine) their pages; gunicorn --preload does the same.
        gc.freeze()
        # Orphans of the engine (a worker it left behind) become ours, as they would be
        # PID 1's in a container, and are reaped: the same behaviour on a host and in a pod.
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED_SIGNALS)
        try:
            status = self._loop()
            if self.stopping:  # else the status file said "stopping" (and a next start) after the exit
                self.state, self.next_start = "stopped", None
                self._publish()
            return status
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old_mask)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self) -> int:
        delay = 0.0
        while True:
            if delay > 0:
                self.state = "backoff"
                self.next_start = time.monotonic() + delay
                self._publish()
                self._wait_until(self.next_start)
                self.next_start = None
            if self.stopping:
                return self.stop_status
            try:
                check_fork_safe(self.inherited_fds)  # something in the template may have started a thread since
            except ForkUnsafe as exc:
                log.error("cannot fork the next engine: %s", exc)
                return 2
            self._fork()
            ex = self._wait_engine()
            if self.stopping:
                log.info("%s; stopped", ex.describe())
                return self.stop_status
            delay_or_stop = self.policy.decide(ex)
            if delay_or_stop is None:
                log.info("%s: finished; the supervisor exits", ex.describe())
                self.state = "finished"
                self._publish()
                return 0
            delay = delay_or_stop
            kind = "planned restart" if ex.planned else f"crash {self.policy.crash_streak} in a row"
            log.info("%s (%s); restart %d %s", ex.describe(), kind, self.counters.forks,
                     "now" if delay == 0 else f"in {delay:.0f} s")

    def _fork(self) -> None:
        r, w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # else both processes would write what is buffered
            with contextlib.suppress(Exception):
                stream.flush()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            self._child(r, w)
        os.close(w)
        os.set_blocking(r, False)
        self.engine = _Engine(pid, started, r)
        self.counters.forks += 1
        self.state = "running"
        log.info("engine pid %d started (%s)", pid, "first start" if self.counters.forks == 1 else f"restart {self.counters.forks - 1}")
        self._publish()

    def _child(self, r: int, w: int) -> NoReturn:
        status: int | signal.Signals = 1
        try:
            os.close(r)
            # An engine whose supervisor died (SIGKILL, OOM) gets SIGTERM, rather than
            # running on beside the next supervisor's engine.
            _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != self.pid:  # the supervisor died before the line above
                os._exit(1)
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old_mask)
            _detach_logger()
            reseed()
            engine_api._link = engine_api.SupervisorLink(self.pid, w, self.options.record, self.template_modules,
                                                         frozenset(sys.modules), self.command.path0)
            status = run_engine(self.command)
        except BaseException:
            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            if isinstance(status, signal.Signals):
                signal.signal(status, signal.SIG_DFL)
                os.kill(os.getpid(), status)
                status = 128 + status
            os._exit(status & 0xFF)

    def _wait_engine(self) -> EngineExit:
        while True:
            assert self.engine is not None
            eng = self.engine
            # The pipe is read between signals: often until the engine is ready, so that the
            # log's ready line comes when it happened (its time is the engine's own anyway).
            timeout = 0.1 if eng.ready_s is None else 1.0
            if self.stopping:
                timeout = max(0.0, min(timeout, self.stop_deadline - time.monotonic()))
            info = signal.sigtimedwait(WAITED_SIGNALS, timeout)
            if info is not None:
                self._on_signal(info)
            self._read_messages(eng)
            ex = self._reap()
            if ex is not None:
                return ex
            if self.stopping and not eng.killed and time.monotonic() >= self.stop_deadline:
                log.warning("engine pid %d still running %.0f s after the stop signal: SIGKILL", eng.pid, self.options.stop_timeout_s)
                self._kill()

    def _wait_until(self, deadline: float) -> None:
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            info = signal.sigtimedwait(WAITED_SIGNALS, left)
            if info is not None:
                self._on_signal(info)
            self._reap()

    def _on_signal(self, info: Any) -> None:
        sig = signal.Signals(info.si_signo)
        if sig == signal.SIGCHLD:
            return  # reaped by the caller
        from_terminal = info.si_code == SI_KERNEL
        if sig in STOP_SIGNALS:
            taken = self.stops.take(sig, info.si_pid, from_terminal)
            if taken == "duplicate":
                log.info("%s again from pid %d within %g s: taken as the same request (sent to the supervisor and to its "
                         "process group); send it again to kill the engine at once", sig.name, info.si_pid,
                         StopRequests.REPEAT_AFTER_S)
                return
            if taken == "again":
                log.warning("second %s: SIGKILL the engine", sig.name)
                self._kill()
                return
            self.stopping = True
            self.stop_status = 0
            self.stop_deadline = time.monotonic() + self.options.stop_timeout_s
            self.state = "stopping"
            log.info("%s: stopping the engine%s", sig.name, f" (pid {self.engine.pid})" if self.engine else "")
            with contextlib.suppress(OSError):
                engine_api.sd_notify("STOPPING=1")
        if self.engine is not None and not from_terminal:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine.pid, sig)
        self._publish()

    def _kill(self) -> None:
        if self.engine is not None and not self.engine.killed:
            self.engine.killed = True
            self.stop_status = 1
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine.pid, signal.SIGKILL)

    def _reap(self) -> EngineExit | None:
        """Collect every child that ended (as PID 1, orphans of the engine too)."""
        ex = None
        while True:
            try:
                pid, wstatus = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return ex
            if pid == 0:
                return ex
            eng = self.engine
            if eng is None or pid != eng.pid:
                log.debug("reaped pid %d (not the engine)", pid)
                continue
            self._read_messages(eng)
            os.close(eng.pipe)
            ex = EngineExit(pid, os.waitstatus_to_exitcode(wstatus), time.monotonic() - eng.started, eng.ready_s, eng.reason)
            self.counters.exits = [*self.counters.exits[-19:], ex.to_json()]
            self.engine = None

    def _read_messages(self, eng: _Engine) -> None:
        while True:
            try:
                chunk = os.read(eng.pipe, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            eng.buffer += chunk
        *lines, eng.buffer = eng.buffer.split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line)
                event = msg["event"]
            except (ValueError, KeyError, TypeError):
                continue  # the engine wrote something else on the fd; not ours to judge
            if event == "ready" and eng.ready_s is None:
                eng.ready_s = float(msg["t"]) - eng.started
                recorded = msg.get("recorded")
                log.info("engine pid %d ready %.3f s after the fork%s", eng.pid, eng.ready_s,
                         f"; recorded {recorded} modules to {self.options.record}" if recorded else
                         f"; {self.options.record} unchanged (the engine imported nothing new)" if recorded == 0 else "")
                self._publish()
            elif event == "restart":
                eng.reason = str(msg.get("reason"))

    # -- what others see ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        eng = self.engine
        return {
            "supervisor_pid": self.pid, "state": self.state, "command": list(self.command.orig_argv),
            "started_at": self.counters.started_at, "preloaded_modules": self.preloaded,
            "engine": None if eng is None else {"pid": eng.pid, "uptime_s": round(time.monotonic() - eng.started, 3),
                                                "ready_s": None if eng.ready_s is None else round(eng.ready_s, 3)},
            "forks": self.counters.forks, "restarts": max(0, self.counters.forks - 1), "planned_restarts": self.policy.planned,
            "crashes": self.policy.crashes, "crash_streak": self.policy.crash_streak,
            "next_start_in_s": None if self.next_start is None else round(max(0.0, self.next_start - time.monotonic()), 3),
            "exits": self.counters.exits,
        }

    def _publish(self) -> None:
        st = self.status()
        if self.options.status:
            path = Path(self.options.status)
            try:
                _write_atomically(path, json.dumps(st, indent=2) + "\n")
            except OSError as exc:
                log.warning("cannot write the status file %s: %s", path, exc)
        eng = f"engine pid {st['engine']['pid']}" if st["engine"] else "no engine"
        with contextlib.suppress(OSError):
            engine_api.sd_notify(f"STATUS={st['state']}: {eng}; {st['restarts']} restarts "
                                 f"({st['planned_restarts']} planned, {st['crashes']} crashes)")


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a new file holding ``text``. The temporary file gets a name
    nobody can plant beforehand (mkstemp: random, O_EXCL, no link followed): a fixed
    ".NAME.tmp" let whoever may write the directory have the supervisor, often root,
    write through a symlink and move their own file into place as the status."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # what a plain open() would have made (mkstemp's is 0600)
        with os.fdopen(fd, "w") as f:
            fd = -1
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_handler: logging.Handler | None = None


def _attach_logger() -> None:
    global _handler
    if log.handlers:
        return  # configured by the embedding program (or a test)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s weightcache supervise[%(process)d]: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    # Our own handler, not the root logger's: the engine's logging.basicConfig() must work
    # as it would unsupervised.
    log.propagate = False


def _detach_logger() -> None:
    if _handler is not None:
        log.removeHandler(_handler)
        log.setLevel(logging.NOTSET)
        log.propagate = True


def supervise(command: list[str], options: SupervisorOptions) -> int:
    """The ``weightcache supervise`` command. Returns the supervisor's exit status."""
    _attach_logger()
    try:
        cmd = parse_command(command)
    except ConfigError as exc:
        log.error("%s", exc.message)
        return 2
    return Supervisor(cmd, options).run()
