"""The peer port answers only peers that prove the shared key, and holds every peer to the
Unix socket's bounds (docs/reliability.md, "Peers: threat model and bounds"): a listed
address without the key gets no frame decoded; frames are kilobytes; connections per
address are capped; an unconfigured host in a loop writes a bounded log; the asking
side refuses a big inventory reply unread; a lend cannot be renewed to pin a model, and
a local load ends idle lends."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from weightcache import SyncClient
from weightcache.loader import fingerprint_files
from weightcache.peers.auth import ASKER, LENDER, MAGIC, NONCE
from weightcache.peers.transport import unavailable
from weightcache.tools.spawn import DaemonProcess, config_text, free_port
from weightcache.tools.synth import write_checkpoint

MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]
NIXL = unavailable()
needs_nixl = pytest.mark.skipif(NIXL is not None, reason=f"NIXL cannot start here (pip install 'weightcache[peers]'): {NIXL}")



def write_key(path: Path, key: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key + b"\n")
    return path


class Peer:
    """A daemon with a peer port on loopback whose listed peer is ``127.0.0.1:<other>``
    (so that any local process connects from a listed address)."""

    def __init__(self, tmp: Path, models: dict[str, Path], budget: str = "64MiB", peers: dict[str, Any] | None = None,
                 other: int | None = None, key: bytes | None = None, model_opts: dict[str, dict[str, Any]] | None = None) -> None:
        self.key = key or os.urandom(32).hex().encode()
        self.keyfile = write_key(tmp / "peer.key", self.key)
        self.port, self.other = free_port(), other or free_port()
        self.sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
        sock = os.path.join(self.sockdir, "d.sock")
        rows = [{"name": n, "path": str(p), "device": "cpu", **(model_opts or {}).get(n, {})} for n, p in models.items()]
        text = config_text(sock, {"cpu": budget}, rows,
                           {"log_level": "debug", "shutdown_grace_s": 2})
        lines = ["", "[peers]", f'listen = "127.0.0.1:{self.port}"', f'addresses = ["127.0.0.1:{self.other}"]',
                 f'secret_file = "{self.keyfile}"', "refresh_s = 0.3"]
        lines += [f"{k} = {v}" for k, v in (peers or {}).items()]
        cfg = tmp / "peer.toml"
        cfg.write_text(text + "\n".join(lines) + "\n")
        self.log = tmp / "peer.log"
        self.daemon = DaemonProcess(cfg, sock, self.log).start()
        self.socket = sock
        deadline = time.monotonic() + 60
        while "peer port on" not in self.log_text():  # NIXL starts (~1 s) before the port listens
            assert time.monotonic() < deadline, self.log_text()[-3000:]
            time.sleep(0.05)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        with SyncClient(self.socket) as c:
            st: dict[str, Any] = c.status()["peers"]
            return st

    def rss(self) -> int:
        assert self.daemon.proc is not None
        with open(f"/proc/{self.daemon.proc.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def peer_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Peer] = []

    def make(**kw: Any) -> Peer:
        made.append(Peer(tmp_path, **kw))
        return made[-1]

    yield make
    for p in made:
        assert p.daemon.stop() == 0, p.log_text()[-3000:]


def dial(port: int, source: str = "127.0.0.1", timeout: float = 10.0) -> socket.socket:
    s = socket.socket()
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def read_until_eof(s: socket.socket, limit: int = 1 << 16) -> bytes:
    out = b""
    while len(out) < limit:
        try:
            got = s.recv(limit - len(out))
        except ConnectionResetError:
            break
        if not got:
            break
        out += got
    return out


def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += got
    return out


def mac(key: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, label + a + b, hashlib.sha256).digest()


def prove(s: socket.socket, key: bytes) -> bytes:
    """The asker's half of the handshake; returns the lender's proof (checked here)."""
    head = recv_exactly(s, len(MAGIC) + NONCE)
    assert head.startswith(MAGIC)
    ns, nc = head[len(MAGIC):], os.urandom(NONCE)
    s.sendall(nc + mac(key, ASKER, ns, nc))
    got = recv_exactly(s, 32)
    assert hmac.compare_digest(got, mac(key, LENDER, nc, ns))
    return got


def frame(msg: dict[str, Any]) -> bytes:
    payload = msgpack.packb(msg, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def request(s: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
    s.sendall(frame(msg))
    (n,) = struct.unpack(">I", recv_exactly(s, 4))
    reply: dict[str, Any] = msgpack.unpackb(recv_exactly(s, n), raw=False)
    return reply


def hello(s: socket.socket) -> dict[str, Any]:
    return request(s, {"op": "hello", "protocol": 2, "daemon": "test"})


def tiny(tmp_path: Path, nbytes: int = 64 * 1024, seed: int = 0) -> Path:
    return write_checkpoint(tmp_path / f"m{seed}-{nbytes}.safetensors", nbytes, 4, seed=seed)


def test_a_listed_address_without_the_key_gets_no_frame_answered(peer_factory: Any, tmp_path: Path) -> None:
    """Any local process connects from 127.0.0.1, a listed address: the address alone was
    a peer's whole proof. Without the key, nothing it sends is decoded or answered."""
    p = peer_factory(models={"m": tiny(tmp_path)})
    with dial(p.port) as s:  # speaks the protocol, no key: the hello is taken as a (wrong) proof
        s.sendall(frame({"op": "hello", "protocol": 2, "daemon": "x"}).ljust(64, b"\0"))
        got = read_until_eof(s)
        assert got.startswith(MAGIC) and len(got) == len(MAGIC) + NONCE, got[:80]  # the challenge, then the end
    with dial(p.port) as s:  # a wrong key
        head = recv_exactly(s, len(MAGIC) + NONCE)
        nc = os.urandom(NONCE)
        s.sendall(nc + mac(os.urandom(32), ASKER, head[len(MAGIC):], nc))
        assert read_until_eof(s) == b""
    with dial(p.port) as s:  # a 16 MiB frame without the key: 64 bytes are read, then the end
        head = recv_exactly(s, len(MAGIC) + NONCE)
        s.sendall(struct.pack(">I", 16 * MIB - 1) + b"\x91" * 60)
        assert read_until_eof(s) == b""
    with dial(p.port) as s:  # the key: answered (held: a configured peer still works)
        prove(s, p.key)
        assert hello(s)["ok"] is True
        assert request(s, {"op": "inventory"})["ok"] is True
    st = p.status()
    assert st["authenticated"] is True and st["unauthenticated"] == 3, st


def test_peers_refuse_a_daemon_that_does_not_prove_the_key(peer_factory: Any, tmp_path: Path) -> None:
    """The asking side checks the lender's proof too: a listener at a listed address that
    has no key is never asked for an inventory."""
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(8)
    got: list[bytes] = []

    def serve() -> None:
        fake.settimeout(30)
        with contextlib.suppress(OSError):
            conn, _ = fake.accept()
            with conn:
                conn.settimeout(10)
                conn.sendall(MAGIC + os.urandom(NONCE))
                got.append(recv_exactly(conn, NONCE + 32))
                conn.sendall(os.urandom(32))  # not the key's proof
                got.append(read_until_eof(conn))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    p = peer_factory(models={"m": tiny(tmp_path)}, other=fake.getsockname()[1])
    t.join(30)
    fake.close()
    assert len(got) == 2 and got[1] == b"", got  # it sent its proof, then nothing: no hello, no inventory
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        peers = p.status()["peers"]
        if peers and peers[0]["error"]:
            break
        time.sleep(0.1)
    assert "not authenticated" in peers[0]["error"], peers


def test_frames_on_the_peer_port_are_kilobytes(peer_factory: Any, tmp_path: Path) -> None:
    """A 15 MiB hello (the limit was the lend reply's 16 MiB) is refused from its header,
    before its bytes are read: an authenticated peer's connection ends at once."""
    p = peer_factory(models={"m": tiny(tmp_path)})
    rss0 = p.rss()
    for _ in range(3):
        with dial(p.port) as s:
            prove(s, p.key)
            s.sendall(struct.pack(">I", 15 * MIB))  # the header alone
            assert read_until_eof(s) == b""  # closed without waiting for the payload
    with dial(p.port) as s:  # a frame under 4 KiB of nested arrays is refused by the decode limits, not built
        prove(s, p.key)
        payload = b"\x81\xa2op" + b"\x91" * 3996  # the whole frame: a short one waits for its last byte
        s.sendall(struct.pack(">I", len(payload)) + payload)
        t = time.monotonic()
        assert read_until_eof(s) == b""
        assert time.monotonic() - t < 5, "closed by an idle timeout, not refused"
    with dial(p.port) as s:
        prove(s, p.key)
        assert hello(s)["ok"] is True
    assert p.rss() - rss0 < 32 * MIB
    assert "exceeds the limit of 4096" in p.log_text() and "malformed frame" in p.log_text()


def test_connections_per_address_are_capped_and_given_back(peer_factory: Any, tmp_path: Path) -> None:
    from weightcache.peers.server import CONNECTIONS_PER_ADDRESS

    p = peer_factory(models={"m": tiny(tmp_path)})
    held = [dial(p.port) for _ in range(CONNECTIONS_PER_ADDRESS)]
    try:
        for s in held:
            assert recv_exactly(s, len(MAGIC) + NONCE).startswith(MAGIC)  # each is in the handshake
        with dial(p.port) as s:
            assert read_until_eof(s) == b""  # one more: closed unread
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 20
    while True:  # the closed ones' places come back
        with dial(p.port) as s:
            if read_until_eof(s, len(MAGIC)).startswith(MAGIC):
                break
        assert time.monotonic() < deadline, "a closed connection's place never came back"
        time.sleep(0.1)
    assert p.status()["over_limit"] >= 1


def test_an_address_that_keeps_failing_the_handshake_is_cut_off(peer_factory: Any, tmp_path: Path) -> None:
    """Each wrong proof cost the daemon an accept, a challenge and a read: after STRIKES of
    them an address is closed unread, as an unconfigured one is."""
    from weightcache.peers.server import STRIKES

    p = peer_factory(models={"m": tiny(tmp_path)})
    for _ in range(STRIKES):
        with dial(p.port) as s:
            head = recv_exactly(s, len(MAGIC) + NONCE)
            nc = os.urandom(NONCE)
            s.sendall(nc + mac(b"not the key", ASKER, head[len(MAGIC):], nc))
            assert read_until_eof(s) == b""
    with dial(p.port) as s:  # closed before the challenge: nothing of this connection is read
        assert read_until_eof(s) == b""
    st = p.status()
    assert st["cut_off"] == 1 and st["unauthenticated"] == STRIKES, st
    assert "failed the handshake or broke the protocol" in p.log_text()


def test_an_unconfigured_host_connecting_in_a_loop_writes_a_bounded_log(peer_factory: Any, tmp_path: Path) -> None:
    """127.0.0.2 is not a configured peer: each connect is closed unread; one warning per
    connect wrote ~2,500 lines/s."""
    p = peer_factory(models={"m": tiny(tmp_path)})
    n = 300
    for _ in range(n):
        with dial(p.port, source="127.0.0.2") as s:
            read_until_eof(s)
    deadline = time.monotonic() + 20
    while p.status()["refused"] < n and time.monotonic() < deadline:
        time.sleep(0.1)
    assert p.status()["refused"] == n
    lines = [x for x in p.log_text().splitlines() if "not a configured peer" in x]
    assert 1 <= len(lines) <= 3, len(lines)


def test_the_asking_side_refuses_a_big_inventory_reply_unread(peer_factory: Any, tmp_path: Path) -> None:
    """A peer's inventory reply was decoded on the asking daemon's loop up to 16 MiB."""
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(8)
    key = os.urandom(32).hex().encode()
    sent: list[int] = []

    def serve() -> None:
        fake.settimeout(30)
        with contextlib.suppress(OSError):
            conn, _ = fake.accept()
            with conn:
                conn.settimeout(10)
                ns = os.urandom(NONCE)
                conn.sendall(MAGIC + ns)
                proof = recv_exactly(conn, NONCE + 32)
                nc = proof[:NONCE]
                assert hmac.compare_digest(proof[NONCE:], mac(key, ASKER, ns, nc))
                conn.sendall(mac(key, LENDER, nc, ns))
                (n,) = struct.unpack(">I", recv_exactly(conn, 4))
                recv_exactly(conn, n)
                conn.sendall(frame({"ok": True, "protocol": 2, "daemon": "fake"}))
                (n,) = struct.unpack(">I", recv_exactly(conn, 4))
                recv_exactly(conn, n)
                body = b"\x81\xa6models\xdd" + struct.pack(">I", 15 * MIB - 16) + b"\x90" * (15 * MIB - 16)
                conn.sendall(struct.pack(">I", len(body)))
                with contextlib.suppress(OSError):
                    conn.sendall(body)
                    sent.append(len(body))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    p = peer_factory(models={"m": tiny(tmp_path)}, other=fake.getsockname()[1], key=key)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        peers = p.status()["peers"]
        if peers and peers[0]["error"]:
            break
        time.sleep(0.1)
    t.join(30)
    fake.close()
    assert "exceeds the limit of 65536" in peers[0]["error"], peers
    assert not sent, "the asking daemon read the whole 15 MiB reply"


@needs_nixl
def test_a_peer_cannot_renew_lends_to_pin_a_model(peer_factory: Any, tmp_path: Path) -> None:
    """Two idle lends renewed at every timeout_s kept a model resident for good. A peer
    gets LENDS_PER_MODEL lends of a model per window; the next is BUSY."""
    from weightcache.peers.server import LENDS_PER_MODEL

    p = peer_factory(models={"m": tiny(tmp_path)})
    with SyncClient(p.socket) as c:
        c.load("m")
    ask = {"op": "lend", **offered(p)}
    for i in range(LENDS_PER_MODEL + 1):
        with dial(p.port) as s:
            prove(s, p.key)
            hello(s)
            reply = request(s, ask)
            if i < LENDS_PER_MODEL:
                assert reply["ok"] is True, reply
                s.sendall(frame({"op": "done"}))
                assert request_reply(s)["ok"] is True
            else:
                assert reply["ok"] is False and reply["error"]["code"] == "BUSY", reply
                assert f"{LENDS_PER_MODEL} times in the last" in reply["error"]["message"], reply


def offered(p: Peer) -> dict[str, str]:
    """The fingerprint and layout of the one model ``p`` lists to its peers."""
    with dial(p.port) as s:
        prove(s, p.key)
        hello(s)
        (m,) = request(s, {"op": "inventory"})["models"]
        return {"fingerprint": m["fingerprint"], "layout": m["layout"]}


def request_reply(s: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack(">I", recv_exactly(s, 4))
    reply: dict[str, Any] = msgpack.unpackb(recv_exactly(s, n), raw=False)
    return reply


@needs_nixl
def test_a_local_load_that_needs_the_room_ends_an_idle_lend(peer_factory: Any, tmp_path: Path) -> None:
    """A lend held idle kept its model attached: a local load of another model got
    NO_SPACE until the lend's timeout_s (here 10 minutes)."""
    a, b = tiny(tmp_path, 8 * MIB, seed=1), tiny(tmp_path, 8 * MIB, seed=2)
    p = peer_factory(models={"a": a, "b": b}, budget="12MiB", peers={"timeout_s": 600})
    with SyncClient(p.socket) as c:
        c.load("a")
    with dial(p.port, timeout=60) as s:
        prove(s, p.key)
        hello(s)
        assert request(s, {"op": "lend", **offered(p)})["ok"] is True
        with SyncClient(p.socket) as c:
            c.load("b", wait_s=60)  # waits for the lend to be found idle, then gets its room
            assert next(m for m in c.models() if m["name"] == "b")["state"] == "resident"
        assert read_until_eof(s) == b""  # the lend was ended: its connection closed
    assert p.status()["lends_ended_for_room"] == 1


# A peer that writes into what it was lent, over TCP alone (UCX's software RMA: the
# lender's worker performs the write). It proves the key, asks for a lend, and posts one
# NIXL WRITE of 4 KiB into the first lent region.
WRITER = textwrap.dedent('''
    import hashlib, hmac, json, mmap, os, socket, struct, sys, time
    import msgpack
    from weightcache.backends.cpu import _address
    from weightcache.peers.auth import ASKER, MAGIC, NONCE
    from weightcache.peers.transport import Transport

    port, key, fp, layout = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3], sys.argv[4]
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    def exactly(n):
        out = b""
        while len(out) < n:
            got = s.recv(n - len(out))
            if not got:
                raise EOFError
            out += got
        return out
    def ask(msg):
        p = msgpack.packb(msg, use_bin_type=True)
        s.sendall(struct.pack(">I", len(p)) + p)
        (n,) = struct.unpack(">I", exactly(4))
        return msgpack.unpackb(exactly(n), raw=False)
    ns = exactly(len(MAGIC) + NONCE)[len(MAGIC):]
    nc = os.urandom(NONCE)
    s.sendall(nc + hmac.new(key, ASKER + ns + nc, hashlib.sha256).digest())
    exactly(32)
    ask({"op": "hello", "protocol": 2, "daemon": "writer"})
    lent = ask({"op": "lend", "fingerprint": fp, "layout": layout})
    assert lent["ok"], lent
    _, addr, n = lent["regions"][0]
    t = Transport()
    remote = t._add_remote(lent["metadata"])
    src = mmap.mmap(-1, 4096)
    src[:] = b"W" * 4096
    reg = t.register([(_address(src), 4096)], "DRAM")
    local = t.agent.get_xfer_descs([(_address(src), 4096, 0)], "DRAM")
    far = t.agent.get_xfer_descs([(addr, 4096, 0)], "DRAM")
    h = t.agent.initialize_xfer("WRITE", local, far, remote)
    state = t.agent.transfer(h)
    end = time.monotonic() + 20
    while state not in ("DONE", "ERR") and time.monotonic() < end:
        time.sleep(0.01)
        state = t.agent.check_xfer_state(h)
    print("RESULT " + json.dumps({"write": state}), flush=True)
    os._exit(0)
''')


@needs_nixl
def test_a_write_into_a_lend_never_reaches_the_daemon(peer_factory: Any, tmp_path: Path) -> None:
    """One NIXL WRITE into a lent (read-only) region killed the lender daemon (SIGSEGV in
    UCX's software RMA over TCP), 3 of 3. Lends now come from the lend worker, whose
    mapping is read-only: the write faults there or is refused; the daemon serves on,
    its model's bytes unchanged, and lends again."""
    path = tiny(tmp_path, 1 * MIB)
    p = peer_factory(models={"m": path})
    with SyncClient(p.socket) as c:
        c.load("m")
    ask = offered(p)
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    env["UCX_TLS"] = "tcp"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", WRITER, str(p.port), p.key.decode(), ask["fingerprint"], ask["layout"]],
                       env=env, capture_output=True, text=True, timeout=120)
    assert "RESULT" in r.stdout or r.returncode != 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert p.daemon.proc is not None and p.daemon.proc.poll() is None, p.log_text()[-3000:]  # the daemon lives
    died = p.status()["lend_worker"]
    assert died["deaths"] >= 1 or '"write": "ERR"' in r.stdout, (died, r.stdout[-2000:])  # the write faulted in the worker
    with SyncClient(p.socket) as c, c.attach("m") as m:  # its bytes are the file's
        from safetensors.torch import load_file

        want = load_file(str(path))
        for k, v in want.items():
            assert m[k].reshape(-1).view(torch.uint8).equal(v.reshape(-1).view(torch.uint8)), k
    deadline = time.monotonic() + 30
    while True:  # lends again (a worker that died is started again within 5 s)
        with dial(p.port) as s:
            prove(s, p.key)
            hello(s)
            reply = request(s, {"op": "lend", **ask})
            if reply["ok"]:
                s.sendall(frame({"op": "done"}))
                break
        assert time.monotonic() < deadline, reply
        time.sleep(0.5)
    worker = p.status()["lend_worker"]
    assert worker["pid"] is not None and worker["pid"] != p.daemon.proc.pid, worker


@needs_nixl
def test_a_lend_maps_nothing_of_the_daemon_but_the_lent_model(peer_factory: Any, tmp_path: Path) -> None:
    """NIXL checks a read's range only in the reader's library; over TCP the lender's UCX
    worker served any address of the daemon (8 KB of a root-only model were read). The
    process that serves a lend now maps the lent model's files and nothing of the others."""
    lent, other = tiny(tmp_path, 1 * MIB, seed=3), tiny(tmp_path, 1 * MIB, seed=4)
    p = peer_factory(models={"open": lent, "other": other})
    with SyncClient(p.socket) as c:
        c.load("open")
        c.load("other")
    with dial(p.port) as s:
        prove(s, p.key)
        hello(s)
        models = request(s, {"op": "inventory"})["models"]
    fp_open = next(m for m in models if m["nbytes"] and m["fingerprint"] == fingerprint_files(lent))
    with dial(p.port) as s:
        prove(s, p.key)
        hello(s)
        reply = request(s, {"op": "lend", "fingerprint": fp_open["fingerprint"], "layout": fp_open["layout"]})
        assert reply["ok"] is True, reply
        worker = p.status()["lend_worker"]["pid"]
        assert p.daemon.proc is not None and worker not in (None, p.daemon.proc.pid)
        maps = Path(f"/proc/{worker}/maps").read_text()
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps.splitlines()]
        for _, addr, n in reply["regions"]:  # every lent byte is the worker's, in a read-only mapping
            line = next(x for x, (lo, hi) in zip(maps.splitlines(), spans, strict=True) if lo <= addr and addr + n <= hi)
            assert line.split()[1].startswith("r-"), line
        assert (str(other) not in maps and str(lent) in maps) or "memfd" in maps, maps[-3000:]
        s.sendall(frame({"op": "done"}))


@needs_nixl
def test_held_only_open_models_are_listed_or_lent_and_a_fifth_lend_at_once_is_busy(peer_factory: Any, tmp_path: Path) -> None:
    """Kept from before the key: a model restricted to some uids is neither listed nor lent
    (UNKNOWN_MODEL even with its fingerprint), and one address holds 4 lends at once."""
    from weightcache.peers.server import LENDS_PER_PEER

    p = peer_factory(models={"open": tiny(tmp_path, seed=5), "restricted": tiny(tmp_path, seed=6)},
                     model_opts={"restricted": {"allowed_uids": [0]}})
    with SyncClient(p.socket) as c:
        c.load("open")
        c.load("restricted")
        hidden = next(m for m in c.models() if m["name"] == "restricted")["fingerprint"]
    ask = offered(p)  # the one model listed: the open one
    with dial(p.port) as s:
        prove(s, p.key)
        hello(s)
        reply = request(s, {"op": "lend", "fingerprint": hidden, "layout": ask["layout"]})  # same shapes, same layout
        assert reply["ok"] is False and reply["error"]["code"] == "UNKNOWN_MODEL", reply
    held = []
    try:
        for i in range(LENDS_PER_PEER + 1):
            s = dial(p.port)
            held.append(s)
            prove(s, p.key)
            hello(s)
            reply = request(s, {"op": "lend", **ask})
            assert reply["ok"] is (i < LENDS_PER_PEER), (i, reply)
        assert reply["error"]["code"] == "BUSY", reply
    finally:
        for s in held:
            s.close()


# The read: lend the open model, patch the 16 bytes of NIXL metadata that say
# where the registration starts and how long it is, so that NIXL's own check (in the
# reader's library) passes for another address, and read it over TCP alone.
PATCHED_READER = WRITER.split("t = Transport()")[0] + textwrap.dedent('''
    from weightcache.peers.transport import Extent
    target = int(sys.argv[5])
    md = bytearray(lent["metadata"])
    at = md.find(struct.pack("<Q", addr) + struct.pack("<Q", n))
    assert at >= 0, "the registration is not in the metadata"
    md[at:at + 16] = struct.pack("<Q", target) + struct.pack("<Q", 4096)
    t = Transport()
    dst = mmap.mmap(-1, 4096)
    try:
        t.read(bytes(md), [Extent(_address(dst), target, 4096)], "DRAM", 0, "DRAM", 0, window=1,
               on_done=lambda d, k: None, stop=lambda: None, deadline=time.monotonic() + 20, stall_s=5)
        got = "bytes " + bytes(dst[:4096]).hex()
    except Exception as exc:
        got = "refused: " + str(exc)[:200]
    print("RESULT " + json.dumps({"read": got}), flush=True)
    os._exit(0)
''')


@needs_nixl
def test_patched_metadata_reads_nothing_of_the_daemon(peer_factory: Any, tmp_path: Path) -> None:
    """8,112 bytes of a root-only model were read from the daemon this way. The lend now
    comes from the lend worker: the address the daemon maps the other model at holds
    none of its bytes there (or nothing: the worker faults, and is started again)."""
    lent, other = tiny(tmp_path, 1 * MIB, seed=7), tiny(tmp_path, 1 * MIB, seed=8)
    other.chmod(0o600)
    p = peer_factory(models={"open": lent, "other": other}, model_opts={"other": {"allowed_uids": [0]}})
    with SyncClient(p.socket) as c:
        c.load("open")
        c.load("other")
    assert p.daemon.proc is not None
    maps = Path(f"/proc/{p.daemon.proc.pid}/maps").read_text().splitlines()
    target = next(int(x.split("-")[0], 16) for x in maps if x.endswith(str(other)))  # the daemon's view of the other file
    ask = offered(p)
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    env["UCX_TLS"] = "tcp"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", PATCHED_READER, str(p.port), p.key.decode(), ask["fingerprint"], ask["layout"],
                        str(target)], env=env, capture_output=True, text=True, timeout=120)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, (r.stdout[-2000:], r.stderr[-2000:])
    got = json.loads(line[7:])["read"]
    assert got != "bytes " + other.read_bytes()[:4096].hex(), "the other model's bytes were read from the daemon"
    assert p.daemon.proc.poll() is None, p.log_text()[-3000:]
