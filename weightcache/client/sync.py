"""SyncClient: the async client driven from a private event loop thread, for engines
that are not asyncio code. Same methods, same errors, blocking."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from ..errors import DaemonUnavailable
from .client import Client
from .connection import DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_FRAME_BYTES, DEFAULT_REQUEST_TIMEOUT

if TYPE_CHECKING:
    from .mapping import AttachedModel

P = ParamSpec("P")
T = TypeVar("T")
_open_clients: weakref.WeakSet[SyncClient] = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    # At interpreter exit Python freezes daemon threads, and the event loop thread is one:
    # a blocking call made after that would wait forever. One is made when an engine exits
    # inside an attach block (its generator is finalized, and its cleanup detaches). So
    # close the clients while the loop still runs; cleanup after close does nothing (the
    # daemon ended the leases with the connection).
    for client in list(_open_clients):
        client.close()


def _blocking(method: Callable[Concatenate[Client, P], Coroutine[Any, Any, T]]) -> Callable[Concatenate[SyncClient, P], T]:
    """The SyncClient method that runs ``method`` (a Client coroutine method) on the
    client's loop thread and returns its result. ``inspect.signature`` and ``help`` show
    ``method``'s own signature and docstring (``functools.wraps`` sets ``__wrapped__``)."""

    @functools.wraps(method)
    def blocking(self: SyncClient, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._call(method(self._client, *args, **kwargs))

    blocking.__qualname__ = f"SyncClient.{method.__name__}"
    return blocking


class SyncClient:
    """:class:`Client` for code that is not asyncio: the same methods with the same
    arguments, blocking. It connects in ``__init__``.

    >>> with SyncClient() as c, c.attach("qwen-7b") as weights:   # doctest: +SKIP
    ...     model = load_into_module(skeleton, weights)

    Each call returns, or raises, within its timeout (Note [timeouts] in connection.py);
    the constructor waits up to ``wait_for_daemon`` for a daemon not started yet (Note
    [waiting for the daemon]). Importing it does not import torch; ``attach`` and
    ``publish`` do, like Client's."""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, load_timeout: float | None = None,
                 wait_for_daemon: float | None = None) -> None:
        self._client = Client(socket_path, name=name, max_frame_bytes=max_frame_bytes, connect_timeout=connect_timeout,
                              request_timeout=request_timeout, load_timeout=load_timeout, wait_for_daemon=wait_for_daemon)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weightcache-client", daemon=True)
        self._thread.start()
        try:
            self._call(self._client.connect())
        except BaseException:
            self._stop_loop()
            raise
        _open_clients.add(self)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and wait for it. No wait of ours is unbounded:
        the coroutine's own timeouts bound it (Note [timeouts])."""
        if self._loop.is_closed():
            coro.close()
            raise DaemonUnavailable("client closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            # E.g. KeyboardInterrupt in this thread: cancel the request rather than leave it
            # running (a late reply is then dropped, Note [cancellation]). A no-op if done.
            fut.cancel()
            raise

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
        """Close the connection (the daemon ends its leases) and stop the loop thread."""
        if self._loop.is_closed():
            return
        _open_clients.discard(self)
        self._call(self._client.close())
        self._stop_loop()

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

    # The plain calls, made from Client's own methods (_blocking): the same parameters,
    # defaults and docstrings, so they cannot drift. A Client method missing here fails
    # tests/test_client_timeouts.py, which compares the two classes' methods.
    request = _blocking(Client.request)
    status = _blocking(Client.status)
    health = _blocking(Client.health)
    models = _blocking(Client.models)
    load = _blocking(Client.load)
    evict = _blocking(Client.evict)
    pin = _blocking(Client.pin)
    unpin = _blocking(Client.unpin)
    register = _blocking(Client.register)
    unregister = _blocking(Client.unregister)
    publish = _blocking(Client.publish)
    reload = _blocking(Client.reload)

    @contextlib.contextmanager
    def attach(self, name: str, device: str | None = None, rank: int | None = None, *, wait_s: float | None = None,
               timeout: float | None = None, writable: bool = False,
               keep_alive: float | str | None = None) -> Iterator[AttachedModel]:
        """:meth:`Client.attach` as a plain context manager: the lease ends when the block does."""
        cm = self._client.attach(name, device, rank, wait_s=wait_s, timeout=timeout, writable=writable, keep_alive=keep_alive)
        model = self._call(cm.__aenter__())
        try:
            yield model
        except BaseException:
            # A closed client's leases ended with its connection: nothing to detach.
            if self._loop.is_closed() or not self._call(cm.__aexit__(*sys.exc_info())):
                raise
        else:
            if not self._loop.is_closed():
                self._call(cm.__aexit__(None, None, None))
