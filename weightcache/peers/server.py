"""The lending side: a daemon's peer port, answering its configured peers' ``inventory``
and ``lend`` (wire.py).

Note [what a lend holds]
------------------------
A lend takes a lease on the model, of the daemon's own (a negative connection id, one per
peer connection, so no engine's connection can end it), before it registers the arena's
memory with NIXL, and gives it back only after the registration is removed and the
arena's view released: an attached model is never a victim (cache/core.py), so the
arena the peer reads is never freed under the read. The lease ends with ``done``, when
the peer's connection closes (the peer died, or gave up), or at ``timeout_s`` after the
lend, whichever comes first. What is lent is only what the operator configured and
every user may use (``lendable``): a tenant's registered or published model, or one
restricted to some uids or groups, is neither listed nor lent, so a peer's question
never reaches past the access rules of this daemon's tenants.

Note [lends are bounded in time]
--------------------------------
A lend pins its model (an attached model is never a victim), so a peer could keep one
resident by asking again at every ``timeout_s``. Three bounds: a lend ends at
``timeout_s``; one peer address gets at most LENDS_PER_MODEL lends of one model in any
``LEND_WINDOW_TIMEOUTS * timeout_s`` (a fill needs one); and a local load or publish
refused for room ends the lends that are idle (``end_idle``: a host lend older than
IDLE_LEND_S, whose one-sided reads this side cannot see, or a GPU lend with no stage
asked for that long): this daemon's own tenants come before its peers, whose fills
fall back to their files.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..backends import Arena, Backend
from ..backends.base import StagedRing
from ..cache import CacheCore, State
from ..config import ModelConfig
from ..config.peers import RING_SLOTS
from ..errors import WeightcacheError
from ..loader import Checkpoint
from ..peer_log import PeerEventLog
from ..protocol.framing import encode_frame
from . import wire
from .auth import NotAuthenticated, Secret, challenge
from .lend_worker import LendWorker, LentFiles, WorkerGone
from .transport import Transport

log = logging.getLogger("weightcache.peers")
T = TypeVar("T")

HELLO_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0  # a peer connection with no request for this long is closed
CLOSE_WAIT_S = 1.0  # for a closed connection's unsent bytes to go; then it is aborted
LENDS_PER_PEER = 4  # lends one peer address holds at once; more are refused BUSY (each pins a model)
GPU_LENDS = 4  # GPU lends at once, all peers together: each holds a ring outside the budget ([peers] gpu_ring_bytes)
CONNECTIONS_PER_ADDRESS = 8  # peer connections open at once from one address; more are closed unread
CONNECTIONS = 64  # and from all addresses together
READ_BUFFER = 16 * 2**10  # a connection's stream stops reading the socket past twice this (asyncio's limit)
LENDS_PER_MODEL = 4  # lends of one model to one address per window (Note [lends are bounded in time])
LEND_WINDOW_TIMEOUTS = 5  # the window, in [peers] timeout_s
IDLE_LEND_S = 5.0  # a lend with nothing asked for this long is ended when a local load needs room
STRIKES = 10  # failed handshakes or broken frames from one address within STRIKE_WINDOW_S ...
STRIKE_WINDOW_S = 60.0  # ... cut it off: its connections are closed unread until the window has no STRIKES


class ServedResident(Protocol):
    """What the lender reads of a model's resident copy (the daemon's server/registry.py: Resident)."""

    @property
    def arena(self) -> Arena | None: ...
    @property
    def checkpoint(self) -> Checkpoint | None: ...


class ServedModel(Protocol):
    """What peers/ reads of a model the daemon serves (the daemon's server/registry.py
    Model): described here so that peers/ imports nothing of the daemon that builds it."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def device(self) -> str: ...
    @property
    def origin(self) -> str: ...
    @property
    def owner(self) -> int | None: ...
    @property
    def resident(self) -> ServedResident: ...
    def unchanged(self) -> bool: ...


class ServedModels(Protocol):
    """The daemon's models by name (its server/registry.py Registry)."""

    @property
    def models(self) -> Mapping[str, ServedModel]: ...


def lendable(name: str, model: ServedModel, core: CacheCore, backends: dict[str, Backend]) -> bool:
    """Whether ``model`` may be listed to peers and lent: the operator's, open to every
    user, resident with its files unchanged since it was loaded, on a device whose
    backend offers its arenas to a transfer engine."""
    cfg = model.config
    return (backends[model.device].supports_dma and model.origin == "config" and model.owner is None
            and cfg.allowed_uids is None and cfg.allowed_gids is None
            and core.entry(name).state is State.RESIDENT and model.resident.arena is not None and model.resident.checkpoint is not None
            and bool(model.resident.checkpoint.fingerprint) and model.unchanged())


def tier(device: str) -> str:
    return "gpu" if device.startswith("cuda") else "host"


@dataclass
class Lending:
    """A lend in progress, for ``Lender.end_idle``."""

    name: str
    host: str
    task: asyncio.Task[None]
    active: float  # monotonic time of its lend or its last stage request
    fingerprint: str = ""  # what was asked for: its window's key with ``host``
    worker: bool = False  # lent through the lend worker (its death ends the lend)
    stages: StageCount = field(default_factory=lambda: StageCount())

    def __post_init__(self) -> None:
        self.stages.lending = self  # each stage request renews ``active``


class Lender:
    def __init__(self, *, daemon_id: str, core: CacheCore, registry: ServedModels, backends: dict[str, Backend],
                 transport: Callable[[], Transport | None], nixl_ok: Callable[[], bool],
                 allowed: Callable[[str], Awaitable[bool]],
                 notify_space: Callable[[], None], timeout_s: float, serve: bool, slot_bytes: int,
                 secret: Secret | None = None, known: Callable[[str], bool | None] | None = None) -> None:
        self.daemon_id = daemon_id
        self.core = core
        self.registry = registry
        self.backends = backends
        self._transport = transport  # the daemon's own NIXL agent: GPU lends only (None on a host without them)
        self._nixl_ok = nixl_ok  # NIXL can start here: the lend worker's agent can
        self._allowed = allowed
        self._notify_space = notify_space
        self.timeout_s = timeout_s
        self.serve = serve
        self.slot_bytes = slot_bytes  # of a GPU lend's ring ([peers] gpu_ring_bytes)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._conn_ids = itertools.count(1)
        self.lent_now = 0  # lends holding a lease now
        self.rings_now = 0  # of them, GPU lends (each holds a ring)
        self.lends = 0  # lends made since start
        self.refused = 0  # connections from addresses that are not configured peers
        self._by_peer: dict[str, int] = {}  # peer host -> lends it holds now
        self.secret = secret
        self._known = known  # the directory's word without a lookup: a peer, not one, or None (ask ``allowed``)
        self.unauthenticated = 0  # connections closed for not proving the key (auth.py)
        self.over_limit = 0  # connections closed for CONNECTIONS_PER_ADDRESS / CONNECTIONS
        self.ended_for_room = 0  # lends ended by end_idle
        self._open: dict[str, int] = {}  # peer host -> its connections open now
        self._lent_at: dict[tuple[str, str], deque[float]] = {}  # (host, fingerprint) -> its lends' times in the window
        self._lending: dict[int, Lending] = {}  # conn -> the lend it holds
        self._strikes: dict[str, deque[float]] = {}  # peer host -> when it failed the handshake or broke a frame
        self.cut_off = 0  # connections closed unread for their address's strikes
        self._idle_timer: asyncio.TimerHandle | None = None  # end_idle's next look
        # One line per kind of refusal per address and minute at most, then a count
        # (an unconfigured host connecting in a loop wrote ~2,500 lines/s).
        self.events = PeerEventLog(log, burst=3, total=20, window=60.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.worker = LendWorker(on_gone=self._on_worker_gone)

    def _on_worker_gone(self, why: str) -> None:  # the worker's watch thread
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed at shutdown
                self._loop.call_soon_threadsafe(self._worker_gone, why)

    async def start(self, host: str, port: int) -> None:
        self._loop = asyncio.get_running_loop()
        loop = self._loop

        def factory() -> asyncio.StreamReaderProtocol:
            return _PeerProtocol(self, asyncio.StreamReader(limit=READ_BUFFER, loop=loop), self._accept, loop=loop)

        self._server = await loop.create_server(factory, host or None, port, reuse_address=True)

    @property
    def port(self) -> int | None:
        if self._server is None or not self._server.sockets:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        await asyncio.to_thread(self.worker.close)
        self.events.flush()

    def _strike(self, host: str) -> None:
        """``host`` failed the handshake or broke the protocol (Note [peer strikes])."""
        now = time.monotonic()
        times = self._strikes.setdefault(host, deque(maxlen=STRIKES))
        times.append(now)
        if len(self._strikes) > 4 * CONNECTIONS:  # forget the addresses whose strikes are old
            for h in [h for h, t in self._strikes.items() if now - t[-1] > STRIKE_WINDOW_S]:
                del self._strikes[h]

    def _struck_out(self, host: str) -> bool:
        """Note [peer strikes]
        ----------------------
        Each connection that fails the handshake or breaks a frame costs the loop an
        accept, a challenge and a read (an unauthenticated 15 MiB hello flood from 4
        processes took the daemon from 1.5 to 2.3 s of CPU in 10 s on the 2-core VM). An
        address with STRIKES of them within STRIKE_WINDOW_S is closed unread, as an
        unconfigured one is, until its oldest strike of the last STRIKES is that old. On a
        node shared with an attacker (hostNetwork) this shuts the node's honest daemon out
        too for that long: its fills fall back to the files; nothing else is lost."""
        times = self._strikes.get(host)
        return times is not None and len(times) >= STRIKES and time.monotonic() - times[0] < STRIKE_WINDOW_S

    def end_idle(self, look_again: bool = True) -> int:
        """End the lends idle for IDLE_LEND_S (Note [lends are bounded in time]): a local
        load or publish was refused for room. A lend not idle yet is looked at again once
        it would be (the load may be waiting for the room). Returns how many were ended."""
        now = time.monotonic()
        idle = [ln for ln in self._lending.values() if now - ln.active >= IDLE_LEND_S and not ln.task.done()]
        for ln in idle:
            log.info("ending the lend of %s to peer %s: a load here needs the room", ln.name, ln.host,
                     extra={"model": ln.name, "peer": ln.host})
            ln.task.cancel()
        self.ended_for_room += len(idle)
        later = [ln.active + IDLE_LEND_S for ln in self._lending.values() if ln not in idle]
        if later and look_again and self._idle_timer is None:
            def again() -> None:
                self._idle_timer = None
                self.end_idle(look_again=False)  # once per refusal: a lend kept busy is not polled

            self._idle_timer = asyncio.get_running_loop().call_later(max(0.0, min(later) - now) + 0.01, again)
        return len(idle)

    def inventory(self) -> list[dict[str, Any]]:
        """What this daemon would lend now; nothing without NIXL (it would refuse every
        lend, and its peers would count the refusals as failed fills)."""
        out: list[dict[str, Any]] = []
        if not self._nixl_ok():
            return out
        room = wire.MAX_INVENTORY_FRAME - 64  # the frame's header and the reply's own keys
        for name, m in self.registry.models.items():
            if lendable(name, m, self.core, self.backends):
                assert m.resident.checkpoint is not None
                row = {"fingerprint": m.resident.checkpoint.fingerprint, "layout": m.resident.checkpoint.layout,
                       "nbytes": m.resident.checkpoint.data_bytes, "tier": tier(m.device), "device": m.device}
                room -= len(encode_frame(row))
                if room < 0:  # what a peer's inventory frame holds (wire.py); the rest is not offered
                    break
                out.append(row)
        return out

    def _find(self, fingerprint: str, layout: str) -> str | None:
        for name, m in self.registry.models.items():
            if (lendable(name, m, self.core, self.backends) and m.resident.checkpoint is not None and m.resident.checkpoint.fingerprint == fingerprint
                    and m.resident.checkpoint.layout == layout):
                return name
        return None

    # -- one peer connection ------------------------------------------------------------
    def _refuse(self, host: str) -> None:
        self.refused += 1
        self.events.log(logging.WARNING, "peer refused", host, "peer port: refused a connection from %s, which is "
                        "not a configured peer", host, extra={"peer": host})

    def _cut(self, host: str) -> None:
        self.cut_off += 1
        self.events.log(logging.WARNING, "peer cut off", host, "peer port: closed a connection from %s unread: it "
                        "failed the handshake or broke the protocol %d times in %.0f s", host, STRIKES,
                        STRIKE_WINDOW_S, extra={"peer": host})

    def refuse_at_once(self, host: str) -> bool:
        """Whether a connection from ``host`` is closed as it is accepted, before a stream or
        a task is made for it: an address cut off for its strikes, or one the directory
        knows is not a peer (``known``). A flood of those costs an accept and a close."""
        if self._struck_out(host):
            self._cut(host)
            return True
        if self._known is not None and self._known(host) is False:
            self._refuse(host)
            return True
        return False

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if peer else "?"
        counted = False
        try:
            if not await self._allowed(host):
                self._refuse(host)
                return
            if self._struck_out(host):
                self._cut(host)
                return
            if self._open.get(host, 0) >= CONNECTIONS_PER_ADDRESS or sum(self._open.values()) >= CONNECTIONS:
                self.over_limit += 1
                self.events.log(logging.WARNING, "peer over limit", host, "peer port: closed a connection from %s: it has "
                                "%d open (at most %d per address, %d in all)", host, self._open.get(host, 0),
                                CONNECTIONS_PER_ADDRESS, CONNECTIONS, extra={"peer": host})
                return
            self._open[host] = self._open.get(host, 0) + 1
            counted = True
            try:
                await challenge(reader, writer, self.secret)
            except NotAuthenticated as exc:
                self.unauthenticated += 1
                if exc.strike:
                    self._strike(host)
                self.events.log(logging.WARNING, "peer not authenticated", host, "peer port: closed a connection from %s: %s",
                                host, exc, extra={"peer": host})
                return
            await self._serve(reader, writer, host)
        except (wire.PeerError, OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            self.events.log(logging.INFO, "peer connection ended", host, "peer %s: connection ended: %s", host, exc,
                            extra={"peer": host})
        except Exception as exc:  # a malformed request (a frame over the limit) must not end the daemon's port
            self._strike(host)
            self.events.log(logging.WARNING, "peer broke the protocol", host, "peer %s: %s: %s", host,
                            type(exc).__name__, exc, extra={"peer": host})
        finally:
            if counted:
                self._open[host] -= 1
                if not self._open[host]:
                    del self._open[host]
            self._conns.discard(task)
            writer.close()
            # Bounded: a peer that stopped reading would keep unsent replies (and this
            # task, and its fd) here for good, no longer counted or cancelled as a lend.
            try:
                await asyncio.wait_for(writer.wait_closed(), CLOSE_WAIT_S)
            except Exception:
                writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        hello = await asyncio.wait_for(wire.recv(reader), HELLO_TIMEOUT_S)
        if hello is None:
            return
        if hello.get("op") != "hello" or hello.get("protocol") != wire.PROTOCOL:
            await wire.send(writer, wire.reply_error("PROTOCOL_VERSION", f"this daemon speaks peer protocol {wire.PROTOCOL}"))
            return
        await wire.send(writer, {"ok": True, "protocol": wire.PROTOCOL, "daemon": self.daemon_id})
        conn = -(1_000_000 + next(self._conn_ids))  # the lender's own lease holder (Note [what a lend holds])
        while True:
            req = await asyncio.wait_for(wire.recv(reader), IDLE_TIMEOUT_S)
            if req is None:
                return
            op = req.get("op")
            if op == "inventory":
                await wire.send(writer, {"ok": True, "models": self.inventory() if self.serve else []})
            elif op == "lend":
                await self._lend(req, reader, writer, host, conn)
                return  # one lend per connection: its end is the lease's end
            else:
                await wire.send(writer, wire.reply_error("UNKNOWN_OP", f"unknown peer op {str(op)[:64]!r}"))

    async def _lend(self, req: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                    conn: int) -> None:
        fingerprint, layout = req.get("fingerprint"), req.get("layout")
        transport = self._transport()
        if not isinstance(fingerprint, str) or not isinstance(layout, str):
            await wire.send(writer, wire.reply_error("BAD_REQUEST", "lend needs a fingerprint and a layout (strings)"))
            return
        name = self._find(fingerprint, layout) if self.serve else None
        if name is None or not self._nixl_ok():
            await wire.send(writer, wire.reply_error("UNKNOWN_MODEL", "no lendable resident model has that fingerprint and layout"))
            return
        if self._by_peer.get(host, 0) >= LENDS_PER_PEER:
            await wire.send(writer, wire.reply_error("BUSY", f"this peer holds {LENDS_PER_PEER} lends already"))
            return
        now = time.monotonic()
        window = LEND_WINDOW_TIMEOUTS * self.timeout_s
        times = self._lent_at.get((host, fingerprint), deque())
        while times and now - times[0] > window:
            times.popleft()
        if len(times) >= LENDS_PER_MODEL:
            await wire.send(writer, wire.reply_error("BUSY", f"this peer was lent this model {LENDS_PER_MODEL} times in the "
                                                             f"last {window:.0f} s; load it from the files"))
            return
        for key in [k for k, v in self._lent_at.items() if not v or now - v[-1] > window]:
            del self._lent_at[key]
        model = self.registry.models[name]
        backend = self.backends[model.device]
        if backend.dma_through_ring and self.rings_now >= GPU_LENDS:
            await wire.send(writer, wire.reply_error("BUSY", f"this daemon lends from its GPUs to {GPU_LENDS} fills already"))
            return
        arena = model.resident.arena
        assert arena is not None
        lease = self.core.attach(name, conn)
        self.lent_now += 1
        ring = backend.dma_through_ring
        self.rings_now += ring
        self._by_peer[host] = self._by_peer.get(host, 0) + 1
        task = asyncio.current_task()
        assert task is not None
        lending = self._lending[conn] = Lending(name, host, task, time.monotonic(), fingerprint)
        t0 = time.monotonic()
        try:
            if backend.dma_through_ring:
                assert transport is not None  # Peers starts its own agent where a backend lends through a ring
                await self._lend_ring(backend, arena, transport, reader, writer, lending, t0)
            else:
                await self._lend_files(backend, arena, reader, writer, lending, t0)
        finally:
            self._lending.pop(conn, None)
            self.core.detach(lease.id, conn)
            self.lent_now -= 1
            self.rings_now -= ring
            self._by_peer[host] -= 1
            if not self._by_peer[host]:
                del self._by_peer[host]
            log.info("lend of %s to peer %s ended after %.2fs%s", name, host, time.monotonic() - t0,
                     f" ({lending.stages.n} stages, {lending.stages.seconds * 1e3:.1f} ms from request to reply)"
                     if lending.stages.n else "", extra={"model": name, "peer": host})
            self._notify_space()

    def _lent(self, lending: Lending) -> None:
        """A lend was made (counted in its window only then: a refused one pins nothing)."""
        self.lends += 1
        self._lent_at.setdefault((lending.host, lending.fingerprint), deque()).append(time.monotonic())
        model = self.registry.models.get(lending.name)
        ckpt = model.resident.checkpoint if model is not None else None
        log.info("lending %s (%d bytes) to peer %s", lending.name, ckpt.data_bytes if ckpt else 0, lending.host,
                 extra={"model": lending.name, "peer": lending.host})

    async def _lend_files(self, backend: Backend, arena: Arena, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter, lending: Lending, t0: float) -> None:
        """A host lend, through the lend worker (lend_worker.py, Note [a lend exposes only
        what is lent]): the daemon's own memory is never registered with NIXL."""
        files = backend.dma_files(arena)
        if files is None:
            await wire.send(writer, wire.reply_error("UNSUPPORTED", "this arena cannot be lent"))
            return
        lend_id: int | None = None
        try:
            try:
                lend_id, metadata, regions = await asyncio.to_thread(self.worker.lend, LentFiles(*files))
            except WorkerGone as exc:
                await wire.send(writer, wire.reply_error("BUSY", f"cannot lend now: {exc}"))
                return
            lending.worker = True
            await wire.send(writer, {"ok": True, "metadata": metadata, "memory": "DRAM", "device_id": 0,
                                     "regions": [list(r) for r in regions]})
            self._lent(lending)
            with contextlib.suppress(TimeoutError):  # until done, EOF, or the timeout (Note [what a lend holds])
                await serve_lend(reader, writer, None, t0 + self.timeout_s, lending.stages)
        finally:
            if lend_id is not None:  # unmapped in the worker before the lease ends
                with contextlib.suppress(WorkerGone):
                    await asyncio.shield(asyncio.to_thread(self.worker.end, lend_id))

    async def _lend_ring(self, backend: Backend, arena: Arena, transport: Transport, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter, lending: Lending, t0: float) -> None:
        """A GPU lend: the arena is copied into a ring of device memory piece by piece
        (cuda_staging.py), registered with this daemon's own NIXL agent."""
        view = reg = pump = None
        pumping = threading.Event()
        try:
            try:
                view = await asyncio.to_thread(backend.dma_source, arena, RING_SLOTS, self.slot_bytes)
            except WeightcacheError as exc:  # the ring's device memory refused (cuda_staging.py)
                await wire.send(writer, wire.reply_error("BUSY", f"cannot lend now: {exc.message}"))
                return
            if view is None or view.staged is None:
                await wire.send(writer, wire.reply_error("UNSUPPORTED", f"the {arena.device} backend cannot lend its arenas"))
                return
            staged = view.staged
            reg = await asyncio.to_thread(within, view.context, transport.register,
                                          [(staged.addr, staged.slots * staged.slot_bytes)], view.memory, view.device_id)
            metadata = await asyncio.to_thread(transport.metadata)
            pump = asyncio.ensure_future(asyncio.to_thread(transport.progress, pumping))
            await wire.send(writer, {"ok": True, "metadata": metadata, "memory": view.memory, "device_id": view.device_id,
                                     "regions": [], "staged": {"addr": staged.addr, "slots": staged.slots,
                                                               "slot_bytes": staged.slot_bytes}})
            self._lent(lending)
            with contextlib.suppress(TimeoutError):  # until done, EOF, or the timeout (Note [what a lend holds])
                await serve_lend(reader, writer, staged, t0 + self.timeout_s, lending.stages)
        finally:
            # Deregistered before the view goes, the view before the lease: see the Note.
            pumping.set()
            if pump is not None:
                await asyncio.shield(pump)
            if reg is not None:
                assert view is not None
                await asyncio.shield(asyncio.to_thread(within, view.context, transport.deregister, reg))
            if view is not None:  # a GPU's ring is freed (cuMemFree may wait for the device): off the loop
                await asyncio.shield(asyncio.to_thread(view.release))

    def _worker_gone(self, why: str) -> None:
        """The lend worker died (a write into a lent range faults there): its lends are over."""
        for ln in list(self._lending.values()):
            if ln.worker and not ln.task.done():
                ln.task.cancel()


class _PeerProtocol(asyncio.StreamReaderProtocol):
    """asyncio.start_server's protocol, but a connection the lender refuses at once
    (``Lender.refuse_at_once``) is aborted before its stream and task are made."""

    def __init__(self, lender: Lender, reader: asyncio.StreamReader, cb: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(reader, cb, loop=loop)
        self._lender = lender

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        if self._lender.refuse_at_once(str(peer[0]) if peer else "?"):
            if isinstance(transport, asyncio.Transport):
                transport.abort()
            else:
                transport.close()
            return
        super().connection_made(transport)


@dataclass
class StageCount:
    """A staged lend's stages: how many, and their seconds from request to reply."""

    n: int = 0
    seconds: float = 0.0
    lending: Lending | None = None  # whose ``active`` each stage request renews


async def serve_lend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, staged: StagedRing | None,
                     deadline: float, count: StageCount | None = None) -> None:
    """A lend's requests until ``done``, the connection's end, or ``deadline``
    (TimeoutError): a staged lend's ``stage`` requests (wire.py), each handed to the ring
    as it arrives and answered in order as its copy completes (cuda_staging.py's Note
    [stages pipelined]). A malformed request, or one outside the arena or the ring, is
    answered BAD_REQUEST after the answers before it, and ends the lend; so does a copy
    that failed. The deadline holds for the replies too: a borrower that asks and never
    reads cannot hold the lend past it."""
    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
        await _serve_lend(reader, writer, staged, count)


@dataclass
class _Stage:
    """A stage request handed to the ring: answered once ``copied`` says how it went."""

    seq: int
    asked: float  # time.monotonic() when it arrived
    copied: asyncio.Future[str | None]  # None: the bytes are in the slot; else why not


async def _serve_lend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, staged: StagedRing | None,
                      count: StageCount | None) -> None:
    loop = asyncio.get_running_loop()
    answers: asyncio.Queue[_Stage | dict[str, Any] | None] = asyncio.Queue()
    # Stages asked and not answered yet: at most as many as the ring has slots (a fill
    # asks for a slot's next chunk only once it read the last), so that a borrower that
    # asks without end cannot queue copies without end.
    unanswered = [0]
    sender = asyncio.ensure_future(_answer_in_order(writer, answers, count, unanswered))
    request: asyncio.Future[dict[str, Any] | None] | None = None
    try:
        while True:
            request = asyncio.ensure_future(wire.recv(reader))
            await asyncio.wait((request, sender), return_when=asyncio.FIRST_COMPLETED)
            if not request.done():  # the sender ended the lend: a copy failed (answered so), or a reply's write did
                request.cancel()
                sender.result()  # raises what ended it, if anything did
                return
            msg = request.result()
            if msg is None:  # the borrower went away: nothing more to answer
                return
            if count is not None and count.lending is not None:
                count.lending.active = time.monotonic()
            answer = _take(msg, staged, loop, unanswered[0])
            if isinstance(answer, _Stage):
                unanswered[0] += 1
            answers.put_nowait(answer)
            if not isinstance(answer, _Stage):  # done's ok, or a refusal: the lend's last answer
                answers.put_nowait(None)
                await sender
                return
    finally:  # neither task outlives the lend (a pending recv would take the borrower's next frame)
        pending = [t for t in (sender, request) if t is not None]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _take(msg: dict[str, Any], staged: StagedRing | None, loop: asyncio.AbstractEventLoop,
          unanswered: int) -> _Stage | dict[str, Any]:
    """One request of a lend -> a stage handed to the ring, or the lend's last answer."""
    op = msg.get("op")
    if op == "done":
        return {"ok": True}
    if op != "stage" or staged is None:
        return wire.reply_error("BAD_REQUEST", f"a lend takes {'stage or ' if staged else ''}done, not {str(op)[:64]!r}")
    seq, slot, offset, nbytes = (msg.get(k) for k in ("seq", "slot", "offset", "nbytes"))
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (seq, slot, offset, nbytes)):
        return wire.reply_error("BAD_REQUEST", "stage needs integers seq, slot, offset and nbytes")
    assert isinstance(seq, int) and isinstance(slot, int) and isinstance(offset, int) and isinstance(nbytes, int)
    why = check_stage(staged, slot, offset, nbytes)
    if why is None and unanswered >= staged.slots:
        why = f"more than {staged.slots} stages asked before their replies (the ring's slots)"
    if why is not None:
        return wire.reply_error("BAD_REQUEST", f"stage: {why}")
    stage = _Stage(seq, time.monotonic(), loop.create_future())

    def copied(why: str | None) -> None:  # the ring's thread
        with contextlib.suppress(RuntimeError):  # the loop closed under a lend ended at shutdown
            loop.call_soon_threadsafe(_settle, stage.copied, why)

    staged.stage(slot, offset, nbytes, copied)
    return stage


def _settle(copied: asyncio.Future[str | None], why: str | None) -> None:
    if not copied.done():
        copied.set_result(why)


async def _answer_in_order(writer: asyncio.StreamWriter, answers: asyncio.Queue[_Stage | dict[str, Any] | None],
                           count: StageCount | None, unanswered: list[int]) -> None:
    """Each stage's reply once its copy is done, in the order asked; then the lend's last
    answer (None in the queue ends it with none). A failed copy is answered BAD_REQUEST
    and ends the lend."""
    while (answer := await answers.get()) is not None:
        if not isinstance(answer, _Stage):
            with contextlib.suppress(OSError):  # the lend ends either way
                await wire.send(writer, answer)
            return
        why = await answer.copied
        unanswered[0] -= 1  # before the reply goes: the borrower may ask for that slot again once it has it
        if why is not None:
            with contextlib.suppress(OSError):
                await wire.send(writer, wire.reply_error("BAD_REQUEST", f"stage: {why}"))
            return
        await wire.send(writer, {"ok": True, "seq": answer.seq})
        if count is not None:
            count.n += 1
            count.seconds += time.monotonic() - answer.asked


def check_stage(ring: StagedRing, slot: int, offset: int, nbytes: int) -> str | None:
    """Why a peer's ``stage`` request is refused (outside the ring or the arena), or None."""
    if not 0 <= slot < ring.slots:
        return f"slot {slot} is not one of this lend's {ring.slots}"
    if not 0 < nbytes <= ring.slot_bytes:
        return f"{nbytes} bytes do not fit one slot ({ring.slot_bytes})"
    if not 0 <= offset <= ring.arena_bytes - nbytes:
        return f"bytes {offset}..{offset + nbytes} are not within the arena ({ring.arena_bytes})"
    return None


def within(context: Callable[[], AbstractContextManager[None]], fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with ``context`` entered (a GPU's context current, for NIXL's calls on its memory)."""
    with context():
        return fn(*args)


def same_host(a: str, b: str) -> bool:
    """Whether two textual IP addresses are the same address (an IPv4 peer may connect as
    ::ffff:a.b.c.d on a dual-stack socket)."""
    try:
        x, y = ipaddress.ip_address(a), ipaddress.ip_address(b)
    except ValueError:
        return a == b
    unmap = lambda ip: ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip  # noqa: E731
    return unmap(x) == unmap(y)
