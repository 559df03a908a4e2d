"""The peers' pure parts (weightcache/peers/), without NIXL: the config section, peer or
files by measured rates, how a lender's regions map onto this daemon's arena, what a peer's answers may hold, who may
connect, and the Kubernetes example's peer discovery."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from weightcache.config import PeersConfig, Settings, load_settings
from weightcache.loader import fingerprint_files, open_source, parse_checkpoint
from weightcache.peers import known_fingerprint
from weightcache.peers.choice import backoff_s, choose, files_default, files_warm, smoothed
from weightcache.peers.directory import Directory, _parse_offers
from weightcache.peers.fill import Lent, extents_for
from weightcache.peers.server import same_host
from weightcache.peers.transport import Extent, TransferFailed, Transport
from weightcache.peers.wire import PeerError
from weightcache.tools.synth import write_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def test_peers_config_parses_and_refuses_what_is_not_host_port() -> None:
    p = PeersConfig(listen="0.0.0.0:7470", addresses=["10.0.0.2:7470"], dns="peers.svc:7470", timeout_s="2m",
                    max_fill_bytes_per_s="1GiB", fingerprints={"m": "ab"}, secret_file="/run/secrets/peers")
    assert p.timeout_s == 120 and p.max_fill_bytes_per_s == 2**30 and p.addresses == ("10.0.0.2:7470",)
    assert p.prefer == "faster" and PeersConfig(prefer="peers").prefer == "peers"
    assert PeersConfig().slot_bytes == 64 * 2**20 and PeersConfig(gpu_ring_bytes="2GiB").slot_bytes == 256 * 2**20
    assert PeersConfig(gpu_ring_bytes="100MiB").slot_bytes == 12 * 2**20  # whole 2 MiB
    for bad in ({"listen": "7470"}, {"addresses": ["host"]}, {"dns": "svc:http"}, {"refresh_s": 0}, {"nope": 1},
                {"prefer": "fastest"}, {"gpu_ring_bytes": "8MiB"}, {"gpu_ring_bytes": "16GiB"},
                {"listen": "127.0.0.1:7470"},  # peers on, no secret: refused (peers/auth.py)
                {"secret_file": "/k", "insecure_no_secret": True}):
        with pytest.raises(ValidationError):
            PeersConfig(**bad)
    assert Settings().peers.listen is None  # off unless configured


def test_lender_regions_map_onto_the_arena() -> None:
    # A file arena's regions: runs at arena offsets 0 and 4096 (padding between), elsewhere in memory.
    regions = ((0, 10_000, 1000), (4096, 50_000, 3000))
    assert extents_for(0, 1000, 1 << 20, regions) == [Extent((1 << 20), 10_000, 1000)]
    assert extents_for(4096, 3000, 1 << 20, regions) == [Extent((1 << 20) + 4096, 50_000, 3000)]
    assert extents_for(4196, 100, 0, regions) == [Extent(4196, 50_100, 100)]
    one = ((0, 7, 100),)
    assert extents_for(10, 50, 1000, one) == [Extent(1010, 17, 50)]
    with pytest.raises(ValueError, match="do not cover"):
        extents_for(900, 200, 0, regions)  # past the first run, not in the second
    with pytest.raises(ValueError, match="do not cover"):
        extents_for(0, 8000, 0, regions)


def test_a_malformed_lend_reply_is_refused() -> None:
    good = {"metadata": b"md", "memory": "DRAM", "device_id": 0, "regions": [[4096, 2, 3], [0, 1, 2]]}
    assert Lent.parse(good).regions == ((0, 1, 2), (4096, 2, 3))  # sorted by arena offset
    for bad in ({**good, "memory": "DISK"}, {**good, "metadata": "md"}, {**good, "regions": [[0, -1, 2]]},
                {**good, "regions": [[0, 1]]}, {**good, "regions": "x"}):
        with pytest.raises(ValueError):
            Lent.parse(bad)


def test_a_peers_inventory_keeps_only_well_formed_offers() -> None:
    ok = {"fingerprint": "f", "layout": "l", "nbytes": 5, "tier": "host", "device": "cpu"}
    got = _parse_offers([ok, {**ok, "tier": "disk"}, {**ok, "nbytes": "5"}, "junk", {**ok, "fingerprint": "x" * 999}])
    assert [o.fingerprint for o in got] == ["f"]
    with pytest.raises(PeerError):
        _parse_offers({"not": "a list"})


def test_same_host_sees_through_ipv4_mapped_addresses() -> None:
    assert same_host("::ffff:10.0.0.2", "10.0.0.2") and same_host("10.0.0.2", "10.0.0.2")
    assert not same_host("10.0.0.3", "10.0.0.2")


async def test_only_configured_peers_are_allowed() -> None:
    d = Directory(PeersConfig(listen="127.0.0.1:1", insecure_no_secret=True, addresses=["127.0.0.1:7470", "localhost:7471"]), "me", None)
    assert await d.allowed("127.0.0.1")
    assert not await d.allowed("10.9.9.9")


def test_the_fingerprint_is_known_only_when_pinned_or_kept(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "k.safetensors", 2 * 2**20, 4, seed=7, mode=0o644)
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        assert known_fingerprint(PeersConfig(fingerprints={"k": "pinned"}), "k", ckpt, opened) == "pinned"
        assert known_fingerprint(PeersConfig(), "k", ckpt, opened) is None  # never read: not known
    # Read once (files only the daemon's uid or root can change keep their tensor digests,
    # by file identity): the fingerprint of these very files is known without reading them.
    fp = fingerprint_files(path)
    with open_source(path) as opened:
        assert known_fingerprint(PeersConfig(), "k", parse_checkpoint(opened), opened) == fp
    with open(path, "r+b") as f:  # rewritten in place: st_ctime moves, the kept digests no longer apply
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(last)
    with open_source(path) as opened:
        assert known_fingerprint(PeersConfig(), "k", parse_checkpoint(opened), opened) is None


def test_the_daemonset_discovers_peers_through_a_headless_service() -> None:
    docs = list(yaml.safe_load_all((ROOT / "examples/kubernetes/weightcache-daemonset.yaml").read_text()))
    cm = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["weightcache.toml"]
    assert cm.strip() == (ROOT / "examples/kubernetes/weightcache.toml").read_text().strip()
    svc = next(d for d in docs if d["kind"] == "Service")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"app": "weightcache"}
    peers = load_settings(ROOT / "examples/kubernetes/weightcache.toml").peers
    assert peers.dns is not None and peers.dns.startswith(f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc")
    assert peers.dns.endswith(f":{svc['spec']['ports'][0]['port']}")


def test_a_reload_says_peers_are_read_at_start_only() -> None:
    from weightcache.server.settings_reload import settings_changes

    report: dict[str, list[str]] = {"failed": []}
    old = Settings(peers=PeersConfig(listen="127.0.0.1:7470", insecure_no_secret=True))
    settings_changes(old, old, report)
    assert report["failed"] == []
    settings_changes(old, Settings(peers=PeersConfig(listen="127.0.0.1:7471", insecure_no_secret=True)), report)
    assert report["failed"] == ["peers: changed in the file, but read at start only: restart the daemon to apply it"]


class _StuckAgent:
    """A NIXL agent whose reads complete ``completes`` times, then never again (a peer that
    hung mid-transfer: its control connection still open, its NIC or process stopped)."""

    def __init__(self, completes: int, delay_s: float = 0.0) -> None:
        self.completes = completes
        self.delay_s = delay_s  # how long after it is posted a read completes
        self.released: list[int] = []
        self.posted = 0
        self.posted_at: dict[int, float] = {}

    def add_remote_agent(self, md: bytes) -> str:
        return "peer"

    def remove_remote_agent(self, name: str) -> None:
        pass

    def register_memory(self, regions: list, memory: str) -> str:
        return "reg"

    def deregister_memory(self, handle: str) -> None:
        pass

    def get_xfer_descs(self, descs: list, memory: str) -> list:
        return descs

    def initialize_xfer(self, op: str, local: list, far: list, remote: str) -> int:
        self.posted += 1
        self.posted_at[self.posted] = time.monotonic()
        return self.posted

    def transfer(self, h: int) -> str:
        return "PROC"

    def check_xfer_state(self, h: int) -> str:
        return "DONE" if h <= self.completes and time.monotonic() - self.posted_at[h] >= self.delay_s else "PROC"

    def release_xfer_handle(self, h: int) -> None:
        self.released.append(h)


def _stuck_transport(completes: int, delay_s: float = 0.0) -> tuple[Transport, _StuckAgent]:
    t = Transport.__new__(Transport)  # no NIXL: the read loop alone, over a stand-in agent
    t.agent = _StuckAgent(completes, delay_s)  # type: ignore[assignment]
    t._reading = threading.Lock()
    return t, t.agent  # type: ignore[return-value]


def test_a_peer_that_stops_moving_bytes_fails_the_read_after_stall_s_not_timeout_s() -> None:
    t, agent = _stuck_transport(completes=3)
    done: list[int] = []
    extents = [Extent(dst=i * 4096, src=i * 4096, nbytes=4096) for i in range(8)]
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match=r"stalled: no read completed for 0\.3 s"):
        t.read(b"md", extents, "DRAM", 0, "DRAM", 0, window=4, on_done=lambda dst, n: done.append(dst),
               stop=lambda: None, deadline=t0 + 60, stall_s=0.3)
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 5, waited  # the stall bound, far from the 60 s deadline
    assert done == [0, 4096, 8192]  # what did arrive was handed on
    assert sorted(agent.released) == list(range(1, agent.posted + 1))  # nothing left in flight


def test_a_slow_but_moving_peer_is_not_a_stall() -> None:
    """Reads that keep completing, each within stall_s of being posted, run to the end
    however long the whole takes; this side's own waits before posting (``pace``: pages
    reserved, a rate cap) do not count as the peer's stall."""
    t, _ = _stuck_transport(completes=10**9, delay_s=0.01)
    slow: list[float] = []

    def pace(n: int, dst: int) -> None:
        time.sleep(0.05)
        slow.append(time.monotonic())

    extents = [Extent(dst=i * 4096, src=i * 4096, nbytes=4096) for i in range(8)]
    done: list[int] = []
    t.read(b"md", extents, "DRAM", 0, "DRAM", 0, window=1, on_done=lambda dst, n: done.append(dst), stop=lambda: None,
           deadline=time.monotonic() + 60, stall_s=0.03, pace=pace)
    assert len(done) == 8 and slow[-1] - slow[0] > 0.3  # took 10x stall_s in all, never stalled


def test_peer_or_files_by_the_rates_measured_here() -> None:
    # A peer not measured (or not lately) is tried, whatever the files' state: one fill teaches its rate.
    assert choose(None, 2e9, warm=True).peer and choose(None, 0.9e9, warm=False).peer
    # Measured: the faster wins. The VM's loopback peer (0.83 GB/s) loses to warm files (~2 GB/s).
    slower = choose(0.83e9, 2.15e9, warm=True)
    assert not slower.peer and slower.why == "warm files 2.15 GB/s >= peer 0.83 GB/s"
    assert choose(3e9, 2.15e9, warm=True).peer
    # Files not measured in their state count at the device's default: on the VM's CPU a
    # peer at 0.83 GB/s loses to cold files too (0.90); a GPU host's disk is taken at 1.9.
    assert files_default("cpu", warm=True) == 2.15e9 and files_default("cpu", warm=False) == 0.9e9
    assert files_default("cuda:0", warm=True) == 30e9 and files_default("cuda:0", warm=False) == 1.9e9
    assert not choose(0.83e9, files_default("cpu", warm=False), warm=False).peer
    assert choose(25e9, files_default("cuda:0", warm=False), warm=False).peer  # RDMA beside a cold disk
    # Smoothed: the last few fills weigh most, one outlier does not flip a measured rate.
    assert smoothed(None, 1e9) == 1e9
    assert smoothed(1e9, 5e9) == pytest.approx(2e9)
    # A peer whose fills fail is left out for 10 s, doubling per failure in a row, at most 10 min.
    assert [backoff_s(n) for n in (0, 1, 2, 3, 8, 50)] == [0, 10, 20, 40, 600, 600]


def test_files_warm_reads_the_page_cache_state(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "m.safetensors", 8 * 2**20, 4, seed=1)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written pages must be clean before the kernel drops them
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with open_source(path) as opened:
            if files_warm(opened):
                pytest.skip("this file system keeps the file cached after DONTNEED (tmpfs?)")
            while os.read(fd, 1 << 20):
                pass  # read it all: every page cached
            assert files_warm(opened)
    finally:
        os.close(fd)


def _keyfile(path: Path, *keys: bytes, mode: int = 0o600) -> str:
    path.write_bytes(b"\n".join(keys) + b"\n")
    path.chmod(mode)
    return str(path)


def test_the_key_file_is_refused_with_a_reason(tmp_path: Path) -> None:
    from weightcache.errors import ConfigError
    from weightcache.peers.auth import read_keys

    k1, k2 = b"a" * 64, b"b" * 64
    assert read_keys(_keyfile(tmp_path / "ok", k1, k2)) == (k1, k2)
    assert read_keys(_keyfile(tmp_path / "group", k1, mode=0o640)) == (k1,)  # a group may read (fsGroup)
    for name, keys, mode, why in (("others", (k1,), 0o604, "mode 0604"), ("gw", (k1,), 0o620, "mode 0620"),
                                  ("short", (b"x" * 31,), 0o600, "shorter than 32"), ("empty", (b"",), 0o600, "no key"),
                                  ("many", (k1,) * 5, 0o600, "holds 5 keys")):
        with pytest.raises(ConfigError, match=why):
            read_keys(_keyfile(tmp_path / name, *keys, mode=mode))
    with pytest.raises(ConfigError, match="cannot be opened"):
        read_keys(str(tmp_path / "missing"))
    if os.geteuid() == 0:
        p = _keyfile(tmp_path / "theirs", k1)
        os.chown(p, 65534, -1)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            read_keys(p)


async def _handshake(asker: tuple[bytes, ...], lender: tuple[bytes, ...], tmp_path: Path) -> str:
    """Both halves over loopback: "ok", or which side refused."""
    from weightcache.peers.auth import NotAuthenticated, Secret, challenge, prove

    a = Secret(_keyfile(tmp_path / "asker", *asker))
    b = Secret(_keyfile(tmp_path / "lender", *lender))
    got: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await challenge(reader, writer, b)
            got.append("ok")
        except NotAuthenticated:
            got.append("lender refused")
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.sockets[0].getsockname()[1])
    try:
        await prove(reader, writer, a)
        mine = "ok"
    except NotAuthenticated:
        mine = "asker refused"
    writer.close()
    srv.close()
    await srv.wait_closed()
    if got and got[0] != "ok":
        return got[0]
    return mine


async def test_a_rotation_keeps_every_pair_of_daemons_talking(tmp_path: Path) -> None:
    """The three steps of docs/deployment.md, "The shared key": at every step, daemons on
    either side of it accept each other; a daemon with the old key alone and one with the
    new key alone do not."""
    old, new = b"o" * 64, b"n" * 64
    steps = [(old,), (old, new), (new, old), (new,)]
    for before, after in itertools.pairwise(steps):
        assert await _handshake(before, after, tmp_path) == "ok", (before, after)
        assert await _handshake(after, before, tmp_path) == "ok", (after, before)
    assert await _handshake((old,), (new,), tmp_path) == "lender refused"
    assert await _handshake((new,), (new, old), tmp_path) == "ok"
