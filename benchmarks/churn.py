"""Churn stress (``make stress``): hundreds of engine processes attaching and
detaching at random for a bounded time, some SIGKILLed mid-flight; then the daemon's
books and file descriptors must be exactly as if nothing had happened.

The clients speak the wire protocol directly (``churn.py --client``): written
from docs/protocol.md alone, without torch, so that 200 of them fit in memory and the
spec is exercised by a second implementation. Each maps what it receives read-only (a
sealed memfd, or a "file" arena's checkpoint files and their segments: two of the four
models are served each way) and reads a byte of every tensor, like an engine would.

Run: python -m benchmarks churn --clients 200 --seconds 30   (prints a JSON summary, writes results/churn.json)
"""

from __future__ import annotations

import argparse
import array
import collections
import json
import mmap
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default


# ----------------------------------------------------------------------------- client
class WireClient:
    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        self.buf = b""
        self.fds: collections.deque[int] = collections.deque()
        self.next_id = 1

    def _recv(self) -> None:
        data, anc, _flags, _ = self.s.recvmsg(1 << 16, socket.CMSG_SPACE(64 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                self.fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        if not data:
            raise ConnectionError("daemon closed the connection")
        self.buf += data

    def call(self, op: str, **args: object) -> tuple[dict, list[int]]:
        rid = self.next_id
        self.next_id += 1
        payload = msgpack.packb({"id": rid, "op": op, **args})
        self.s.sendall(struct.pack(">I", len(payload)) + payload)
        while True:
            while len(self.buf) < 4 or len(self.buf) < 4 + struct.unpack(">I", self.buf[:4])[0]:
                self._recv()
            (n,) = struct.unpack(">I", self.buf[:4])
            reply = msgpack.unpackb(self.buf[4 : 4 + n])
            self.buf = self.buf[4 + n :]
            fds = [self.fds.popleft() for _ in range(reply.get("fds", 0))]
            if reply.get("id") == rid:
                return reply, fds
            for fd in fds:
                os.close(fd)


def client_main(path: str, seconds: float, seed: int, models: list[str]) -> None:
    rng = random.Random(seed)
    c = WireClient(path)
    assert c.call("hello", protocol=1, client=f"churn-{seed}")[0]["ok"]
    held: list[int] = []
    counts: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        r = rng.random()
        if r < 0.45 and len(held) < 2:
            reply, fds = c.call("attach", name=rng.choice(models), wait_s=0.2)
            if reply["ok"]:
                touch_every_tensor(reply, fds)
                held.append(reply["lease"])
                counts[f"arena_{reply['arena']['kind']}"] += 1
        elif r < 0.85 and held:
            reply, _ = c.call("detach", lease=held.pop(rng.randrange(len(held))))
        else:
            reply, _ = c.call("status")
        counts["ok" if reply["ok"] else reply["error"]["code"]] += 1
        time.sleep(rng.random() * 0.01)
    print(json.dumps(counts), flush=True)  # exits holding whatever it holds: the close must release it


def touch_every_tensor(reply: dict, fds: list[int]) -> None:
    """Map the attach reply's arena read-only and read one byte of every tensor: a memfd
    (one fd over the arena) or a file arena (one fd per file, and 32-byte segments:
    file index, file offset, arena offset, byte count; docs/protocol.md). Closes the fds."""
    arena = reply["arena"]
    try:
        if arena["kind"] == "memfd":
            maps = [mmap.mmap(fds[0], arena["nbytes"], prot=mmap.PROT_READ)]
            segments = [(0, 0, 0, arena["nbytes"])]
        else:
            maps = [mmap.mmap(fd, size, prot=mmap.PROT_READ) for fd, size in zip(fds, arena["files"], strict=True)]
            segments = list(struct.iter_unpack("<4Q", arena["segments"]))
    finally:
        for fd in fds:
            os.close(fd)
    for _n, _d, _s, off, nb in reply["tensors"]:
        if nb:
            f, fo, ao, _n = next(seg for seg in segments if seg[2] <= off < seg[2] + seg[3])
            assert maps[f][fo + off - ao] >= 0
    for m in maps:
        m.close()


# ----------------------------------------------------------------------------- driver
def daemon_fds(pid: int, work: Path) -> collections.Counter[str]:
    """The daemon's fds by kind; ``checkpoint``: fds of the models' files (a file arena
    holds one per file)."""
    out: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(work)) and target.endswith(".safetensors"):
            out["checkpoint"] += 1
        else:
            out["memfd" if target.startswith("/memfd:") else target.split(":")[0] if ":" in target else "file"] += 1
    return out


def other_fds(fds: collections.Counter[str]) -> dict[str, int]:
    """The fds that no resident model accounts for."""
    return {k: v for k, v in fds.items() if k not in ("memfd", "checkpoint")}


def settled_fds(pid: int, work: Path, client, like: collections.Counter[str] | None = None,
                within_s: float = 5.0) -> collections.Counter[str]:
    """The daemon's fds once only ``client`` is connected and the count holds still (or
    matches ``like``). A closed connection's socket is closed on a later turn of the
    daemon's loop than the one that stops counting it (asyncio closes a transport's
    socket in a call_soon), so one read right after a disconnect can see it still open;
    a leaked fd stays, and the check still fails on it."""
    deadline = time.monotonic() + within_s
    last = None
    while True:
        connected = client.status()["connections"]
        fds = daemon_fds(pid, work)
        if connected == 1 and (other_fds(fds) == other_fds(like) if like is not None else fds == last):
            return fds
        if time.monotonic() > deadline:
            return fds
        last = fds
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--kill-fraction", type=float, default=0.2)
    ap.add_argument("--out", type=Path, default=RESULTS / "churn.json")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from weightcache.client import SyncClient
    from weightcache.tools.spawn import DaemonProcess, config_text
    from weightcache.tools.synth import write_checkpoint

    work = Path(tempfile.mkdtemp(prefix="wc-churn-", dir="/tmp"))
    names = [f"m{i}" for i in range(4)]
    for i, n in enumerate(names):
        # m0, m1 as save_file leaves them (served from their page cache); m2, m3 writable by
        # their group, so the daemon copies them into sealed memfds: both arenas churn.
        write_checkpoint(work / f"{n}.safetensors", 4 * 2**20, 30, seed=i, mode=0o600 if i < 2 else 0o664)
    sock = str(work / "d.sock")
    (work / "c.toml").write_text(config_text(
        sock, {"cpu": "13MiB"},  # room for three of the four: the churn forces evictions
        [{"name": n, "path": str(work / f"{n}.safetensors")} for n in names],
        {"max_connections": 4096, "max_connections_per_uid": 4096, "log_level": "warning"}))  # every client is this uid
    summary: dict[str, object] = {"clients": args.clients, "seconds": args.seconds}
    with DaemonProcess(work / "c.toml", sock, work / "daemon.log") as d:
        assert d.proc is not None
        # The observer stays connected from the baseline to the last count, so both counts
        # hold its socket; one arena exists before the baseline, so memfds count from there.
        observer = SyncClient(sock)
        observer.load(names[0])
        baseline = settled_fds(d.proc.pid, work, observer)
        rng = random.Random(0)
        procs = []
        t0 = time.monotonic()
        for i in range(args.clients):
            procs.append(subprocess.Popen([sys.executable, __file__, "--client", sock, str(args.seconds), str(i), *names],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        spawn_s = time.monotonic() - t0
        victims = rng.sample(procs, int(args.clients * args.kill_fraction))
        kill_at = sorted((rng.uniform(0.2, 0.9) * args.seconds, p) for p in victims), []
        peak_conns = 0
        pending = list(kill_at[0])
        with observer as c:
            while any(p.poll() is None for p in procs):
                now = time.monotonic() - t0
                while pending and pending[0][0] <= now:
                    pending.pop(0)[1].send_signal(signal.SIGKILL)
                peak_conns = max(peak_conns, c.status()["connections"] - 1)
                time.sleep(0.1)
            wall = time.monotonic() - t0
            counts: collections.Counter[str] = collections.Counter()
            for p in procs:
                out, err = p.communicate()
                if p.returncode == 0:
                    counts.update(json.loads(out.strip().splitlines()[-1]))
                elif p.returncode != -signal.SIGKILL:
                    print(f"client failed ({p.returncode}): {err[-1500:]}", file=sys.stderr)
                    counts["client_crashed"] += 1
            for _ in range(100):
                st = c.status()
                if st["leases"] == 0 and st["connections"] == 1:
                    break
                time.sleep(0.05)
            models = c.models()
            after = settled_fds(d.proc.pid, work, c, like=baseline)
        resident = [m for m in models if m["state"] == "resident"]
        dev = st["devices"]["cpu"]
        arenas = collections.Counter(m["arena"] for m in resident)
        checks = {
            "leases_zero": st["leases"] == 0,
            "attach_counts_zero": all(m["attach_count"] == 0 for m in models),
            "used_equals_resident_arenas": dev["used"] == sum(m["nbytes"] for m in resident),
            "nothing_reserved": dev["reserved"] == 0,
            # each resident model holds its arena: one memfd, or its one checkpoint file
            "arena_fds_equal_resident_models": after["memfd"] == arenas["memfd"] and after["checkpoint"] == arenas["file"],
            "both_arenas_churned": counts["arena_file"] > 0 and counts["arena_memfd"] > 0,
            "other_fds_back_to_baseline": other_fds(after) == other_fds(baseline),
            "no_client_crashed": counts["client_crashed"] == 0,
            "no_traceback_in_daemon_log": "Traceback" not in (work / "daemon.log").read_text(),
        }
        requests = sum(v for k, v in counts.items() if k != "client_crashed" and not k.startswith("arena_"))
        summary.update({
            "killed": len(victims), "spawn_s": round(spawn_s, 2), "wall_s": round(wall, 2),
            "peak_connections": peak_conns, "requests_by_survivors": requests,
            "requests_per_s_by_survivors": round(requests / wall, 1), "replies": dict(counts),
            "resident_after": [m["name"] for m in resident], "daemon_fds_before": dict(baseline),
            "daemon_fds_after": dict(after), "checks": checks,
        })
    summary["daemon_exit_clean"] = d.proc.returncode == 0
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = all(checks.values()) and summary["daemon_exit_clean"]
    print("churn:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    else:
        sys.exit(main())
