"""The daemon's ops, written once for both clients (:class:`ClientOps`): aio.py's
:class:`~weightcache.Client` runs them on an asyncio loop, sync.py's SyncClient in the
caller's thread.

Importing this module does not import torch (tests/test_client_imports.py): the control
calls need none, and they are what the CLI and health probes make. ``attach`` imports
mapping.py (tensors from fds) and ``publish`` publish.py (fds from tensors) the first time
they are called, so only an engine that handles weights pays for torch.
Timeouts and cancellation: Note [timeouts] and Note [cancellation] in core.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any, Self

from .connection import ConnectionBase

if TYPE_CHECKING:  # annotations only: importing them would import torch
    import torch

    from .mapping import AttachedModel


class ClientOps(ConnectionBase):
    """The daemon's ops, written once for both transports: :class:`Client` runs them on an
    asyncio loop (connection.py's ``Connection``), :class:`~weightcache.SyncClient` in the
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

    @contextlib.asynccontextmanager
    async def attach(self, name: str, device: str | None = None, rank: int | None = None, *, wait_s: float | None = None,
                     timeout: float | None = None, writable: bool = False,
                     keep_alive: float | str | None = None) -> AsyncIterator[AttachedModel]:
        """Attach ``name`` (loading it first if needed) and yield its tensors, zero-copy.

        Read-only unless ``writable=True`` and the daemon allows it (GPU arenas only):
        writes then change the bytes every other attached engine sees. ``keep_alive`` is
        as for :meth:`load`: ``0`` evicts the model once its last lease ends.

        The lease lasts until the block exits (or the connection closes). Keep the block
        open while the tensors are in use: only a lease keeps the daemon from evicting.

        >>> async with c.attach("qwen-7b", device="cuda:0") as weights:   # doctest: +SKIP
        ...     model = load_into_module(skeleton, weights)
        """
        # Imported before the request, not after: torch's import (~1.5 s) is then not
        # taken from the request's timeout, and an import that fails leaves no lease.
        from ..protocol.arena import parse_attach
        from .mapping import attached_model, prepare_attach

        if device is not None and device.startswith("cuda:") and device[5:].isdigit():
            from .libcuda import driver  # ctypes, not cuda-bindings: cuda_mapping.py's Note [first attach]

            device = f"cuda:{driver().device_uuid(int(device[5:]))}"  # this process's numbering -> UUID
        reply, fds = await self._request("attach", timeout, {"name": name, "device": device, "rank": rank, "wait_s": wait_s,
                                                       "writable": writable or None, "keep_alive": keep_alive,
                                                       "table": "columns"},
                                         while_waiting=lambda: prepare_attach(device != "cpu"))
        async with self._lease(reply["lease"]):  # ends the lease even if the reply is bad or mapping fails
            yield attached_model(name, parse_attach(reply, fds))
