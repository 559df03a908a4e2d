"""The daemon: asyncio on uvloop around the pure cache core.

Each connection owns its raw non-blocking socket (see protocol/transport.py for why not
streams). Every request runs as its own task, so a slow ``load`` never holds up a
``status`` on the same or another connection; blocking work (header parsing, file reads,
allocation, sealing) runs in threads. Loads are single-flight tasks that belong to the
daemon, not to the request that started them: a client that disconnects mid-load does
not cancel a load that others wait on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import resource
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgpack

from .. import __version__
from ..backends import Arena, Backend, backend_for
from ..cache import CacheCore, LoadPlan, State, StepDown
from ..config import ModelConfig, Settings, check_model_name, load_settings, under_roots
from ..errors import (
    Attached,
    BadRequest,
    CorruptCheckpoint,
    FrameTooLarge,
    InternalError,
    LimitExceeded,
    LoadFailed,
    NoSpace,
    PermissionDenied,
    Pinned,
    ProtocolVersionError,
    RequestTimeout,
    ShuttingDown,
    UnknownModel,
    UnknownOp,
    WeightcacheError,
)
from ..loader import Checkpoint, OpenedSource, Progress, adopt_fds, open_source, parse_checkpoint
from ..loader.checkpoint import published_checkpoint
from ..protocol import PROTOCOL_VERSION, FrameDecoder, decode_payload
from ..protocol.messages import ADMIN_OPS, tenant_fingerprint
from ..protocol.packed import Packed, encode_reply
from ..protocol.transport import recv_with_fds, send_with_fds
from .access import AccessPolicy, Peer, check_socket_dir, resolve_gid
from .fills import CopyPublished, FillStrategy, Promote, ReadFiles
from .ops import JsonFormatter, Metrics, sd_notify

log = logging.getLogger("weightcache.daemon")

# Where a model came from: the operator's config file, a peer's register, a peer's publish.
Origin = Literal["config", "register", "publish"]
T = TypeVar("T")


def encode_table(ckpt: Checkpoint) -> bytes:
    return msgpack.packb(ckpt.wire_tensors(), use_bin_type=True)  # type: ignore[no-any-return]


_FILE_DETAILS = frozenset({"file", "path", "roots"})  # error details that describe the daemon's files


def _redacted(error: dict[str, Any]) -> dict[str, Any]:
    """A load error as a peer who may not see the model's files gets it: the code, and
    nothing about paths, sizes or bytes (those answer questions about the daemon's disks)."""
    return {"code": error.get("code", "INTERNAL"),
            "message": "the checkpoint could not be loaded; the daemon's log and administrators have the details"}


@dataclass
class Model:
    """What the daemon holds for one cache entry beyond the core's accounting. An
    unsharded model is one entry named like the model; a sharded one is an entry per rank,
    named ``model@rank``, each on its own device, grouped in ``Daemon.groups``."""

    config: ModelConfig  # the whole model's config (all ranks)
    path: Path  # this entry's checkpoint
    device: str  # this entry's device
    rank: int | None  # None for an unsharded model
    origin: Origin = "config"
    owner: int | None = None  # uid that registered or published it; None for the operator's config
    files: OpenedSource | None = None  # a peer's own open files (register with fds), held while registered
    checkpoint: Checkpoint | None = None  # parsed at load time; identity of what is resident
    table: bytes = b""  # the attach reply's tensor table, msgpack-encoded once per load
    arena: Arena | None = None
    host: Any = None  # the backend's host-tier copy while the model is HOST
    last_error: dict[str, Any] | None = None

    @property
    def published(self) -> bool:  # sent by an engine: no files to reload it from
        return self.origin == "publish"

    def unchanged(self) -> bool:
        """The resident bytes still are what the files hold (the staleness check)."""
        if self.checkpoint is None:
            return False
        if self.files is not None:  # a peer's fds: the same inodes, unchanged since parsed
            return self.checkpoint.matches(self.files)
        return self.checkpoint.unchanged_on_disk()


@dataclass
class Connection:
    id: int
    sock: socket.socket
    peer: Peer  # pid, uid, gid(s) from SO_PEERCRED
    client: str = "?"
    greeted: bool = False
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: dict[asyncio.Task[None], str] = field(default_factory=dict)  # request in flight -> its op
    fds: deque[int] = field(default_factory=deque)  # received, not yet claimed by a frame ("fds": n)
    unsent: int = 0  # bytes of the reply being sent that the peer has not taken yet
    partial: int = 0  # bytes of a half-received frame (summed in Daemon.partial_bytes)
    # Set while the daemon may read more requests: fewer than max_requests_per_connection
    # in flight and at most max_queued_reply_bytes of replies the peer has not read.
    readable: asyncio.Event = field(default_factory=asyncio.Event)


def _arg(req: dict[str, Any], key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
    """A request argument of the expected type, or BadRequest naming it."""
    if key not in req or req[key] is None:
        if default is ...:
            raise BadRequest(f"missing argument {key!r}", argument=key)
        return default
    value = req[key]
    if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, float, (int, float))):
        want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise BadRequest(f"argument {key!r} must be {want}, got {type(value).__name__}", argument=key)
    return value


class Daemon:
    def __init__(self, settings: Settings, config_path: str | None = None) -> None:
        self.settings = settings
        self.config_path = config_path
        self.backends: dict[str, Backend] = {}
        self.core: CacheCore | None = None
        self.models: dict[str, Model] = {}  # cache entries by entry name
        self.groups: dict[str, list[str]] = {}  # model name -> its entries, in rank order
        self.loads: dict[str, asyncio.Task[None]] = {}
        self.demotions: dict[str, asyncio.Task[None]] = {}  # device -> host copies in flight
        self._releasing: set[asyncio.Task[Any]] = set()  # arenas being freed in threads
        self.progress: dict[str, Progress] = {}
        self.conns: dict[int, Connection] = {}
        self.partial_bytes = 0  # half-received frames over every connection (max_partial_frame_bytes)
        self._staging_ids = itertools.count(1)
        # Opening and parsing what peers name or send: bounded, and apart from the loads.
        self._io_pool = ThreadPoolExecutor(settings.daemon.io_threads, thread_name_prefix="wc-io")
        self._conn_ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._space_freed: asyncio.Condition | None = None
        # Made here, not in start(): a SIGTERM that comes while start() runs must be kept.
        self._stopping = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self.started = time.monotonic()
        self.socket_path = str(settings.daemon.socket)
        self.access = AccessPolicy(settings.daemon)
        self.metrics = Metrics(self)
        self.last_load_rate: dict[str, float] = {}  # bytes/s of each model's last load (metrics)
        # Preloads decide readiness (the health op): pending until every rank is resident,
        # failed with the error until a later preload of that model succeeds.
        self.preloads_pending: set[str] = set()
        self.preloads_failed: dict[str, str] = {}
        self._ops: dict[str, Callable[[Connection, dict[str, Any]], Awaitable[tuple[dict[str, Any], list[int]]]]] = {
            "status": self.op_status, "models": self.op_models, "load": self.op_load,
            "attach": self.op_attach, "detach": self.op_detach, "evict": self.op_evict,
            "pin": self.op_pin, "unpin": self.op_unpin, "register": self.op_register,
            "unregister": self.op_unregister, "reload": self.op_reload, "publish": self.op_publish,
            "health": self.op_health,
        }

    @property
    def shutting_down(self) -> bool:
        return self._stopping.is_set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Build backends and budgets, register the configured models, bind the socket.
        Preloads start in the background: the socket answers before they finish."""
        self._space_freed = asyncio.Condition()
        _raise_fd_limit()
        budgets = {}
        for device, budget in self.settings.budgets.items():
            backend = backend_for(device)
            self.backends[device] = backend
            budgets[device] = budget.resolve(backend.total_memory())
            log.info("device %s: backend %s, budget %d bytes (%s)", device, backend.kind, budgets[device], budget)
        host_budget = self.settings.daemon.host_budget
        if host_budget and not any(b.supports_host_tier for b in self.backends.values()):
            log.warning("host_budget is set but no configured device has a host tier (only GPUs do); ignoring it")
            host_budget = 0
        self.core = CacheCore(budgets, host_budget=host_budget)
        if host_budget:
            tiered = [b for b in self.backends.values() if b.supports_host_tier]
            pool = tiered[0].start_host_tier(host_budget)  # type: ignore[attr-defined]
            for b in tiered:
                b.host_pool = pool  # type: ignore[attr-defined]
            log.info("host tier: pinning %d bytes of host memory for demoted GPU models (in the background)", host_budget)
        for mc in self.settings.models:
            self._register(mc)
        self._listener = self._bind(self.socket_path)
        if self.settings.daemon.metrics_listen:
            self.metrics.serve(self.settings.daemon.metrics_listen)
        log.info("weightcache %s serving on %s (pid %d)", __version__, self.socket_path, os.getpid())
        sd_notify(f"READY=1\nSTATUS=serving on {self.socket_path}")
        for mc in self.settings.models:
            if mc.preload:
                self._start_preload(mc.name)
        self._spawn(self._keep_alive_loop())

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
            os.chown(path, -1, resolve_gid(d.socket_group))
        os.chmod(path, d.socket_mode)
        sock.listen(512)
        return sock

    async def serve(self) -> None:
        """Accept connections until shutdown is requested, then shut down in order."""
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        accept = asyncio.ensure_future(self._accept_loop(loop))
        try:
            await self._stopping.wait()
        finally:
            accept.cancel()
            await asyncio.gather(accept, return_exceptions=True)
            await self._shutdown()

    def request_stop(self, reason: str = "") -> None:
        if not self._stopping.is_set():
            log.info("shutting down%s", f" ({reason})" if reason else "")
            sd_notify("STOPPING=1")
            self._stopping.set()

    async def _accept_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # EMFILE and friends: log, back off, keep serving
                log.error("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            conn = Connection(id=next(self._conn_ids), sock=sock, peer=Peer.of(sock))
            refusal: WeightcacheError | None = None
            if not self.access.allows(conn.peer):
                log.warning("refused conn from pid %d uid %d gid %d: not in allowed uids/gids",
                            conn.peer.pid, conn.peer.uid, conn.peer.gid)
                refusal = PermissionDenied(f"uid {conn.peer.uid} may not use this weightcache daemon", uid=conn.peer.uid)
            elif len(self.conns) >= self.settings.daemon.max_connections:
                log.warning("refused conn from pid %d: %d connections open", conn.peer.pid, len(self.conns))
                refusal = LimitExceeded(f"the daemon holds its maximum of {len(self.conns)} connections",
                                        limit=self.settings.daemon.max_connections)
            elif (mine := sum(1 for c in self.conns.values() if c.peer.uid == conn.peer.uid)) >= self.settings.daemon.max_connections_per_uid:
                log.warning("refused conn from pid %d: uid %d holds %d connections", conn.peer.pid, conn.peer.uid, mine)
                refusal = LimitExceeded(f"uid {conn.peer.uid} holds its maximum of {mine} connections",
                                        limit=self.settings.daemon.max_connections_per_uid)
            if refusal is not None:
                self._spawn(self._refuse(conn, refusal))
                continue
            self.conns[conn.id] = conn
            self._spawn(self._serve_connection(conn))

    async def _refuse(self, conn: Connection, exc: WeightcacheError) -> None:
        try:
            await self._send_final(conn, exc)
        finally:
            conn.sock.close()

    async def _shutdown(self) -> None:
        """Stop accepting (done by the caller), refuse new work, give in-flight requests
        the grace period, close connections, free every arena, remove the socket."""
        assert self.core is not None and self._space_freed is not None
        grace = self.settings.daemon.shutdown_grace_s
        deadline = time.monotonic() + grace
        if self._listener is not None:
            self._listener.close()
        # Tell every client; engines holding leases should detach (or restart elsewhere).
        note = {"id": None, "event": "shutting_down", "grace_s": grace, "leases": len(self.core.leases)}
        # A peer that does not read must not hold the shutdown: each send gets a second.
        await asyncio.gather(*(asyncio.wait_for(self._send(c, dict(note)), 1.0) for c in list(self.conns.values())),
                             return_exceptions=True)
        pending = [t for c in self.conns.values() for t in c.tasks] + list(self.loads.values())
        if pending:
            log.info("waiting up to %.1fs for %d request(s) in flight", grace, len(pending))
            _, still = await asyncio.wait(pending, timeout=grace or None) if grace else (set(), set(pending))
            for t in still:
                t.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        if self.core.leases:
            log.info("waiting up to %.1fs for %d lease(s) to end", max(0.0, deadline - time.monotonic()), len(self.core.leases))
            async with self._space_freed:
                while self.core.leases and time.monotonic() < deadline:
                    try:
                        await asyncio.wait_for(self._space_freed.wait(), deadline - time.monotonic())
                    except TimeoutError:
                        break
            if self.core.leases:
                log.warning("exiting with %d lease(s) still held; their mappings stay valid (memory is refcounted)",
                            len(self.core.leases))
        for conn in list(self.conns.values()):
            conn.sock.close()
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for model in self.models.values():
            if model.arena is not None:
                self.backends[model.arena.device].free(model.arena)
                model.arena = None
            if model.host is not None:
                self.backends[model.device].free_host(model.host)
                model.host = None
        for model in self.models.values():
            if model.files is not None:
                model.files.close()
        for backend in self.backends.values():
            backend.close()
        self._io_pool.shutdown(wait=False, cancel_futures=True)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        log.info("stopped")

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    # ------------------------------------------------------------------ connections
    # Note [untrusted peers]
    # ----------------------
    # Any allowed peer may be hostile. Nothing one connection sends may cost the daemon
    # unbounded memory, fds, threads or loop time, or delay another connection:
    # - requests: at most max_requests_per_connection in flight; beyond that, or while a
    #   reply of more than max_queued_reply_bytes waits for the peer to read it, the
    #   daemon stops reading the connection (the kernel's buffer then stops the peer);
    # - frames: one deadline per frame from its first byte (frame_read_timeout_s), a
    #   deadline for hello, and half-received frames summed over every connection
    #   (max_partial_frame_bytes);
    # - fds: only with a frame's first bytes, at most max_fds_per_frame, and at most
    #   max_fds_per_uid waiting for frames not yet complete;
    # - decoding: msgpack's structural limits (framing.decode_payload) bound loop time;
    #   big tables are validated in the io pool and attach tables are encoded once.
    async def _serve_connection(self, conn: Connection) -> None:
        d = self.settings.daemon
        decoder = FrameDecoder(d.max_frame_bytes)
        log.debug("conn %d open: pid %d uid %d", conn.id, conn.peer.pid, conn.peer.uid)
        hello_deadline = time.monotonic() + d.hello_timeout_s
        frame_deadline: float | None = None  # set when a frame's first byte arrives
        conn.readable.set()
        try:
            while True:
                await conn.readable.wait()
                deadlines = [t for t in (None if conn.greeted else hello_deadline, frame_deadline) if t is not None]
                timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                try:
                    # asyncio.timeout, not wait_for: no second task, so the fds recvmsg took
                    # are counted below before any other connection's read runs.
                    async with asyncio.timeout(timeout):
                        data, fds = await recv_with_fds(conn.sock)
                except TimeoutError:
                    self._close_fds(conn)
                    if frame_deadline is not None and time.monotonic() >= frame_deadline:
                        why = f"frame incomplete {d.frame_read_timeout_s:g}s after its first byte"
                    else:
                        why = f"no hello within {d.hello_timeout_s:g}s"
                    log.warning("conn %d (uid %d): %s; closing it", conn.id, conn.peer.uid, why)
                    await self._send_final(conn, RequestTimeout(f"{why}; closing the connection"))
                    break
                except (ConnectionError, OSError):
                    break
                pending_before = decoder.pending
                if fds:
                    conn.fds.extend(fds)  # closed with the connection if refused below
                    refusal = self._check_fds(conn, len(fds))
                    if refusal is not None:
                        log.warning("conn %d (uid %d): %s; closing it", conn.id, conn.peer.uid, refusal.message)
                        self._close_fds(conn)  # now, not after the (up to 1 s) goodbye
                        await self._send_final(conn, refusal)
                        break
                if not data:
                    break
                try:
                    frames = decoder.feed(data)
                except FrameTooLarge as exc:
                    # The stream is out of step: answer, then close this connection only.
                    log.warning("conn %d: %s; closing it", conn.id, exc.message)
                    self._close_fds(conn)
                    await self._send_final(conn, exc)
                    break
                self.partial_bytes += decoder.pending - conn.partial
                conn.partial = decoder.pending
                if self.partial_bytes > d.max_partial_frame_bytes:
                    self._close_fds(conn)
                    log.warning("conn %d (uid %d): half-received frames of all connections exceed %d bytes; closing it",
                                conn.id, conn.peer.uid, d.max_partial_frame_bytes)
                    await self._send_final(conn, LimitExceeded(
                        f"the daemon holds {d.max_partial_frame_bytes} bytes of unfinished frames; send whole frames",
                        limit=d.max_partial_frame_bytes))
                    break
                # fds ride on a frame's first byte: a frame must start in this read.
                started_here = pending_before == 0 or len(frames) > 1 or (len(frames) == 1 and decoder.pending > 0)
                if fds and not started_here:
                    log.warning("conn %d (uid %d): fds sent inside a frame; closing it", conn.id, conn.peer.uid)
                    self._close_fds(conn)
                    await self._send_final(conn, BadRequest("file descriptors must come with a frame's first byte"))
                    break
                if not decoder.pending:
                    frame_deadline = None
                elif frames or frame_deadline is None:  # a new frame began in this read
                    frame_deadline = time.monotonic() + d.frame_read_timeout_s
                for payload in frames:
                    # One read may hold hundreds of small frames: the in-flight limit
                    # holds between them too, not only between reads.
                    await conn.readable.wait()
                    self._dispatch(conn, payload)
                if not decoder.pending:  # fds no frame claimed: nobody will
                    self._close_fds(conn)
        finally:
            self.partial_bytes -= conn.partial
            conn.partial = 0
            self._close_fds(conn)
            await self._close_connection(conn)

    def _check_fds(self, conn: Connection, arrived: int) -> WeightcacheError | None:
        d = self.settings.daemon
        if arrived > d.max_fds_per_frame or len(conn.fds) > 2 * d.max_fds_per_frame:
            return LimitExceeded(f"at most {d.max_fds_per_frame} file descriptors per frame", limit=d.max_fds_per_frame)
        waiting = sum(len(c.fds) for c in self.conns.values() if c.peer.uid == conn.peer.uid)
        if waiting > d.max_fds_per_uid:
            return LimitExceeded(f"uid {conn.peer.uid} has {waiting} file descriptors waiting for unfinished frames "
                                 f"(limit {d.max_fds_per_uid})", limit=d.max_fds_per_uid)
        return None

    @staticmethod
    def _close_fds(conn: Connection) -> None:
        while conn.fds:
            os.close(conn.fds.popleft())

    async def _close_connection(self, conn: Connection) -> None:
        """The peer is gone. A ``load`` it asked for still completes (the docs promise it,
        and it may have been the first to ask); every other request is cancelled, so no
        lease is granted to a dead connection; then its leases end. Leases end before any
        load is awaited: that load may be waiting for exactly the memory they hold."""
        self.conns.pop(conn.id, None)
        cancelled = [t for t, op in conn.tasks.items() if op != "load"]
        for t in cancelled:
            t.cancel()
        await asyncio.gather(*cancelled, return_exceptions=True)
        for t in list(conn.tasks):  # loads: now the daemon's to finish and to await at shutdown
            self._background.add(t)
            t.add_done_callback(self._background.discard)
        assert self.core is not None
        dropped = self.core.drop_connection(conn.id)
        if dropped:
            log.info("conn %d (%s, pid %d) closed holding %d lease(s); released", conn.id, conn.client, conn.peer.pid, len(dropped))
            await self._notify_space()
        conn.sock.close()

    def _dispatch(self, conn: Connection, payload: bytes) -> None:
        try:
            req = decode_payload(payload)
        except WeightcacheError as exc:
            self._reply_later(conn, {"id": None, "ok": False, "error": exc.to_wire()})
            return
        rid = req.get("id")
        if not isinstance(rid, int) or isinstance(rid, bool):
            err = BadRequest("request needs an integer 'id'")
            self._reply_later(conn, {"id": None, "ok": False, "error": err.to_wire()})
            return
        nfds = req.pop("fds", 0)
        if not isinstance(nfds, int) or isinstance(nfds, bool) or not 0 <= nfds <= len(conn.fds):
            err = BadRequest(f"'fds' is {nfds!r} but {len(conn.fds)} file descriptor(s) arrived with the frame")
            self._reply_later(conn, {"id": rid, "ok": False, "error": err.to_wire()})
            return
        req["_fds"] = [conn.fds.popleft() for _ in range(nfds)]  # closed when the request ends
        op = req.get("op")
        if op == "hello":
            for fd in req["_fds"]:
                os.close(fd)
            # Handled inline so that requests pipelined behind it see greeted=True.
            try:
                reply = self.op_hello(conn, req)
            except WeightcacheError as exc:
                reply = {"ok": False, "error": exc.to_wire()}
            self._reply_later(conn, {"id": rid, **reply})
            return
        self._track(conn, asyncio.ensure_future(self._handle(conn, rid, op, req)), str(op))

    def _reply_later(self, conn: Connection, msg: dict[str, Any]) -> None:
        self._track(conn, asyncio.ensure_future(self._send(conn, msg)), "reply")

    def _track(self, conn: Connection, task: asyncio.Task[None], op: str) -> None:
        conn.tasks[task] = op

        def done(t: asyncio.Task[None]) -> None:
            conn.tasks.pop(t, None)
            self._update_readable(conn)

        task.add_done_callback(done)
        self._update_readable(conn)

    def _update_readable(self, conn: Connection) -> None:
        d = self.settings.daemon
        if len(conn.tasks) < d.max_requests_per_connection and conn.unsent <= d.max_queued_reply_bytes:
            conn.readable.set()
        else:
            conn.readable.clear()

    async def _handle(self, conn: Connection, rid: int, op: Any, req: dict[str, Any]) -> None:
        try:
            await self._handle_request(conn, rid, op, req)
        finally:
            for fd in req["_fds"]:  # the fds the request brought and did not hand on
                os.close(fd)

    async def _handle_request(self, conn: Connection, rid: int, op: Any, req: dict[str, Any]) -> None:
        fds: list[int] = []  # the reply's
        try:
            if not conn.greeted:
                raise BadRequest("the first request on a connection must be 'hello'")
            handler = self._ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise UnknownOp(f"unknown op {op!r}", op=str(op))
            if op in ADMIN_OPS and not self.access.is_admin(conn.peer):
                log.warning("conn %d: uid %d refused admin op %r", conn.id, conn.peer.uid, op)
                raise PermissionDenied(f"op {op!r} is for administrators; uid {conn.peer.uid} is not one", op=op)
            if self._stopping.is_set() and op in ("load", "attach", "register", "publish"):
                raise ShuttingDown("the daemon is shutting down")
            timeout = self.settings.daemon.request_timeout_s
            started = time.monotonic()
            try:
                reply, fds = await asyncio.wait_for(handler(conn, req), timeout)
            except TimeoutError:
                raise RequestTimeout(f"op {op!r} did not finish within {timeout:g}s (a load goes on regardless)") from None
            finally:
                self.metrics.observe(op, started)
            msg = {"id": rid, "ok": True, **reply}
        except WeightcacheError as exc:
            msg = {"id": rid, "ok": False, "error": self._redact(conn, req, exc).to_wire()}
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("conn %d: op %r failed unexpectedly", conn.id, op)
            msg = {"id": rid, "ok": False, "error": InternalError(f"{type(exc).__name__}: {exc}").to_wire()}
        try:
            await self._send(conn, msg, fds)
        finally:
            for fd in fds:
                os.close(fd)

    async def _send(self, conn: Connection, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        if fds:
            msg["fds"] = len(fds)
        async with conn.write_lock:
            # Encoded under the lock: replies waiting for a peer that does not read hold
            # their (small, or shared) reply maps, never a second copy of their bytes.
            frame = encode_reply(msg)
            conn.unsent = sum(len(part) for part in frame)
            self._update_readable(conn)
            try:
                await send_with_fds(conn.sock, frame, fds or [])
            except OSError as exc:
                # The peer went away; the read side notices and releases its leases.
                log.debug("conn %d: send failed: %s", conn.id, exc)
            finally:
                conn.unsent = 0
                self._update_readable(conn)

    async def _send_final(self, conn: Connection, exc: WeightcacheError) -> None:
        """An error about the connection itself, just before closing it: never waits long
        on a peer that does not read."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._send(conn, {"id": None, "ok": False, "error": exc.to_wire()}), 1.0)

    # ------------------------------------------------------------------ ops
    def op_hello(self, conn: Connection, req: dict[str, Any]) -> dict[str, Any]:
        version = req.get("protocol")
        if version != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"client speaks protocol {version!r}; this daemon speaks {PROTOCOL_VERSION}", supported=[PROTOCOL_VERSION]
            )
        client = req.get("client", "?")
        conn.client = client if isinstance(client, str) else "?"
        conn.greeted = True
        return {"ok": True, "protocol": PROTOCOL_VERSION, "server": f"weightcache/{__version__}", "pid": os.getpid(),
                "max_frame_bytes": self.settings.daemon.max_frame_bytes,
                "request_timeout_s": self.settings.daemon.request_timeout_s}

    async def op_status(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        assert self.core is not None
        devices = self.core.device_summary()
        for dev, d in devices.items():
            d["backend"] = self.backends[dev].kind if dev in self.backends else "pinned-host"
        return {
            "version": __version__, "pid": os.getpid(), "uptime_s": time.monotonic() - self.started,
            "socket": self.socket_path, "devices": devices, "connections": len(self.conns),
            "leases": len(self.core.leases),
            "loading": {name: p.snapshot() for name, p in self.progress.items()},
            "shutting_down": self.shutting_down,
        }, []

    async def op_health(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        health = self.health()
        if not self.access.is_admin(conn.peer):  # failures name files: for administrators
            health["failed_preloads"] = {name: "failed (the daemon's log and administrators have the details)"
                                         for name in health["failed_preloads"]}
        return health, []

    def health(self) -> dict[str, Any]:
        """For probes and metrics: serving (alive and not shutting down) and ready (serving,
        and every preload done and succeeded: a DaemonSet rollout with a bad model path
        stops at the first node instead of reaching them all). Also read from the metrics
        thread: it only copies containers (atomic under the GIL)."""
        serving = not self.shutting_down
        pending, failed = sorted(self.preloads_pending), dict(sorted(self.preloads_failed.items()))
        return {"serving": serving, "ready": serving and not pending and not failed,
                "preloading": pending, "failed_preloads": failed, "uptime_s": time.monotonic() - self.started}

    async def op_models(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return {"models": [self._describe(name, conn.peer) for name in self.models]}, []

    def _may_see(self, peer: Peer, model: Model) -> bool:
        """Paths and load errors of a model are its owner's and the administrators' to see:
        for anyone else they would tell what exists on the daemon's disks."""
        return model.owner == peer.uid or self.access.is_admin(peer)

    def _redact(self, conn: Connection, req: dict[str, Any], exc: WeightcacheError) -> WeightcacheError:
        """A load failure names files; a peer who may not see the model gets the code only."""
        names_files = isinstance(exc, (LoadFailed, CorruptCheckpoint)) or bool(_FILE_DETAILS & exc.details.keys())
        if not names_files or self.access.is_admin(conn.peer):
            return exc
        name = req.get("name")
        model = self.models.get(self.groups[name][0] if name in self.groups else name) if isinstance(name, str) else None
        if model is not None and self._may_see(conn.peer, model):
            return exc
        return type(exc)(_redacted(exc.to_wire())["message"], **({"model": name} if isinstance(name, str) else {}))

    def _describe(self, name: str, viewer: Peer) -> dict[str, Any]:
        assert self.core is not None
        e = self.core.entry(name)
        m = self.models[name]
        private = not self._may_see(viewer, m)
        return {
            "name": name, "state": str(e.state), "device": e.device,
            "device_uuid": getattr(self.backends[e.device], "uuid", None), "nbytes": e.nbytes,
            "attach_count": e.attach_count, "pinned": e.pinned, "keep_alive": e.keep_alive,
            "shard_of": m.config.name if m.rank is not None else None, "rank": m.rank,
            "origin": m.origin, "owner": m.owner,
            "path": None if private else str(m.path), "fingerprint": m.checkpoint.fingerprint if m.checkpoint else None,
            "tensors": len(m.checkpoint.tensors) if m.checkpoint else None,
            "idle_s": (time.monotonic() - e.last_used) if e.last_used else None,
            "loads": e.loads, "evictions": e.evictions, "demotions": e.demotions, "promotions": e.promotions,
            "last_error": _redacted(m.last_error) if private and m.last_error else m.last_error,
            "progress": self.progress[name].snapshot() if name in self.progress else None,
        }

    async def op_load(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        wait = self._wait_arg(req)
        rank = _arg(req, "rank", int, None)
        entries = [self._entry_for(_arg(req, "name", str), rank)] if rank is not None else self._members(_arg(req, "name", str))
        await asyncio.gather(*(self.ensure_resident(e, wait) for e in entries))
        return {"model": self._describe(entries[0], conn.peer), "shards": [self._describe(e, conn.peer) for e in entries]}, []

    def _wait_arg(self, req: dict[str, Any]) -> float:
        wait = float(_arg(req, "wait_s", (int, float), self.settings.daemon.no_space_wait_s))
        if not 0 <= wait < float("inf"):  # also rejects NaN
            raise BadRequest(f"argument 'wait_s' must be a finite number >= 0, got {wait}", argument="wait_s")
        # The request times out at request_timeout_s anyway; the load it starts (which
        # others may join) must not go on waiting for room after that.
        return min(wait, self.settings.daemon.request_timeout_s)

    def _members(self, name: str) -> list[str]:
        """The cache entries an op on ``name`` acts on: every rank of a sharded model, or
        the one entry (a shard may also be named directly as ``model@rank``)."""
        if name in self.groups:
            return self.groups[name]
        if name in self.models:
            return [name]
        raise UnknownModel(f"no model named {name!r} is registered", model=name)

    def _entry_for(self, name: str, rank: int | None) -> str:
        """The entry an attach of ``name`` (with ``rank``) maps."""
        members = self._members(name)
        if self.models[members[0]].rank is None:
            if rank not in (None, 0):
                raise BadRequest(f"model {name!r} is not sharded; rank {rank} does not exist", model=name, rank=rank)
            return members[0]
        if rank is None:
            raise BadRequest(f"model {name!r} is sharded over {len(members)} ranks: attach with rank=", model=name)
        if not 0 <= rank < len(members):
            raise BadRequest(f"model {name!r} has ranks 0..{len(members) - 1}, not {rank}", model=name, rank=rank)
        return members[rank]

    async def op_attach(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        assert self.core is not None
        name = self._entry_for(_arg(req, "name", str), _arg(req, "rank", int, None))
        wait = self._wait_arg(req)
        writable = _arg(req, "writable", bool, False)
        if writable and not self.settings.daemon.allow_writable_attach:
            raise PermissionDenied("read-write attachments are disabled (daemon.allow_writable_attach = false)", argument="writable")
        device = _arg(req, "device", str, None)
        entry = self.core.entry(name)
        if writable and self.backends[entry.device].kind != "cuda_vmm":
            raise BadRequest(f"{entry.device} arenas are sealed memfds: they cannot be mapped writable", argument="writable")
        if device is not None and not self._same_device(entry.device, device):
            raise BadRequest(f"model {name!r} lives on {entry.device}, not {device}", model=name, device=device)
        while True:
            await self.ensure_resident(name, wait)
            # Another request may have evicted it between the load and here; retry then.
            if self.core.entry(name).state is State.RESIDENT:
                break
        held = self.core.leases_held(conn.id)
        if held >= self.settings.daemon.max_leases_per_connection:
            raise LimitExceeded(f"this connection holds {held} leases, the maximum", limit=held)
        lease = self.core.attach(name, conn.id)
        m = self.models[name]
        assert m.arena is not None and m.checkpoint is not None
        try:
            fds, arena = self.backends[m.arena.device].export(m.arena)
        except BaseException:
            self.core.detach(lease.id, conn.id)
            raise
        return {
            "lease": lease.id, "model": name, "rank": m.rank, "device": entry.device, "fingerprint": m.checkpoint.fingerprint,
            "arena": {**arena, "writable": writable}, "tensors": Packed(m.table),
        }, fds

    async def op_publish(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """An engine hands over weights it processed itself (quantized, repacked) with the
        memory they live in (fds, as in an attach reply). The daemon copies them into its
        own arena, so the engine may exit; later starts attach the processed form.

        Everything is validated, and the copy made under a staging entry, before an
        existing model of that name is replaced: a failed publish changes nothing. Only the
        owner (or an administrator) replaces a published model, only an administrator a
        configured one, never while it is pinned or attached. The fingerprint is bound to
        the publisher's uid, so no tenant can claim another's (protocol.tenant_fingerprint)."""
        assert self.core is not None
        name = _arg(req, "name", str)
        try:
            check_model_name(name)
        except ValueError as exc:
            raise BadRequest(str(exc), argument="name") from None
        replace = _arg(req, "replace", bool, False)
        self._check_may_publish(conn.peer, name, replace)
        device = self._resolve_device(_arg(req, "device", str))
        backend = self.backends[device]
        desc = _arg(req, "arena", dict)
        if desc.get("kind") != backend.kind:
            raise BadRequest(f"{device} models are published as {backend.kind!r} arenas, not {desc.get('kind')!r}")
        nbytes = _arg(desc, "nbytes", int)
        if nbytes <= 0:  # more than the budget is NO_SPACE at admission, like any load
            raise BadRequest(f"arena nbytes must be positive, got {nbytes}", argument="nbytes")
        wait = self._wait_arg(req)
        fingerprint = tenant_fingerprint(_arg(req, "fingerprint", str), conn.peer.uid)
        ckpt = await self._io(published_checkpoint, name, _arg(req, "tensors", list), nbytes, fingerprint)
        source = await self._io(backend.open_published, desc, req["_fds"], cleanup=backend.close_published)
        staging = f"{name}#{next(self._staging_ids)}"  # '#' is never in a model name: no clash
        try:
            self.core.register(staging, device)
            config = ModelConfig(name=name, path=Path(ckpt.source), device=device)
            self.models[staging] = Model(config=config, path=config.parts[0][0], device=device, rank=None,
                                         origin="publish", owner=conn.peer.uid)
            await self._fill_new_arena(staging, ckpt, backend.capacity(ckpt.arena_bytes), wait,
                                       CopyPublished(backend, source, ckpt.arena_bytes),
                                       verb=f"published by {conn.client} (pid {conn.peer.pid}, uid {conn.peer.uid}):")
            if name in self.groups:  # again: it may have been attached or pinned during the copy
                self._check_may_publish(conn.peer, name, replace)
                self._unregister(name)
            self.core.rename(staging, name)
            self.models[name] = self.models.pop(staging)
            self.groups[name] = [name]
        except BaseException:
            if staging in self.models:
                self._drop_entry(staging)  # a failed publish leaves nothing behind
            raise
        finally:
            await self._io(backend.close_published, source)
        return {"model": self._describe(name, conn.peer)}, []

    def _check_may_publish(self, peer: Peer, name: str, replace: bool) -> None:
        assert self.core is not None
        if name not in self.groups:
            return
        if not replace:
            raise BadRequest(f"a model named {name!r} exists; publish with replace=true to supersede it", model=name)
        model = self.models[self.groups[name][0]]
        if not self.access.is_admin(peer):
            if model.origin == "config":
                raise PermissionDenied(f"model {name!r} is configured by the operator; only an administrator may replace it",
                                       model=name)
            if model.owner != peer.uid:
                raise PermissionDenied(f"model {name!r} belongs to uid {model.owner}", model=name)
        for entry in self.groups[name]:
            e = self.core.entry(entry)
            if e.pinned:
                raise Pinned(f"model {name!r} is pinned; unpin it before replacing it", model=name)
            if e.leases:
                raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name,
                               attach_count=e.attach_count)
            if e.state is State.LOADING:
                raise BadRequest(f"model {name!r} is loading; replace it when the load ends", model=name)

    def _resolve_device(self, device: str) -> str:
        """This daemon's name for ``device`` (given as its name or as cuda:GPU-<uuid>)."""
        for mine in self.backends:
            if self._same_device(mine, device):
                return mine
        raise BadRequest(f"device {device!r} has no budget in this daemon; configured: {sorted(self.backends)}", device=device)

    def _same_device(self, mine: str, theirs: str) -> bool:
        """``theirs`` names ``mine`` directly or by GPU UUID (clients send UUIDs: their
        CUDA_VISIBLE_DEVICES may number the GPUs differently from the daemon's)."""
        uuid = getattr(self.backends[mine], "uuid", None)
        return theirs == mine or (uuid is not None and theirs.lower() == f"cuda:{uuid}".lower())

    async def op_detach(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        assert self.core is not None
        lease = self.core.detach(_arg(req, "lease", int), conn.id)
        await self._notify_space()
        return {"lease": lease.id, "model": lease.model}, []

    async def op_evict(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """One tier down for every rank: device -> host tier (where enabled) -> gone."""
        assert self.core is not None
        entries = [self.core.entry(n) for n in self._members(_arg(req, "name", str))]
        movable = [e for e in entries if e.state in (State.RESIDENT, State.HOST)]
        for e in movable:  # check every rank before moving any: all or nothing
            if e.state is State.RESIDENT and (e.leases or e.pinned):
                self.core.evict(e.name)  # raises ATTACHED / PINNED with the reason
        freed = sum(e.nbytes for e in movable if e.state is State.RESIDENT)
        for e in movable:
            await self._carry_out(self.core.evict(e.name), reason="requested")
        await self._notify_space()
        return {"evicted": bool(movable), "freed": freed, "state": str(entries[0].state)}, []

    async def op_pin(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return await self._set_pin(conn, req, True)

    async def op_unpin(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return await self._set_pin(conn, req, False)

    async def _set_pin(self, conn: Connection, req: dict[str, Any], pinned: bool) -> tuple[dict[str, Any], list[int]]:
        assert self.core is not None
        entries = self._members(_arg(req, "name", str))
        for e in entries:
            self.core.set_pinned(e, pinned)
        if not pinned:
            await self._notify_space()
        return {"model": self._describe(entries[0], conn.peer), "shards": [self._describe(e, conn.peer) for e in entries]}, []

    async def op_register(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Add a model at run time. By path the daemon opens the files with its own rights,
        so only administrators may, and only under model_roots. With ``files`` the peer
        sends its own open fds (one per file, per rank): the daemon reads only what the
        peer could read; non-admins may do that where tenant_register allows."""
        d = self.settings.daemon
        admin = self.access.is_admin(conn.peer)
        files = req.get("files")
        if files is None and not admin:
            raise PermissionDenied("registering by path is for administrators; send the files' descriptors instead "
                                   "(Client.register does by default)", op="register")
        if files is not None and not (admin or d.tenant_register):
            raise PermissionDenied("registering models is for administrators here (daemon.tenant_register = false)",
                                   op="register")
        fields = {k: req[k] for k in ("name", "path", "device", "shards", "pin", "preload", "keep_alive") if k in req}
        try:
            mc = ModelConfig(**fields)
        except Exception as exc:
            raise BadRequest(f"invalid model: {exc}") from None
        if mc.pin and not admin:
            raise PermissionDenied("pinning is for administrators", op="register", argument="pin")
        sources: list[OpenedSource] | None = None
        if files is None:
            if req["_fds"]:
                raise BadRequest("file descriptors came without 'files' naming them", argument="files")
            for path, _device in mc.parts:
                if d.model_roots and not under_roots(path, d.model_roots):
                    raise PermissionDenied(f"{path} is not under daemon.model_roots", path=str(path))
        else:
            held = sum(len(m.files.files) for m in self.models.values() if m.files is not None and m.owner == conn.peer.uid)
            if held + len(req["_fds"]) > d.max_files_per_uid:
                raise LimitExceeded(f"uid {conn.peer.uid}'s registered models hold {held} open files; "
                                    f"{len(req['_fds'])} more would pass max_files_per_uid={d.max_files_per_uid}",
                                    limit=d.max_files_per_uid)
            sources = self._adopt_files(mc, files, req)
        try:
            self._register(mc, origin="register", owner=conn.peer.uid, sources=sources)
        except BaseException:
            for src in sources or ():
                src.close()
            raise
        if mc.preload:
            self._start_preload(mc.name, gates=admin)
        return {"model": self._describe(self.groups[mc.name][0], conn.peer)}, []

    def _adopt_files(self, mc: ModelConfig, files: Any, req: dict[str, Any]) -> list[OpenedSource]:
        """The peer's fds for ``mc``: ``files`` holds one list of file names per rank, the
        fds came in the same order. Takes the fds out of the request (they are the
        sources' now, closed on failure and at unregister)."""
        fds: list[int] = req["_fds"]
        if not (isinstance(files, list) and len(files) == len(mc.parts)
                and all(isinstance(f, list) and f and all(isinstance(n, str) for n in f) for f in files)):
            raise BadRequest(f"'files' must be a list of {len(mc.parts)} non-empty list(s) of file names, one per rank",
                             argument="files")
        if sum(len(f) for f in files) != len(fds):
            raise BadRequest(f"'files' names {sum(len(f) for f in files)} file(s) but {len(fds)} fd(s) arrived",
                             argument="files")
        req["_fds"] = []
        sources: list[OpenedSource] = []
        start = 0
        try:
            for rank, names in enumerate(files):
                part = fds[start : start + len(names)]
                start += len(names)
                sources.append(adopt_fds(f"fds:{mc.name}@{rank}", names, part))
        except BaseException:
            for src in sources:
                src.close()
            for fd in fds[start:]:
                os.close(fd)
            raise
        return sources

    async def op_unregister(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        name = _arg(req, "name", str)
        members = self._members(name)
        model = self.models[members[0]]
        if not (self.access.is_admin(conn.peer) or (model.owner == conn.peer.uid and model.origin != "config")):
            raise PermissionDenied(f"model {name!r} is not yours to unregister", model=name, op="unregister")
        self._unregister(name)
        return {"unregistered": name}, []

    async def op_reload(self, conn: Connection, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return {"report": await self.reload_config()}, []

    async def reload_config(self) -> dict[str, list[str]]:
        """Re-read the config file: register new models, unregister removed ones (kept,
        and reported, while attached or loading), re-register changed ones when unattached.
        The ``reload`` op and SIGHUP both land here."""
        if self.config_path is None:
            raise BadRequest("the daemon was started without a config file; nothing to reload")
        assert self.core is not None
        new = await asyncio.to_thread(load_settings, self.config_path)
        report: dict[str, list[str]] = {"added": [], "removed": [], "changed": [], "kept": [], "unchanged": [], "budgets": [],
                                        "displaced": []}
        for device, budget in new.budgets.items():
            if device not in self.backends:
                report["kept"].append(f"budget {device}: a new device needs a daemon restart")
                continue
            nbytes = budget.resolve(self.backends[device].total_memory())
            if nbytes != self.core.devices[device].budget:
                try:
                    step = self.core.set_budget(device, nbytes)
                except NoSpace as exc:
                    report["kept"].append(f"budget {device}: {exc.message}")
                    continue
                await self._carry_out(step, reason=f"{device} budget lowered")
                await self._notify_space()
                report["budgets"].append(f"{device}: {nbytes}")
        wanted = {m.name: m for m in new.models}
        # Only the config's own models: what peers registered or published stays.
        for name in [n for n in self.groups if self.models[self.groups[n][0]].origin == "config"]:
            old = self.models[self.groups[name][0]].config
            if name in wanted and wanted[name] == old:
                report["unchanged"].append(name)
                continue
            try:
                self._unregister(name)
            except WeightcacheError as exc:
                report["kept"].append(f"{name}: {exc.message}")
                wanted.pop(name, None)
                continue
            report["changed" if name in wanted else "removed"].append(name)
        for name, mc in wanted.items():
            if name in self.groups and self.models[self.groups[name][0]].origin != "config":
                # The config names it: the operator's model wins over a peer's of that name
                # (else a tenant could take a name before the operator adds it).
                try:
                    self._unregister(name)
                except WeightcacheError as exc:
                    report["kept"].append(f"{name}: a peer's model of that name stays while {exc.message}")
                    continue
                report["displaced"].append(name)
            if name not in self.groups:
                missing = [dev for _p, dev in mc.parts if dev not in self.backends]
                if missing:
                    report["kept"].append(f"{name}: device {missing[0]} has no backend in the running daemon")
                    continue
                self._register(mc)
                if name not in report["changed"]:
                    report["added"].append(name)
                if mc.preload:
                    self._start_preload(name)
        log.info("reload: %s", {k: v for k, v in report.items() if v and k != "unchanged"})
        return report

    # ------------------------------------------------------------------ loading
    def _register(self, mc: ModelConfig, *, origin: Origin = "config", owner: int | None = None,
                  sources: list[OpenedSource] | None = None) -> None:
        """Add a model's cache entries (one, or one per rank). ``sources`` are a peer's own
        open files, one per rank; the entries hold them until unregistered."""
        assert self.core is not None
        if mc.name in self.groups or mc.name in self.models:
            raise BadRequest(f"model {mc.name!r} is already registered", model=mc.name)
        sharded = bool(mc.shards)
        entries = [f"{mc.name}@{r}" if sharded else mc.name for r in range(len(mc.parts))]
        for i, (entry, (path, device)) in enumerate(zip(entries, mc.parts, strict=True)):
            try:
                self.core.register(entry, device, pinned=mc.pin, keep_alive=mc.keep_alive)
            except BaseException:
                for done in entries[:i]:
                    self.core.unregister(done)
                    del self.models[done]
                raise
            self.models[entry] = Model(config=mc, path=path, device=device, rank=i if sharded else None, origin=origin,
                                       owner=owner, files=sources[i] if sources else None)
        self.groups[mc.name] = entries

    def _unregister(self, name: str) -> None:
        """Forget a whole model (every rank), only if no rank is attached or loading."""
        assert self.core is not None
        if name not in self.groups:
            raise UnknownModel(f"no model named {name!r} is registered", model=name)
        for entry in self.groups[name]:
            e = self.core.entry(entry)
            if e.leases or e.state is State.LOADING:
                self.core.unregister(entry)  # raises ATTACHED / BAD_REQUEST with the reason
        self.preloads_pending.discard(name)
        self.preloads_failed.pop(name, None)
        for entry in self.groups.pop(name):
            self._drop_entry(entry)

    def _drop_entry(self, entry: str) -> None:
        """Forget one cache entry and free what it holds (arena, host copy, a peer's files)."""
        assert self.core is not None
        if self.core.entry(entry).state is State.LOADING:
            self.core.abort_load(entry)
        self.core.unregister(entry)
        model = self.models.pop(entry)
        if model.arena is not None:
            self._release(model.arena)
            model.arena = None
        self._drop_host_copy(model)
        if model.files is not None:
            model.files.close()

    async def ensure_resident(self, name: str, wait_s: float) -> None:
        """Return once ``name`` is resident: at once if it is, else by joining the one
        load in flight or starting it. The load is shielded: a caller that goes away does
        not cancel it for the others."""
        assert self.core is not None
        e = self.core.entry(name)
        if e.state is State.RESIDENT:
            m = self.models[name]
            if m.checkpoint is not None and (e.attach_count or m.published or m.unchanged()):
                self.core.touch(name)
                return
            # The files changed since it was loaded and nobody holds the old bytes:
            # drop them so the new checkpoint is what gets served.
            log.warning("model %s changed on disk; reloading it", name)
            # a pin keeps a model, not stale bytes; and stale bytes do not go to the host tier
            await self._carry_out(self.core.evict(name, ignore_pin=True, demote=False), reason="changed on disk")
        task = self.loads.get(name)
        if task is None:
            task = asyncio.ensure_future(self._load(name, wait_s))
            self.loads[name] = task
            task.add_done_callback(self._load_done)
        await asyncio.shield(task)

    def _load_done(self, task: asyncio.Task[None]) -> None:
        # The load may outlive every request that waited on it; its error is already
        # logged and kept in last_error, so mark it retrieved here.
        self.loads = {n: t for n, t in self.loads.items() if t is not task}
        if not task.cancelled():
            task.exception()

    async def _load(self, name: str, wait_s: float) -> None:
        """Decide where the bytes come from (the host tier, the files), then fill."""
        assert self.core is not None
        model = self.models[name]
        entry = self.core.entry(name)
        backend = self.backends[entry.device]
        if name in self.demotions:
            await asyncio.shield(self.demotions[name])  # its host copy is still being made
        if entry.state is State.HOST and (model.host is None or not model.unchanged()):
            log.warning("host copy of %s is stale or missing; loading from disk", name)
            self.core.drop_host(name)
            await self._carry_out(StepDown(drop_host=(name,)), reason="stale")
        if entry.state is State.HOST:
            assert model.checkpoint is not None
            await self._fill_new_arena(name, model.checkpoint, entry.nbytes, wait_s, Promote(backend, model.host),
                                       verb="promoted")
            return
        if model.published:
            raise LoadFailed(f"model {name!r} was published by an engine and has since been evicted; publish it again",
                             model=name, reason="published model evicted")
        d = self.settings.daemon
        opened = model.files
        try:
            if opened is None:  # the daemon opens the files itself: the operator's or an admin's paths
                opened = await self._io(open_source, model.path, roots=d.model_roots or None,
                                        follow_symlinks=d.follow_symlinks, cleanup=OpenedSource.close)
            ckpt = await self._io(parse_checkpoint, opened)
            if model.owner is not None:  # a peer's model: nobody may pass it off as the operator's
                ckpt = dataclasses.replace(ckpt, fingerprint=tenant_fingerprint(ckpt.fingerprint, model.owner))
        except Exception as exc:
            if opened is not None and opened is not model.files:
                opened.close()
            err = exc if isinstance(exc, WeightcacheError) else LoadFailed(f"{name}: {type(exc).__name__}: {exc}", model=name)
            model.last_error = err.to_wire()
            log.error("load %s refused: %s", name, err)
            raise err from None
        try:
            await self._fill_new_arena(name, ckpt, backend.capacity(ckpt.arena_bytes), wait_s,
                                       ReadFiles(backend, d, opened, cancelled=lambda: self.shutting_down, label=name),
                                       verb="loaded")
        finally:
            if opened is not model.files:
                opened.close()

    async def _io(self, fn: Callable[..., T], *args: Any, cleanup: Callable[[T], object] | None = None, **kwargs: Any) -> T:
        """Run ``fn`` in the bounded io pool, for at most io_timeout_s: opening and parsing
        what a peer names or sends. A call that overruns is abandoned (a thread cannot be
        killed); ``cleanup`` then releases what it returns when it finally does."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._io_pool, functools.partial(fn, *args, **kwargs))
        timeout = self.settings.daemon.io_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            if cleanup is not None:
                fut.add_done_callback(lambda f: cleanup(f.result()) if not f.cancelled() and f.exception() is None else None)
            log.error("%s did not finish within io_timeout_s=%gs; abandoned", getattr(fn, "__name__", fn), timeout)
            raise LoadFailed(f"opening or parsing did not finish within {timeout:g}s (io_timeout_s)",
                             reason="io timeout") from None

    async def _fill_new_arena(self, name: str, ckpt: Checkpoint, nbytes: int, wait_s: float,
                              fill: FillStrategy, verb: str) -> None:
        """Admit (evicting as planned), allocate, ``fill`` in a thread, seal, and make the
        model resident; on any failure free the arena and return the reservation, so the
        budget is exactly as before. Loads, promotions and publishes all come here."""
        assert self.core is not None
        model = self.models[name]
        backend = self.backends[self.core.entry(name).device]
        t0 = time.monotonic()
        try:
            plan = await self._admit(name, nbytes, wait_s)
        except WeightcacheError as exc:
            model.last_error = exc.to_wire()
            log.error("load %s refused: %s", name, exc)
            raise
        await self._carry_out(plan.step_down, reason=f"LRU, to make room for {name}")
        progress = self.progress[name] = Progress(ckpt.data_bytes)
        arena: Arena | None = None
        if self._releasing:
            # Victims' memory must be back before the allocation checks the device's free memory.
            await asyncio.wait(list(self._releasing))
        try:
            arena = await asyncio.to_thread(backend.allocate, nbytes, name)
            await asyncio.to_thread(fill, ckpt, arena, progress)
            await asyncio.to_thread(backend.seal, arena)
            # Encoded once, spliced into every attach reply: a 600,000-row table encoded
            # per attach cost ~2 s of loop time each.
            table = await asyncio.to_thread(encode_table, ckpt)
        except BaseException as exc:
            if arena is not None:
                self._release(arena)
            self.core.abort_load(name)
            err = exc if isinstance(exc, WeightcacheError) else LoadFailed(f"{name}: {type(exc).__name__}: {exc}", model=name)
            model.last_error = err.to_wire()
            log.error("load %s failed: %s", name, err)
            await self._notify_space()
            if isinstance(exc, (WeightcacheError, asyncio.CancelledError)):
                raise
            raise err from exc
        finally:
            self.progress.pop(name, None)
        model.arena, model.checkpoint, model.table, model.last_error = arena, ckpt, table, None
        self.core.finish_load(name)
        if plan.promote:
            self._drop_host_copy(model)
        dt = time.monotonic() - t0
        self.last_load_rate[name] = ckpt.data_bytes / max(dt, 1e-9)
        log.info("%s %s: %d tensors, %d bytes in %.2fs (%.2f GB/s)", verb, name.partition("#")[0],  # staged publish
                 len(ckpt.tensors), ckpt.data_bytes, dt, ckpt.data_bytes / max(dt, 1e-9) / 1e9)

    async def _admit(self, name: str, nbytes: int, wait_s: float) -> LoadPlan:
        """Reserve room, evicting LRU models; on NO_SPACE wait up to ``wait_s`` for
        detaches if waiting could ever help."""
        assert self.core is not None and self._space_freed is not None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self.core.begin_load(name, nbytes)
            except NoSpace as exc:
                left = deadline - time.monotonic()
                if left <= 0 or not exc.details.get("fits_ever"):
                    raise
                async with self._space_freed:
                    try:
                        await asyncio.wait_for(self._space_freed.wait(), left)
                    except TimeoutError:
                        pass

    def _start_preload(self, name: str, gates: bool = True) -> None:
        """Load ``name`` in the background. Only the operator's and the admins' preloads
        decide readiness (``gates``): a tenant's broken one must not take the node out of service."""
        if gates:
            self.preloads_pending.add(name)  # before the task runs: a health request may come first
        self._spawn(self._preload(name, gates))

    async def _preload(self, name: str, gates: bool) -> None:
        try:
            for entry in self.groups.get(name, []):
                try:
                    await self.ensure_resident(entry, self.settings.daemon.no_space_wait_s)
                except Exception as exc:  # any failure, not only ours: readiness must not lie
                    log.error("preload of %s failed: %s", entry, exc)
                    if gates:
                        self.preloads_failed[name] = str(exc) if entry == name else f"{entry}: {exc}"
                    return
            self.preloads_failed.pop(name, None)
        finally:
            self.preloads_pending.discard(name)

    async def _carry_out(self, step: StepDown, reason: str) -> None:
        """Do what the core decided: drop host copies, demote arenas to the host tier
        (a device-to-host copy, awaited: the arena is freed only once its bytes are safe),
        free the rest. A demotion that fails (no pinned memory) becomes an eviction."""
        assert self.core is not None
        for name in step.drop_host:
            log.info("dropped host copy of %s: %s", name, reason)
            self._drop_host_copy(self.models[name])
        for name in step.evict:
            self._free_arena(name, reason)
        for name in step.demote:
            task = asyncio.ensure_future(self._demote(name, reason))
            self.demotions[name] = task
            try:
                await asyncio.shield(task)
            finally:
                self.demotions.pop(name, None)

    async def _demote(self, name: str, reason: str) -> None:
        assert self.core is not None
        model = self.models[name]
        assert model.arena is not None
        backend = self.backends[model.arena.device]
        t = time.monotonic()
        try:
            model.host = await asyncio.to_thread(backend.demote, model.arena)
        except Exception as exc:
            log.error("demoting %s to the host tier failed (%s); evicting it instead", name, exc)
            if self.core.entry(name).state is State.HOST:
                self.core.drop_host(name)
                self.core.entry(name).demotions -= 1  # it was evicted, not demoted
        else:
            dt = time.monotonic() - t
            log.info("demoted %s to the host tier (%d bytes, %.1f GB/s): %s", name, model.arena.nbytes,
                     model.arena.nbytes / max(dt, 1e-9) / 1e9, reason)
        self._release(model.arena)
        model.arena = None

    def _drop_host_copy(self, model: Model) -> None:
        if model.host is not None:
            host, model.host = model.host, None
            self._spawn(asyncio.to_thread(self.backends[model.device].free_host, host))

    def _free_arena(self, name: str, reason: str) -> None:
        model = self.models[name]
        if model.arena is not None:
            log.info("evicted %s (%d bytes): %s", name, model.arena.nbytes, reason)
            self._release(model.arena)
            model.arena = None

    def _release(self, arena: Arena) -> None:
        """Free an arena off the event loop: the kernel takes ~63 ms per GiB to release a
        memfd's pages (measured on the CI machine), which would stall every connection.
        The core has already stopped counting these bytes."""
        task = self._spawn(asyncio.to_thread(self.backends[arena.device].free, arena))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _notify_space(self) -> None:
        assert self._space_freed is not None
        async with self._space_freed:
            self._space_freed.notify_all()

    async def _keep_alive_loop(self) -> None:
        assert self.core is not None
        while True:
            await asyncio.sleep(1.0)
            for name in self.core.expired():
                await self._carry_out(self.core.evict(name), reason="keep_alive expired")
                await self._notify_space()


def run_daemon(settings: Settings, config_path: str | None = None) -> None:
    """Run until SIGTERM/SIGINT; a second signal forces exit. Uses uvloop."""
    import uvloop

    handler = logging.StreamHandler()
    if settings.daemon.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=settings.daemon.log_level.upper(), handlers=[handler])

    async def main() -> None:
        daemon = Daemon(settings, config_path)
        loop = asyncio.get_running_loop()
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

            daemon._spawn(reload())

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
