"""Connections: accept, framing, dispatch and sending, with every limit that keeps one
peer from costing the others.

Each connection owns its raw non-blocking socket (see protocol/__init__.py for why not
streams). Every request runs as its own task, so a slow ``load`` never holds up a
``status`` on the same or another connection. What one peer may cost the others is
bounded as Note [untrusted peers] says, by the counts kept in ``Bounds``.

The sections, each under its banner: WHAT ONE PEER MAY COST (Note [untrusted peers]; the
sans-I/O read side, ``FrameReader`` and ``FlowControl``, tested with bytes and a clock and
no daemon; ``Bounds``, the counts summed over connections), THE DISPATCH TABLE, and THE
CONNECTIONS (the reader, the sender, the handler's run).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import itertools
import logging
import socket
import struct
import termios
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..cache import CacheCore
from ..config import DaemonConfig
from ..errors import (
    BadRequest,
    FrameTooLarge,
    InternalError,
    LimitExceeded,
    PermissionDenied,
    RequestTimeout,
    ShuttingDown,
    UnknownOp,
    WeightcacheError,
)
from ..peer_log import PeerEventLog
from ..protocol import ADMIN_OPS, OPS, FrameDecoder, close_fds, decode_payload, recv_with_fds, send_with_fds
from ..protocol.framing import DEFERRED_KEYS, PayloadRefused, encode_reply
from . import handlers, model_ops
from .access import AccessPolicy, Peer
from .handlers import OWNER_PIN_OPS, Caller, Context, Handler, Request, hello, redact
from .metrics import Metrics
from .residency import Residency

log = logging.getLogger("weightcache.daemon")


# ===============================================================================================
# WHAT ONE PEER MAY COST: the limits, the sans-I/O read side, the counts over connections
# ===============================================================================================
# Note [untrusted peers]
# ----------------------
# Any allowed peer may be hostile. Nothing one connection sends may cost the daemon
# unbounded memory, fds, threads or loop time, or delay another connection:
# - requests: at most max_requests_per_connection in flight; beyond that, or while a
#   reply of more than max_queued_reply_bytes waits for the peer to read it, the daemon
#   stops reading the connection (the kernel's buffer then stops the peer);
# - frames: one deadline per frame from its first byte (frame_read_timeout_s), a deadline
#   for hello, and half-received frames summed over every connection
#   (max_partial_frame_bytes);
# - bytes read: each uid's connections together are read at most at
#   max_read_bytes_per_s_per_uid once they have sent a burst of max_frame_bytes
#   (``Bounds.read_pause``); beyond that its readers wait, so the kernel's buffer stops
#   the peer's writes and the loop and the host's cores go to others. A tenant that wrote
#   refused 3.5 MB frames as fast as it could (~200 MB/s on the 2-core VM) kept a core of
#   its own and much of the daemon's busy;
# - fds: only with a frame's first bytes, at most max_fds_per_frame, and at most
#   max_fds_per_uid waiting for frames not yet complete; and, the other way, at most
#   max_fds_per_uid sent to a uid's peers that they have not read (Bounds.fds_out):
#   the kernel counts fds in flight against the daemon's RLIMIT_NOFILE;
# - decoding: every value is skipped before it is built, and at most 1 MiB of a request
#   is built on the loop (framing.decode_payload); a publish's table is built and
#   validated in the io pool (Note [deferred values]); attach tables are encoded once.
#
# The counts summed over connections live in ``Bounds``; the reader and sender below ask
# them before they take more. What one connection's reader decides on its own is in this
# section without I/O, so that it is tested with bytes and a clock and no daemon:
# ``FrameReader`` (frames out of bytes, the fd rule, the hello and frame deadlines) and
# ``FlowControl`` (whether the connection is read at all).


class FlowControl:
    """Whether the daemon reads a connection's next request (uvicorn's FlowControl, for a
    reader task): not while max_requests_per_connection of its requests are in flight,
    nor while more than max_queued_reply_bytes of a reply wait for the peer to read
    them; it reads again as soon as both are back under."""

    def __init__(self, max_requests: int, max_unsent: int) -> None:
        self.max_requests, self.max_unsent = max_requests, max_unsent
        self.in_flight = 0  # requests (and queued replies) of the connection not done
        self.unsent = 0  # the size of the reply being sent, until all of it is out
        self._readable = asyncio.Event()
        self._readable.set()

    @property
    def reading(self) -> bool:
        return self._readable.is_set()

    def set_in_flight(self, n: int) -> None:
        self.in_flight = n
        self._update()

    def set_unsent(self, nbytes: int) -> None:
        self.unsent = nbytes
        self._update()

    async def wait(self) -> None:
        """Until the connection may be read."""
        await self._readable.wait()

    def _update(self) -> None:
        if self.in_flight < self.max_requests and self.unsent <= self.max_unsent:
            self._readable.set()
        else:
            self._readable.clear()


class FrameReader:
    """One connection's read side, without I/O: bytes (and how many fds came with them) in,
    whole frames out, and when the reader must give up waiting. A frame has
    frame_read_timeout_s from its first byte; a connection hello_timeout_s for its hello;
    fds ride on a frame's first byte (a frame must start in the read that brought them)."""

    def __init__(self, max_frame_bytes: int, frame_read_timeout_s: float, hello_timeout_s: float, now: float) -> None:
        self.decoder = FrameDecoder(max_frame_bytes)
        self.frame_read_timeout_s, self.hello_timeout_s = frame_read_timeout_s, hello_timeout_s
        self.hello_deadline = now + hello_timeout_s
        self.frame_deadline: float | None = None  # set when a frame's first byte arrives

    @property
    def pending(self) -> int:
        """Bytes of a frame begun and not complete."""
        return self.decoder.pending

    def timeout(self, greeted: bool, now: float) -> float | None:
        """How long the next read may wait (None: as long as it takes)."""
        deadlines = [t for t in (None if greeted else self.hello_deadline, self.frame_deadline) if t is not None]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def timed_out(self, now: float) -> RequestTimeout:
        """The error that closes a connection whose read waited past :meth:`timeout`."""
        if self.frame_deadline is not None and now >= self.frame_deadline:
            why = f"frame incomplete {self.frame_read_timeout_s:g}s after its first byte"
        else:
            why = f"no hello within {self.hello_timeout_s:g}s"
        return RequestTimeout(f"{why}; closing the connection")

    def feed(self, data: bytes, nfds: int, now: float) -> list[bytes]:
        """The frames ``data`` completes. Raises FrameTooLarge (a frame over the limit: the
        stream is out of step) or BadRequest (fds that came with no frame's first byte)."""
        pending_before = self.decoder.pending
        frames = self.decoder.feed(data)
        started_here = pending_before == 0 or len(frames) > 1 or (len(frames) == 1 and self.decoder.pending > 0)
        if nfds and not started_here:
            raise BadRequest("file descriptors must come with a frame's first byte")
        if not self.decoder.pending:
            self.frame_deadline = None
        elif frames or self.frame_deadline is None:  # a new frame began in this read
            self.frame_deadline = now + self.frame_read_timeout_s
        return frames

    def discard(self) -> None:
        """Drop the half frame (its memory goes now)."""
        self.decoder.discard()


@dataclass
class Connection:
    id: int
    sock: socket.socket
    peer: Peer  # pid, uid, gid(s) from SO_PEERCRED
    flow: FlowControl
    client: str = "?"
    greeted: bool = False
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: dict[asyncio.Task[None], str] = field(default_factory=dict)  # request in flight -> its op
    fds: deque[int] = field(default_factory=deque)  # received, not yet claimed by a frame ("fds": n)
    partial: int = 0  # bytes of a half-received frame (summed in Bounds.partial_bytes)
    # fds sent since the peer was last seen to have read everything (Bounds.fds_out)
    fds_out: int = 0
    # Done once the peer is gone: its loads go on, but stop waiting for room (Caller.gone).
    gone: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def close_fds(self) -> None:
        fds, self.fds = self.fds, deque()
        close_fds(fds)


class Bounds:
    def __init__(self, settings: DaemonConfig, conns: dict[int, Connection]) -> None:
        self.settings = settings
        self.conns = conns  # Connections' own, by id: the open connections
        self.partial_bytes = 0  # half-received frames over every connection (max_partial_frame_bytes)
        self.partial_by_uid: dict[int, int] = {}  # the same per peer uid (max_partial_frame_bytes_per_uid)
        self._read_tokens: dict[int, tuple[float, float]] = {}  # uid -> (bytes it may still read now, when counted)

    def read_pause(self, uid: int) -> float:
        """Seconds a reader of ``uid``'s connections waits before its next read: its reads
        beyond a burst of max_frame_bytes, at max_read_bytes_per_s_per_uid (0: no limit).
        A token bucket per uid, dropped once it is full again (so that it holds only uids
        that read lately)."""
        rate = self.settings.max_read_bytes_per_s_per_uid
        got = self._read_tokens.get(uid)
        if not rate or got is None:
            return 0.0
        tokens, then = got
        now = time.monotonic()
        tokens = min(float(self.settings.max_frame_bytes), tokens + (now - then) * rate)
        if tokens >= self.settings.max_frame_bytes:
            del self._read_tokens[uid]
            return 0.0
        self._read_tokens[uid] = (tokens, now)
        return -tokens / rate if tokens < 0 else 0.0

    def count_read(self, uid: int, nbytes: int) -> None:
        """``nbytes`` read from one of ``uid``'s connections (read_pause says when it may read again)."""
        if not self.settings.max_read_bytes_per_s_per_uid:
            return
        got = self._read_tokens.get(uid)
        tokens, then = got if got is not None else (float(self.settings.max_frame_bytes), time.monotonic())
        self._read_tokens[uid] = (tokens - nbytes, then)

    def count_partial(self, conn: Connection, pending: int) -> None:
        self.partial_bytes += pending - conn.partial
        self.partial_by_uid[conn.peer.uid] = self.partial_by_uid.get(conn.peer.uid, 0) + pending - conn.partial
        conn.partial = pending

    def check_partial(self, conn: Connection) -> WeightcacheError | None:
        """Half-received frames: a share per uid, so that one tenant cannot hold the
        whole budget and make every other peer's large frame fail; and a total."""
        d = self.settings
        if self.partial_by_uid[conn.peer.uid] > d.max_partial_frame_bytes_per_uid:
            return LimitExceeded(f"uid {conn.peer.uid} holds {d.max_partial_frame_bytes_per_uid} bytes of unfinished "
                                 "frames; send whole frames", limit=d.max_partial_frame_bytes_per_uid)
        if self.partial_bytes > d.max_partial_frame_bytes:
            return LimitExceeded(f"the daemon holds {d.max_partial_frame_bytes} bytes of unfinished frames; "
                                 "send whole frames", limit=d.max_partial_frame_bytes)
        return None

    def check_fds(self, conn: Connection, arrived: int) -> WeightcacheError | None:
        d = self.settings
        if arrived > d.max_fds_per_frame or len(conn.fds) > 2 * d.max_fds_per_frame:
            return LimitExceeded(f"at most {d.max_fds_per_frame} file descriptors per frame", limit=d.max_fds_per_frame)
        waiting = sum(len(c.fds) for c in self.conns.values() if c.peer.uid == conn.peer.uid)
        if waiting > d.max_fds_per_uid:
            return LimitExceeded(f"uid {conn.peer.uid} has {waiting} file descriptors waiting for unfinished frames "
                                 f"(limit {d.max_fds_per_uid})", limit=d.max_fds_per_uid)
        return None

    def unread_fds(self, uid: int) -> int:
        """fds sent to ``uid``'s connections that their peers may not have read yet; a
        connection whose send queue is empty (SIOCOUTQ) has read all of its."""
        total = 0
        for c in self.conns.values():
            if c.peer.uid == uid and c.fds_out:
                try:
                    queued = struct.unpack("i", fcntl.ioctl(c.sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
                except OSError:
                    queued = 0  # closed: its fds went with it
                if not queued:
                    c.fds_out = 0
                total += c.fds_out
        return total

    async def fds_out(self, conn: Connection, n: int) -> None:
        """Wait until ``n`` more fds may go to ``conn``. An fd sent over a Unix socket stays
        "in flight" until the peer reads it, and Linux counts those against the sender's
        RLIMIT_NOFILE: a tenant that pipelined attaches without reading their replies
        held thousands, and past the limit every peer's reply with fds failed
        (ETOOMANYREFS). So a uid's peers get at most max_fds_per_uid fds they have not
        read; a connection with none unread always gets its next reply (a reply may
        carry more). The peer's reading gives no event: polled while over."""
        limit = self.settings.max_fds_per_uid
        while conn.fds_out and self.unread_fds(conn.peer.uid) + n > limit and conn.id in self.conns:
            await asyncio.sleep(0.01)
        conn.fds_out += n


# ===============================================================================================
# THE DISPATCH TABLE
# ===============================================================================================
# The dispatch table: one handler per op of protocol/__init__.py's OPS (checked here, at import).
HANDLERS: dict[str, Handler] = {
    "status": handlers.status, "health": handlers.health, "models": handlers.models, "load": handlers.load,
    "attach": handlers.attach, "detach": handlers.detach, "evict": handlers.evict, "pin": handlers.pin,
    "unpin": handlers.unpin, "reload": handlers.reload,
    "register": model_ops.register, "unregister": model_ops.unregister, "publish": model_ops.publish,
}
assert set(HANDLERS) | {"hello"} == OPS, "protocol OPS and the handlers disagree"


# ===============================================================================================
# THE CONNECTIONS
# ===============================================================================================
_REFUSED_WHILE_STOPPING = frozenset({"load", "attach", "register", "publish"})
_CLIENT_NAME_CHARS = 128


# sendmsg errors that mean the peer is gone (its reader notices and cleans up)
_PEER_GONE = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF, errno.ESHUTDOWN})


def client_name(name: Any) -> str:
    """The name a peer gave in hello, as the daemon keeps and logs it: a peer's string, so
    bounded (it lives as long as the connection) and printable (it goes into the log)."""
    if not isinstance(name, str) or not name:
        return "?"
    clean = "".join(ch if ch.isprintable() else "?" for ch in name[:_CLIENT_NAME_CHARS])
    return clean + ("..." if len(name) > _CLIENT_NAME_CHARS else "")


def error_reply(rid: int | None, exc: WeightcacheError) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": exc.to_wire()}


def _peer_fields(conn: Connection, **more: Any) -> dict[str, Any]:
    """The log record's fields (top-level keys in JSON logs) for a line about ``conn``."""
    fields = {"conn": conn.id, "pid": conn.peer.pid, "uid": conn.peer.uid, "client": conn.client, **more}
    return {k: v for k, v in fields.items() if v is not None}


def _op_label(op: str) -> str:
    """An op as a metrics label: a known op, else "other" (a peer chooses the string)."""
    return op if op in HANDLERS or op == "hello" else "other"


class Connections:
    def __init__(self, settings: DaemonConfig, access: AccessPolicy, core: CacheCore, residency: Residency, metrics: Metrics,
                 context: Callable[[], Context], stopping: asyncio.Event) -> None:
        self.settings = settings
        self.access = access
        self.core = core
        self.residency = residency
        self.metrics = metrics
        self._context = context
        self._stopping = stopping
        self.conns: dict[int, Connection] = {}
        self.bounds = Bounds(settings, self.conns)
        self._ids = itertools.count(1)
        self.background: set[asyncio.Task[Any]] = set()
        # Lines for what peers cause, rate-limited per uid with counts of what was left out
        # (peer_log.PeerEventLog): refused connections, refused admin ops, limits broken, replies
        # not sent. The daemon's one such log, the loads' too (Fill.model_event): flushed
        # once at close, it says what all of them left out.
        self.peer_log: PeerEventLog = residency.fill.peer_log

    def __len__(self) -> int:
        return len(self.conns)

    def _error(self, conn: Connection, rid: int | None, exc: WeightcacheError, op: str,
               told: WeightcacheError | None = None) -> dict[str, Any]:
        """Every error reply goes through here: counted by code and op
        (weightcache_errors_total), and logged at debug with its fields. ``told`` is the
        error as the peer may see it (handlers.redact); the log has the whole one."""
        code = str(exc.code)
        self.metrics.count_error(code, op)
        log.debug("conn %d: %s error %s: %s", conn.id, op, code, exc.message,
                  extra=_peer_fields(conn, op=op, code=code, model=exc.details.get("model")))
        return error_reply(rid, told or exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- accepting ------------------------------------------------------------------
    async def accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        d = self.settings
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE and friends: log, back off, keep serving
                log.error("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            sock.setblocking(False)
            conn = Connection(id=next(self._ids), sock=sock, peer=Peer.of(sock),
                              flow=FlowControl(d.max_requests_per_connection, d.max_queued_reply_bytes))
            refusal: WeightcacheError | None = None
            if not self.access.allows(conn.peer):
                self.peer_log.log(logging.WARNING, "refused conn", conn.peer.uid,
                                  "refused conn from pid %d uid %d gid %d: not in allowed uids/gids",
                                  conn.peer.pid, conn.peer.uid, conn.peer.gid, extra=_peer_fields(conn, code=PermissionDenied.code))
                refusal = PermissionDenied(f"uid {conn.peer.uid} may not use this weightcache daemon", uid=conn.peer.uid)
            elif len(self.conns) >= d.max_connections:
                self.peer_log.log(logging.WARNING, "refused conn: max_connections", conn.peer.uid,
                                  "refused conn from pid %d: %d connections open", conn.peer.pid, len(self.conns),
                                  extra=_peer_fields(conn, code=LimitExceeded.code))
                refusal = LimitExceeded(f"the daemon holds its maximum of {len(self.conns)} connections",
                                        limit=d.max_connections)
            elif (mine := sum(1 for c in self.conns.values() if c.peer.uid == conn.peer.uid)) >= d.max_connections_per_uid:
                self.peer_log.log(logging.WARNING, "refused conn: max_connections_per_uid", conn.peer.uid,
                                  "refused conn from pid %d: uid %d holds %d connections", conn.peer.pid, conn.peer.uid,
                                  mine, extra=_peer_fields(conn, code=LimitExceeded.code))
                refusal = LimitExceeded(f"uid {conn.peer.uid} holds its maximum of {mine} connections",
                                        limit=d.max_connections_per_uid)
            if refusal is not None:
                self._spawn(self._refuse(conn, refusal))
                continue
            self.conns[conn.id] = conn
            self._spawn(self._serve(conn))

    async def _refuse(self, conn: Connection, exc: WeightcacheError) -> None:
        try:
            await self._send_final(conn, exc)
        finally:
            conn.sock.close()

    # -- reading --------------------------------------------------------------------
    async def _serve(self, conn: Connection) -> None:
        d = self.settings
        reader = FrameReader(d.max_frame_bytes, d.frame_read_timeout_s, d.hello_timeout_s, time.monotonic())
        log.debug("conn %d open: pid %d uid %d", conn.id, conn.peer.pid, conn.peer.uid, extra=_peer_fields(conn))
        try:
            while True:
                await conn.flow.wait()
                if (pause := self.bounds.read_pause(conn.peer.uid)) > 0:
                    await asyncio.sleep(pause)  # this uid sent more than its share of bytes (Note [untrusted peers])
                try:
                    # asyncio.timeout, not wait_for: no second task, so the fds recvmsg took
                    # are counted below before any other connection's read runs.
                    async with asyncio.timeout(reader.timeout(conn.greeted, time.monotonic())):
                        data, fds = await recv_with_fds(conn.sock)
                except TimeoutError:
                    conn.close_fds()
                    await self._drop(conn, reader.timed_out(time.monotonic()), reader)
                    break
                except (ConnectionError, OSError):
                    break
                self.bounds.count_read(conn.peer.uid, len(data))
                if fds:
                    conn.fds.extend(fds)  # closed with the connection if refused below
                    refusal = self.bounds.check_fds(conn, len(fds))
                    if refusal is not None:
                        await self._drop(conn, refusal, reader)
                        break
                if not data:
                    break
                try:
                    frames = reader.feed(data, len(fds), time.monotonic())
                except (FrameTooLarge, BadRequest) as exc:  # the stream is out of step: this connection only
                    await self._drop(conn, exc, reader)
                    break
                self.bounds.count_partial(conn, reader.pending)
                # Only the connection that grew the sum can find it over a cap here: each
                # refused one's half frame leaves the count (and the memory) before its
                # goodbye, so no bystander reads while the sum is over.
                if (refusal := self.bounds.check_partial(conn)) is not None:
                    await self._drop(conn, refusal, reader)
                    break
                await self._dispatch_all(conn, frames)
                frames = []  # an idle connection must not keep its last frame (up to max_frame_bytes) alive
                if not reader.pending:  # fds no frame claimed: nobody will
                    conn.close_fds()
        finally:
            self.bounds.count_partial(conn, 0)
            conn.close_fds()
            await self._close(conn)

    async def _drop(self, conn: Connection, exc: WeightcacheError, reader: FrameReader) -> None:
        """A connection broke a limit: its fds and its half frame go now (not after the
        goodbye, which may take up to a second to a peer that does not read: held that
        long, up to max_frame_bytes of it was memory no count saw), then one error frame,
        then the caller closes it."""
        self.peer_log.log(logging.WARNING, f"connection closed: {exc.code}", conn.peer.uid, "conn %d (uid %d): %s; closing it",
                          conn.id, conn.peer.uid, exc.message, extra=_peer_fields(conn, code=exc.code))
        conn.close_fds()
        reader.discard()
        self.bounds.count_partial(conn, 0)  # its half frame no longer counts against the others
        await self._send_final(conn, exc)

    async def _close(self, conn: Connection) -> None:
        """The peer is gone. A ``load`` it asked for still completes (the docs promise it,
        and it may have been the first to ask); every other request is cancelled, so no
        lease is granted to a dead connection; then its leases end. Leases end before any
        load is awaited: that load may be waiting for exactly the memory they hold."""
        self.conns.pop(conn.id, None)
        if not conn.gone.done():
            conn.gone.set_result(None)
        cancelled = [t for t, op in conn.tasks.items() if op != "load"]
        for t in cancelled:
            t.cancel()
        await asyncio.gather(*cancelled, return_exceptions=True)
        for t in list(conn.tasks):  # loads: now the daemon's to finish and to await at shutdown
            self.residency.tasks.adopt(t)
        dropped = self.core.drop_connection(conn.id)
        if dropped:
            log.info("conn %d (%r, pid %d) closed holding %d lease(s); released", conn.id, conn.client, conn.peer.pid, len(dropped),
                     extra=_peer_fields(conn, leases=len(dropped)))
            self.residency.room.notify()
        else:
            log.debug("conn %d (%r, pid %d) closed", conn.id, conn.client, conn.peer.pid, extra=_peer_fields(conn, leases=0))
        conn.sock.close()

    # -- requests -------------------------------------------------------------------
    async def _dispatch_all(self, conn: Connection, frames: list[bytes]) -> None:
        for payload in frames:
            # One read may hold hundreds of small frames: the in-flight limit holds
            # between them too, not only between reads.
            await conn.flow.wait()
            self._dispatch(conn, payload)

    def _dispatch(self, conn: Connection, payload: bytes) -> None:
        try:
            args = decode_payload(payload, deferred=DEFERRED_KEYS)  # a publish's table is decoded in the io pool
        except PayloadRefused as exc:
            self._reply_later(conn, self._error(conn, exc.request_id, exc, "other"))
            return
        rid = args.pop("id", None)
        if not isinstance(rid, int) or isinstance(rid, bool):
            self._reply_later(conn, self._error(conn, None, BadRequest("request needs an integer 'id'"), _op_label(str(args.get("op")))))
            return
        nfds = args.pop("fds", 0)
        if not isinstance(nfds, int) or isinstance(nfds, bool) or not 0 <= nfds <= len(conn.fds):
            err = BadRequest(f"'fds' is {nfds!r} but {len(conn.fds)} file descriptor(s) arrived with the frame")
            self._reply_later(conn, self._error(conn, rid, err, _op_label(str(args.get("op")))))
            return
        op = args.pop("op", None)
        req = Request(rid, op if isinstance(op, str) else repr(op), args, [conn.fds.popleft() for _ in range(nfds)])
        if op == "hello":
            close_fds(req.fds)
            # Handled inline so that requests pipelined behind it see greeted=True.
            try:
                reply = {"id": rid, "ok": True, **hello(self._context(), args)}
                conn.client = client_name(args.get("client", "?"))
                conn.greeted = True
            except WeightcacheError as exc:
                reply = self._error(conn, rid, exc, "hello")
            self._reply_later(conn, reply)
            return
        self._track(conn, asyncio.ensure_future(self._handle(conn, req)), req.op)

    def _reply_later(self, conn: Connection, msg: dict[str, Any]) -> None:
        self._track(conn, asyncio.ensure_future(self._send(conn, msg)), "reply")

    def _track(self, conn: Connection, task: asyncio.Task[None], op: str) -> None:
        conn.tasks[task] = op

        def done(t: asyncio.Task[None]) -> None:
            conn.tasks.pop(t, None)
            conn.flow.set_in_flight(len(conn.tasks))

        task.add_done_callback(done)
        conn.flow.set_in_flight(len(conn.tasks))

    async def _handle(self, conn: Connection, req: Request) -> None:
        fds: list[int] = []  # the reply's
        ctx = self._context()
        caller = Caller(conn.id, conn.peer, conn.client, conn.gone)
        try:
            if not conn.greeted:
                raise BadRequest("the first request on a connection must be 'hello'")
            handler = HANDLERS.get(req.op)
            if handler is None:
                raise UnknownOp(f"unknown op {req.op!r}", op=req.op)
            # pin / unpin are also a model owner's under a pins quota: the handler decides (handlers._set_pin).
            if req.op in ADMIN_OPS and req.op not in OWNER_PIN_OPS and not self.access.is_admin(conn.peer):
                self.peer_log.log(logging.WARNING, "refused admin op", conn.peer.uid, "conn %d: uid %d refused admin op %r",
                                  conn.id, conn.peer.uid, req.op, extra=_peer_fields(conn, op=req.op, code=PermissionDenied.code))
                raise PermissionDenied(f"op {req.op!r} is for administrators; uid {conn.peer.uid} is not one", op=req.op)
            if self._stopping.is_set() and req.op in _REFUSED_WHILE_STOPPING:
                raise ShuttingDown("the daemon is shutting down")
            timeout = self.settings.request_timeout_s
            started = time.monotonic()
            try:
                async with asyncio.timeout(timeout):
                    reply, fds = await handler(ctx, caller, req)
            except TimeoutError:
                raise RequestTimeout(f"op {req.op!r} did not finish within {timeout:g}s (a load goes on regardless)") from None
            finally:
                self.metrics.observe(req.op, started)
            msg = {"id": req.id, "ok": True, **reply}
        except WeightcacheError as exc:
            msg = self._error(conn, req.id, exc, _op_label(req.op), told=redact(ctx, caller, req, exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("conn %d: op %r failed unexpectedly", conn.id, req.op, extra=_peer_fields(conn, op=req.op, code=InternalError.code))
            msg = self._error(conn, req.id, InternalError(f"{type(exc).__name__}: {exc}"), _op_label(req.op))
        finally:
            close_fds(req.fds)  # the fds the request brought and did not hand on
            req.fds.clear()
        try:
            await self._send(conn, msg, fds)
        finally:
            close_fds(fds)

    # -- sending --------------------------------------------------------------------
    async def _send(self, conn: Connection, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        if fds:
            msg["fds"] = len(fds)
        async with conn.write_lock:
            if fds:
                await self.bounds.fds_out(conn, len(fds))
            # Encoded under the lock: replies waiting for a peer that does not read hold
            # their (small, or shared) reply maps, never a second copy of their bytes.
            frame = encode_reply(msg)
            conn.flow.set_unsent(sum(len(part) for part in frame))
            try:
                await send_with_fds(conn.sock, frame, fds or [])
            except OSError as exc:
                if exc.errno in _PEER_GONE:
                    # The peer went away; the read side notices and releases its leases.
                    log.debug("conn %d: send failed: %s", conn.id, exc)
                else:
                    # Not sent, the peer still there (ETOOMANYREFS: fds in flight past the
                    # daemon's RLIMIT_NOFILE): it would wait for this reply forever, holding
                    # what the reply granted. Closed, its leases end and the peer knows.
                    # The peer's doing (it left fds unread), so its share of the log.
                    self.peer_log.log(logging.WARNING, "reply not sent", conn.peer.uid,
                                      "conn %d: reply not sent (%s); closing the connection", conn.id, exc,
                                      extra=_peer_fields(conn))
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_RDWR)
            finally:
                conn.flow.set_unsent(0)

    async def _send_final(self, conn: Connection, exc: WeightcacheError) -> None:
        """An error about the connection itself, just before closing it: never waits long
        on a peer that does not read."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._send(conn, self._error(conn, None, exc, "connection")), 1.0)

    async def broadcast(self, event: dict[str, Any]) -> None:
        """An event to every connection; a peer that does not read gets a second."""
        await asyncio.gather(*(asyncio.wait_for(self._send(c, {"id": None, **event}), 1.0) for c in list(self.conns.values())),
                             return_exceptions=True)

    def caller(self, conn_id: int) -> Caller | None:
        """Who is behind a connection: pid and uid from SO_PEERCRED, the name it gave in
        hello. None once it closed (its leases are being released)."""
        c = self.conns.get(conn_id)
        return None if c is None else Caller(c.id, c.peer, c.client)

    def in_flight(self) -> list[asyncio.Task[None]]:
        return [t for c in self.conns.values() for t in c.tasks]

    async def close(self) -> None:
        """At shutdown: close every connection and stop their readers."""
        self.peer_log.flush()  # what was left out of the log, said before the daemon goes
        for conn in list(self.conns.values()):
            conn.sock.close()
        for t in list(self.background):
            t.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
