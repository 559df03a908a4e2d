"""SyncClient: the async client's ops, run in the caller's thread on a blocking transport,
for engines that are not asyncio code. Same methods, same errors, blocking.

Note [blocking transport]
-------------------------
A SyncClient does its socket I/O in the thread that calls it: no event loop, no thread of
its own. The first version ran the async client on a private loop thread; starting that
thread and loop, and two cross-thread handoffs per call, cost a fresh engine ~0.6-1.2 ms
of a ~2 ms connect on the H200, against 0.35 ms for the async client's connect.

One implementation of the protocol: the ops are connection.py's ``ClientOps`` coroutines,
connecting (the retry loop, the hello) is connection.py's ``ConnectionBase``, and
everything that is not waiting (framing, reading replies and their fds, errors, stale
replies) is core.py's ``ClientCore``. ``BlockingConnection`` implements the
waits with plain blocking calls, so those coroutines never suspend: ``run_to_end`` drives
one with a single ``send(None)`` and gets its result (or exception) back, and raises if
one ever does suspend (a wait that is not the transport's).

- Socket: non-blocking, waited on with poll(2) up to each request's deadline, so one
  socket serves several threads and every wait keeps its own bound (Note [timeouts] in core.py).
- Threads: any number may call one client at once, as before. Sends are serialised by a
  lock; replies are read by whichever waiting thread finds nobody reading (it hands
  every reply it reads to the thread waiting for its id, and wakes the others when it
  stops), so one thread's long ``load`` does not delay another's ``status``.
- Leases end when the connection closes, so the socket stays open for as long as the
  client lives (``close``, ``with``, or its collection close it), and for as long as
  the tensors of an attach never exited live (mapping.py's ``Lease``).
- Nothing runs in the background. While the daemon answers the hello, the connecting
  thread imports what the first attach needs (connection.py's ``import_attach_half``)
  in an engine that has imported torch. What the daemon sends unasked is read at the next call:
  events (``shutting_down``) and the late reply to a request that timed out or was
  interrupted (KeyboardInterrupt). A late attach's lease is given back then, with a
  detach sent without waiting for its answer; if no call comes, closing the client ends
  it. A stream left out of step (a frame half sent, or a read interrupted before its
  bytes were handed on) breaks the connection: later calls raise DaemonUnavailable.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ..errors import DaemonUnavailable, WeightcacheError
from ..protocol import recv_with_fds_blocking, send_with_fds_blocking
from .connection import ClientOps, ConnectionBase
from .core import DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_FRAME_BYTES, DEFAULT_REQUEST_TIMEOUT, PEER_GONE_ERRNOS, Reply

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .mapping import AttachedModel

    # Annotations only: making them at run time cost a fresh engine ~45 µs of its import (2-core VM).
    P = ParamSpec("P")
    T = TypeVar("T")

_open_clients: weakref.WeakSet[SyncClient] = weakref.WeakSet()
_WAITING = None  # a pending request's slot before its reply comes


@atexit.register
def _close_open_clients() -> None:
    # An engine that exits inside an attach block finalizes the block's generator at exit,
    # and its cleanup would detach: one round trip per lease, and up to request_timeout
    # against a stopped daemon. Closing the clients first ends the leases with the
    # connections at once; cleanup after close sends nothing.
    for client in list(_open_clients):
        client.close()


def run_to_end(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (Note [blocking transport]) and return its result."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a SyncClient call awaited something other than its blocking transport")


def _deadline(limit: float | None) -> float | None:
    return None if limit is None else time.monotonic() + limit


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (None: no bound), for Condition.wait."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _acquire(lock: threading.Lock, deadline: float | None) -> bool:
    left = _left(deadline)
    return lock.acquire(timeout=-1 if left is None else left)


class BlockingConnection(ConnectionBase):
    """The transport of :class:`SyncClient`: blocking I/O in the calling thread (Note
    [blocking transport]). Its coroutines complete without suspending."""

    def _init_transport(self) -> None:
        self._send_lock = threading.Lock()
        self._state = threading.Condition()  # guards what follows; notified when a reply lands or the reader stops
        self._pending: dict[int, Reply | WeightcacheError | None] = {}
        self._reading = False  # a thread is reading replies for everyone
        # (epoch, lease) to detach without waiting: of late attach replies (after the read that
        # found them) and of attaches whose tensors were collected (Lease)
        self._leftover_leases: deque[tuple[int, int]] = deque()
        self._reconnect_lock = threading.Lock()

    # -- connecting: the waits of ConnectionBase._connect ----------------------------
    async def _connect_once(self, sock: socket.socket, deadline: float | None) -> None:
        while True:
            try:
                sock.connect(self.core.socket_path)
                return
            except (BlockingIOError, InterruptedError):  # the listen backlog is full: wait for room
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError from None
                time.sleep(1e-3)

    async def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def _started(self) -> None:
        """Nothing to start: replies are read by the threads that wait for them (_wait_for)."""

    async def close(self) -> None:
        self._close_now()

    def _close_now(self) -> None:
        self._drop_now(self.core.close())

    async def _drop(self, error: WeightcacheError) -> None:
        self._drop_now(error)

    def _drop_now(self, error: WeightcacheError) -> None:
        with self._state:
            sock, self._sock = self._sock, None
            self._fail_pending(self.core.stop(error))
            self._leftover_leases.clear()  # they end with the connection
        if sock is not None:
            sock.close()

    @contextlib.asynccontextmanager
    async def _reconnecting(self) -> AsyncIterator[None]:
        with self._reconnect_lock:
            yield

    # -- requests -------------------------------------------------------------------
    async def _exchange(self, op: str, timeout: float | None, args: dict[str, Any], send_fds: list[int] | None = None,
                        while_waiting: Callable[[], None] | None = None) -> Reply:
        rid, frame = self.core.request(op, args, len(send_fds or ()))
        limit = self.core.limit(op, timeout)
        deadline = _deadline(limit)
        with self._state:
            self._pending[rid] = _WAITING
        sending = False
        try:
            if not _acquire(self._send_lock, deadline):
                raise TimeoutError
            try:
                sock = self._sock
                if sock is None:
                    raise self.core.error or DaemonUnavailable("client closed")
                sending = True
                send_with_fds_blocking(sock, frame, send_fds or [], deadline)
                sending = False
            finally:
                self._send_lock.release()
            if while_waiting is not None:
                while_waiting()
            reply, fds = self._wait_for(rid, deadline)
        except BaseException as exc:
            if sending and isinstance(exc, OSError) and exc.errno in PEER_GONE_ERRNOS:  # Note [reconnecting]
                # A refusal comes at accept, so only the hello can meet one; any later request
                # that finds the end closed is sent again on a new connection.
                gone = (self._last_words(sock) if op == "hello" else None) or self.core.peer_gone(op, exc)
                self._break_connection(gone)
                raise gone from exc
            if sending:  # part of the frame may be out (Note [timeouts])
                self._break_connection(self.core.abandoned(op))
            if isinstance(exc, TimeoutError):
                raise self.core.timed_out(op, limit) from None
            if isinstance(exc, OSError):
                raise self.core.broken(exc) from exc
            raise
        finally:
            with self._state:
                slot = self._pending.pop(rid, None)  # a late reply for rid is now dropped (Note [cancellation])
            if isinstance(slot, tuple):  # interrupted after its reply came in: give it back
                self._unclaimed(*slot)
            self._detach_leftovers()
        return self.core.checked(reply, fds)

    def _last_words(self, sock: socket.socket | None) -> WeightcacheError | None:
        """The error the daemon sent before it closed the connection, if one is waiting in
        the socket: a daemon that refuses a connection (a uid it does not allow, too many
        connections) sends why and closes, and a hello sent meanwhile finds the socket
        closed (EPIPE). The refusal, not the EPIPE, is what the caller must see, and it is
        not a reason to connect again. Read only when no other thread is reading."""
        with self._state:
            if self._reading or sock is None:
                return None
        try:
            data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            replies = self.core.receive(data, [])
        except (OSError, WeightcacheError):
            return None
        for reply, fds in replies:
            if isinstance(err := self.core.unclaimed(reply, fds), WeightcacheError):
                return err
        return None

    def _wait_for(self, rid: int, deadline: float | None) -> Reply:
        """The reply to ``rid``: read by this thread, or by another that is reading."""
        with self._state:
            while True:
                if (got := self._take(rid)) is not None:
                    return got
                if self.core.error is not None:
                    raise self.core.error
                if not self._reading:
                    self._reading = True
                    break
                left = _left(deadline)
                if left == 0:
                    raise TimeoutError
                self._state.wait(left)
        try:
            while True:
                self._read_once(deadline)
                with self._state:
                    if (got := self._take(rid)) is not None:
                        return got
        finally:
            with self._state:
                self._reading = False
                self._state.notify_all()  # one of the others reads next

    def _take(self, rid: int) -> Reply | None:
        """``rid``'s reply, taken out of ``_pending``, if it came; its error raised if it
        failed; None while it waits. Called holding ``_state``."""
        slot = self._pending.get(rid)
        if slot is _WAITING:
            return None
        del self._pending[rid]
        if isinstance(slot, WeightcacheError):
            raise slot
        return slot

    def _read_once(self, deadline: float | None) -> None:
        """Read what has arrived (waiting up to ``deadline``) and hand out its replies.
        Only the thread that is reading calls this."""
        sock = self._sock
        if sock is None:
            raise self.core.error or DaemonUnavailable("client closed")
        try:
            data, fds = recv_with_fds_blocking(sock, deadline)
        except TimeoutError:
            raise
        except OSError as exc:
            self._break_connection(self.core.broken(exc))
            raise
        try:
            replies = self.core.receive(data, fds)
            with self._state:
                for reply, mine in replies:
                    rid = reply.get("id")
                    if rid in self._pending and self._pending[rid] is _WAITING:
                        self._pending[rid] = (reply, mine)
                    else:
                        self._unclaimed(reply, mine)
                self._state.notify_all()
        except WeightcacheError as exc:  # the end of the stream, or garbage: the connection is over
            self._break_connection(exc)
            raise
        except BaseException:  # e.g. KeyboardInterrupt: bytes read but not handed on
            self._break_connection(self.core.interrupted())
            raise

    def _give_back(self, lease: int) -> None:
        # sent once the read that found it is over: _detach_leftovers
        self._leftover_leases.append((self.core.epoch, lease))

    def _lease_gone(self, lease: int, epoch: int) -> None:
        # From a finalizer, maybe in a thread that holds the send lock or _state: queue it,
        # and send it now only if the send lock is free (else its holder sends it after).
        self._leftover_leases.append((epoch, lease))
        self._detach_leftovers(wait=False)

    def _detach_leftovers(self, wait: bool = True) -> None:
        """Detach the queued leases of this connection, waiting for no answer: the
        daemon's answers are dropped as they come. If sending fails, the connection is
        gone and the daemon ended the leases with it. ``wait=False``: only if the send
        lock is free now."""
        while self._leftover_leases:
            deadline = _deadline(self.core.limit("detach", None))
            if not (_acquire(self._send_lock, deadline) if wait else self._send_lock.acquire(blocking=False)):
                return  # another thread is sending (and sends these after), or stuck; the connection breaks with it
            try:
                with contextlib.suppress(IndexError):
                    while True:
                        epoch, lease = self._leftover_leases.popleft()
                        if epoch != self.core.epoch or self._sock is None:
                            continue  # ended with its connection
                        _rid, frame = self.core.request("detach", {"lease": lease})
                        try:
                            send_with_fds_blocking(self._sock, frame, [], deadline)
                        except OSError as exc:
                            self._break_connection(self.core.peer_gone("detach", exc) if exc.errno in PEER_GONE_ERRNOS
                                                   else self.core.broken(exc))
                            return
                        except BaseException:
                            self._break_connection(self.core.abandoned("detach"))
                            raise
            except WeightcacheError:
                return  # the connection is over: the daemon ended the leases with it
            finally:
                self._send_lock.release()

    async def _end_lease(self, lease: int) -> None:
        await self._detach_quietly(lease)

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)  # the caller's thread waits for it anyway; other threads' requests are not held up

    def _break_connection(self, err: WeightcacheError) -> None:
        """The stream is out of step or over: fail every request and close the socket."""
        self._drop_now(err)

    def _fail_pending(self, exc: WeightcacheError) -> None:
        with self._state:
            for rid, slot in self._pending.items():
                if slot is _WAITING:
                    self._pending[rid] = exc
            self._state.notify_all()


class _BlockingClient(ClientOps, BlockingConnection):
    """The ops of :class:`Client` on the blocking transport; SyncClient's engine."""


def _blocking(method: Callable[Concatenate[ClientOps, P], Coroutine[Any, Any, T]]) -> Callable[Concatenate[SyncClient, P], T]:
    """The SyncClient method that runs ``method`` (a Client coroutine method, which is a
    ``ClientOps`` or ``ConnectionBase`` one) on the blocking transport and returns its
    result. ``inspect.signature`` and ``help`` show ``method``'s own signature and
    docstring (``functools.wraps`` sets ``__wrapped__``)."""

    @functools.wraps(method)
    def blocking(self: SyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return run_to_end(method(self._client, *args, **kwargs))

    blocking.__qualname__ = f"SyncClient.{method.__name__}"
    return blocking


class SyncClient:
    """:class:`Client` for code that is not asyncio: the same methods with the same
    arguments, blocking. It connects in ``__init__``.

    >>> with SyncClient() as c, c.attach("qwen-7b") as weights:   # doctest: +SKIP
    ...     model = load_into_module(skeleton, weights)

    Each call returns, or raises, within its timeout (Note [timeouts] in core.py);
    the constructor waits up to ``wait_for_daemon`` for a daemon not started yet (Note
    [waiting for the daemon]). The I/O happens in the calling thread (Note [blocking
    transport]); several threads may share one client. Importing it does not import
    torch; ``attach`` and ``publish`` do, like Client's."""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, load_timeout: float | None = None,
                 wait_for_daemon: float | None = None) -> None:
        self._client = _BlockingClient(socket_path, name=name, max_frame_bytes=max_frame_bytes,
                                       connect_timeout=connect_timeout, request_timeout=request_timeout,
                                       load_timeout=load_timeout, wait_for_daemon=wait_for_daemon)
        run_to_end(self._client._open())
        _open_clients.add(self)

    def close(self) -> None:
        """Close the connection (the daemon ends its leases)."""
        _open_clients.discard(self)
        self._client._close_now()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def server_info(self) -> dict[str, Any]:
        return self._client.server_info

    @property
    def load_timeout(self) -> float:
        return self._client.load_timeout

    # The plain calls, made from Client's own methods (_blocking; Client inherits them from
    # ClientOps and ConnectionBase, imported without it): the same parameters,
    # defaults and docstrings, so they cannot drift. A Client method missing here fails
    # tests/test_client_timeouts.py, which compares the two classes' methods.
    request = _blocking(ConnectionBase.request)
    status = _blocking(ClientOps.status)
    health = _blocking(ClientOps.health)
    models = _blocking(ClientOps.models)
    load = _blocking(ClientOps.load)
    evict = _blocking(ClientOps.evict)
    pin = _blocking(ClientOps.pin)
    unpin = _blocking(ClientOps.unpin)
    register = _blocking(ClientOps.register)
    unregister = _blocking(ClientOps.unregister)
    publish = _blocking(ClientOps.publish)
    reload = _blocking(ClientOps.reload)

    def attach(self, name: str, device: str | None = None, rank: int | None = None, *, wait_s: float | None = None,
               timeout: float | None = None, writable: bool = False,
               keep_alive: float | str | None = None) -> SyncAttachment:
        """:meth:`Client.attach` as a plain context manager: the lease ends when the block
        does (or, for one entered and never exited, when its tensors are gone)."""
        return SyncAttachment(functools.partial(self._client._attach, name, device, rank, wait_s=wait_s, timeout=timeout,
                                                writable=writable, keep_alive=keep_alive))


class SyncAttachment:
    """What :meth:`SyncClient.attach` returns: ``with`` it to attach (as aio.py's
    ``Attachment``: the block holds the model, and its exit ends the lease)."""

    def __init__(self, attach: Callable[[], Coroutine[Any, Any, AttachedModel]]) -> None:
        self._attach = attach
        self._model: AttachedModel | None = None

    def __enter__(self) -> AttachedModel:
        if self._model is not None:
            raise RuntimeError("this attach was entered already; call attach() again")
        self._model = run_to_end(self._attach())
        return self._model

    def __exit__(self, *exc: object) -> None:
        model, self._model = self._model, None
        if model is not None and model._lease is not None:
            run_to_end(model._lease.end())

