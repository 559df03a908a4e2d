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
import threading
import time

from ..backends import Backend, backend_for
from ..cache import CacheCore
from ..config import Settings
from ..errors import ConfigError, WeightcacheError
from ..units import format_size
from .daemon import Daemon
from .logs import setup_logging

log = logging.getLogger("weightcache.daemon")


def build(settings: Settings, config_path: str | None = None) -> Daemon:
    """The backends of every budgeted device, their budgets resolved, the core built from
    them, and the daemon around it. Needs a running event loop (the daemon's events)."""
    backends: dict[str, Backend] = {}
    budgets = {}
    for device, budget in settings.budgets.items():
        backend = backends[device] = backend_for(device)
        total = backend.total_memory()
        if budget.nbytes is not None and budget.nbytes > total:
            raise ConfigError(f"budgets.{device}: {budget} is more than the device's {format_size(total)}; "
                              "give a size it has, or a fraction such as \"0.8\"")
        budgets[device] = budget.resolve(total)
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
    return Daemon(settings, backends, CacheCore(budgets, host_budget=host_budget, policy=settings.daemon.eviction_policy), config_path)


def run_daemon(settings: Settings, config_path: str | None = None) -> None:
    """Run until SIGTERM/SIGINT; a second signal forces exit; SIGHUP reloads the config."""
    import uvloop

    setup_logging(settings.daemon.log_level, settings.daemon.log_format)
    _raise_fd_limit()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        daemon = build(settings, config_path)
        signals = {"count": 0}

        def on_signal(sig: signal.Signals) -> None:
            signals["count"] += 1
            if signals["count"] > 1:
                log.warning("second %s: exiting now", sig.name)
                os._exit(1)
            daemon.request_stop(sig.name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)

        def on_hup() -> None:  # reload the config, like the reload op
            async def reload() -> None:
                try:
                    await daemon.reload_config()
                except WeightcacheError as exc:
                    log.error("SIGHUP reload failed: %s", exc)

            daemon.loads.spawn(reload())

        loop.add_signal_handler(signal.SIGHUP, on_hup)
        # Handlers first: systemd may send SIGTERM as soon as READY=1 went out in start().
        await daemon.start()
        await daemon.serve()

    uvloop.run(main())
    _exit_past_stuck_threads()


def _raise_fd_limit() -> None:
    """Every lease's fds, every peer's in-flight fds and every open checkpoint count
    against RLIMIT_NOFILE; take the hard limit (often 1024 soft vs 1M+ hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _exit_past_stuck_threads() -> None:
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
        os._exit(0)
