"""The async client. One connection, many concurrent requests matched by id.

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
import math
import os
import socket
import stat
import struct
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import torch

from ..defaults import DAEMON_UID_ENV, client_socket_path
from ..errors import (
    DaemonUnavailable,
    LimitExceeded,
    LoadFailed,
    PermissionDenied,
    RequestTimeout,
    WeightcacheError,
    error_from_wire,
)
from ..protocol import PROTOCOL_VERSION, FrameDecoder, decode_payload, encode_frame
from ..protocol.transport import MAX_FDS_PER_MSG, recv_with_fds, send_with_fds
from .mapping import map_arena, tensor_views

DEFAULT_MAX_FRAME_BYTES = 256 * 2**20  # replies: an attach's tensor table can be long
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_REQUEST_TIMEOUT = 60.0
LONG_OPS = frozenset({"load", "attach", "publish"})  # may take minutes: they get load_timeout
DAEMON_REQUEST_TIMEOUT_S = 900.0  # the daemon's default request_timeout_s, for one whose hello does not say
LOAD_TIMEOUT_MARGIN_S = 30.0  # past the daemon's own timeout, so its TIMEOUT reply arrives first


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


def _open_checkpoint_files(parts: list[str]) -> tuple[list[list[str]], list[int]]:
    """Open every file of every part (rank order) read-only: (paths per part, fds in the
    same order, flattened). Raises PermissionDenied / LoadFailed naming the file, after
    closing what it opened."""
    from ..loader.checkpoint import discover_files  # here: engines that never register need not import the loader

    names = [[str(f) for f in discover_files(part)] for part in parts]
    count = sum(len(files) for files in names)
    if count > MAX_FDS_PER_MSG:
        raise LimitExceeded(f"the checkpoint has {count} files but one frame carries at most {MAX_FDS_PER_MSG} "
                            "descriptors; register it with send_files=False (as an administrator)",
                            limit=MAX_FDS_PER_MSG)
    fds: list[int] = []
    try:
        for files in names:
            for f in files:
                fds.append(_open_readonly(f))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return names, fds


def _open_readonly(path: str) -> int:
    try:
        # O_NONBLOCK so that a FIFO in the checkpoint cannot hang us; cleared below.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except PermissionError as exc:
        raise PermissionDenied(f"cannot open checkpoint file {path}: {exc.strerror}", file=path) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise LoadFailed(f"cannot open checkpoint file {path}: {reason}", file=path, reason=reason) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LoadFailed(f"checkpoint file {path} is not a regular file", file=path, reason="not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Client:
    """Async client for the weightcache daemon.

    >>> async with Client() as c:                          # doctest: +SKIP
    ...     print(await c.status())
    ...     async with c.attach("qwen-7b") as weights:
    ...         ...

    ``socket_path`` defaults to ``$WEIGHTCACHE_SOCKET``, then /run/weightcache/weightcache.sock.
    Timeouts are in seconds (Note [timeouts]): ``connect_timeout`` bounds the connect and
    hello, ``request_timeout`` control requests, ``load_timeout`` load/attach/publish
    (None: the daemon's ``request_timeout_s`` plus 30 s). ``math.inf`` means no bound.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, load_timeout: float | None = None) -> None:
        for what, value in (("connect_timeout", connect_timeout), ("request_timeout", request_timeout),
                            ("load_timeout", load_timeout)):
            if value is not None and not value > 0:  # also refuses NaN
                raise ValueError(f"{what} must be a positive number of seconds (math.inf for no bound), not {value!r}")
        self.socket_path = client_socket_path(socket_path)
        self.name = name or f"python/{os.getpid()}"
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._load_timeout = load_timeout
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

    # -- connection -----------------------------------------------------------------
    async def connect(self) -> Client:
        """Connect and say hello, within ``connect_timeout`` (else DaemonUnavailable)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        deadline = asyncio.timeout(None if math.isinf(self.connect_timeout) else self.connect_timeout)
        try:
            async with deadline:
                try:
                    if os.path.islink(self.socket_path):
                        raise PermissionDenied(f"{self.socket_path} is a symlink; refusing to connect through it")
                    await asyncio.get_running_loop().sock_connect(sock, self.socket_path)
                    _check_daemon_identity(sock, self.socket_path)
                except OSError as exc:
                    raise DaemonUnavailable(f"cannot connect to weightcache at {self.socket_path}: {exc.strerror or exc}",
                                            socket=self.socket_path) from exc
                self._sock = sock
                self._closed_error = None
                self._reader = asyncio.ensure_future(self._read_loop())
                self.server_info = await self.request("hello", timeout=math.inf, protocol=PROTOCOL_VERSION,
                                                      client=self.name)
        except BaseException as exc:
            if self._sock is sock:
                await self.close()
            else:
                sock.close()
            if isinstance(exc, TimeoutError) and deadline.expired():
                raise DaemonUnavailable(
                    f"weightcache at {self.socket_path} did not answer within {self.connect_timeout:g}s "
                    "(connect and hello); is the daemon stopped, hung or overloaded?", socket=self.socket_path) from None
            raise
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
        if self._closed_error is not None:  # the reader has stopped: nobody would read a reply
            raise self._closed_error
        if self._sock is None:
            raise DaemonUnavailable("not connected; use 'async with Client()' or connect()")
        limit = self._limit(op, timeout)
        rid = next(self._ids)
        fut: asyncio.Future[tuple[dict[str, Any], list[int]]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        msg = {"id": rid, "op": op, **{k: v for k, v in args.items() if v is not None}}
        if send_fds:
            msg["fds"] = len(send_fds)
        frame = encode_frame(msg)
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
                self._break_connection(DaemonUnavailable(
                    f"connection to {self.socket_path} closed: a {op!r} request was abandoned while its frame was "
                    "being sent", socket=self.socket_path))
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                if not timed_out:  # cancelled after the reply arrived, before we resumed: give it back
                    self._drop_reply(*fut.result())
                    raise
                reply, fds = fut.result()  # it did answer in time; we had not resumed yet
            elif timed_out:
                assert limit is not None
                raise RequestTimeout(
                    f"the daemon at {self.socket_path} did not answer {op!r} within {limit:g}s; it may be stopped, "
                    "hung or overloaded (a late reply is dropped)", op=op, timeout_s=limit) from None
            elif isinstance(exc, OSError):
                raise DaemonUnavailable(f"connection to {self.socket_path} broke: {exc}") from exc
            else:
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
                    # Replies may hold long arrays (an attach's tensor table) and maps keyed
                    # by model: as long as this client's frame limit, not a request's limits.
                    reply = decode_payload(payload, max_map_len=self._max_frame, max_array_len=self._max_frame,
                                           max_str_len=self._max_frame, max_bin_len=self._max_frame)
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
            if self._closed_error is None:  # else _break_connection said why first
                self._closed_error = err
            self._fail_pending(self._closed_error)
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

    # -- the API --------------------------------------------------------------------
    # ``timeout=None`` is the op's default (Note [timeouts]); math.inf waits without a bound.
    async def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Per-device ``budget``/``used``/``reserved``/``free``, loads in progress, leases."""
        return await self.request("status", timeout=timeout)

    async def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``{"serving", "ready", "preloading", "failed_preloads", "uptime_s"}``: ready means
        serving with every configured preload resident (docs/protocol.md)."""
        reply = await self.request("health", timeout=timeout)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def models(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """One dict per model: name, state, device, nbytes, attach_count, pinned, ..."""
        return (await self.request("models", timeout=timeout))["models"]

    async def load(self, name: str, *, wait_s: float | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Make ``name`` resident (evicting LRU unattached models if needed)."""
        return (await self.request("load", name=name, wait_s=wait_s, timeout=timeout))["model"]

    async def evict(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return await self.request("evict", name=name, timeout=timeout)

    async def pin(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return (await self.request("pin", name=name, timeout=timeout))["model"]

    async def unpin(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        return (await self.request("unpin", name=name, timeout=timeout))["model"]

    async def register(self, name: str, path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                       shards: list[dict[str, str]] | None = None, pin: bool = False, preload: bool = False,
                       keep_alive: float | None = None, send_files: bool = True,
                       timeout: float | None = None) -> dict[str, Any]:
        """Add a model: ``path`` (+ ``device``), or ``shards=[{"path":..., "device":...}, ...]`` in rank order.

        With ``send_files`` (the default) this process opens the checkpoint's files and
        hands the daemon their descriptors, so the daemon reads only what this peer can
        read; a file it cannot open raises PermissionDenied or LoadFailed here, naming
        it, and nothing is sent. Without, only the paths go and the daemon opens them
        itself (which it allows administrators only).
        """
        shard_list = None if shards is None else [
            {**s, "path": os.fspath(s["path"])} if "path" in s else dict(s) for s in shards]
        args: dict[str, Any] = {"name": name, "path": os.fspath(path) if path is not None else None, "device": device,
                                "shards": shard_list, "pin": pin, "preload": preload, "keep_alive": keep_alive}
        parts: list[str] = []  # one checkpoint per rank; none if the request is malformed (the daemon says why)
        if path is not None and not shards:
            parts = [os.fspath(path)]
        elif path is None and shard_list and all(isinstance(s.get("path"), str) for s in shard_list):
            parts = [s["path"] for s in shard_list]
        if not send_files or not parts:
            return (await self.request("register", timeout=timeout, **args))["model"]
        args["files"], fds = _open_checkpoint_files(parts)
        try:
            reply, reply_fds = await self._request("register", timeout, args, send_fds=fds)
        finally:
            for fd in fds:  # the daemon has its own copies once the frame is sent
                os.close(fd)
        for fd in reply_fds:
            os.close(fd)
        return reply["model"]

    async def unregister(self, name: str, *, timeout: float | None = None) -> None:
        await self.request("unregister", name=name, timeout=timeout)

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

    async def reload(self, *, timeout: float | None = None) -> dict[str, list[str]]:
        """Make the daemon re-read its config file; returns what was added/removed/changed."""
        return (await self.request("reload", timeout=timeout))["report"]

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

