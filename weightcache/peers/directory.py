"""Who the peers are and what each holds: the configured addresses (and those the DNS
name resolves to, a Kubernetes headless Service), each asked ``inventory`` every
``refresh_s``. What a peer says it holds only chooses where a fill is tried: the bytes
are checked against this daemon's own fingerprint before they are served (fill.py), and
nothing a peer says reaches the access rules of this daemon's models."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import PeersConfig
from ..errors import WeightcacheError
from . import wire
from .auth import NotAuthenticated, Secret, prove
from .server import same_host

log = logging.getLogger("weightcache.peers")

CONNECT_TIMEOUT_S = 5.0
MAX_REFRESH_BACKOFF_S = 300.0  # a peer that keeps failing is asked at most this seldom
MAX_MODELS = 4096  # a peer's inventory is cut here: a broken peer cannot make this daemon hold unbounded lists


@dataclass(frozen=True)
class Offer:
    """A model a peer said it holds."""

    fingerprint: str
    layout: str
    nbytes: int
    tier: str  # "gpu" or "host"
    device: str


@dataclass
class PeerState:
    address: str  # host:port as resolved (an IP)
    daemon: str | None = None  # its id, from hello
    offers: list[Offer] = field(default_factory=list)
    last_seen: float | None = None  # monotonic time of its last good answer
    error: str | None = None  # why its last inventory failed
    failed_fills: int = 0
    fills: int = 0
    fill_rate: float | None = None  # bytes/s of this daemon's fills from it, smoothed (choice.py)
    measured_at: float = 0.0  # monotonic time of the last fill that measured it
    failed_in_a_row: int = 0  # fills from it that failed since its last good one
    retry_at: float = 0.0  # monotonic time before which it is not asked to fill (choice.backoff_s)
    failed_asks: int = 0  # inventories that failed in a row
    ask_at: float = 0.0  # monotonic time before which it is not asked its inventory again (refresh_backoff_s)

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "daemon": self.daemon, "reachable": self.error is None and self.last_seen is not None,
                "seen_s_ago": None if self.last_seen is None else round(time.monotonic() - self.last_seen, 3),
                "error": self.error, "fills": self.fills, "failed_fills": self.failed_fills,
                "fill_bytes_per_s": None if self.fill_rate is None else round(self.fill_rate),
                "retry_in_s": round(max(0.0, self.retry_at - time.monotonic()), 3),
                "models": [{"fingerprint": o.fingerprint, "layout": o.layout, "nbytes": o.nbytes, "tier": o.tier,
                            "device": o.device} for o in self.offers]}


def refresh_backoff_s(refresh_s: float, failed: int) -> float:
    """How long after its last failed inventory a peer is asked again: refresh_s, doubled
    for each failure in a row after the first, up to MAX_REFRESH_BACKOFF_S."""
    return min(refresh_s * 2 ** max(0, failed - 1), max(refresh_s, MAX_REFRESH_BACKOFF_S))


async def connect(address: str, daemon_id: str, secret: Secret | None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """A control connection to the peer at ``address``, past the handshake (auth.py) and
    hello; returns its daemon id."""
    host, port = wire.split_host_port(address)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=wire.MAX_INVENTORY_FRAME),
                                            CONNECT_TIMEOUT_S)
    try:
        try:
            await prove(reader, writer, secret)
        except NotAuthenticated as exc:
            raise wire.PeerError(f"not authenticated: {exc}", code="NOT_AUTHENTICATED") from None
        await wire.send(writer, {"op": "hello", "protocol": wire.PROTOCOL, "daemon": daemon_id})
        reply = wire.check_reply(await asyncio.wait_for(wire.recv(reader), CONNECT_TIMEOUT_S), "hello")
        peer_id = reply.get("daemon")
        if not isinstance(peer_id, str):
            raise wire.PeerError("hello: the peer did not say who it is")
        return reader, writer, peer_id
    except BaseException:
        writer.close()
        raise


def _parse_offers(models: Any) -> list[Offer]:
    if not isinstance(models, list):
        raise wire.PeerError("inventory: models is not a list")
    out = []
    for m in models[:MAX_MODELS]:
        if not isinstance(m, dict):
            continue
        fp, layout, nbytes, tier, device = (m.get(k) for k in ("fingerprint", "layout", "nbytes", "tier", "device"))
        if (isinstance(fp, str) and isinstance(layout, str) and isinstance(nbytes, int) and tier in ("gpu", "host")
                and isinstance(device, str) and len(fp) <= 256 and len(layout) <= 256):
            out.append(Offer(fp, layout, nbytes, str(tier), device[:64]))
    return out


class Directory:
    def __init__(self, settings: PeersConfig, daemon_id: str, secret: Secret | None) -> None:
        self.settings = settings
        self.daemon_id = daemon_id
        self.secret = secret
        self.peers: dict[str, PeerState] = {}  # resolved address -> state
        self._hosts: set[str] = set()  # IPs of the configured peers, as last resolved
        self._resolved_at = 0.0
        self._resolving = asyncio.Lock()
        self.changed = asyncio.Event()  # set after each refresh (tests wait on it)

    async def resolve(self) -> list[str]:
        """The configured peers as host:port with an IP each (DNS names resolved now)."""
        names = list(self.settings.addresses) + ([self.settings.dns] if self.settings.dns else [])
        loop = asyncio.get_running_loop()
        out: list[str] = []
        for name in names:
            host, port = wire.split_host_port(name)
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("peers: cannot resolve %s: %s", name, exc)
                continue
            for family, _, _, _, sockaddr in infos:
                ip = str(sockaddr[0])
                addr = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
                if addr not in out:
                    out.append(addr)
        async with self._resolving:
            self._hosts = {wire.split_host_port(a)[0] for a in out}
            self._resolved_at = time.monotonic()
        return out

    def known(self, host: str) -> bool | None:
        """Whether ``host`` is a configured peer, as far as the last resolution (under a
        second old for a no) tells without resolving again; None: ask ``allowed``."""
        if any(same_host(host, h) for h in self._hosts):
            return True
        return False if time.monotonic() - self._resolved_at < 1.0 else None

    async def allowed(self, host: str) -> bool:
        """Whether a connection from ``host`` comes from a configured peer (resolved again,
        at most once a second, when it is not among the last answer: a pod just started)."""
        if any(same_host(host, h) for h in self._hosts):
            return True
        if time.monotonic() - self._resolved_at >= 1.0:
            await self.resolve()
        return any(same_host(host, h) for h in self._hosts)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(self.settings.refresh_s)

    async def refresh(self) -> None:
        addresses = await self.resolve()
        for gone in set(self.peers) - set(addresses):
            del self.peers[gone]
        now = time.monotonic()
        await asyncio.gather(*(self._ask(a) for a in addresses if a not in self.peers or self.peers[a].ask_at <= now))
        self.changed.set()

    async def _ask(self, address: str) -> None:
        state = self.peers.setdefault(address, PeerState(address))
        try:
            reader, writer, peer_id = await connect(address, self.daemon_id, self.secret)
            try:
                if peer_id == self.daemon_id:  # this daemon itself (the Service resolves to every pod)
                    self.peers.pop(address, None)
                    return
                await wire.send(writer, {"op": "inventory"})
                got = await asyncio.wait_for(wire.recv(reader, wire.MAX_INVENTORY_FRAME), CONNECT_TIMEOUT_S)
                reply = wire.check_reply(got, "inventory")
                state.daemon, state.offers = peer_id, _parse_offers(reply.get("models"))
                state.last_seen, state.error = time.monotonic(), None
                state.failed_asks, state.ask_at = 0, 0.0
            finally:
                writer.close()
        except (OSError, wire.PeerError, TimeoutError, asyncio.IncompleteReadError, WeightcacheError) as exc:
            why = str(exc) or type(exc).__name__
            if state.error != why:  # once per reason, not once per refresh
                log.warning("peer %s: cannot ask what it holds: %s", address, why, extra={"peer": address})
            state.error = why
            state.offers = []
            state.failed_asks += 1
            state.ask_at = time.monotonic() + refresh_backoff_s(self.settings.refresh_s, state.failed_asks)

    def offers(self, fingerprint: str, layout: str) -> list[tuple[PeerState, Offer]]:
        """Peers that said they hold this content, best first: GPU before host memory (a
        GPU-to-GPU read is the fastest path where both ends have one), then the fewest
        failed fills."""
        found = [(p, o) for p in self.peers.values() if p.error is None
                 for o in p.offers if o.fingerprint == fingerprint and o.layout == layout]
        return sorted(found, key=lambda po: (po[1].tier != "gpu", po[0].failed_fills))
