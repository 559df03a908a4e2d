"""SyncClient: the async client driven from a private event loop thread, for engines
that are not asyncio code. Same methods, same errors, blocking."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from ..errors import DaemonUnavailable
from .client import AttachedModel, Client

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


class SyncClient:
    """>>> with SyncClient() as c, c.attach("qwen-7b") as weights:   # doctest: +SKIP
    ...     module.load_state_dict(...)"""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weightcache-client", daemon=True)
        self._thread.start()
        self._client = Client(socket_path, **kwargs)
        try:
            self._call(self._client.connect())
        except BaseException:
            self._stop_loop()
            raise
        _open_clients.add(self)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise DaemonUnavailable("client closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def close(self) -> None:
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

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        return self._call(self._client.request(op, **args))

    def status(self) -> dict[str, Any]:
        return self._call(self._client.status())

    def health(self) -> dict[str, Any]:
        return self._call(self._client.health())

    def models(self) -> list[dict[str, Any]]:
        return self._call(self._client.models())

    def load(self, name: str, **kwargs: Any) -> dict[str, Any]:
        return self._call(self._client.load(name, **kwargs))

    def evict(self, name: str) -> dict[str, Any]:
        return self._call(self._client.evict(name))

    def pin(self, name: str) -> dict[str, Any]:
        return self._call(self._client.pin(name))

    def unpin(self, name: str) -> dict[str, Any]:
        return self._call(self._client.unpin(name))

    def register(self, name: str, path: str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
        return self._call(self._client.register(name, path, **kwargs))

    def unregister(self, name: str) -> None:
        self._call(self._client.unregister(name))

    def publish(self, name: str, tensors: Any, **kwargs: Any) -> dict[str, Any]:
        return self._call(self._client.publish(name, tensors, **kwargs))

    def reload(self) -> dict[str, list[str]]:
        return self._call(self._client.reload())

    @contextlib.contextmanager
    def attach(self, name: str, device: str | None = None, rank: int | None = None, **kwargs: Any) -> Iterator[AttachedModel]:
        cm = self._client.attach(name, device, rank, **kwargs)
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
