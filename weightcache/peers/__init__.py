"""Neighbour daemons (issue 27): a load that misses here may be filled from a peer
daemon's resident copy over NIXL instead of from the files.

- directory.py: who the peers are (config, DNS) and what each holds (``inventory``).
- server.py: the lending side, on the peer port: inventory, and ``lend`` under a lease.
- fill.py: the borrowing side's fill strategy: the NIXL read, every piece hashed, the
  fingerprint checked before the arena is sealed.
- transport.py: the NIXL agent; wire.py: the control channel's frames.

``Peers`` ties them to a daemon: ``start``/``close`` with it, ``fill`` from the load path
(server/residency/flight.py, the one hook), ``status`` for the status op. The ``nixl`` package is
optional (``pip install weightcache[peers]``): without it the daemon logs why and loads
from the files.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ..backends import Backend
from ..cache import CacheCore
from ..config import PeersConfig
from ..errors import NoSpace, WeightcacheError
from ..loader import Checkpoint, OpenedSource
from ..loader.content import FILE_DIGESTS, fingerprint
from ..server.registry import Model, Registry
from . import wire
from .directory import Directory, PeerState, connect
from .fill import Lent, PeerFill
from .server import Lender
from .transport import Transport, unavailable


class Job(Protocol):
    """The load in flight the fill is for (server/residency/job.py LoadJob): where its bytes come
    from, and whether it was given up."""

    name: str
    source: str
    abandoned: threading.Event

log = logging.getLogger("weightcache.peers")

SOURCE = "neighbour"  # a model's ``source`` and the metrics' label for bytes from a peer daemon


def known_fingerprint(settings: PeersConfig, name: str, ckpt: Checkpoint, opened: OpenedSource) -> str | None:
    """The content fingerprint this daemon knows its files of ``name`` have without reading
    them: pinned in ``[peers] fingerprints``, or from the tensor digests kept for these
    very files (unchanged: same inode, size, mtime and ctime) since an earlier load
    (loader/content.py, FileDigests)."""
    pinned = settings.fingerprints.get(name)
    if pinned:
        return pinned
    digests: dict[int, bytes] = {}
    for i, sf in enumerate(opened.files):
        try:
            st = os.fstat(sf.fd)
        except OSError:
            return None
        got = FILE_DIGESTS.get((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        if got is None:
            return None
        for j, t in enumerate(ckpt.tensors):
            if t.file == i:
                d = got.get((t.file_offset, t.nbytes))
                if d is None:
                    return None
                digests[j] = d
    return fingerprint(ckpt, digests) if len(digests) == len(ckpt.tensors) else None


class Peers:
    def __init__(self, settings: PeersConfig, *, core: CacheCore, registry: Registry, backends: dict[str, Backend],
                 notify_space: Callable[[], None], shutting_down: Callable[[], bool]) -> None:
        self.settings = settings
        self.daemon_id = f"{socket.gethostname()}/{os.getpid()}/{os.urandom(4).hex()}"
        self.directory = Directory(settings, self.daemon_id)
        self.transport: Transport | None = None
        self.nixl_error: str | None = None
        self._shutting_down = shutting_down
        self.lender = Lender(daemon_id=self.daemon_id, core=core, registry=registry, backends=backends,
                             transport=lambda: self.transport, allowed=self.directory.allowed, notify_space=notify_space,
                             timeout_s=settings.timeout_s, serve=settings.serve)
        self._refresh: asyncio.Task[None] | None = None
        self.filled: Counter[str] = Counter()  # outcomes of fills tried: "ok", "failed", "no fingerprint"

    async def start(self) -> None:
        """Start NIXL (in a thread: ~0.5 s), the peer port, and the inventory refresh. NIXL
        that cannot start is logged and shown in status; the daemon serves from its files."""
        self.nixl_error = await asyncio.to_thread(unavailable)
        if self.nixl_error is None:
            try:
                self.transport = await asyncio.to_thread(Transport)
            except Exception as exc:
                self.nixl_error = f"{type(exc).__name__}: {exc}"
        if self.nixl_error is not None:
            log.warning("peers: NIXL cannot start (%s); this daemon neither fills from nor lends to its peers", self.nixl_error)
        assert self.settings.listen is not None
        host, port = wire.split_host_port(self.settings.listen)
        await self.lender.start(host, port)
        log.info("peer port on %s (NIXL agent %s)", self.settings.listen,
                 self.transport.name if self.transport else "not started")
        self._refresh = asyncio.ensure_future(self.directory.run())

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
        await self.lender.close()

    def status(self) -> dict[str, Any]:
        return {"listen": self.settings.listen, "daemon": self.daemon_id,
                "nixl": "ok" if self.transport is not None else self.nixl_error,
                "peers": [p.describe() for p in self.directory.peers.values()],
                "lending_now": self.lender.lent_now, "lends": self.lender.lends, "refused": self.lender.refused,
                "fills": dict(self.filled)}

    # -- the load path's hook -----------------------------------------------------------
    async def fill(self, job: Job, model: Model, backend: Backend, ckpt: Checkpoint, opened: OpenedSource,
                   fill_new_arena: Callable[..., Awaitable[None]]) -> bool:
        """Try to fill ``job``'s new arena (``model``'s, on ``backend``) from a peer that
        holds its content, through the daemon's ``fill_new_arena`` (admit, allocate, fill,
        seal, or roll back). True: it is resident (``job.source`` is SOURCE). False: no
        peer could (nothing to try, or every try failed and was logged); the caller loads
        from the files. NoSpace, and the load's cancellation, pass through as from any fill."""
        name = job.name
        if self.transport is None or not backend.supports_dma or model.origin != "config" or model.owner is not None:
            return False
        expected = known_fingerprint(self.settings, name, ckpt, opened)
        if expected is None:
            return False
        offers = self.directory.offers(expected, ckpt.layout)
        for peer, _offer in offers:
            t0 = time.monotonic()
            try:
                await self._fill_from(fill_new_arena, job, ckpt, backend, peer, expected)
            except NoSpace:
                raise
            except (WeightcacheError, wire.PeerError, OSError, TimeoutError, ValueError) as exc:
                job.source = "files"
                if job.abandoned.is_set() or self._shutting_down():
                    raise
                peer.failed_fills += 1
                self.filled["failed"] += 1
                log.warning("fill of %s from peer %s failed after %.2fs (%s); loading from the files", name, peer.address,
                            time.monotonic() - t0, exc, extra={"model": name, "peer": peer.address})
                continue
            peer.fills += 1
            self.filled["ok"] += 1
            return True
        return False

    async def _fill_from(self, fill_new_arena: Callable[..., Awaitable[None]], job: Job, ckpt: Checkpoint, backend: Backend,
                         peer: PeerState, expected: str) -> None:
        assert self.transport is not None
        reader, writer, _ = await connect(peer.address, self.daemon_id)
        closed: list[str] = []
        watcher: asyncio.Task[None] | None = None
        try:
            await wire.send(writer, {"op": "lend", "fingerprint": expected, "layout": ckpt.layout})
            lent = Lent.parse(wire.check_reply(await asyncio.wait_for(wire.recv(reader), 30), "lend"))

            async def watch() -> None:  # the lender sends nothing until done: EOF means it went
                try:
                    await reader.read(1)
                finally:
                    closed.append("the peer closed its control connection")

            watcher = asyncio.ensure_future(watch())

            def stop() -> str | None:
                if closed:
                    return closed[0]
                if job.abandoned.is_set() or self._shutting_down():
                    return "the load was cancelled"
                return None

            fill = PeerFill(self.transport, backend, lent, expected, stop, self.settings.timeout_s,
                            self.settings.max_fill_bytes_per_s, stall_s=self.settings.stall_s)
            job.source = SOURCE
            await fill_new_arena(job.name, ckpt, backend.capacity(ckpt.arena_bytes), 0, fill,
                                 verb=f"filled from peer {peer.address}", job=job)
            watcher.cancel()
            with contextlib.suppress(OSError, ConnectionError):
                await wire.send(writer, {"op": "done"})
        finally:
            if watcher is not None:
                watcher.cancel()
            writer.close()
