"""The async client. One connection, many concurrent requests matched by id.

Note [cancellation]
-------------------
A request cancelled (or timed out) between send and reply leaves its id behind; the
reader drops that reply when it comes, closes any fds it carried and, if it granted a
lease, detaches it, so no stale reply reaches a later caller and no lease leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import struct
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import torch

from ..defaults import DAEMON_UID_ENV, client_socket_path
from ..errors import DaemonUnavailable, PermissionDenied, WeightcacheError, error_from_wire
from ..protocol import PROTOCOL_VERSION, FrameDecoder, decode_payload, encode_frame
from ..protocol.transport import recv_with_fds, send_with_fds
from .mapping import map_arena, tensor_views


class AttachedModel(Mapping[str, torch.Tensor]):
    """A read-only mapping of tensor name -> tensor, backed by the daemon's arena.

    >>> async with client.attach("qwen-7b") as m:   # doctest: +SKIP
    ...     logits = model_forward(m["lm_head.weight"], ...)
    """

    def __init__(self, name: str, lease: int, fingerprint: str, device: str, tensors: dict[str, torch.Tensor]) -> None:
        self.name = name
        self.lease = lease
        self.fingerprint = fingerprint
        self.device = device
        self._tensors = tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def __repr__(self) -> str:
        return f"AttachedModel({self.name!r}, lease={self.lease}, tensors={len(self)}, device={self.device!r})"


def _check_daemon_identity(sock: socket.socket, path: str) -> None:
    """Trust only a daemon running as root, as ourselves, or as $WEIGHTCACHE_DAEMON_UID:
    anyone who could create a socket at that path could otherwise serve us weights."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
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


class Client:
    """Async client for the weightcache daemon.

    >>> async with Client() as c:                          # doctest: +SKIP
    ...     print(await c.status())
    ...     async with c.attach("qwen-7b") as weights:
    ...         ...

    ``socket_path`` defaults to ``$WEIGHTCACHE_SOCKET``, then /run/weightcache/weightcache.sock.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = 256 * 2**20) -> None:
        self.socket_path = client_socket_path(socket_path)
        self.name = name or f"python/{os.getpid()}"
        self._max_frame = max_frame_bytes
        self._sock: socket.socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[dict[str, Any], list[int]]]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._closed_error: WeightcacheError | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.server_info: dict[str, Any] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=64)  # events the daemon announced, newest last

    # -- connection -----------------------------------------------------------------
    async def connect(self) -> Client:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            if os.path.islink(self.socket_path):
                raise PermissionDenied(f"{self.socket_path} is a symlink; refusing to connect through it")
            await asyncio.get_running_loop().sock_connect(sock, self.socket_path)
            _check_daemon_identity(sock, self.socket_path)
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to weightcache at {self.socket_path}: {exc.strerror or exc}",
                                    socket=self.socket_path) from exc
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._reader = asyncio.ensure_future(self._read_loop())
        self.server_info = await self.request("hello", protocol=PROTOCOL_VERSION, client=self.name)
        return self

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._fail_pending(DaemonUnavailable("client closed"))

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests -------------------------------------------------------------------
    async def request(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request; return the reply map or raise the error class of its code."""
        reply, fds = await self._request(op, timeout, args)
        for fd in fds:  # only attach takes fds; anything else carrying them is closed
            os.close(fd)
        return reply

    async def _request(self, op: str, timeout: float | None, args: dict[str, Any],
                       send_fds: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        if self._sock is None:
            raise self._closed_error or DaemonUnavailable("not connected; use 'async with Client()' or connect()")
        rid = next(self._ids)
        fut: asyncio.Future[tuple[dict[str, Any], list[int]]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        msg = {"id": rid, "op": op, **{k: v for k, v in args.items() if v is not None}}
        if send_fds:
            msg["fds"] = len(send_fds)
        try:
            async with self._write_lock:
                await send_with_fds(self._sock, encode_frame(msg), send_fds or [])
            reply, fds = await asyncio.wait_for(fut, timeout)
        except OSError as exc:
            raise DaemonUnavailable(f"connection to {self.socket_path} broke: {exc}") from exc
        except BaseException:
            # Cancelled after the reply arrived but before we resumed: give it back.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._drop_reply(*fut.result())
            raise
        finally:
            self._pending.pop(rid, None)  # a late reply for rid is now dropped (Note [cancellation])
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise error_from_wire(reply.get("error") or {})
        return reply, fds

    async def _read_loop(self) -> None:
        assert self._sock is not None
        decoder = FrameDecoder(self._max_frame)
        fd_queue: deque[int] = deque()  # fds arrive with the first byte of the frame that names them
        try:
            while True:
                data, fds = await recv_with_fds(self._sock)
                fd_queue.extend(fds)
                if not data:
                    raise DaemonUnavailable(f"weightcache at {self.socket_path} closed the connection")
                for payload in decoder.feed(data):
                    reply = decode_payload(payload)
                    if "event" in reply:  # unsolicited, e.g. {"event": "shutting_down", "grace_s": 10}
                        self.events.append(reply)
                        continue
                    mine = [fd_queue.popleft() for _ in range(int(reply.get("fds", 0)))]
                    fut = self._pending.get(reply.get("id"))  # type: ignore[arg-type]
                    if fut is not None and not fut.done():
                        fut.set_result((reply, mine))
                    else:
                        self._drop_reply(reply, mine)
        except asyncio.CancelledError:
            raise
        except (WeightcacheError, OSError) as exc:
            err = exc if isinstance(exc, WeightcacheError) else DaemonUnavailable(f"connection broke: {exc}")
            self._closed_error = err
            self._fail_pending(err)
        finally:
            while fd_queue:
                os.close(fd_queue.popleft())

    def _drop_reply(self, reply: dict[str, Any], fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        if reply.get("id") is None and not reply.get("ok"):
            # An error about the connection itself (e.g. FRAME_TOO_LARGE): fail everyone.
            self._fail_pending(error_from_wire(reply.get("error") or {}))
        elif reply.get("ok") and "lease" in reply and "tensors" in reply:
            task = asyncio.ensure_future(self._detach_quietly(reply["lease"]))
            self._background.add(task)  # keep a reference until it is done
            task.add_done_callback(self._background.discard)

    async def _detach_quietly(self, lease: int) -> None:
        with contextlib.suppress(WeightcacheError, OSError):
            await self.request("detach", lease=lease)

    def _fail_pending(self, exc: WeightcacheError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()

    # -- the API --------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """Per-device ``budget``/``used``/``reserved``/``free``, loads in progress, leases."""
        return await self.request("status")

    async def health(self) -> dict[str, Any]:
        """``{"serving", "ready", "preloading", "failed_preloads", "uptime_s"}``: ready means
        serving with every configured preload resident (docs/protocol.md)."""
        reply = await self.request("health")
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def models(self) -> list[dict[str, Any]]:
        """One dict per model: name, state, device, nbytes, attach_count, pinned, ..."""
        return (await self.request("models"))["models"]

    async def load(self, name: str, *, wait_s: float | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Make ``name`` resident (evicting LRU unattached models if needed)."""
        return (await self.request("load", name=name, wait_s=wait_s, timeout=timeout))["model"]

    async def evict(self, name: str) -> dict[str, Any]:
        return await self.request("evict", name=name)

    async def pin(self, name: str) -> dict[str, Any]:
        return (await self.request("pin", name=name))["model"]

    async def unpin(self, name: str) -> dict[str, Any]:
        return (await self.request("unpin", name=name))["model"]

    async def register(self, name: str, path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                       shards: list[dict[str, str]] | None = None, pin: bool = False, preload: bool = False,
                       keep_alive: float | None = None) -> dict[str, Any]:
        """Add a model: ``path`` (+ ``device``), or ``shards=[{"path":..., "device":...}, ...]`` in rank order."""
        return (await self.request("register", name=name, path=os.fspath(path) if path is not None else None, device=device,
                                   shards=shards, pin=pin, preload=preload, keep_alive=keep_alive))["model"]

    async def unregister(self, name: str) -> None:
        await self.request("unregister", name=name)

    async def publish(self, name: str, tensors: Mapping[str, torch.Tensor], *, fingerprint: str, replace: bool = False,
                      wait_s: float | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Hand the daemon weights this engine processed itself (quantized, repacked, ...)
        so that later starts attach them instead of redoing the work. The daemon keeps its
        own copy (on the tensors' device); ``fingerprint`` should name what they were made
        from and how (e.g. the source checkpoint's fingerprint plus the recipe).

        >>> await c.publish("qwen-7b-int8", model.state_dict(), fingerprint=f"{src_fp}+int8-v1")  # doctest: +SKIP
        """
        from .publish import pack

        fds, arena, table, release = await asyncio.to_thread(pack, tensors)
        try:
            device = next(iter(tensors.values())).device
            dev = "cpu" if device.type == "cpu" else f"cuda:{arena['device_uuid']}"
            reply, _ = await self._request("publish", timeout, {
                "name": name, "device": dev, "fingerprint": fingerprint, "arena": arena, "tensors": table,
                "replace": replace or None, "wait_s": wait_s}, send_fds=fds)
            return reply["model"]
        finally:
            release()

    async def reload(self) -> dict[str, list[str]]:
        """Make the daemon re-read its config file; returns what was added/removed/changed."""
        return (await self.request("reload"))["report"]

    @contextlib.asynccontextmanager
    async def attach(self, name: str, device: str | None = None, rank: int | None = None, *, wait_s: float | None = None,
                     timeout: float | None = None, writable: bool = False) -> AsyncIterator[AttachedModel]:
        """Attach ``name`` (loading it first if needed) and yield its tensors, zero-copy.

        Read-only unless ``writable=True`` and the daemon allows it (GPU arenas only):
        writes then change the bytes every other attached engine sees.

        The lease lasts until the block exits (or the connection closes). Keep the block
        open while the tensors are in use: only a lease keeps the daemon from evicting.
        """
        if device is not None and device.startswith("cuda:") and device[5:].isdigit():
            from .. import cuda_driver

            device = f"cuda:{cuda_driver.device_uuid(int(device[5:]))}"  # this process's numbering -> UUID
        reply, fds = await self._request("attach", timeout, {"name": name, "device": device, "rank": rank, "wait_s": wait_s,
                                                       "writable": writable or None})
        lease = reply["lease"]
        try:
            slab = map_arena(reply["arena"], fds)
            fds = []
            model = AttachedModel(name, lease, reply["fingerprint"], reply["device"], tensor_views(slab, reply["tensors"]))
        except BaseException:
            for fd in fds:
                os.close(fd)
            await asyncio.shield(self._detach_quietly(lease))
            raise
        try:
            yield model
        finally:
            if self._sock is not None:
                # Shielded: a cancelled engine task must still give its lease back.
                await asyncio.shield(self._detach_quietly(lease))

