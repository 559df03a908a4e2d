"""The async client: :class:`Client`, the daemon's ops (connection.py's ``ClientOps``) on the
asyncio transport (:class:`Connection`: a reader task per connection).

In a module of its own so that ``from weightcache import SyncClient`` imports neither: an
engine that is not asyncio code paid for both classes at its import.
Timeouts and cancellation: Note [timeouts] and Note [cancellation] in core.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import DaemonUnavailable, WeightcacheError
from ..protocol import recv_with_fds, send_with_fds
from .connection import ClientOps, ConnectionBase
from .core import PEER_GONE_ERRNOS, Reply

if TYPE_CHECKING:
    from .mapping import AttachedModel

T = TypeVar("T")
LAST_WORDS_S = 1.0  # the most a send that found the daemon's end closed waits for what it sent before closing


class Connection(ConnectionBase):
    """The asyncio transport under :class:`~weightcache.Client`; not used on its own.
    A reader task reads every frame as it comes and hands each reply to the request
    waiting for its id."""

    def _init_transport(self) -> None:
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._write_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._reconnect_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the connection: finalizers hand it their detaches
        self._said: WeightcacheError | None = None  # an error the daemon sent about this connection (a refusal)

    # -- connecting -----------------------------------------------------------------
    async def _connect_once(self, sock: socket.socket, deadline: float | None) -> None:
        async with asyncio.timeout(None if deadline is None else max(0.0, deadline - time.monotonic())):
            await asyncio.get_running_loop().sock_connect(sock, self.core.socket_path)

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def _started(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._said = None
        self._reader = asyncio.ensure_future(self._read_loop())

    async def close(self) -> None:
        await self._drop(self.core.close())

    async def _drop(self, error: WeightcacheError) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._fail_pending(self.core.stop(error))

    def _reconnecting(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self._reconnect_lock

    # -- requests -------------------------------------------------------------------
    async def _exchange(self, op: str, timeout: float | None, args: dict[str, Any], send_fds: list[int] | None = None,
                        while_waiting: Callable[[], None] | None = None) -> Reply:
        rid, frame = self.core.request(op, args, len(send_fds or ()))
        limit = self.core.limit(op, timeout)
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        deadline = asyncio.timeout(limit)
        sending = False
        try:
            async with deadline:
                async with self._write_lock:
                    if self._sock is None:
                        raise self.core.error or DaemonUnavailable("client closed")
                    sending = True
                    await send_with_fds(self._sock, frame, send_fds or [])
                    sending = False
                if while_waiting is not None:
                    while_waiting()
                reply, fds = await fut
        except BaseException as exc:
            timed_out = isinstance(exc, TimeoutError) and deadline.expired()
            if sending and isinstance(exc, OSError) and exc.errno in PEER_GONE_ERRNOS:  # Note [reconnecting]
                epoch = self.core.epoch
                # A refusal comes at accept, so only the hello can meet one; any later request
                # that finds the end closed is sent again on a new connection.
                refused = await self._last_words() if op == "hello" else None
                gone = refused or self.core.peer_gone(op, exc)
                if self.core.epoch == epoch:  # else another caller connected again meanwhile: not ours to break
                    self._break_connection(gone)
                raise gone from exc
            if sending and (timed_out or not isinstance(exc, OSError)):  # part of the frame may be out (Note [timeouts])
                self._break_connection(self.core.abandoned(op))
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                if not timed_out:  # cancelled after the reply arrived, before we resumed: give it back
                    self._unclaimed(*fut.result())
                    raise
                reply, fds = fut.result()  # it did answer in time; we had not resumed yet
            elif timed_out:
                raise self.core.timed_out(op, limit) from None
            elif isinstance(exc, OSError):
                raise self.core.broken(exc) from exc
            else:
                raise
        finally:
            self._pending.pop(rid, None)  # a late reply for rid is now dropped (Note [cancellation])
        return self.core.checked(reply, fds)

    async def _last_words(self) -> WeightcacheError | None:
        """The error the daemon sent before it closed the connection: a daemon that refuses
        a connection (a uid it does not allow, too many connections) sends why and closes,
        and a hello sent meanwhile finds the socket closed (EPIPE). The refusal, not the
        EPIPE, is what the caller must see, and it is not a reason to connect again. The
        reader task reads what is left up to the end (at most LAST_WORDS_S: the daemon's
        end is closed, so the end is there at once) and keeps the refusal in ``_said``."""
        reader = self._reader
        if reader is not None and not reader.done():
            await asyncio.wait({reader}, timeout=LAST_WORDS_S)
        if self._reader is not reader:  # a new connection meanwhile: its _said is not this one's
            return None
        return copy.copy(self._said)  # a new exception: the one in _said failed the pending requests already

    async def _read_loop(self) -> None:
        assert self._sock is not None
        try:
            while True:
                data, fds = await recv_with_fds(self._sock)
                for reply, mine in self.core.receive(data, fds):
                    fut = self._pending.get(reply.get("id"))  # type: ignore[arg-type]
                    if fut is not None and not fut.done():
                        fut.set_result((reply, mine))
                    else:
                        self._said = self._unclaimed(reply, mine) or self._said
        except asyncio.CancelledError:
            raise
        except (WeightcacheError, OSError) as exc:
            self._fail_pending(self.core.stop(exc if isinstance(exc, WeightcacheError) else self.core.broken(exc)))
        finally:
            self.core.discard()

    def _give_back(self, lease: int) -> None:
        epoch = self.core.epoch

        async def detach() -> None:
            if self.core.epoch == epoch:  # else it ended with its connection (Note [reconnecting])
                await self._detach_quietly(lease)

        task = asyncio.ensure_future(detach())
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    async def _end_lease(self, lease: int) -> None:
        """Shielded: a cancelled engine task must still give its lease back."""
        await asyncio.shield(self._detach_quietly(lease))

    def _lease_gone(self, lease: int, epoch: int) -> None:
        def detach() -> None:
            if self.core.epoch == epoch and self.core.connected:
                self._give_back(lease)

        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: so is the connection, and the lease with it
                loop.call_soon_threadsafe(detach)

    async def _offload(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)  # the loop keeps serving other requests meanwhile

    def _break_connection(self, err: WeightcacheError) -> None:
        """The stream is out of step: fail every request and stop using the connection.
        Shut down, not closed: the reader wakes, sees the end, and exits; close() closes."""
        self._fail_pending(self.core.stop(err))
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def _fail_pending(self, exc: WeightcacheError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()


class Attachment:
    """What :meth:`Client.attach` returns: ``async with`` it to attach. The lease ends when
    the block exits; one entered and never exited ends when its tensors are gone
    (mapping.py's Note [lifetime])."""

    def __init__(self, attach: Callable[[], Awaitable[AttachedModel]]) -> None:
        self._attach = attach
        # Held while the block runs: ``async with c.attach("m"):`` without ``as`` keeps no
        # tensor, and the lease must last to the block's end all the same.
        self._model: AttachedModel | None = None

    async def __aenter__(self) -> AttachedModel:
        if self._model is not None:
            raise RuntimeError("this attach was entered already; call attach() again")
        self._model = await self._attach()
        return self._model

    async def __aexit__(self, *exc: object) -> None:
        model, self._model = self._model, None
        if model is not None and model._lease is not None:
            await model._lease.end()


class Client(ClientOps, Connection):
    """Async client for the weightcache daemon.

    >>> async with Client() as c:                          # doctest: +SKIP
    ...     print(await c.status())
    ...     async with c.attach("qwen-7b") as weights:
    ...         ...

    ``socket_path`` defaults to ``$WEIGHTCACHE_SOCKET``, then /run/weightcache/weightcache.sock.
    Timeouts are in seconds (Note [timeouts]): ``connect_timeout`` bounds the connect and
    hello, ``request_timeout`` control requests, ``load_timeout`` load/attach/publish
    (None: the daemon's ``request_timeout_s`` plus 30 s). ``math.inf`` means no bound.
    Every method takes ``timeout=``: None is the op's default, ``math.inf`` no bound.
    ``wait_for_daemon``: how long connecting waits for a daemon that is not running yet
    (None: ``$WEIGHTCACHE_WAIT_FOR_DAEMON``, else 5 s; 0 tries once).
    """

    def attach(self, name: str, device: str | None = None, rank: int | None = None, *, wait_s: float | None = None,
               timeout: float | None = None, writable: bool = False,
               keep_alive: float | str | None = None) -> Attachment:
        """Attach ``name`` (loading it first if needed) and yield its tensors, zero-copy.

        Read-only unless ``writable=True`` and the daemon allows it (GPU arenas only):
        writes then change the bytes every other attached engine sees. ``keep_alive`` is
        as for :meth:`load`: ``0`` evicts the model once its last lease ends.

        The lease lasts until the block exits (or the connection ends). Keep the block
        open while the tensors are in use: only a lease keeps the daemon from evicting.
        An attach entered and never exited (``w = await c.attach("m").__aenter__()``)
        keeps its lease, and its client, for as long as any of its tensors lives
        (mapping.py's Note [lifetime]).

        >>> async with c.attach("qwen-7b", device="cuda:0") as weights:   # doctest: +SKIP
        ...     model = load_into_module(skeleton, weights)
        """
        return Attachment(functools.partial(self._attach, name, device, rank, wait_s=wait_s, timeout=timeout,
                                            writable=writable, keep_alive=keep_alive))
