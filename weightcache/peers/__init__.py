"""Neighbour daemons: a load that misses here may be filled from a peer
daemon's resident copy over NIXL instead of from the files.

- directory.py: who the peers are (config, DNS) and what each holds (``inventory``).
- server.py: the lending side, on the peer port: inventory, and ``lend`` under a lease.
- fill.py: the borrowing side's fill strategy: the NIXL read, every piece hashed, the
  fingerprint checked before the arena is sealed.
- staged.py: the same for GPU arenas, through device rings and the lender's ``stage``.
- choice.py: peer or files for a load, by the rates this daemon measured for each.
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
from ..cache.eviction import OWN_PHASES
from ..config import PeersConfig
from ..errors import NoSpace, WeightcacheError
from ..loader import Checkpoint, OpenedSource
from ..loader.reader import FILE_DIGESTS, fingerprint
from . import wire
from .auth import Secret
from .choice import REMEASURE_S, Choice, backoff_s, choose, files_default, files_warm, smoothed
from .directory import Directory, PeerState, connect
from .fill import Lent, PeerFill
from .lend_worker import FillWorker, WorkerGone
from .server import Lender, ServedModel, ServedModels
from .staged import CannotLand, StagedFill
from .transport import TransferFailed, Transport, unavailable


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
    (loader/reader.py, FileDigests)."""
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
    def __init__(self, settings: PeersConfig, *, core: CacheCore, registry: ServedModels, backends: dict[str, Backend],
                 notify_space: Callable[[], None], shutting_down: Callable[[], bool]) -> None:
        self.settings = settings
        self.backends = backends
        self.daemon_id = f"{socket.gethostname()}/{os.getpid()}/{os.urandom(4).hex()}"
        # A key file that cannot be used is the config's error: the daemon does not start (auth.py).
        self.secret = Secret(settings.secret_file) if settings.secret_file is not None else None
        self.directory = Directory(settings, self.daemon_id, self.secret)
        self.transport: Transport | None = None
        self.nixl_error: str | None = None
        self._shutting_down = shutting_down
        self.lender = Lender(daemon_id=self.daemon_id, core=core, registry=registry, backends=backends,
                             transport=lambda: self.transport, nixl_ok=lambda: self.nixl_error is None,
                             allowed=self.directory.allowed, notify_space=notify_space,
                             secret=self.secret, known=self.directory.known,
                             timeout_s=settings.timeout_s, serve=settings.serve, slot_bytes=settings.slot_bytes)
        self._refresh: asyncio.Task[None] | None = None
        # Outcomes of loads a peer offered: "ok", "failed", and "files faster" (not tried).
        self.filled: Counter[str] = Counter()
        # Bytes/s of this daemon's own loads from files, by device and whether the files
        # were warm (choice.py); the loads a peer offered teach it (observe_files).
        self.files_rates: dict[tuple[str, bool], float] = {}
        self._probed: dict[str, tuple[str, bool]] = {}  # load -> (device, warm) it was chosen with
        self._told_unknown: set[str] = set()  # models whose unknown fingerprint was logged (_unknown_fingerprint)
        self._one_fill = asyncio.Lock()
        self.fill_worker = FillWorker()  # reads fills into host arenas (lend_worker.py, Note [a fill lands in a worker])

    async def start(self) -> None:
        """Start NIXL (in a thread: ~0.5 s), the peer port, and the inventory refresh. NIXL
        that cannot start is logged and shown in status; the daemon serves from its files.
        The daemon runs a NIXL agent of its own only where a GPU arena may be lent or filled
        (through device rings in its CUDA context); host memory is lent and filled by the
        lend and fill workers alone (lend_worker.py), so a daemon without a GPU budget has
        no UCX worker for a peer to reach."""
        self.nixl_error = await asyncio.to_thread(unavailable)
        if self.nixl_error is None and any(b.dma_through_ring for b in self.backends.values()):
            try:
                self.transport = await asyncio.to_thread(Transport)
            except Exception as exc:
                self.nixl_error = f"{type(exc).__name__}: {exc}"
        if self.secret is None:
            log.warning("peers: [peers] insecure_no_secret = true: ANY process that can connect from a listed address is "
                        "answered as a peer (tests only; set secret_file)")
        if self.nixl_error is not None:
            log.warning("peers: NIXL cannot start (%s); this daemon neither fills from nor lends to its peers", self.nixl_error)
        if self.nixl_error is None and self.settings.serve:  # the lend worker's NIXL starts now, not at the first lend
            try:
                await asyncio.to_thread(self.lender.worker.start)
            except WorkerGone as exc:
                log.warning("peers: %s; host models are not lent until it starts", exc)
        if self.nixl_error is None and any(not b.dma_through_ring and b.supports_dma for b in self.backends.values()):
            try:  # likewise the fill worker's, where a host arena may be filled
                await asyncio.to_thread(self.fill_worker.start)
            except WorkerGone as exc:
                log.warning("peers: %s; host models are filled from their files until it starts", exc)
        assert self.settings.listen is not None
        host, port = wire.split_host_port(self.settings.listen)
        await self.lender.start(host, port)
        log.info("peer port on %s (NIXL %s; the daemon's own agent: %s)", self.settings.listen,
                 "ok" if self.nixl_error is None else "unavailable",
                 self.transport.name if self.transport else "none")
        self._refresh = asyncio.ensure_future(self.directory.run())

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
        await self.lender.close()
        await asyncio.to_thread(self.fill_worker.close)

    def status(self) -> dict[str, Any]:
        return {"listen": self.settings.listen, "daemon": self.daemon_id,
                "nixl": "ok" if self.nixl_error is None else self.nixl_error,
                "agent": self.transport.name if self.transport is not None else None,
                "peers": [p.describe() for p in self.directory.peers.values()],
                "lending_now": self.lender.lent_now, "lends": self.lender.lends, "refused": self.lender.refused,
                "authenticated": self.secret is not None, "unauthenticated": self.lender.unauthenticated,
                "over_limit": self.lender.over_limit, "cut_off": self.lender.cut_off, "lends_ended_for_room": self.lender.ended_for_room,
                "lend_worker": self.lender.worker.describe(), "fill_worker": self.fill_worker.describe(),
                "fills": dict(self.filled),
                # what the choice (choice.py) compares a peer's fill_bytes_per_s with
                "files_bytes_per_s": {f"{dev} {'warm' if warm else 'cold'}": round(rate)
                                      for (dev, warm), rate in sorted(self.files_rates.items())}}

    # -- the load path's hook -----------------------------------------------------------
    async def fill(self, job: Job, model: ServedModel, backend: Backend, ckpt: Checkpoint, opened: OpenedSource,
                   fill_new_arena: Callable[..., Awaitable[None]]) -> bool:
        """Try to fill ``job``'s new arena (``model``'s, on ``backend``) from a peer that
        holds its content, through the daemon's ``fill_new_arena`` (admit, allocate, fill,
        seal, or roll back). True: it is resident (``job.source`` is SOURCE). False: no
        peer could (nothing to try, the files are expected faster (choice.py), or every
        try failed and was logged); the caller loads from the files. NoSpace, and the
        load's cancellation, pass through as from any fill."""
        name = job.name
        self._probed.pop(name, None)  # an earlier load's, refused for room: not this one's state
        if (self.nixl_error is not None or not backend.supports_dma
                or (backend.dma_through_ring and (self.transport is None or not backend.can_land_dma))
                or model.origin != "config" or model.owner is not None):
            return False
        expected = known_fingerprint(self.settings, name, ckpt, opened)
        if expected is None:
            self._unknown_fingerprint(name, ckpt.layout)
            return False
        now = time.monotonic()
        # A GPU lend is a ring of device memory (wire.py): a host arena cannot take it.
        offers = [(peer, offer) for peer, offer in self.directory.offers(expected, ckpt.layout)
                  if peer.retry_at <= now and (backend.dma_through_ring or offer.tier == "host")]
        if not offers:  # none holds it, or those that do failed lately (choice.backoff_s)
            return False
        device = backend.device
        warm = await asyncio.to_thread(files_warm, opened)
        self._probed[name] = (device, warm)
        files_rate = self.files_rates.get((device, warm)) or files_default(device, warm)

        def lately(peer: PeerState) -> float | None:
            return peer.fill_rate if now - peer.measured_at < REMEASURE_S else None

        choices = [(peer, offer, choose(lately(peer), files_rate, warm) if self.settings.prefer == "faster"
                     else Choice(True, "prefer = peers")) for peer, offer in offers]
        if not any(c.peer for _, _, c in choices):
            self.filled["files faster"] += 1
            log.info("load %s: from the files, not a peer (%s)", name, choices[0][2].why,
                     extra={"model": name, "peer": choices[0][0].address})
            return False
        # The directory's order (GPU copies first, then the fewest failed fills), and among
        # equals the fastest measured, a peer not measured yet first (to learn its rate).
        for peer, _offer, choice in sorted(choices, key=lambda c: (c[1].tier != "gpu", c[0].failed_fills,
                                                                    -(c[0].fill_rate or float("inf")))):
            if not choice.peer:
                continue
            t0 = time.monotonic()
            try:
                own_s = await self._fill_from(fill_new_arena, job, ckpt, backend, peer, expected, choice)
            except NoSpace:
                raise
            except CannotLand as exc:  # this daemon's lack, not the peer's: no backoff, no failed fill
                job.source = "files"
                if job.abandoned.is_set() or self._shutting_down():
                    raise
                log.warning("load %s: from the files, not peer %s: %s", name, peer.address, exc.message,
                            extra={"model": name, "peer": peer.address})
                return False
            except (WeightcacheError, wire.PeerError, OSError, TimeoutError, ValueError) as exc:
                job.source = "files"
                if job.abandoned.is_set() or self._shutting_down():
                    raise
                peer.failed_fills += 1
                peer.failed_in_a_row += 1
                wait = backoff_s(peer.failed_in_a_row)
                peer.retry_at = time.monotonic() + wait
                self.filled["failed"] += 1
                log.warning("fill of %s from peer %s failed after %.2fs (%s); loading from the files, and not asking "
                            "that peer again for %.0fs", name, peer.address, time.monotonic() - t0, exc, wait,
                            extra={"model": name, "peer": peer.address})
                continue
            self._probed.pop(name, None)
            if own_s > 0:
                peer.fill_rate = smoothed(peer.fill_rate, ckpt.arena_bytes / own_s)
                peer.measured_at = time.monotonic()
            peer.fills += 1
            peer.failed_in_a_row = 0
            self.filled["ok"] += 1
            return True
        return False

    def _unknown_fingerprint(self, name: str, layout: str) -> None:
        """Said once per model: a peer holds files of this layout, but this daemon cannot
        fill from it, not knowing what its own files hold (known_fingerprint)."""
        if name in self._told_unknown:
            return
        holders = [p.address for p in self.directory.peers.values() for o in p.offers if o.layout == layout]
        if holders:
            self._told_unknown.add(name)
            log.info("load %s: peer %s holds a copy of this layout, but this daemon does not know the fingerprint of "
                     "its files (not pinned in [peers] fingerprints, not loaded since start): from the files",
                     name, holders[0], extra={"model": name, "peer": holders[0]})

    def observe_files(self, name: str, rate: float) -> None:
        """A load this daemon chose peer or files for (``fill``) was made from its files at
        ``rate`` bytes/s (the fill's own phases, as the cache policy measures it): it
        teaches the rate of files in the state they were probed in."""
        probed = self._probed.pop(name, None)
        if probed is not None and rate > 0:
            self.files_rates[probed] = smoothed(self.files_rates.get(probed), rate)

    async def _fill_from(self, fill_new_arena: Callable[..., Awaitable[None]], job: Job, ckpt: Checkpoint, backend: Backend,
                         peer: PeerState, expected: str, choice: Choice) -> float:
        """Fill from ``peer``; returns the seconds of the fill's own phases (its rate's measure).
        One fill at a time (the transport reads one at a time): a fill waits here, before
        it asks for a lend, so that neither its lend nor its ``timeout_s`` runs while it
        waits for another's read."""
        async with self._one_fill:
            return await self._lend_and_fill(fill_new_arena, job, ckpt, backend, peer, expected, choice)

    async def _lend_and_fill(self, fill_new_arena: Callable[..., Awaitable[None]], job: Job, ckpt: Checkpoint,
                             backend: Backend, peer: PeerState, expected: str, choice: Choice) -> float:
        reader, writer, _ = await connect(peer.address, self.daemon_id, self.secret)
        channel: LendChannel | None = None
        watcher: asyncio.Task[None] | None = None
        try:
            await wire.send(writer, {"op": "lend", "fingerprint": expected, "layout": ckpt.layout})
            reply = await asyncio.wait_for(wire.recv(reader, wire.lend_reply_limit(len(ckpt.tensors)),
                                                    max_array_len=max(len(ckpt.tensors) + 1, 4096)), 30)
            lent = Lent.parse(wire.check_reply(reply, "lend"))
            channel = LendChannel(asyncio.get_running_loop(), reader, writer)
            watcher = asyncio.ensure_future(channel.run())

            def stop() -> str | None:
                assert channel is not None
                if channel.closed:
                    return channel.closed[0]
                if job.abandoned.is_set() or self._shutting_down():
                    return "the load was cancelled"
                return None

            fill: PeerFill | StagedFill
            if backend.dma_through_ring:
                assert self.transport is not None  # fill() asks a peer for a GPU arena only with the agent up
                fill = StagedFill(self.transport, backend, lent, expected, stop, channel, self.settings.timeout_s,
                                  self.settings.max_fill_bytes_per_s, stall_s=self.settings.stall_s,
                                  slot_bytes=self.settings.slot_bytes)
            else:
                fill = PeerFill(self.transport, backend, lent, expected, stop, self.settings.timeout_s,
                                self.settings.max_fill_bytes_per_s, stall_s=self.settings.stall_s, worker=self.fill_worker)
            job.source = SOURCE
            phases: dict[str, float] = {}
            await fill_new_arena(job.name, ckpt, backend.capacity(ckpt.arena_bytes), 0, fill,
                                 verb=f"filled from peer {peer.address} ({choice.why})", job=job, phases=phases)
            watcher.cancel()
            with contextlib.suppress(OSError, ConnectionError):
                await wire.send(writer, {"op": "done"})
            return sum(phases.get(k, 0.0) for k in OWN_PHASES)
        finally:
            if watcher is not None:
                watcher.cancel()
            writer.close()


class LendChannel:
    """A lend's control connection while the fill runs (wire.py): the lender's replies to
    ``stage`` are noted for the fill's thread (staged.py's StageRequests); its refusal, or
    the connection's end, stops the fill (``closed``). A lend from host memory gets
    nothing until ``done``: there, only the end is watched."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._loop, self._reader, self._writer = loop, reader, writer
        self.closed: list[str] = []
        self._lock = threading.Lock()
        self._asked: dict[int, float] = {}  # seq -> when, for the stage requests not answered yet
        self._staged: set[int] = set()

    async def run(self) -> None:
        try:
            while True:
                msg = await wire.recv(self._reader)
                if msg is None:
                    self.closed.append("the peer closed its control connection")
                    return
                seq = wire.check_reply(msg, "stage").get("seq")
                with self._lock:
                    if not isinstance(seq, int) or self._asked.pop(seq, None) is None:
                        raise wire.PeerError(f"the peer answered a stage not asked for ({str(seq)[:32]})")
                    self._staged.add(seq)
        except asyncio.CancelledError:
            self.closed.append("the fill ended")
            raise
        except Exception as exc:  # PeerError, OSError, FrameTooLarge: whatever it was, the fill stops on it
            self.closed.append(f"the peer's control connection: {type(exc).__name__}: {exc}")

    def request(self, seq: int, slot: int, offset: int, nbytes: int) -> None:
        with self._lock:
            self._asked[seq] = time.monotonic()
        frame = wire.encode_frame({"op": "stage", "seq": seq, "slot": slot, "offset": offset, "nbytes": nbytes})
        self._loop.call_soon_threadsafe(self._writer.write, frame)

    def staged(self, seq: int, stall_s: float) -> bool:
        with self._lock:
            if seq in self._staged:
                return True
            asked = self._asked.get(seq)
        if self.closed:
            raise TransferFailed(self.closed[0])
        if asked is not None and time.monotonic() - asked > stall_s:
            raise TransferFailed(f"the peer did not stage bytes within {stall_s:g} s")
        return False
