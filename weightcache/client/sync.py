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
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any, TypeVar

import torch

from ..errors import DaemonUnavailable
from .client import DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_FRAME_BYTES, DEFAULT_REQUEST_TIMEOUT, AttachedModel, Client

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
    ...     module.load_state_dict(...)

    The same arguments as :class:`Client` (tests/test_client_timeouts.py keeps every
    method's signature equal to Client's), timeouts included: each call returns, or
    raises, within its timeout (Note [timeouts] in client.py)."""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, load_timeout: float | None = None) -> None:
        self._client = Client(socket_path, name=name, max_frame_bytes=max_frame_bytes, connect_timeout=connect_timeout,
                              request_timeout=request_timeout, load_timeout=load_timeout)
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

    def request(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        return self._call(self._client.request(op, timeout=timeout, **args))

    def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.status(timeout=timeout))

    def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.health(timeout=timeout))

    def models(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        return self._call(self._client.models(timeout=timeout))

    def load(self, name: str, *, wait_s: float | None = None, timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.load(name, wait_s=wait_s, timeout=timeout))

    def evict(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.evict(name, timeout=timeout))

    def pin(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.pin(name, timeout=timeout))

    def unpin(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.unpin(name, timeout=timeout))

    def register(self, name: str, path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                 shards: list[dict[str, str]] | None = None, pin: bool = False, preload: bool = False,
                 keep_alive: float | None = None, send_files: bool = True,
                 timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.register(name, path, device=device, shards=shards, pin=pin, preload=preload,
                                                keep_alive=keep_alive, send_files=send_files, timeout=timeout))

    def unregister(self, name: str, *, timeout: float | None = None) -> None:
        self._call(self._client.unregister(name, timeout=timeout))

    def publish(self, name: str, tensors: Mapping[str, torch.Tensor], *, fingerprint: str, replace: bool = False,
                wait_s: float | None = None, timeout: float | None = None) -> dict[str, Any]:
        return self._call(self._client.publish(name, tensors, fingerprint=fingerprint, replace=replace, wait_s=wait_s,
                                               timeout=timeout))

    def reload(self, *, timeout: float | None = None) -> dict[str, list[str]]:
        return self._call(self._client.reload(timeout=timeout))

    @contextlib.contextmanager
    def attach(self, name: str, device: str | None = None, rank: int | None = None, *, wait_s: float | None = None,
               timeout: float | None = None, writable: bool = False) -> Iterator[AttachedModel]:
        cm = self._client.attach(name, device, rank, wait_s=wait_s, timeout=timeout, writable=writable)
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
