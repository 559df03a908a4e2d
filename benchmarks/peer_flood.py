#!/usr/bin/env python3
"""A victim tenant's attach latency beside each flood of the peer port, and the daemon's
RSS after it (docs/reliability.md, "Peers: threat model and bounds").

One daemon (a 64 KiB model ``tiny`` preloaded, ``[peers]`` on loopback with a key file;
its listed peer is a fake lender of this script). A victim process attaches ``tiny``
in a loop, first alone for --seconds, then beside each flood in turn for --seconds
(each flood in processes of its own), with --settle seconds between:

- ``hello-nokey``: 4 connections from a listed address, without the key, each sending a
  15 MiB hello of nested empty arrays, reconnecting as each is closed;
- ``hello-key``:   the same after proving the key;
- ``partial``:     48 connections, each proving the key and sending 16 MiB - 1 bytes;
- ``unconfigured``: connects from 127.0.0.2 (not a listed peer) in a loop;
- ``inventory``:   the listed peer proves the key and answers every ``inventory`` with a
  15 MiB frame of nested empty arrays (the asking side's decode);
- ``<kind>-sink``: the same flood against a listener of this script that does what the
  peer port does with each connection: what the flooding processes themselves cost the
  victim on this machine (on 2 cores, most of it).

With ``--flood-cpus 1`` the flooding processes (and the sinks and the fake lender) run
on CPU 1 and the daemon and the victim on the others: what is left of the victim's
slowdown is the daemon's own work for the flood, not the flooders' CPU.

Prints (and with --out writes) a JSON summary: per phase the attach p50/p99 and their
ratio to the alone phase, and the daemon's RSS before the floods and after each.

    .venv/bin/python -m benchmarks peer-flood --seconds 10 --out /tmp/peer_flood.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import multiprocessing as mp
import os
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightcache.peers.auth import ASKER, LENDER, MAGIC, NONCE
from weightcache.tools.spawn import DaemonProcess, config_text, free_port
from weightcache.tools.synth import write_checkpoint

MIB = 2**20
# Each flood from an address of its own (all but 127.0.0.2 listed as peers), so that one
# flood's strikes (peers/server.py, Note [peer strikes]) do not cut off the next.
SOURCES = {"hello-nokey": "127.0.0.3", "hello-key": "127.0.0.4", "partial": "127.0.0.5", "unconfigured": "127.0.0.2"}
BIG = 15 * MIB
NESTED = b"\x81\xa2op\xdd" + struct.pack(">I", BIG - 8) + b"\x90" * (BIG - 8)  # {"op": [[], [], ...]}: 15 MiB


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload



def recv_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise EOFError
        out += got
    return out


def prove(s: socket.socket, key: bytes) -> None:
    head = recv_exactly(s, len(MAGIC) + NONCE)
    ns, nc = head[len(MAGIC):], os.urandom(NONCE)
    s.sendall(nc + hmac.new(key, ASKER + ns + nc, hashlib.sha256).digest())
    recv_exactly(s, 32)


def flooder(phase: str, port: int, key: bytes, start: float, until: float, conns: int, out: Any) -> None:
    kind = phase.removesuffix("-sink")
    while time.monotonic() < start:  # started before the victim's first phase: no start-up in a flood's figures
        time.sleep(0.01)
    socks: list[socket.socket] = []
    made = errors = 0
    while time.monotonic() < until:
        made += 1
        try:
            s = socket.socket()
            s.settimeout(5)
            s.bind((SOURCES[kind], 0))
            s.connect(("127.0.0.1", port))
            if kind == "unconfigured":
                s.close()
                continue
            if kind in ("hello-key", "partial"):
                prove(s, key)
            if kind == "partial":
                s.sendall(struct.pack(">I", 16 * MIB) + b"\x90" * (16 * MIB - 1 - 4))
                socks.append(s)
                if len(socks) >= conns:
                    time.sleep(0.5)
                    for x in socks:
                        x.close()
                    socks.clear()
                continue
            s.sendall(frame(NESTED))
            s.close()
        except (OSError, EOFError):
            errors += 1
            with contextlib.suppress(OSError):
                s.close()
    for x in socks:
        x.close()
    out.put((phase, made, errors))


def sink(port: int, until: float) -> None:
    """A control: a listener that does what the peer port does with each flood connection
    (the challenge, 64 bytes read, a proof, a frame header read, closed), so that the same
    flood against it shows what the flood's own processes cost the victim."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(64)
    srv.settimeout(0.5)
    while time.monotonic() < until:
        try:
            c, _ = srv.accept()
        except TimeoutError:
            continue
        with c, contextlib.suppress(OSError, EOFError):
            c.settimeout(5)
            c.sendall(MAGIC + os.urandom(NONCE))
            recv_exactly(c, NONCE + 32)
            c.sendall(bytes(32))
            recv_exactly(c, 4)
    srv.close()


def fake_lender(port: int, key: bytes, start: float, until: float) -> None:
    """The listed peer: proves the key, answers hello, and every inventory with 15 MiB."""
    while time.monotonic() < start:
        time.sleep(0.01)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(16)
    srv.settimeout(0.5)
    while time.monotonic() < until:
        try:
            c, _ = srv.accept()
        except TimeoutError:
            continue
        with c, contextlib.suppress(OSError, EOFError):
            c.settimeout(5)
            ns = os.urandom(NONCE)
            c.sendall(MAGIC + ns)
            proof = recv_exactly(c, NONCE + 32)
            nc = proof[:NONCE]
            c.sendall(hmac.new(key, LENDER + nc + ns, hashlib.sha256).digest())
            (n,) = struct.unpack(">I", recv_exactly(c, 4))
            recv_exactly(c, n)
            c.sendall(frame(b"\x83\xa2ok\xc3\xa8protocol\x02\xa6daemon\xa4fake"))
            (n,) = struct.unpack(">I", recv_exactly(c, 4))
            recv_exactly(c, n)
            c.sendall(frame(NESTED))
    srv.close()


def victim(sock: str, phases: list[tuple[str, float, float]], out: Any) -> None:
    from weightcache import SyncClient

    lat: dict[str, list[float]] = {name: [] for name, _, _ in phases}
    failures: list[str] = []
    with SyncClient(sock, name="victim") as c:
        for name, start, end in phases:
            while time.monotonic() < start:
                time.sleep(0.01)
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    with c.attach("tiny"):
                        lat[name].append(time.monotonic() - t)
                except Exception as exc:
                    failures.append(f"{name}: {type(exc).__name__}: {exc}")
                time.sleep(0.005)
    out.put({"latency": lat, "failures": failures[:20]})


def on_cpus(cpus: set[int], target: Any, args: tuple[Any, ...]) -> None:
    os.sched_setaffinity(0, cpus)
    target(*args)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--startup", type=float, default=2.0, help="seconds for the processes to start before the first phase")
    ap.add_argument("--floods", default="hello-nokey,hello-nokey-sink,hello-key,hello-key-sink,partial,partial-sink,"
                                        "unconfigured,inventory", help="a kind ending in -sink floods a control listener")
    ap.add_argument("--flood-cpus", default="", help="CPUs for the flooding processes (e.g. 1); the daemon and the "
                    "victim get the others")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    flood_cpus = {int(c) for c in args.flood_cpus.split(",") if c}
    if flood_cpus:
        rest = os.sched_getaffinity(0) - flood_cpus
        if not rest or not flood_cpus <= os.sched_getaffinity(0):
            ap.error(f"--flood-cpus {args.flood_cpus}: leaves no CPU for the daemon, or names one this process may not use")
        os.sched_setaffinity(0, rest)  # the daemon and the victim inherit it

    kinds = [k for k in args.floods.split(",") if k]
    tmp = Path(tempfile.mkdtemp(prefix="peer-flood-"))
    key = os.urandom(32).hex().encode()
    keyfile = tmp / "peer.key"
    keyfile.write_bytes(key + b"\n")
    keyfile.chmod(0o600)
    port, fake = free_port(), free_port()
    sock = str(tmp / "d.sock")
    model = write_checkpoint(tmp / "tiny.safetensors", 64 * 1024, 4, seed=0)
    cfg = tmp / "d.toml"
    cfg.write_text(config_text(sock, {"cpu": "256MiB"}, [{"name": "tiny", "path": str(model), "device": "cpu", "preload": True}],
                               {"log_level": "info"})
                   + f'\n[peers]\nlisten = "127.0.0.1:{port}"\nsecret_file = "{keyfile}"\n'
                   + f'addresses = ["127.0.0.1:{fake}", "127.0.0.3:1", "127.0.0.4:1", "127.0.0.5:1"]\n'
                   + "refresh_s = 0.3\n")
    d = DaemonProcess(cfg, sock, tmp / "d.log").start()
    assert d.proc is not None
    try:
        from weightcache import SyncClient

        with SyncClient(sock) as c:
            c.load("tiny")
        ctx = mp.get_context("fork")  # at once: a spawned child imports for seconds on 2 cores
        q = ctx.Queue()
        fq = ctx.Queue()
        t0 = time.monotonic() + args.startup
        phases, at = [], t0
        for name in ["alone", *kinds]:
            phases.append((name, at, at + args.seconds))
            at += args.seconds + args.settle
        procs = []  # every flood's processes, started now, each waiting for its phase
        for name, start, end in phases[1:]:
            if name == "inventory":
                procs.append(ctx.Process(target=fake_lender, args=(fake, key, start, end)))
                continue
            to = port
            if name.endswith("-sink"):
                to = free_port()  # one per flood: a listener of its own
                procs.append(ctx.Process(target=sink, args=(to, end)))
            n = 1 if name == "unconfigured" else 4
            procs += [ctx.Process(target=flooder, args=(name, to, key, start, end, 12, fq)) for _ in range(n)]
        flooders = len([p for p in procs if p._target is flooder])  # type: ignore[attr-defined]
        if flood_cpus:
            procs = [ctx.Process(target=on_cpus, args=(flood_cpus, p._target, p._args)) for p in procs]  # type: ignore[attr-defined]
        procs.append(ctx.Process(target=victim, args=(sock, phases, q)))
        for p in procs:
            p.start()
        rss_after: dict[str, int] = {}
        cpu: dict[str, float] = {}
        for name, start, end in phases:
            while time.monotonic() < start:
                time.sleep(0.01)
            c0 = cpu_s(d.proc.pid)
            while time.monotonic() < end:
                time.sleep(0.05)
            cpu[name] = cpu_s(d.proc.pid) - c0
            while time.monotonic() < end + (args.settle - 0.2 if name != "alone" else 0):
                time.sleep(0.05)
            rss_after[name] = rss(d.proc.pid)
        made: dict[str, list[int]] = {}
        for _ in range(flooders):
            kind, n_made, n_err = fq.get(timeout=60)
            made.setdefault(kind, [0, 0])
            made[kind][0] += n_made
            made[kind][1] += n_err
        res = q.get(timeout=60)
        for p in procs:
            p.join()
        lat = res["latency"]
        alone99 = pct(lat["alone"], 0.99)
        summary: dict[str, Any] = {"seconds": args.seconds, "flood_cpus": sorted(flood_cpus),
                                   "daemon_cpus": sorted(os.sched_getaffinity(0)), "failures": res["failures"], "phases": {}}
        for name, _, _ in phases:
            xs = lat[name]
            summary["phases"][name] = {"n": len(xs), "p50_ms": round(pct(xs, 0.5) * 1e3, 3),
                                       "p99_ms": round(pct(xs, 0.99) * 1e3, 3),
                                       "p99_ratio": round(pct(xs, 0.99) / alone99, 2) if alone99 else None,
                                       "rss_mib_after": round(rss_after[name] / MIB, 1),
                                       "daemon_cpu_s": round(cpu[name], 2)}
        with SyncClient(sock) as c:
            st = c.status()["peers"]
        summary["peer_port"] = {k: st[k] for k in ("refused", "unauthenticated", "over_limit", "cut_off")}
        summary["flood_connections"] = {k: {"made": v[0], "closed_or_failed": v[1]} for k, v in made.items()}
        summary["peer_errors"] = [p["error"] for p in st["peers"]]
        log = (tmp / "d.log").read_text(errors="replace")
        summary["log_lines"] = len(log.splitlines())
        print(json.dumps(summary, indent=1))
        if args.out:
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
