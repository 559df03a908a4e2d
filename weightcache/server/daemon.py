"""The daemon's lifecycle: it builds the rooms, binds the socket, serves until told to
stop, then shuts down in order. It owns no policy (cache/core.py), no connection
handling (connections.py), no op (handlers.py, model_ops.py) and no I/O of models
(residency/), nor the config's models (config_models.py); it wires them together,
re-reads the config (reload) and hands metrics a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..backends import Backend
from ..cache import CacheCore
from ..cache.eviction import Quota
from ..config import Settings, load_settings
from ..errors import BadRequest, ConfigError
from ..systemd import reloading_message, sd_notify
from ..units import format_size
from .access import AccessPolicy, check_socket_dir, resolve_gid
from .config_models import ConfigModels
from .connections import Connections
from .handlers import Context
from .loop_watch import LoopWatch
from .metrics import MODEL_COUNTERS, Metrics, ModelFigures, Snapshot
from .outlived import Survey, other_daemons, still_mapping, survey
from .registry import Registry
from .residency import Residency
from .settings_reload import reload_budgets, reload_max_loaded, settings_changes
from .store import PublishedStore

if TYPE_CHECKING:
    from ..peers import Peers

# last_error["reason"] of a failed start/reload check, which a later good check clears
# (a load's own error stays until a load succeeds).

log = logging.getLogger("weightcache.daemon")


def quotas_of(settings: Settings) -> dict[str, Quota]:
    """The config's [quotas] as the core keeps them."""
    return {t: Quota(tenant=t, nbytes=dict(q.bytes), pins=q.pins) for t, q in settings.quotas.items()}


class Daemon:
    def __init__(self, settings: Settings, backends: dict[str, Backend], core: CacheCore,
                 config_path: str | None = None) -> None:
        self.settings = settings
        self.config_path = config_path
        self.backends = backends
        self.core = core
        self.socket_path = str(settings.daemon.socket)
        self.started = time.monotonic()
        # Made here, not in start(): a SIGTERM that comes while start() runs must be kept.
        self._stopping = asyncio.Event()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self.access = AccessPolicy(settings.daemon)
        self._reload_lock = asyncio.Lock()
        self._outlived = Survey(mappers=[], unreadable=0)
        self._others: list[dict[str, Any]] = []
        core.set_quotas(quotas_of(settings))
        self.registry = Registry(core, backends, self.access)
        self.residency = Residency(settings.daemon, core, self.registry, backends, shutting_down=self._stopping.is_set)
        self.config_models = ConfigModels(core, self.registry, self.residency, backends, self._stopping.is_set)
        self.metrics = Metrics(self.snapshot)
        stall_s = settings.daemon.loop_stall_s
        self.loop_watch = LoopWatch(stall_s, self.metrics.loop_lag.observe) if stall_s else None
        self.peers = _peers(settings, core, self.registry, backends, self.residency, self._stopping.is_set)
        self.store = PublishedStore(settings, core, self.registry, backends, self.residency, self.access) \
            if settings.published.dir is not None else None
        self.residency.flights.store = self.store
        self.context = Context(
            settings=settings, core=core, registry=self.registry, residency=self.residency, access=self.access, backends=backends,
            started=self.started, socket_path=self.socket_path, connections=lambda: len(self.connections),
            caller_of=lambda conn: self.connections.caller(conn),
            shutting_down=self._stopping.is_set, health=self.health, reload=self.reload_config,
            outlived=self.outlived, other_daemons=self.other_daemons,
            peers=lambda: self.peers.status() if self.peers is not None else None,
            loop=lambda: self.loop_watch.status() if self.loop_watch is not None else None,
        )
        self.connections = Connections(settings.daemon, self.access, core, self.residency, self.metrics,
                                       context=lambda: self.context, stopping=self._stopping)

    @property
    def shutting_down(self) -> bool:
        return self._stopping.is_set()

    # -- starting -------------------------------------------------------------------
    async def start(self) -> None:
        """Register the configured models, bind the socket, start serving. Preloads start
        in the background: the socket answers before they finish."""
        if self.loop_watch is not None:
            self.loop_watch.start()
        for mc in self.settings.models:
            self.registry.register(mc)
        if self.store is not None:  # published models kept on disk: registered again, read when asked for
            await asyncio.to_thread(self.store.open)
            self.store.restore()
        # Before the socket listens: a mapping seen now cannot be one of this daemon's.
        self._outlived = await asyncio.to_thread(survey, os.getpid())
        self._warn_outlived()
        self._others = await asyncio.to_thread(other_daemons, os.getpid())
        for other in self._others:
            log.warning("another weightcache daemon runs on this host (pid %d: %s): each takes its own budget of the "
                        "same memory, so together they can exceed it; run one daemon per host", other["pid"],
                        other["cmdline"], extra={"pid": other["pid"]})
        self._listener = self._bind(self.socket_path)
        if self.settings.daemon.metrics_listen:
            self.metrics.serve(self.settings.daemon.metrics_listen)
        if self.peers is not None:
            await self.peers.start()
        self._accepting = asyncio.ensure_future(self.connections.accept_loop(self._listener))
        log.info("weightcache %s serving on %s (pid %d)", __version__, self.socket_path, os.getpid())
        sd_notify(f"READY=1\nSTATUS=serving on {self.socket_path}")
        for mc in self.settings.models:
            self.config_models.preload_if_asked(mc)
        # Paths and headers are checked behind the socket (in the io pool): a bad one shows
        # in `models` as last_error long before anyone asks to load it.
        self.residency.tasks.spawn(self.config_models.check([mc.name for mc in self.settings.models]))
        self.residency.tasks.spawn(self.residency.keep_alive_loop())

    def _warn_outlived(self) -> None:
        s = self._outlived
        if s.mappers:
            total = sum(sum(m.models.values()) for m in s.mappers)
            who = "; ".join(f"pid {m.pid} ({m.comm}, uid {m.uid}): {', '.join(sorted(m.models))}" for m in s.mappers)
            log.warning("%d process(es) still map %s of weightcache memory from an earlier (or another) daemon, outside "
                        "this daemon's budget and leases until they exit or restart: %s (`weightcache status` lists "
                        "those still mapping it)", len(s.mappers), format_size(total), who)
        if s.unreadable:
            # Not only other users' processes when the daemon is not root: a root daemon in a
            # sandbox was refused one (this VM's init) too.
            log.info("could not read the memory maps of %d process(es) (permission denied): mappings of an "
                     "earlier daemon's memory held by them are not reported", s.unreadable)

    def other_daemons(self) -> list[dict[str, Any]]:
        """The other daemons found at start that still run (a pid reused by another
        command is not one)."""
        if self._others:
            self._others = other_daemons(os.getpid(), among=[o["pid"] for o in self._others])
        return list(self._others)

    def outlived(self) -> list[dict[str, Any]]:
        """The processes found at start mapping an earlier daemon's memfd arenas that still
        map them (re-read now: one that exited or restarted leaves the list)."""
        if not self._outlived.mappers:
            return []
        self._outlived.mappers = still_mapping(self._outlived.mappers)
        return [m.describe() for m in self._outlived.mappers]

    def _bind(self, path: str) -> socket.socket:
        p = Path(path)
        d = self.settings.daemon
        if not p.parent.exists():
            # Searchable by all: the socket file's own mode and group, and the peer
            # credential check, decide who gets in.
            p.parent.mkdir(mode=0o755, parents=True)
        check_socket_dir(p.parent)
        if p.is_symlink() or p.exists():
            if not p.is_socket():
                raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except (ConnectionRefusedError, FileNotFoundError):
                log.warning("removing stale socket %s (no daemon answers on it)", path)
                p.unlink()
            else:
                raise RuntimeError(f"another daemon is already serving on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)  # no window in which the socket is world-connectable
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        if d.socket_group is not None:
            try:
                os.chown(path, -1, resolve_gid(d.socket_group))
            except PermissionError:
                # chown(2) to a group needs membership of it: name the key, not the socket.
                sock.close()
                os.unlink(path)
                raise ConfigError(f"daemon.socket_group: cannot give {path} to group {d.socket_group!r}: the daemon's "
                                  f"user (uid {os.geteuid()}) is not a member; add it to the group (systemd: "
                                  "SupplementaryGroups=) or run the daemon as root", key="daemon.socket_group") from None
        os.chmod(path, d.socket_mode)
        sock.listen(512)
        return sock

    # -- stopping -------------------------------------------------------------------
    async def serve(self) -> None:
        """Serve until shutdown is requested, then shut down in order."""
        try:
            await self._stopping.wait()
        finally:
            await self._shutdown()

    def request_stop(self, reason: str = "") -> None:
        if not self._stopping.is_set():
            log.info("shutting down%s", f" ({reason})" if reason else "")
            sd_notify("STOPPING=1")
            self._stopping.set()

    async def _shutdown(self) -> None:
        """Stop accepting, refuse new work, give in-flight requests the grace period, close
        connections, free every arena, remove the socket."""
        grace = self.settings.daemon.shutdown_grace_s
        deadline = time.monotonic() + grace
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        # Tell every client; engines holding leases should detach (or restart elsewhere).
        await self.connections.broadcast({"event": "shutting_down", "grace_s": grace, "leases": len(self.core.leases)})
        pending = self.connections.in_flight() + self.residency.flights.tasks
        if pending:
            log.info("waiting up to %.1fs for %d request(s) in flight", grace, len(pending))
            _, still = await asyncio.wait(pending, timeout=grace or None) if grace else (set(), set(pending))
            for t in still:
                t.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        if self.core.leases:
            log.info("waiting up to %.1fs for %d lease(s) to end", max(0.0, deadline - time.monotonic()), len(self.core.leases))
            ticket = self.residency.room.freed.ticket()
            while self.core.leases and time.monotonic() < deadline:
                await self.residency.room.freed.wait(ticket, deadline - time.monotonic())
            if self.core.leases:
                log.warning("exiting with %d lease(s) still held; their mappings stay valid (memory is refcounted)",
                            len(self.core.leases))
        if self.peers is not None:
            await self.peers.close()  # its lends' leases end with it
        await self.connections.close()
        await self.residency.close()
        for backend in self.backends.values():
            backend.close()
        if self.loop_watch is not None:
            await self.loop_watch.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        log.info("stopped")

    # -- what others read -----------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """For probes and metrics: serving (alive and not shutting down) and ready (serving,
        and every preload done and succeeded: a DaemonSet rollout with a bad model path
        stops at the first node instead of reaching them all). Also read from the metrics
        thread: it only copies containers (atomic under the GIL)."""
        serving = not self.shutting_down
        pending, failed = sorted(self.residency.preloads.pending), dict(sorted(self.residency.preloads.failed.items()))
        return {"serving": serving, "ready": serving and not pending and not failed,
                "preloading": pending, "failed_preloads": failed, "uptime_s": time.monotonic() - self.started}

    def snapshot(self) -> Snapshot:
        """Plain figures for the metrics thread (copies containers first: atomic under the GIL)."""
        core = self.core
        devices = {name: {"budget": a.budget, "used": a.used, "reserved": a.reserved}
                   for name, a in [*core.devices.items(), *([("host", core.host)] if core.host.budget else [])]}
        # Not a publish's staging entry; and a model only some peers may use only when the
        # operator asked (metrics_all_models): any local user can read the port, and the
        # labels would name it (docs/deployment.md, "Tenants").
        everyone = self.settings.daemon.metrics_all_models
        models = [ModelFigures(e.name, e.device, str(e.state), e.nbytes, e.attach_count,
                               {k: getattr(e, k) for k in MODEL_COUNTERS})
                  for e in list(core.entries.values())
                  if not e.staging and (everyone or self._open_to_all(e.name))]
        health = self.health()
        return Snapshot(devices=devices, models=models, last_load_rate=dict(self.residency.stats.last_load_rate),
                        connections=len(self.connections), leases=len(core.leases), ready=health["ready"],
                        failed_preloads=[n for n in health["failed_preloads"]
                                         if everyone or self._open_to_all(self.registry.groups.get(n, [n])[0])],
                        counters=dict(self.residency.stats.counters),
                        filled=self.residency.stats.filled())

    def _open_to_all(self, entry: str) -> bool:
        model = self.registry.models.get(entry)
        return model is not None and model.config.allowed_uids is None and model.config.allowed_gids is None

    # -- reload ---------------------------------------------------------------------
    async def reload_config(self) -> dict[str, Any]:
        """Re-read the config file and apply it. New models are registered, removed ones
        unregistered. A model whose policy alone changed (keep_alive, pin, preload) is
        updated in place and stays resident; one whose path, device or shards changed is
        replaced only once the new checkpoint opens and its header parses. Budgets are
        checked as start checks them (``resolve_budget``) and applied, evicting what a
        lowered one no longer holds. Models that peers registered or published are left
        alone unless the config now names them: then the config's wins (``displaced``, or
        ``pending`` while the peer's copy is attached; Note [config names win] in config_models.py).

        One rule for the report: every change that did not take effect is one line in
        ``failed`` (a model kept because it is attached, a budget that attached models
        exceed or the device cannot hold, a [daemon] key read at start only), and
        ``weightcache reload`` exits non-zero when ``failed`` or ``pending`` is not
        empty. The ``reload`` op and SIGHUP both land here."""
        if self.config_path is None:
            raise BadRequest("the daemon was started without a config file; nothing to reload")
        # One reload at a time (SIGHUP and the op may overlap), each announced to systemd
        # (RELOADING=1 ... READY=1), with how it ended in STATUS=. A unit's ExecReload runs
        # `weightcache reload`, whose exit status is what fails `systemctl reload`.
        async with self._reload_lock:
            _notify(reloading_message())
            status = "reload failed: the config file could not be read"
            try:
                report = await self._reload(await asyncio.to_thread(load_settings, self.config_path))
                bad = len(report["failed"]) + len(report["pending"])
                status = f"{bad} change(s) of the last reload did not take effect" if bad else "reloaded"
                return report
            finally:
                _notify(f"READY=1\nSTATUS=serving on {self.socket_path}; {status}")

    async def _reload(self, new: Settings) -> dict[str, Any]:
        report: dict[str, Any] = {"added": [], "removed": [], "changed": [], "updated": [], "failed": [],
                                  "pending": [], "unchanged": [], "displaced": [], "evicted": [], "budgets": [],
                                  "max_loaded_models": [], "quotas": None}
        settings_changes(self.settings, new, report)
        await reload_budgets(self.core, self.backends, self.residency, new, report)
        await reload_max_loaded(self.core, self.backends, self.residency, new, report)
        quotas = quotas_of(new)
        if quotas != self.core.quotas:
            self.core.set_quotas(quotas)  # in place; a lowered one evicts nothing now (Note [quotas])
            report["quotas"] = sorted(quotas)
        await self.config_models.reload(new.models, report)
        if self.store is not None:
            await self.store.reload(new, report)
        elif new.published != self.settings.published:
            report["failed"].append("published: changed in the file, but read at start only: restart the daemon to "
                                    "apply it")
        log.info("reload: %s", {k: v for k, v in report.items() if v and k != "unchanged"})
        for line in report["failed"] + report["pending"]:  # each change that did not take effect, on its own line
            log.error("reload: not in effect: %s", line)
        # The models the file left as they were get the same check: a file deleted or
        # replaced since the last one shows now, not at the next load (the check logs it).
        await self.config_models.check(report["unchanged"] + report["updated"])
        return report


def _peers(settings: Settings, core: CacheCore, registry: Registry, backends: dict[str, Backend], residency: Residency,
           stopping: Callable[[], bool]) -> Peers | None:
    """The [peers] section at work (weightcache/peers/), or None when it has no listen address."""
    if settings.peers.listen is None:
        return None
    from ..peers import Peers  # only where configured: it imports NIXL's wrapper

    peers = Peers(settings.peers, core=core, registry=registry, backends=backends, notify_space=residency.room.notify,
                  shutting_down=stopping)
    residency.flights.neighbours = peers
    residency.pins.pinned = lambda: peers.settings.fingerprints
    residency.room.on_refused = peers.lender.end_idle  # a local load's need for room ends idle lends
    return peers


def _notify(message: str) -> None:
    """sd_notify for a reload: a notify socket that has gone (systemd re-executed) must not
    turn the reload's report into an INTERNAL error."""
    try:
        sd_notify(message)
    except OSError as exc:
        log.warning("could not tell systemd %r: %s", message.partition("\n")[0], exc)
