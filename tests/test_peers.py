"""Two daemons on loopback: a model resident in one is loaded by the other
from the first's memory over NIXL, bit-exact and with the same fingerprint; when the
lender dies mid-transfer the load finishes from the files and nothing leaks; bytes that
do not match the fingerprint are never served. Skipped where NIXL cannot start."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import re
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import eventually
from helpers import NOBODY, as_uid, root_only

from weightcache import Client
from weightcache.loader import fingerprint_files
from weightcache.peers.confine import can_seal
from weightcache.peers.lend_worker import FillWorker
from weightcache.peers.transport import unavailable
from weightcache.tools.bench_measure import memfd_bytes
from weightcache.tools.spawn import DaemonProcess, config_text, free_port
from weightcache.tools.synth import write_checkpoint

MIB = 2**20
WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"NIXL cannot start here (pip install 'weightcache[peers]'): {WHY}")



class Pair:
    """Two daemon processes that are each other's peers."""

    def __init__(self, tmp: Path, sockdir: str) -> None:
        self.tmp, self.sockdir = tmp, sockdir
        self.ports = [free_port(), free_port()]
        self.procs: list[DaemonProcess] = []
        self.secret = write_secret(tmp / "peer-secret")

    def start(self, i: int, models: dict[str, Path], peers: dict[str, Any] | None = None,
              budget: str = "1GiB", device: str = "cpu") -> DaemonProcess:
        sock = os.path.join(self.sockdir, f"p{i}.sock")
        cfg = self.tmp / f"peer{i}.toml"
        text = config_text(sock, {device: budget}, [{"name": n, "path": str(p), "device": device} for n, p in models.items()],
                           {"log_level": "debug", "shutdown_grace_s": 2})
        other = self.ports[1 - i]
        lines = ["", "[peers]", f'listen = "127.0.0.1:{self.ports[i]}"', f'addresses = ["127.0.0.1:{other}"]', "refresh_s = 0.3",
                 f'secret_file = "{self.secret}"']
        for k, v in (peers or {}).items():
            lines.append(f"{k} = {v}")
        cfg.write_text(text + "\n".join(lines) + "\n")
        d = DaemonProcess(cfg, sock, self.tmp / f"peer{i}.log").start()
        self.procs.append(d)
        return d

    def log(self, i: int) -> str:
        return (self.tmp / f"peer{i}.log").read_text(errors="replace")


def write_secret(path: Path, *keys: bytes) -> Path:
    """A key file as the daemon accepts it (peers/auth.py): owned by this uid, mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(b"\n".join(keys or (os.urandom(32).hex().encode(),)) + b"\n")
    return path


@contextlib.contextmanager
def daemon_pair(tmp_path: Path) -> Iterator[Pair]:
    """Two daemons' places; each started daemon still running at the end must stop cleanly."""
    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    p = Pair(tmp_path, sockdir)
    yield p
    for d in p.procs:
        assert d.proc is not None
        if d.proc.poll() is None:
            assert d.stop() == 0, f"daemon exited uncleanly:\n{d.log.read_text()[-3000:]}"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    with daemon_pair(tmp_path) as p:
        yield p


def ckpt(tmp_path: Path, nbytes: int, seed: int = 0, mode: int = 0o644) -> Path:
    return write_checkpoint(tmp_path / f"m{seed}-{nbytes}.safetensors", nbytes, 12, seed=seed, mode=mode)


async def offered(c: Client, fp: str) -> bool:
    st = await c.status()
    return any(m["fingerprint"] == fp for p in st["peers"]["peers"] for m in p["models"])


async def wait_for(check: Any, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(0.05)


def model_row(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(m for m in rows if m["name"] == name)


async def test_model_resident_in_one_daemon_is_filled_into_the_other(pair: Pair, tmp_path: Path) -> None:
    path = ckpt(tmp_path, 48 * MIB)
    fp = fingerprint_files(path)
    lender = pair.start(0, {"m": path})
    # "peers": the second fill below is read from the neighbour even where the warm files are faster.
    borrower = pair.start(1, {"m": path}, {"fingerprints": f'{{ m = "{fp}" }}', "prefer": '"peers"'})
    assert borrower.proc is not None
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        await wait_for(lambda: offered(b, fp))
        first = (await b.status())["peers"]["fill_worker"]["pid"]  # started with the daemon
        assert first not in (None, borrower.proc.pid)
        await b.load("m")
        # Both workers under their seccomp filter (confine.py, Note [a worker is confined]).
        lend_pid = (await a.status())["peers"]["lend_worker"]["pid"]
        assert lend_pid is not None
        assert "Seccomp:\t2" in Path(f"/proc/{lend_pid}/status").read_text()
        if os.geteuid() == 0:  # the limit RDMA's pinning counts against: lifted as far as the daemon could
            locked = re.search(r"Max locked memory\s+(\S+)\s+(\S+)", Path(f"/proc/{lend_pid}/limits").read_text())
            assert locked is not None and locked[1] == locked[2], locked
        row = model_row(await b.models(), "m")
        assert row["source"] == "neighbour", pair.log(1)[-3000:]
        assert row["fingerprint"] == fp
        assert model_row(await a.models(), "m")["source"] == "files"
        async with a.attach("m") as ma, b.attach("m") as mb:
            assert ma.fingerprint == mb.fingerprint == fp
            assert set(ma) == set(mb)
            for k in ma:
                assert torch.equal(ma[k].reshape(-1).view(torch.uint8), mb[k].reshape(-1).view(torch.uint8)), k
        st = await b.status()
        assert st["peers"]["fills"] == {"ok": 1}
        # Read by the fill worker, a process of its own, not by the daemon's NIXL agent
        # (lend_worker.py, Note [a fill lands in a worker]).
        worker = st["peers"]["fill_worker"]
        assert worker["fills"] == 1 and worker["retired"] == 1 and worker["deaths"] == 0, worker
        assert worker["mseal"] is can_seal(), worker  # its read-only pages sealed where the kernel can
        # CPU daemons: no NIXL agent (no UCX worker) in either daemon's own process.
        assert st["peers"]["agent"] is None and (await a.status())["peers"]["agent"] is None
        # One fill a worker: the one that read it was ended after its clean answer, and a
        # second fill at once (its worker starting, or started ahead) is read by another.
        await b.evict("m")
        await b.load("m")
        assert model_row(await b.models(), "m")["source"] == "neighbour", pair.log(1)[-3000:]

        async def next_worker_up() -> bool:
            w = (await b.status())["peers"]["fill_worker"]
            return w["fills"] == 2 and w["retired"] == 2 and w["pid"] not in (None, first) and w["deaths"] == 0

        await eventually(next_worker_up, timeout=30)
        assert "Seccomp:\t2" in Path(f"/proc/{(await b.status())['peers']['fill_worker']['pid']}/status").read_text()
        assert not Path(f"/proc/{first}").exists()

        async def lend_ended() -> bool:  # the lender's lease ends with the fill, in its worker threads: soon after
            st = await a.status()
            return st["peers"]["lending_now"] == 0 and st["leases"] == 0 and "lend of m to peer 127.0.0.1 ended" in pair.log(0)

        await eventually(lend_ended, timeout=30)


async def test_no_fill_without_a_known_fingerprint(pair: Pair, tmp_path: Path) -> None:
    """A layout alone (same headers) is never enough: the borrower must know the content
    its files have. Without a pinned fingerprint and never having loaded them, it reads its files."""
    path = ckpt(tmp_path, 4 * MIB)
    lender = pair.start(0, {"m": path})
    borrower = pair.start(1, {"m": path})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        fp = model_row(await a.models(), "m")["fingerprint"]
        await wait_for(lambda: offered(b, fp))
        await b.load("m")
        assert model_row(await b.models(), "m")["source"] == "files"
        # The operator is told why, once: the peer holds this layout, the fingerprint is unknown here.
        await b.evict("m")
        await b.load("m")
        told = [line for line in pair.log(1).splitlines() if "does not know the fingerprint of its files" in line]
        assert len(told) == 1 and "load m: peer 127.0.0.1:" in told[0], pair.log(1)[-3000:]


async def test_concurrent_misses_ask_for_one_lend_at_a_time(pair: Pair, tmp_path: Path) -> None:
    """The transport reads one fill at a time. A second miss that asked for its lend at
    once would hold it (the lender's lease, a GPU lend's ring) and run its timeout_s while
    it waited for the first's read, and a timeout there would count against a healthy
    peer: it waits before asking instead. Both are filled; the lends do not overlap."""
    m1, m2 = ckpt(tmp_path, 24 * MIB, seed=1), ckpt(tmp_path, 24 * MIB, seed=2)
    fp1, fp2 = fingerprint_files(m1), fingerprint_files(m2)
    lender = pair.start(0, {"m1": m1, "m2": m2})
    borrower = pair.start(1, {"m1": m1, "m2": m2}, {"fingerprints": f'{{ m1 = "{fp1}", m2 = "{fp2}" }}',
                                                    "max_fill_bytes_per_s": '"48MiB"', "prefer": '"peers"'})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m1")
        await a.load("m2")
        await wait_for(lambda: offered(b, fp1))
        await wait_for(lambda: offered(b, fp2))
        await asyncio.gather(b.load("m1"), b.load("m2"))
        rows = await b.models()
        assert [model_row(rows, n)["source"] for n in ("m1", "m2")] == ["neighbour", "neighbour"], pair.log(1)[-3000:]
        assert (await b.status())["peers"]["fills"] == {"ok": 2}


    def at(log: str, text: str) -> list[datetime.datetime]:  # the log lines' own timestamps (one clock: one host)
        return [datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in log.splitlines() if text in line]

    filled = sorted(at(pair.log(1), "filled from peer"))
    lent = sorted(at(pair.log(0), "INFO weightcache.peers: lending m"))
    assert len(filled) == len(lent) == 2
    # The second lend was asked for once the first fill was done (its lender may log that
    # lend's end later: its teardown runs on after the borrower's done).
    assert lent[1] >= filled[0], (lent, filled)


async def test_a_daemon_without_nixl_lists_nothing_to_its_peers(pair: Pair, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """It would refuse every lend (no transport), and its peers would count each refusal
    as a failed fill and back it off: it offers nothing instead."""
    path = ckpt(tmp_path, 4 * MIB)
    shadow = tmp_path / "no-nixl"  # empty packages in front of the real ones: no module nixl*._api
    for pkg in ("nixl", "nixl_cu12", "nixl_cu13"):
        (shadow / pkg).mkdir(parents=True)
        (shadow / pkg / "__init__.py").write_text("")
    with monkeypatch.context() as m:
        m.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")])))
        lender = pair.start(0, {"m": path})
    borrower = pair.start(1, {"m": path})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        loaded = time.monotonic()
        assert (await a.status())["peers"]["nixl"] != "ok"

        async def answered() -> bool:  # an inventory the lender sent after the load
            peers = (await b.status())["peers"]["peers"]
            return bool(peers) and peers[0]["seen_s_ago"] is not None and peers[0]["seen_s_ago"] < time.monotonic() - loaded

        await wait_for(answered)
        assert (await b.status())["peers"]["peers"][0]["models"] == []


async def test_other_bytes_under_the_same_layout_are_not_served(pair: Pair, tmp_path: Path) -> None:
    """The borrower's files hold other values in the same layout (a fine-tune of the same
    base); its pinned fingerprint is theirs. The lender's copy is not asked for (its
    fingerprint differs), and the model is loaded from the files, bytes of its own files."""
    mine = ckpt(tmp_path, 4 * MIB, seed=1)
    theirs = ckpt(tmp_path, 4 * MIB, seed=2)
    lender = pair.start(0, {"m": theirs})
    borrower = pair.start(1, {"m": mine}, {"fingerprints": f'{{ m = "{fingerprint_files(mine)}" }}'})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        await wait_for(lambda: offered(b, fingerprint_files(theirs)))
        await b.load("m")
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fingerprint_files(mine)


def owned_fds(pid: int) -> int:
    """How many fds the daemon ``pid`` holds, less the TCP sockets a dead peer left CLOSED
    inside UCX: UCX keeps the socket of an endpoint it lost (to the killed lender) past
    ``remove_remote_agent`` and worker progress, and closes it on its own schedule. Every
    other fd counts (arenas' memfds, files, pipes, sockets connected or listening)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    count = 0
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{name}")
            except FileNotFoundError:
                continue
            count += 1
            if not link.startswith("socket:"):
                continue
            fd = libc.syscall(438, pidfd, int(name), 0)  # pidfd_getfd(2): a copy of the daemon's fd
            if fd < 0:
                continue  # closed meanwhile, or not permitted: counted
            with socket.socket(fileno=fd) as sock:
                if sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM:
                    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
                    count -= state == TCP_CLOSE
    finally:
        os.close(pidfd)
    return count


TCP_CLOSE = 7  # tcpi_state of a socket whose connection ended (include/net/tcp_states.h)


async def test_lender_killed_mid_transfer_load_finishes_from_the_files(pair: Pair, tmp_path: Path) -> None:
    path = ckpt(tmp_path, 96 * MIB)
    fp = fingerprint_files(path)
    lender = pair.start(0, {"m": path})
    # Paced to ~1 s so that the kill lands while bytes move.
    borrower = pair.start(1, {"m": path}, {"fingerprints": f'{{ m = "{fp}" }}', "max_fill_bytes_per_s": '"96MiB"'})
    assert lender.proc is not None and borrower.proc is not None
    async with Client(lender.socket) as a:
        await a.load("m")
    async with Client(borrower.socket) as b:
        await wait_for(lambda: offered(b, fp))
        pid = borrower.proc.pid
        before_fds = owned_fds(pid)
        load = asyncio.ensure_future(b.load("m"))

        async def moving() -> bool:
            got = (await b.status())["loading"].get("m")
            return got is not None and 0 < got["bytes_done"] < got["bytes_total"] // 2

        await wait_for(moving)  # the precondition: the transfer had begun, and was not near its end
        os.kill(lender.proc.pid, signal.SIGKILL)
        lender.proc.wait()
        await asyncio.wait_for(load, 60)
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fp
        log = pair.log(1)
        assert "fill of m from peer" in log and "failed" in log and "loading from the files" in log, log[-3000:]
        st = await b.status()
        assert st["peers"]["fills"] == {"failed": 1}
        # Nothing leaked: no lease, the failed arena's memfd is gone (the files' arena is
        # their page cache), and once evicted the budget is back to nothing used and the fds as before.
        assert st["leases"] == 0 and st["peers"]["lending_now"] == 0
        assert row["arena"] == "file" and memfd_bytes(borrower.proc.pid) == 0
        await b.evict("m")

        async def settled() -> bool:
            s = await b.status()
            return s["devices"]["cpu"]["used"] == 0 and owned_fds(pid) <= before_fds

        await wait_for(settled, 10)
    pair.procs.remove(lender)


async def test_a_fill_worker_killed_mid_fill_leaves_the_daemon_serving_from_the_files(pair: Pair, tmp_path: Path) -> None:
    """The fill worker (lend_worker.py, Note [a fill lands in a worker]) dies mid-read: the
    load finishes from the files, the daemon counts the death, and a later fill starts a
    new worker and lands."""
    path = ckpt(tmp_path, 96 * MIB)
    fp = fingerprint_files(path)
    lender = pair.start(0, {"m": path})
    borrower = pair.start(1, {"m": path}, {"fingerprints": f'{{ m = "{fp}" }}', "max_fill_bytes_per_s": '"96MiB"',
                                           "prefer": '"peers"'})
    assert borrower.proc is not None
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        await wait_for(lambda: offered(b, fp))
        load = asyncio.ensure_future(b.load("m"))

        async def moving() -> bool:
            got = (await b.status())["loading"].get("m")
            return got is not None and 0 < got["bytes_done"] < got["bytes_total"] // 2

        await wait_for(moving)
        worker = (await b.status())["peers"]["fill_worker"]
        assert worker["pid"] not in (None, borrower.proc.pid), worker
        os.kill(worker["pid"], signal.SIGKILL)
        await asyncio.wait_for(load, 60)
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fp
        st = await b.status()
        assert st["peers"]["fills"] == {"failed": 1} and st["leases"] == 0
        assert st["peers"]["fill_worker"]["deaths"] == 1 and st["peers"]["fill_worker"]["last_death"] == "signal 9"
        assert borrower.proc.poll() is None
        await b.evict("m")

        async def filled_again() -> bool:  # a new worker (at most one start per RESTART_S), after the backoff
            p = (await b.status())["peers"]["peers"][0]
            if p["retry_in_s"] > 0:
                return False
            await b.load("m")
            if model_row(await b.models(), "m")["source"] == "neighbour":
                return True
            await b.evict("m")
            return False

        await wait_for(filled_again, 60)
        st = await b.status()
        assert st["peers"]["fill_worker"]["retired"] == 1 and st["peers"]["fill_worker"]["deaths"] == 1


async def test_a_peer_whose_bytes_do_not_match_the_fingerprint_is_not_served(pair: Pair, tmp_path: Path) -> None:
    """A broken lender: its file was rewritten in place under its page-cache arena with the
    mtime put back, so it still believes (and says) it holds the fingerprint. The borrower
    reads every piece, finds the fingerprint differs, and loads its own files instead."""
    import shutil

    theirs = ckpt(tmp_path, 8 * MIB, seed=3)
    (tmp_path / "b").mkdir()
    mine = tmp_path / "b" / theirs.name  # the same name, size and header: the same layout
    shutil.copyfile(theirs, mine)
    fp = fingerprint_files(mine)
    lender = pair.start(0, {"m": theirs})
    borrower = pair.start(1, {"m": mine}, {"fingerprints": f'{{ m = "{fp}" }}'})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        assert model_row(await a.models(), "m")["arena"] == "file"  # the lender serves the file's own pages
        st = os.stat(theirs)
        with open(theirs, "r+b") as f:  # one byte of the last tensor changed
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
        os.utime(theirs, ns=(st.st_atime_ns, st.st_mtime_ns))
        await wait_for(lambda: offered(b, fp))  # it still offers the old fingerprint
        await b.load("m")
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fp
        log = pair.log(1)
        assert "do not match this checkpoint's fingerprint" in log, log[-3000:]
        assert (await b.status())["peers"]["fills"] == {"failed": 1}
        async with b.attach("m") as mb:
            assert mb.fingerprint == fp
        # A peer whose fill failed is left out for a while (peers/choice.py, backoff_s): the
        # next load does not pay for it again.
        await b.evict("m")
        await b.load("m")
        st = (await b.status())["peers"]
        assert st["fills"] == {"failed": 1} and 0 < st["peers"][0]["retry_in_s"] <= 10, st
        assert pair.log(1).count("fill of m from peer") == 1, pair.log(1)[-3000:]


async def test_the_files_are_read_when_they_are_faster_than_the_peer_measured(pair: Pair, tmp_path: Path) -> None:
    """A fill is chosen by measured cost (peers/choice.py): the first load tries the peer
    and learns its rate; once it is known to be slower than the files in their current
    state (here warm: the lender serves the same file from its page cache), the next load
    reads the files, and says why."""
    path = ckpt(tmp_path, 16 * MIB)
    fp = fingerprint_files(path)
    lender = pair.start(0, {"m": path})
    # Paced far below what warm files give (the CPU default, 2.15 GB/s): whatever the machine, the peer is slower.
    borrower = pair.start(1, {"m": path}, {"fingerprints": f'{{ m = "{fp}" }}', "max_fill_bytes_per_s": '"32MiB"'})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        await wait_for(lambda: offered(b, fp))
        await b.load("m")
        assert model_row(await b.models(), "m")["source"] == "neighbour", pair.log(1)[-3000:]
        peer = (await b.status())["peers"]["peers"][0]
        # The pace as the borrower measured it: the cap holds back each read's posting, so a
        # 16 MiB fill of a few reads comes in above 32 MiB/s, yet far below warm files.
        assert 0 < peer["fill_bytes_per_s"] <= 128 * MIB, peer
        assert "peer not measured lately (files warm): trying it" in pair.log(1)

        await b.evict("m")
        await b.load("m")
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fp
        st = (await b.status())["peers"]
        assert st["fills"] == {"ok": 1, "files faster": 1}, st
        assert "load m: from the files, not a peer (warm files 2.15 GB/s >= peer" in pair.log(1), pair.log(1)[-3000:]
        assert st["files_bytes_per_s"]["cpu warm"] > 0  # the files' load taught their rate


@root_only
def test_the_fill_worker_is_closed_to_other_processes_of_its_uid() -> None:
    """The fill worker runs as 65534, a uid other processes share (another daemon's lend
    worker, any service run as nobody); one of them must not reach the arena it fills
    through /proc (its fds, its memory) or ptrace: the worker is not dumpable."""
    worker = FillWorker()
    worker.start()
    try:
        pid = worker.describe()["pid"]
        if worker.uid != NOBODY:  # the daemon's log says why (an interpreter 65534 cannot run, e.g. under /root)
            pytest.skip(f"the fill worker runs as uid {worker.uid} here, not 65534")

        def look() -> dict[str, Any]:
            try:
                return {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
            except PermissionError:
                return {"denied": True}

        assert as_uid(NOBODY, look) == {"denied": True}
    finally:
        worker.close()
