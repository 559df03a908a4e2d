"""One connection to the daemon: the socket, the check of who serves it, framing, requests
matched by id, timeouts and cancellation. It knows no op beyond what its timeouts and
Note [cancellation] need; :class:`~weightcache.client.client.Client` speaks the protocol
on top of it.

Two transports share it. :class:`ConnectionBase` holds everything that is not waiting:
settings and timeouts, building request frames, reading replies out of received bytes and
fds, checking them, dropping stale ones, and the errors. :class:`Connection` waits on an
asyncio loop (a reader task per connection); sync.py's ``BlockingConnection`` waits in
the caller's thread (Note [blocking transport] there). The ops themselves are written once,
in client.py's ``ClientOps``.

No torch here or in client.py: ``weightcache health`` (which Kubernetes probes run), the
CLI and every control call import only this, msgpack and the standard library. Tensors
are made in mapping.py, imported at the first attach.

Note [timeouts]
---------------
Nothing waits on the daemon without a bound, so a stopped (SIGSTOP), hung or overloaded
daemon cannot hang its engines. Connecting (the socket connect and the hello exchange)
is bounded by ``connect_timeout`` (-> DaemonUnavailable). A request, from waiting for
the write lock through sending to its reply, is bounded by ``request_timeout``, except
``load``, ``attach`` and ``publish``, which may legitimately take minutes: they get
``load_timeout``, by default the daemon's own ``request_timeout_s`` (from its hello
reply; 900 s if it does not say) plus 30 s, so that the daemon's own TIMEOUT, which
says more, normally arrives first. Every method takes ``timeout=`` to override its
default; ``math.inf`` waits without a bound. A request that runs out of time raises
RequestTimeout and is abandoned as in Note [cancellation]. One that ran out of time
while its frame was half sent leaves the stream out of step: the connection is closed.

Note [waiting for the daemon]
-----------------------------
An engine may start before the daemon (systemd ordering races, pods started together).
While the socket does not exist (ENOENT) or nobody listens on it (ECONNREFUSED: not yet,
or a socket left behind by a daemon that died), connecting retries with backoff, 10 ms
doubling to 200 ms, for up to ``wait_for_daemon`` seconds (default 5; 0 tries once;
``$WEIGHTCACHE_WAIT_FOR_DAEMON`` sets the default). Then DaemonUnavailable says which
socket and how to start the daemon. Nothing else is retried: EACCES and EPERM
(PermissionDenied: this user may not use that socket, and waiting will not change it)
and every other error fail at once. ``connect_timeout`` bounds each attempt's connect,
and the hello exchange counts from the start of the attempt that connected.

Note [cancellation]
-------------------
A request cancelled (or timed out) between send and reply leaves its id behind; the
reader drops that reply when it comes, closes any fds it carried and, if it granted a
lease, detaches it, so no stale reply reaches a later caller and no lease leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import math
import os
import socket
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from ..defaults import DAEMON_UID_ENV, SOCKET_ENV, client_socket_path
from ..errors import DaemonUnavailable, PermissionDenied, RequestTimeout, WeightcacheError, error_from_wire
from ..peercred import peer_credentials
from ..protocol import FrameDecoder, decode_payload, encode_frame
from ..protocol.transport import recv_with_fds, send_with_fds

DEFAULT_MAX_FRAME_BYTES = 256 * 2**20  # replies: an attach's tensor table can be long
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_WAIT_FOR_DAEMON = 5.0  # Note [waiting for the daemon]
WAIT_FOR_DAEMON_ENV = "WEIGHTCACHE_WAIT_FOR_DAEMON"
RETRY_FIRST_S, RETRY_MAX_S = 0.01, 0.2  # the backoff between connect attempts
RETRY_ERRNOS = frozenset({errno.ENOENT, errno.ECONNREFUSED})  # the daemon is not there (yet)
START_DAEMON_HINT = ("start it with `weightcache serve --config /etc/weightcache/weightcache.toml` (or `systemctl start weightcache`), "
                     f"or point ${SOCKET_ENV} at the socket it serves")
DEFAULT_REQUEST_TIMEOUT = 60.0
LONG_OPS = frozenset({"load", "attach", "publish"})  # may take minutes: they get load_timeout
DAEMON_REQUEST_TIMEOUT_S = 900.0  # the daemon's default request_timeout_s, for one whose hello does not say
LOAD_TIMEOUT_MARGIN_S = 30.0  # past the daemon's own timeout, so its TIMEOUT reply arrives first

Reply = tuple[dict[str, Any], list[int]]  # a reply map and the fds that came with it
T = TypeVar("T")


def wait_for_daemon_from_env() -> float:
    """``$WEIGHTCACHE_WAIT_FOR_DAEMON`` in seconds, else the default (5)."""
    raw = os.environ.get(WAIT_FOR_DAEMON_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_FOR_DAEMON
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise ValueError(f"${WAIT_FOR_DAEMON_ENV} must be a number of seconds >= 0 (e.g. 5 or 0.5), not {raw!r}")
    return value


def prefetch_attach() -> None:
    """Start importing what the first attach needs (mapping.py and, once torch has CUDA,
    cuda_mapping.py and the driver's UUID table) in a short-lived thread, while this
    process waits on the daemon's hello and attach replies. Note [first attach] in
    cuda_mapping.py: done in the attach, this one-time work was 0.83 ms of imports and
    0.15 ms of driver set-up of a fresh engine's ~9 ms on the H200; the waits it overlaps
    with (two round trips, the GIL released) were 1.7 ms. Only where torch is imported
    already: a control client (the CLI, health probes) must not import torch, and an
    engine that has not imported it would wait ~1.5 s for it in the attach either way.
    The attach imports the same modules: it waits for this thread's import (the import
    lock), or does it itself if the thread failed (the error is raised there)."""
    if "torch" not in sys.modules or "weightcache.client.mapping" in sys.modules:
        return
    threading.Thread(target=_import_for_attach, name="weightcache-prefetch", daemon=True).start()


def _import_for_attach() -> None:
    try:
        from . import mapping  # noqa: F401

        torch = sys.modules["torch"]
        if torch.cuda.is_initialized():  # the engine made its CUDA context: a GPU attach is coming
            from . import cuda_mapping  # noqa: F401
            from .libcuda import driver

            driver().device_uuids()
    except Exception:  # the attach does the same work and raises what went wrong
        return


def check_daemon_identity(sock: socket.socket, path: str) -> None:
    """Trust only a daemon running as root, as ourselves, or as $WEIGHTCACHE_DAEMON_UID:
    anyone who could create a socket at that path could otherwise serve us weights."""
    _pid, uid, _gid = peer_credentials(sock)
    trusted = {0, os.geteuid()}
    if want := os.environ.get(DAEMON_UID_ENV):
        import pwd

        try:
            trusted.add(int(want) if want.isdigit() else pwd.getpwnam(want).pw_uid)
        except KeyError:
            raise PermissionDenied(f"${DAEMON_UID_ENV}={want!r} names no user") from None
    if uid not in trusted:
        raise PermissionDenied(f"the process serving {path} runs as uid {uid}, which is not trusted "
                               f"(root, this user, or ${DAEMON_UID_ENV})", uid=uid)


class ConnectionBase(ABC):
    """What the asyncio and the blocking transport share; not used on its own.

    ``socket_path`` defaults to ``$WEIGHTCACHE_SOCKET``, then /run/weightcache/weightcache.sock.
    Timeouts are in seconds (Note [timeouts]): ``connect_timeout`` bounds the connect and
    hello, ``request_timeout`` control requests, ``load_timeout`` load/attach/publish
    (None: the daemon's ``request_timeout_s`` plus 30 s). ``math.inf`` means no bound.
    ``wait_for_daemon``: how long connecting waits for a daemon that is not running yet
    (None: ``$WEIGHTCACHE_WAIT_FOR_DAEMON``, else 5 s; 0 tries once; Note [waiting for the daemon]).
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, load_timeout: float | None = None,
                 wait_for_daemon: float | None = None) -> None:
        for what, value in (("connect_timeout", connect_timeout), ("request_timeout", request_timeout),
                            ("load_timeout", load_timeout)):
            if value is not None and not value > 0:  # also refuses NaN
                raise ValueError(f"{what} must be a positive number of seconds (math.inf for no bound), not {value!r}")
        if wait_for_daemon is None:
            wait_for_daemon = wait_for_daemon_from_env()
        elif not wait_for_daemon >= 0:  # also refuses NaN
            raise ValueError(f"wait_for_daemon must be a number of seconds >= 0 (math.inf for no bound), not {wait_for_daemon!r}")
        self.socket_path = client_socket_path(socket_path)
        self.name = name or f"python/{os.getpid()}"
        self.connect_timeout = connect_timeout
        self.wait_for_daemon = wait_for_daemon
        self.request_timeout = request_timeout
        self._load_timeout = load_timeout
        self._max_frame = max_frame_bytes
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._closed_error: WeightcacheError | None = None
        self.server_info: dict[str, Any] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=64)  # events the daemon announced, newest last
        self._init_transport()

    @abstractmethod
    def _init_transport(self) -> None:
        """Set up what the transport keeps per connection (its waiters and locks)."""

    @property
    def load_timeout(self) -> float:
        """The default timeout of load, attach and publish (Note [timeouts])."""
        if self._load_timeout is not None:
            return self._load_timeout
        daemon_s = self.server_info.get("request_timeout_s")
        if isinstance(daemon_s, int | float) and not isinstance(daemon_s, bool) and daemon_s > 0:
            return float(daemon_s) + LOAD_TIMEOUT_MARGIN_S
        return DAEMON_REQUEST_TIMEOUT_S + LOAD_TIMEOUT_MARGIN_S

    def _limit(self, op: str, timeout: float | None) -> float | None:
        """The seconds ``op`` may take: the override, else its default; None for no bound."""
        if timeout is None:
            timeout = self.load_timeout if op in LONG_OPS else self.request_timeout
        return None if math.isinf(timeout) else timeout

    # -- connecting: shared ---------------------------------------------------------
    def _new_socket(self) -> socket.socket:
        """A fresh non-blocking socket for one connect attempt (Note [waiting for the daemon])."""
        if os.path.islink(self.socket_path):
            raise PermissionDenied(f"{self.socket_path} is a symlink; refusing to connect through it")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        return sock

    def _retry_after(self, exc: OSError, give_up: float, now: float, delay: float) -> float:
        """The seconds to wait before the next attempt after ``exc``; raises the connect
        error if ``exc`` is not worth retrying or the wait is over (``give_up``)."""
        left = give_up - now
        if exc.errno not in RETRY_ERRNOS or left <= 0:
            raise self._connect_error(exc) from exc
        return min(delay, left)

    def _connect_error(self, exc: OSError) -> WeightcacheError:
        """What a connect that failed for good raises: a clear message by errno."""
        path = self.socket_path
        if exc.errno in (errno.EACCES, errno.EPERM):
            return PermissionDenied(
                f"permission denied connecting to weightcache at {path} as uid {os.geteuid()}: the socket's owner, group "
                "and mode (and its directories') decide who may connect; the daemon's socket_group and socket_mode set "
                "them (docs/deployment.md)", socket=path)
        if exc.errno in RETRY_ERRNOS:
            what = "the socket does not exist" if exc.errno == errno.ENOENT else \
                "nothing is listening on it (a daemon that stopped may have left it behind)"
            return DaemonUnavailable(f"cannot connect to weightcache at {path}: {what}, after waiting "
                                     f"{self.wait_for_daemon:g}s for the daemon. Is it running? {START_DAEMON_HINT}",
                                     socket=path, waited_s=self.wait_for_daemon)
        return DaemonUnavailable(f"cannot connect to weightcache at {path}: {exc.strerror or exc}", socket=path)

    def _no_answer(self) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"weightcache at {self.socket_path} did not answer within {self.connect_timeout:g}s "
            "(connect and hello); is the daemon stopped, hung or overloaded?", socket=self.socket_path)

    # -- requests: shared -----------------------------------------------------------
    async def request(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request; return the reply map or raise the error class of its code.
        Arguments that are None are left out.

        >>> await c.request("status", timeout=5)          # doctest: +SKIP
        {'id': 3, 'ok': True, 'devices': {...}, ...}
        """
        reply, fds = await self._request(op, timeout, args)
        for fd in fds:  # only attach takes fds; anything else carrying them is closed
            os.close(fd)
        return reply

    def _frame(self, op: str, timeout: float | None, args: dict[str, Any],
               send_fds: list[int] | None) -> tuple[int, float | None, bytes]:
        """A new request's id, time limit (None: no bound) and frame; raises if the
        connection cannot carry it."""
        if self._closed_error is not None:  # the connection broke: nobody would read a reply
            raise self._closed_error
        if self._sock is None:
            raise DaemonUnavailable("not connected; use 'async with Client()' or connect()")
        rid = next(self._ids)
        msg = {"id": rid, "op": op, **{k: v for k, v in args.items() if v is not None}}
        if send_fds:
            msg["fds"] = len(send_fds)
        return rid, self._limit(op, timeout), encode_frame(msg)

    def _checked(self, reply: dict[str, Any], fds: list[int]) -> Reply:
        """A reply that says ok, or its error raised (its fds closed)."""
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise error_from_wire(reply.get("error") or {})
        return reply, fds

    def _read_replies(self, decoder: FrameDecoder, fd_queue: deque[int], data: bytes, fds: list[int]) -> list[Reply]:
        """One read's bytes and fds -> the replies it completed, each with its fds (which
        arrive with the first byte of the frame that names them). Events the daemon
        announced go to ``events``. Raises DaemonUnavailable at the end of the stream."""
        fd_queue.extend(fds)
        if not data:
            raise DaemonUnavailable(f"weightcache at {self.socket_path} closed the connection")
        replies = []
        for payload in decoder.feed(data):
            # Replies may hold long arrays (an attach's tensor table) and maps keyed
            # by model: as long as this client's frame limit, not a request's limits.
            reply = decode_payload(payload, max_map_len=self._max_frame, max_array_len=self._max_frame,
                                   max_str_len=self._max_frame, max_bin_len=self._max_frame)
            if "event" in reply:  # unsolicited, e.g. {"event": "shutting_down", "grace_s": 10}
                self.events.append(reply)
                continue
            count = int(reply.get("fds", 0))
            if count > len(fd_queue):
                raise DaemonUnavailable(f"weightcache at {self.socket_path} sent a reply naming {count} fds, "
                                        f"but {len(fd_queue)} arrived")
            replies.append((reply, [fd_queue.popleft() for _ in range(count)]))
        return replies

    def _drop_reply(self, reply: dict[str, Any], fds: list[int]) -> None:
        """A reply nobody waits for (Note [cancellation]): close its fds, give back its lease."""
        for fd in fds:
            os.close(fd)
        if reply.get("id") is None and not reply.get("ok"):
            # An error about the connection itself (e.g. FRAME_TOO_LARGE): fail everyone.
            self._fail_pending(error_from_wire(reply.get("error") or {}))
        elif reply.get("ok") and "lease" in reply and "tensors" in reply:
            self._give_back(reply["lease"])

    async def _detach_quietly(self, lease: int) -> None:
        # If this fails the connection is gone, and the daemon ended the lease with it.
        with contextlib.suppress(WeightcacheError, OSError):
            await self.request("detach", lease=lease)

    def _timed_out(self, op: str, limit: float | None) -> RequestTimeout:
        return RequestTimeout(
            f"the daemon at {self.socket_path} did not answer {op!r} within {limit:g}s; it may be stopped, "
            "hung or overloaded (a late reply is dropped)", op=op, timeout_s=limit)

    def _abandoned(self, op: str) -> DaemonUnavailable:
        return DaemonUnavailable(f"connection to {self.socket_path} closed: a {op!r} request was abandoned while its frame "
                                 "was being sent", socket=self.socket_path)

    # -- what each transport does its own way ---------------------------------------
    @abstractmethod
    async def _open(self, hello: dict[str, Any]) -> None:
        """Connect, check who serves the socket and say ``hello`` (its reply becomes
        ``server_info``), within the limits of Note [timeouts] and Note [waiting for the
        daemon]. On any failure nothing is left open."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection. Requests in flight fail with DaemonUnavailable, and the
        daemon ends every lease this connection held."""

    @abstractmethod
    async def _request(self, op: str, timeout: float | None, args: dict[str, Any], send_fds: list[int] | None = None) -> Reply:
        """``request`` that also sends ``send_fds`` (SCM_RIGHTS, on the same frame) and
        returns the fds of the reply, which the caller must close."""

    @abstractmethod
    def _lease(self, lease: int) -> AbstractAsyncContextManager[None]:
        """Detach ``lease`` when the block exits, however it exits."""

    @abstractmethod
    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, for work that takes long (packing tensors to publish): where it
        would block other requests, off the thread that waits for them."""

    @abstractmethod
    def _give_back(self, lease: int) -> None:
        """Detach ``lease``, granted by a reply nobody waited for, without waiting."""

    @abstractmethod
    def _fail_pending(self, exc: WeightcacheError) -> None:
        """Fail every request waiting for a reply with ``exc``."""


class Connection(ConnectionBase):
    """The asyncio transport under :class:`~weightcache.Client`; not used on its own.
    A reader task reads every frame as it comes and hands each reply to the request
    waiting for its id."""

    def _init_transport(self) -> None:
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._write_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    # -- connecting -----------------------------------------------------------------
    async def _open(self, hello: dict[str, Any]) -> None:
        prefetch_attach()
        loop = asyncio.get_running_loop()
        sock, started = await self._connect_socket(loop)
        deadline = asyncio.timeout_at(None if math.isinf(self.connect_timeout) else started + self.connect_timeout)
        try:
            async with deadline:
                self._sock = sock
                self._closed_error = None
                self._reader = asyncio.ensure_future(self._read_loop())
                # Unbounded here: the connect deadline around it is the bound.
                self.server_info = await self.request("hello", timeout=math.inf, **hello)
        except BaseException as exc:
            if self._sock is sock:
                await self.close()
            else:
                sock.close()
            if isinstance(exc, TimeoutError) and deadline.expired():
                raise self._no_answer() from None
            raise

    async def _connect_socket(self, loop: asyncio.AbstractEventLoop) -> tuple[socket.socket, float]:
        """A connected socket whose peer we trust, and the loop time its attempt began.
        Retries while the daemon is not there, up to ``wait_for_daemon`` (Note [waiting for
        the daemon]); each attempt's connect is bounded by ``connect_timeout``."""
        # time.monotonic(), not loop.time(): uvloop's clock is cached in whole milliseconds,
        # and a sleep on it ended the wait up to 1 ms before wait_for_daemon had passed.
        give_up = time.monotonic() + self.wait_for_daemon
        delay = RETRY_FIRST_S
        while True:
            started = loop.time()
            attempt = asyncio.timeout_at(None if math.isinf(self.connect_timeout) else started + self.connect_timeout)
            try:
                async with attempt:
                    return await self._connect_once(loop), started
            except TimeoutError:
                if attempt.expired():
                    raise self._no_answer() from None
                raise
            except OSError as exc:
                wait = self._retry_after(exc, give_up, time.monotonic(), delay)
            await asyncio.sleep(wait)
            delay = min(2 * delay, RETRY_MAX_S)

    async def _connect_once(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        """One attempt: connect and check who serves the socket. OSError as connect raised it."""
        sock = self._new_socket()
        try:
            await loop.sock_connect(sock, self.socket_path)
            check_daemon_identity(sock, self.socket_path)
        except BaseException:
            sock.close()
            raise
        return sock

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._fail_pending(DaemonUnavailable("client closed"))

    # -- requests -------------------------------------------------------------------
    async def _request(self, op: str, timeout: float | None, args: dict[str, Any], send_fds: list[int] | None = None) -> Reply:
        rid, limit, frame = self._frame(op, timeout, args, send_fds)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        deadline = asyncio.timeout(limit)
        sending = False
        try:
            async with deadline:
                async with self._write_lock:
                    if self._sock is None:
                        raise self._closed_error or DaemonUnavailable("client closed")
                    sending = True
                    await send_with_fds(self._sock, frame, send_fds or [])
                    sending = False
                reply, fds = await fut
        except BaseException as exc:
            timed_out = isinstance(exc, TimeoutError) and deadline.expired()
            if sending and (timed_out or not isinstance(exc, OSError)):  # part of the frame may be out (Note [timeouts])
                self._break_connection(self._abandoned(op))
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                if not timed_out:  # cancelled after the reply arrived, before we resumed: give it back
                    self._drop_reply(*fut.result())
                    raise
                reply, fds = fut.result()  # it did answer in time; we had not resumed yet
            elif timed_out:
                raise self._timed_out(op, limit) from None
            elif isinstance(exc, OSError):
                raise DaemonUnavailable(f"connection to {self.socket_path} broke: {exc}") from exc
            else:
                raise
        finally:
            self._pending.pop(rid, None)  # a late reply for rid is now dropped (Note [cancellation])
        return self._checked(reply, fds)

    async def _read_loop(self) -> None:
        assert self._sock is not None
        decoder = FrameDecoder(self._max_frame)
        fd_queue: deque[int] = deque()  # fds arrive with the first byte of the frame that names them
        try:
            while True:
                data, fds = await recv_with_fds(self._sock)
                for reply, mine in self._read_replies(decoder, fd_queue, data, fds):
                    fut = self._pending.get(reply.get("id"))  # type: ignore[arg-type]
                    if fut is not None and not fut.done():
                        fut.set_result((reply, mine))
                    else:
                        self._drop_reply(reply, mine)
        except asyncio.CancelledError:
            raise
        except (WeightcacheError, OSError) as exc:
            err = exc if isinstance(exc, WeightcacheError) else DaemonUnavailable(f"connection broke: {exc}")
            if self._closed_error is None:  # else _break_connection said why first
                self._closed_error = err
            self._fail_pending(self._closed_error)
        finally:
            while fd_queue:
                os.close(fd_queue.popleft())

    def _give_back(self, lease: int) -> None:
        task = asyncio.ensure_future(self._detach_quietly(lease))
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    @contextlib.asynccontextmanager
    async def _lease(self, lease: int) -> AsyncIterator[None]:
        """Detach ``lease`` when the block exits, however it exits. Shielded: a cancelled
        engine task must still give its lease back."""
        try:
            yield
        finally:
            if self._sock is not None:  # else the connection is closed and the lease ended with it
                await asyncio.shield(self._detach_quietly(lease))

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)  # the loop keeps serving other requests meanwhile

    def _break_connection(self, err: WeightcacheError) -> None:
        """The stream is out of step: fail every request and stop using the connection.
        Shut down, not closed: the reader wakes, sees the end, and exits; close() closes."""
        if self._closed_error is None:
            self._closed_error = err
        self._fail_pending(err)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _fail_pending(self, exc: WeightcacheError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()
