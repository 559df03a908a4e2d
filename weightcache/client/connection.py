"""One connection to the daemon over the no-I/O core (core.py), and the daemon's ops on
it: written once for both transports (the asyncio one is aio.py's, the blocking one
sync.py's).

:class:`ConnectionBase` is what both transports share and that does I/O only through
them: the one connect-and-retry loop (Note [waiting for the daemon] in core.py), the
check of who serves the socket, the hello, requests, and the lease give-back of Note
[cancellation]. aio.py's ``Connection`` waits on an asyncio loop (a reader task per
connection); sync.py's ``BlockingConnection`` waits in the caller's thread (Note
[blocking transport] there). :class:`ClientOps` is the ops over it: aio.py's
:class:`~weightcache.Client` runs them on an asyncio loop, sync.py's SyncClient in the
caller's thread. They were a module of their own; each module a fresh engine imports
costs ~50-110 µs.

Importing this module does not import torch (tests/test_client_imports.py): the control
calls need none, and they are what the CLI and health probes make. ``attach`` imports
mapping.py (tensors from fds) and ``publish`` publish.py (fds from tensors) the first time
they are called, so only an engine that handles weights pays for torch.
Timeouts and cancellation: Note [timeouts] and Note [cancellation] in core.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Self, TypeVar

from ..errors import DaemonUnavailable, PermissionDenied, RequestTimeout, WeightcacheError
from ..protocol import DAEMON_UID_ENV, peer_credentials
from .core import DEFAULT_CONNECT_TIMEOUT, DEFAULT_MAX_FRAME_BYTES, DEFAULT_REQUEST_TIMEOUT, ClientCore, PeerGone, Reply, Retry, close_fds

if TYPE_CHECKING:  # annotations only: importing them would import torch
    import torch

    from .mapping import AttachedModel

    T = TypeVar("T")  # made at run time it cost a fresh engine ~20 µs of its import (2-core VM)


def import_attach_half() -> None:
    """Import what the first attach needs (mapping.py and, once torch has CUDA,
    cuda_mapping.py and the driver's UUID table), in an engine that has imported torch.
    ``_open`` calls it once the hello frame is sent, while the daemon answers: the
    one-time work of the first attach then fills a wait instead of adding to it (on
    the H200 that work was 0.83 ms of imports and 0.15 ms of driver set-up).

    In the caller's thread, not a thread of its own: the thread this replaced started
    0.25-0.34 ms into the connect and then held the GIL the connect wanted, so that on
    the 2-core VM it saved nothing, import to usable tensors 14.1 ms p50 with it and
    14.0 without, CPU 13.1 and 11.8 ms (15 fresh engines each, alternating, 1 GiB and
    200 tensors). Only where torch is imported already: a control client (the
    CLI, health probes) must not import torch, and an engine that has not imported it
    would wait ~1.5 s for it here. An import that fails is left to the attach, which
    imports the same modules and raises."""
    if "torch" not in sys.modules or "weightcache.client.mapping" in sys.modules:
        return
    try:
        from . import mapping  # noqa: F401

        torch = sys.modules["torch"]
        if torch.cuda.is_initialized():  # the engine made its CUDA context: a GPU attach is coming
            from . import cuda_mapping  # noqa: F401
            from .libcuda import driver

            driver().device_uuids()
    except Exception:  # the attach does the same work and raises what went wrong
        return


log = logging.getLogger("weightcache.client")


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
    """What the asyncio and the blocking transport share; not used on its own. The
    arguments are :class:`~.core.ClientCore`'s (timeouts: Note [timeouts] in core.py)."""

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, load_timeout: float | None = None,
                 wait_for_daemon: float | None = None) -> None:
        self.core = ClientCore(socket_path, name=name, max_frame_bytes=max_frame_bytes, connect_timeout=connect_timeout,
                               request_timeout=request_timeout, load_timeout=load_timeout, wait_for_daemon=wait_for_daemon)
        self._sock: socket.socket | None = None
        self._init_transport()

    # The settings and what the daemon said, as the core holds them.
    @property
    def socket_path(self) -> str:
        return self.core.socket_path

    @property
    def name(self) -> str:
        return self.core.name

    @property
    def connect_timeout(self) -> float:
        return self.core.connect_timeout

    @property
    def request_timeout(self) -> float:
        return self.core.request_timeout

    @property
    def wait_for_daemon(self) -> float:
        return self.core.wait_for_daemon

    @property
    def load_timeout(self) -> float:
        """The default timeout of load, attach and publish (Note [timeouts])."""
        return self.core.load_timeout

    @property
    def server_info(self) -> dict[str, Any]:
        """The daemon's hello reply: its version, pid, limits (docs/protocol.md, "Handshake")."""
        return self.core.server_info

    @property
    def events(self) -> deque[dict[str, Any]]:
        """Events the daemon announced (``{"event": "shutting_down", ...}``), newest last."""
        return self.core.events

    # -- connecting: the one loop, over the transport's waits --------------------------------
    async def _open(self) -> None:
        """Connect, check who serves the socket and say ``hello`` (its reply becomes
        ``server_info``), within the limits of Note [timeouts] and Note [waiting for the
        daemon]. On any failure nothing is left open."""
        sock, started = await self._connect()
        self._sock = sock
        self.core.start()
        self._started()
        try:
            deadline = self.core.connect_deadline(started)
            limit = float("inf") if deadline is None else max(1e-3, deadline - time.monotonic())
            try:
                reply, fds = await self._exchange("hello", limit, self.core.hello(), while_waiting=import_attach_half)
                close_fds(fds)
                self.core.accept_hello(reply)
            except RequestTimeout:
                raise self.core.no_answer() from None
        except BaseException as exc:
            await self._drop(exc if isinstance(exc, WeightcacheError) else self.core.interrupted())
            raise

    async def _reconnect(self) -> None:
        """Connect again after the connection ended without ``close()`` (Note [reconnecting]
        in core.py): once, by whichever of the callers that found it lost comes first."""
        async with self._reconnecting():
            if self.core.connected:  # another caller connected again meanwhile
                return
            lost = self.core.error
            if self.core.closed:
                raise lost or DaemonUnavailable("client closed")
            before = self.core.server_info.get("pid")
            await self._drop(lost or self.core.ended())
            try:
                await self._open()
            except WeightcacheError as exc:
                raise self.core.reconnect_failed(lost, exc) from exc
            log.warning("%s", self.core.reconnected(before, lost))

    async def _connect(self) -> tuple[socket.socket, float]:
        """A connected socket whose peer we trust, and the ``time.monotonic()`` its attempt
        began. Retries while the daemon is not there, as :class:`~.core.Retry` says; each
        attempt's connect is bounded by ``connect_timeout``."""
        # time.monotonic(), not an event loop's clock: uvloop's is cached in whole
        # milliseconds, and a sleep on it ended the wait up to 1 ms before wait_for_daemon.
        retry = Retry(self.core.wait_for_daemon, time.monotonic())
        while True:
            started = time.monotonic()
            sock = self._new_socket()
            try:
                await self._connect_once(sock, self.core.connect_deadline(started))
                check_daemon_identity(sock, self.core.socket_path)
                return sock, started
            except TimeoutError:
                sock.close()
                raise self.core.no_answer() from None
            except OSError as exc:
                sock.close()
                wait = retry.after(exc, time.monotonic())
                if wait is None:
                    raise self.core.connect_error(exc) from exc
            except BaseException:
                sock.close()
                raise
            await self._sleep(wait)

    def _new_socket(self) -> socket.socket:
        """A fresh non-blocking socket for one connect attempt (Note [waiting for the daemon])."""
        if os.path.islink(self.core.socket_path):
            raise PermissionDenied(f"{self.core.socket_path} is a symlink; refusing to connect through it")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        return sock

    # -- requests -----------------------------------------------------------------------------
    async def _request(self, op: str, timeout: float | None, args: dict[str, Any], send_fds: list[int] | None = None,
                       while_waiting: Callable[[], None] | None = None) -> Reply:
        """``request`` that also sends ``send_fds`` (SCM_RIGHTS, on the same frame) and
        returns the fds of the reply, which the caller must close. ``while_waiting`` is
        called once the frame is sent, before waiting for the reply (which it must not
        read); its time counts against the request's. A connection that ended is made
        again first, and a frame the daemon never took is sent again on a new one (Note
        [reconnecting] in core.py)."""
        if self.core.lost:
            await self._reconnect()
        try:
            return await self._exchange(op, timeout, args, send_fds, while_waiting)
        except PeerGone:
            await self._reconnect()
            return await self._exchange(op, timeout, args, send_fds, while_waiting)

    async def request(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request; return the reply map or raise the error class of its code.
        Arguments that are None are left out.

        >>> await c.request("status", timeout=5)          # doctest: +SKIP
        {'id': 3, 'ok': True, 'devices': {...}, ...}
        """
        reply, fds = await self._request(op, timeout, args)
        close_fds(fds)  # only attach takes fds; anything else carrying them is closed
        return reply

    def _unclaimed(self, reply: dict[str, Any], fds: list[int]) -> WeightcacheError | None:
        """A reply nobody waits for (Note [cancellation]): give back its lease, or fail
        every request if it is an error about the connection itself (returned)."""
        outcome = self.core.unclaimed(reply, fds)
        if isinstance(outcome, WeightcacheError):
            self._fail_pending(outcome)
            return outcome
        if outcome is not None:
            self._give_back(outcome)
        return None

    async def _detach_quietly(self, lease: int) -> None:
        # If this fails the connection is gone, and the daemon ended the lease with it.
        # On this connection only: a new one (Note [reconnecting]) holds no such lease.
        with contextlib.suppress(WeightcacheError, OSError):
            _reply, fds = await self._exchange("detach", None, {"lease": lease})
            close_fds(fds)

    async def _end_lease(self, lease: int) -> None:
        """Detach ``lease`` (of this connection) and wait for the daemon's answer."""
        await self._detach_quietly(lease)

    # -- what each transport does its own way ----------------------------------------------
    @abstractmethod
    def _init_transport(self) -> None:
        """Set up what the transport keeps per client (its waiters and locks)."""

    @abstractmethod
    async def _connect_once(self, sock: socket.socket, deadline: float | None) -> None:
        """Connect ``sock`` to the socket path, by ``deadline`` (``time.monotonic()``; None:
        no bound) or TimeoutError; OSError as connect raised it."""

    @abstractmethod
    async def _sleep(self, seconds: float) -> None:
        """Wait between connect attempts."""

    @abstractmethod
    def _started(self) -> None:
        """The connection ``_sock`` is up: start reading it (the asyncio transport's reader)."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection. Requests in flight fail with DaemonUnavailable, and the
        daemon ends every lease this connection held."""

    @abstractmethod
    async def _exchange(self, op: str, timeout: float | None, args: dict[str, Any], send_fds: list[int] | None = None,
                        while_waiting: Callable[[], None] | None = None) -> Reply:
        """:meth:`_request` on the connection as it is: no connecting again. A send
        that finds the daemon's end closed raises :class:`~.core.PeerGone`."""

    @abstractmethod
    async def _drop(self, error: WeightcacheError) -> None:
        """Close the socket (and the reader) and fail the requests in flight with
        ``error``, which becomes the connection's; not ``close()``: the next call may
        connect again."""

    @abstractmethod
    def _reconnecting(self) -> AbstractAsyncContextManager[None]:
        """Held while connecting again, so that one caller does it."""

    @abstractmethod
    def _lease_gone(self, lease: int, epoch: int) -> None:
        """Detach ``lease`` of connection ``epoch`` soon, waiting for nothing: called by a
        finalizer (mapping.py's ``Lease``), in any thread, at any moment."""

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


class ClientOps(ConnectionBase):
    """The daemon's ops, written once for both transports: :class:`Client` runs them on an
    asyncio loop (aio.py's ``Connection``), :class:`~weightcache.SyncClient` in the
    caller's thread (sync.py's ``BlockingConnection``, Note [blocking transport]). Every
    wait is the transport's (``_request``, ``_lease``, ``_offload``): nothing here awaits
    anything else. Not used on its own.
    """

    async def connect(self) -> Self:
        """Connect and say hello. A daemon not running yet is waited for, up to
        ``wait_for_daemon`` (Note [waiting for the daemon] in core.py); then
        DaemonUnavailable says how to start it. A socket this user may not use raises
        PermissionDenied at once. The connect and hello are bounded by ``connect_timeout``
        (else DaemonUnavailable); a daemon that speaks another protocol version raises
        ProtocolVersionError."""
        await self._open()
        return self

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- control calls: no tensors, no torch -------------------------------------------
    async def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Per-device ``budget``/``used``/``reserved``/``free``, loads in progress, leases.

        >>> (await c.status())["devices"]["cpu"]["free"]     # doctest: +SKIP
        4294967296
        """
        return await self.request("status", timeout=timeout)

    async def health(self, *, timeout: float | None = None) -> dict[str, Any]:
        """``{"serving", "ready", "preloading", "failed_preloads", "uptime_s"}``: ready means
        serving with every configured preload resident (docs/protocol.md)."""
        reply = await self.request("health", timeout=timeout)
        return {k: v for k, v in reply.items() if k not in ("id", "ok")}

    async def models(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """One dict per model: name, state, device, nbytes, attach_count, pinned, ..."""
        return (await self.request("models", timeout=timeout))["models"]

    async def load(self, name: str, *, device: str | None = None, rank: int | None = None, wait_s: float | None = None,
                   timeout: float | None = None, keep_alive: float | str | None = None) -> dict[str, Any]:
        """Make ``name`` resident (evicting LRU unattached models if needed).

        ``device``: for a model configured with ``device = "auto"``, the device to load it
        on, in the daemon's names (``cuda:1``, or ``cuda:GPU-<uuid>``); without it the
        daemon places it (docs/protocol.md, "Placement"). ``rank``: one rank of a sharded
        model. ``keep_alive`` (seconds, ``"5m"``, ``0``: evict when unattached, ``-1``:
        never) replaces the model's keep_alive until the next request sets one.

        >>> (await c.load("qwen-7b"))["placement"]["device"]   # doctest: +SKIP
        'cuda:1'
        """
        return (await self.request("load", name=name, device=device, rank=rank, wait_s=wait_s, timeout=timeout,
                                   keep_alive=keep_alive))["model"]

    async def evict(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Move ``name`` one tier down (to the host tier, or out): ``{"evicted", "freed", "state"}``.
        An attached model raises Attached, a pinned one Pinned (docs/protocol.md)."""
        return await self.request("evict", name=name, timeout=timeout)

    async def pin(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Never evict ``name`` while pinned; returns its model dict."""
        return (await self.request("pin", name=name, timeout=timeout))["model"]

    async def unpin(self, name: str, *, timeout: float | None = None) -> dict[str, Any]:
        """Make ``name`` evictable again; returns its model dict."""
        return (await self.request("unpin", name=name, timeout=timeout))["model"]

    async def register(self, name: str, path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                       shards: list[dict[str, str]] | None = None, pin: bool = False, preload: bool = False,
                       keep_alive: float | None = None, send_files: bool = True,
                       allowed_uids: list[int] | None = None, allowed_gids: list[int | str] | None = None,
                       timeout: float | None = None) -> dict[str, Any]:
        """Add a model: ``path`` (+ ``device``), or ``shards=[{"path":..., "device":...}, ...]`` in rank order.

        With ``send_files`` (the default) this process opens the checkpoint's files and
        hands the daemon their descriptors, so the daemon reads only what this peer can
        read; a file it cannot open raises PermissionDenied or LoadFailed here, naming
        it, and nothing is sent. Without, only the paths go and the daemon opens them
        itself (which it allows administrators only).

        ``allowed_uids`` / ``allowed_gids``: who else may use it. A model a non-admin adds
        without them is its own alone (docs/deployment.md, "Tenants").

        >>> await c.register("qwen-7b", "/models/qwen-7b", device="cuda:0")   # doctest: +SKIP
        {'name': 'qwen-7b', 'state': 'registered', ...}
        """
        shard_list = None if shards is None else [
            {**s, "path": os.fspath(s["path"])} if "path" in s else dict(s) for s in shards]
        args: dict[str, Any] = {"name": name, "path": os.fspath(path) if path is not None else None, "device": device,
                                "shards": shard_list, "pin": pin, "preload": preload, "keep_alive": keep_alive,
                                "allowed_uids": allowed_uids, "allowed_gids": allowed_gids}
        parts: list[str] = []  # one checkpoint per rank; none if the request is malformed (the daemon says why)
        if path is not None and not shards:
            parts = [os.fspath(path)]
        elif path is None and shard_list and all(isinstance(s.get("path"), str) for s in shard_list):
            parts = [s["path"] for s in shard_list]
        if not send_files or not parts:
            return (await self.request("register", timeout=timeout, **args))["model"]
        from .files import open_checkpoint_files  # only register sends files: not on an engine's import path

        args["files"], fds = open_checkpoint_files(parts)
        try:
            reply, reply_fds = await self._request("register", timeout, args, send_fds=fds)
        finally:
            for fd in fds:  # the daemon has its own copies once the frame is sent
                os.close(fd)
        for fd in reply_fds:
            os.close(fd)
        return reply["model"]

    async def unregister(self, name: str, *, timeout: float | None = None) -> None:
        """Forget ``name`` and free its arena; refused while it is attached or loading."""
        await self.request("unregister", name=name, timeout=timeout)

    async def reload(self, *, timeout: float | None = None) -> dict[str, Any]:
        """Make the daemon re-read its config file; returns its report (docs/protocol.md, "reload")."""
        return (await self.request("reload", timeout=timeout))["report"]

    # -- weights: these import torch, at their first call --------------------------------
    async def publish(self, name: str, tensors: Mapping[str, torch.Tensor], *, fingerprint: str, replace: bool = False,
                      wait_s: float | None = None, allowed_uids: list[int] | None = None,
                      allowed_gids: list[int | str] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Hand the daemon weights this engine processed itself (quantized, repacked, ...)
        so that later starts attach them instead of redoing the work. The daemon keeps its
        own copy (on the tensors' device); ``fingerprint`` should name what they were made
        from and how (e.g. the source checkpoint's fingerprint plus the recipe).
        ``allowed_uids`` / ``allowed_gids`` as for ``register``.

        >>> await c.publish("qwen-7b-int8", model.state_dict(), fingerprint=f"{src_fp}+int8-v1")  # doctest: +SKIP
        """
        from .publish import pack, wire_rows

        packed = await self._offload(pack, tensors)
        try:
            reply, _ = await self._request("publish", timeout, {
                "name": name, "device": packed.device, "fingerprint": fingerprint, "arena": packed.arena.to_wire(),
                "tensors": wire_rows(packed.table), "replace": replace or None, "wait_s": wait_s,
                "allowed_uids": allowed_uids, "allowed_gids": allowed_gids}, send_fds=packed.fds)
            return reply["model"]
        finally:
            packed.release()

    async def _attach(self, name: str, device: str | None = None, rank: int | None = None, *, wait_s: float | None = None,
                      timeout: float | None = None, writable: bool = False,
                      keep_alive: float | str | None = None) -> AttachedModel:
        """What entering ``attach`` does (aio.py's ``Attachment``, sync.py's): the request, and
        the mapping of its reply, which then owns the lease (ended here if mapping fails)."""
        # Imported before the request, not after: torch's import (~1.5 s) is then not
        # taken from the request's timeout, and an import that fails leaves no lease.
        from ..protocol.arena import parse_attach
        from .mapping import Lease, attached_model, prepare_attach

        if device is not None and device.startswith("cuda:") and device[5:].isdigit():
            from .libcuda import driver  # ctypes, not cuda-bindings: cuda_mapping.py's Note [first attach]

            device = f"cuda:{driver().device_uuid(int(device[5:]))}"  # this process's numbering -> UUID
        reply, fds = await self._request("attach", timeout, {"name": name, "device": device, "rank": rank, "wait_s": wait_s,
                                                       "writable": writable or None, "keep_alive": keep_alive,
                                                       "table": "columns"},
                                         while_waiting=lambda: prepare_attach(device != "cpu"))
        lease = Lease(reply["lease"], self)
        try:
            model = attached_model(name, parse_attach(reply, fds), lease)
            model.budget_bytes = reply.get("nbytes")
            return model
        except BaseException:  # a bad reply, or mapping failed: no tensor holds the lease
            await lease.end()
            raise
