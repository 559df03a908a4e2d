"""The daemon process: logging, the devices and their budgets, the cache core, signals,
uvloop, and a clean exit.

Heavy setup (CUDA initialisation, the backends) happens here, in ``build``, not at import
time: the CLI imports this module only for ``serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import threading
import time
from pathlib import Path

from ..backends import Backend, backend_for
from ..cache import CacheCore
from ..config import Settings
from ..errors import ConfigError, WeightcacheError
from ..protocol import CONFIG_ENV, SOCKET_ENV
from ..systemd import StopRequests
from .daemon import Daemon
from .logs import setup_logging
from .settings_reload import resolve_budget

log = logging.getLogger("weightcache.daemon")

# sockaddr_un's sun_path: 108 bytes on Linux, one of them the terminating NUL.
AF_UNIX_PATH_MAX = 107


class StartupError(Exception):
    """The daemon cannot start as configured: one line naming the key or path and what to
    do, logged (as JSON in JSON mode) and exit status 2, never a traceback."""

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields


def check_socket_path(path: Path) -> None:
    """What would make binding ``daemon.socket`` fail or take over someone else's socket,
    checked before anything is created (daemon.py's _bind checks again, for races)."""
    raw = os.fsencode(path)
    if len(raw) > AF_UNIX_PATH_MAX:
        raise StartupError(f"daemon.socket: {path} is {len(raw)} bytes long; a Unix socket path holds at most "
                           f"{AF_UNIX_PATH_MAX}: choose a shorter path (e.g. /run/weightcache/weightcache.sock)",
                           key="daemon.socket", path=str(path))
    for parent in path.parents:  # the nearest one that exists must be a directory (_bind makes the rest)
        if parent.is_symlink() or parent.exists():
            if not parent.is_dir():
                raise StartupError(f"daemon.socket: {parent}, the socket's parent, is not a directory: remove it "
                                   "or choose a socket path in a directory", key="daemon.socket", path=str(parent))
            break
    if path.is_socket():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                return  # no daemon answers: _bind replaces it as stale
        raise StartupError(f"daemon.socket: another daemon is already serving on {path}: stop it first "
                           "(weightcache --socket PATH status shows its pid), or give this one another socket",
                           key="daemon.socket", path=str(path))
    if path.is_symlink() or path.exists():
        raise StartupError(f"daemon.socket: {path} exists and is not a socket: remove it or choose another path",
                           key="daemon.socket", path=str(path))


def claim_metrics_port(daemon: Daemon, listen: str) -> None:
    try:
        daemon.metrics.bind(listen)
    except ValueError as exc:
        raise StartupError(f"daemon.metrics_listen: {exc}; give it as host:port, e.g. \"127.0.0.1:9464\"",
                           key="daemon.metrics_listen") from None
    except OSError as exc:  # EADDRINUSE, EACCES below 1024, an unknown host
        raise StartupError(f"daemon.metrics_listen: cannot listen on {listen} ({exc.strerror or exc}): stop what "
                           "listens there or choose another port", key="daemon.metrics_listen", listen=listen) from None


def build(settings: Settings, config_path: str | None = None) -> Daemon:
    """The backends of every budgeted device, their budgets resolved, the core built from
    them, and the daemon around it. Needs a running event loop (the daemon's events)."""
    backends: dict[str, Backend] = {}
    budgets = {}
    for device, budget in settings.budgets.items():
        backend = backends[device] = backend_for(device)
        budgets[device] = resolve_budget(device, budget, backend.total_memory())  # as a reload checks it
        backend.limit(budgets[device])
        backend.configure_loads(settings.daemon.load_depth, settings.daemon.load_page_cache_dma, settings.daemon.load_chunk_loop)
        backend.prepare_loads(settings.daemon.load_threads, settings.daemon.load_chunk_bytes)
        log.info("device %s: backend %s, budget %d bytes (%s)", device, backend.kind, budgets[device], budget)
    host_budget = settings.daemon.host_budget
    tiered = [b for b in backends.values() if b.supports_host_tier]
    if host_budget and not tiered:
        log.warning("host_budget is set but no configured device has a host tier (only GPUs do); ignoring it")
        host_budget = 0
    if host_budget:
        pool = tiered[0].start_host_tier(host_budget)
        for b in tiered:
            b.use_host_pool(pool)
        log.info("host tier: pinning %d bytes of host memory for demoted GPU models (in the background)", host_budget)
    return Daemon(settings, backends, CacheCore(budgets, host_budget=host_budget, policy=settings.daemon.eviction_policy,
                                                max_loaded=settings.daemon.max_loaded_models), config_path)


def run_daemon(settings: Settings, config_path: str | None = None) -> int:
    """Run until SIGTERM/SIGINT; a second request forces exit (the same signal again within
    a second is the first delivered twice: :class:`~weightcache.systemd.StopRequests`);
    SIGHUP reloads the config.
    Returns the exit status: 0, or 2 when it could not start (logged as one line)."""
    import uvloop

    setup_logging(settings.daemon.log_level, settings.daemon.log_format)
    _raise_fd_limit()
    settings, config_path = leave_working_directory(settings, config_path)
    try:
        check_socket_path(Path(settings.daemon.socket))  # before the devices: nothing made yet
        uvloop.run(_main(settings, config_path))
    except (StartupError, ConfigError) as exc:
        fields = exc.fields if isinstance(exc, StartupError) else {"code": exc.code, **exc.details}
        log.error("%s", exc.message, extra=fields)
        _exit_past_stuck_threads(2)
        return 2
    _exit_past_stuck_threads(0)
    return 0


# Where the daemon runs from: nothing it or a child of it does may depend on (or import
# from) the directory it was started in, which may be one others can write
# (parse_worker.py, Note [what a worker runs]).
DAEMON_CWD = "/"
# Variables naming paths that a reload reads again (config/load.py): made absolute once.
_PATH_VARIABLES = (SOCKET_ENV, "WEIGHTCACHE_DAEMON__SOCKET", CONFIG_ENV)


def leave_working_directory(settings: Settings, config_path: str | None) -> tuple[Settings, str | None]:
    """``chdir`` to DAEMON_CWD, first making absolute what was relative to the working
    directory: the config file's path (a reload reads it again), the socket when
    ``--socket`` or the environment gave it, and those variables themselves (a reload
    reads them again). Paths written in the config file are relative to the file already
    (config/file.py)."""
    for var in _PATH_VARIABLES:
        value = os.environ.get(var)
        if value and not os.path.isabs(os.path.expanduser(value)):
            os.environ[var] = os.path.abspath(value)
    if config_path is not None:
        config_path = os.path.abspath(config_path)
    d = settings.daemon
    if not d.socket.is_absolute() or any(not r.is_absolute() for r in d.model_roots):
        d = d.model_copy(update={"socket": Path(os.path.abspath(d.socket)),
                                 "model_roots": [Path(os.path.abspath(r)) for r in d.model_roots]})
        settings = settings.model_copy(update={"daemon": d})
    os.chdir(DAEMON_CWD)
    return settings, config_path


async def _main(settings: Settings, config_path: str | None) -> None:
    loop = asyncio.get_running_loop()
    daemon = build(settings, config_path)
    if settings.daemon.metrics_listen:
        # Before the socket: a busy port must not leave a bound socket behind.
        claim_metrics_port(daemon, settings.daemon.metrics_listen)
    stops = StopRequests()

    def on_signal(sig: signal.Signals) -> None:
        taken = stops.take(sig)  # no siginfo here: the sender is not known
        if taken == "again":
            log.warning("second %s: exiting now", sig.name)
            os._exit(1)
        if taken == "duplicate":
            log.info("%s again within %g s: taken as the same request (sent to the daemon and to its process group); "
                     "send it again to exit now", sig.name, StopRequests.REPEAT_AFTER_S)
        else:
            daemon.request_stop(sig.name)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    def on_hup() -> None:  # reload the config, like the reload op
        async def reload() -> None:
            try:
                await daemon.reload_config()
            except WeightcacheError as exc:
                log.error("SIGHUP reload failed: %s", exc)

        daemon.residency.tasks.spawn(reload())

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    # Handlers first: systemd may send SIGTERM as soon as READY=1 went out in start().
    try:
        await daemon.start()
    except (RuntimeError, OSError) as exc:  # _bind's own refusals, or a race with the checks above
        _unbind(daemon)
        raise StartupError(f"daemon.socket: cannot serve on {daemon.socket_path}: {exc}",
                           key="daemon.socket", path=daemon.socket_path) from None
    await daemon.serve()


def _unbind(daemon: Daemon) -> None:
    """A start that failed after binding the socket leaves no socket behind."""
    listener = daemon._listener
    if listener is not None:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(daemon.socket_path)


def _raise_fd_limit() -> None:
    """Every lease's fds, every peer's in-flight fds and every open checkpoint count
    against RLIMIT_NOFILE; take the hard limit (often 1024 soft vs 1M+ hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _exit_past_stuck_threads(status: int) -> None:
    """Interpreter exit joins worker threads; one stuck in a system call (a hung network
    file system) would keep a stopped daemon alive. Everything is released by now."""
    deadline = time.monotonic() + 2.0
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if stuck:
        log.warning("exiting with %d worker thread(s) still blocked: %s", len(stuck), ", ".join(stuck))
        logging.shutdown()
        os._exit(status)
