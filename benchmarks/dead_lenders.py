"""What a borrowing daemon keeps of lenders that died mid-transfer: its fds and the TCP
sockets UCX left CLOSED, round after round.

Two daemons on loopback, CPU models, as tests/test_peers.py sets them up. Each round: the
lender loads the model, the borrower evicts it and loads it again (paced, so that the
fill is still moving), the lender is SIGKILLed mid-transfer (its lend worker goes with
it), the borrower's load finishes from its files, and a new lender starts on the same
port. A peer whose fill failed is left out for 10 s (peers/choice.py's backoff, doubled
with each failure in a row): each round first waits that out and fills once from the new
lender to completion, which ends the run of failures. After each round, once the borrower
has settled, its fds are counted by kind, and
its TCP sockets by state (TCP_INFO through pidfd_getfd). A count that grows with every
round (``fds``, 2 s after the round; ``fds_at_once``, as the load
returns) is a leak a long-lived daemon with flapping peers would run out of fds with; one
that stays flat is UCX's own bounded bookkeeping.

    python -m benchmarks dead-lenders --rounds 12        # writes results/dead-lenders.json
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from weightcache import Client
from weightcache.loader import fingerprint_files
from weightcache.tools.spawn import DaemonProcess, config_text, free_port
from weightcache.tools.synth import write_checkpoint

RESULTS = Path(__file__).resolve().parent.parent / "results"
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 6: "TIME_WAIT", 7: "CLOSE",
              8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN", 11: "CLOSING"}
SYS_PIDFD_GETFD = 438


def fds_by_kind(pid: int) -> dict[str, int]:
    """The daemon's fds: files, memfds, pipes, Unix sockets, and TCP sockets by state."""
    libc = ctypes.CDLL(None, use_errno=True)
    out: Counter[str] = Counter()
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{name}")
            except FileNotFoundError:
                continue
            if not link.startswith("socket:"):
                out["memfd" if link.startswith("/memfd:") else link.split(":", 1)[0] if ":" in link else "file"] += 1
                continue
            fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(name), 0)
            if fd < 0:
                out["socket (unreadable)"] += 1
                continue
            with socket.socket(fileno=fd) as sock:
                if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                    state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
                    out[f"tcp {TCP_STATES.get(state, state)}"] += 1
                else:
                    out[f"socket family {sock.family.name}"] += 1
    finally:
        os.close(pidfd)
    return dict(sorted(out.items()))


def start(tmp: Path, sockdir: str, i: int, ports: list[int], secret: Path, path: Path, extra: dict[str, str]) -> DaemonProcess:
    sock = os.path.join(sockdir, f"d{i}.sock")
    cfg = tmp / f"d{i}.toml"
    text = config_text(sock, {"cpu": "1GiB"}, [{"name": "m", "path": str(path), "device": "cpu"}],
                       {"log_level": "info", "shutdown_grace_s": 2})
    lines = ["", "[peers]", f'listen = "127.0.0.1:{ports[i]}"', f'addresses = ["127.0.0.1:{ports[1 - i]}"]',
             "refresh_s = 0.3", f'secret_file = "{secret}"', *(f"{k} = {v}" for k, v in extra.items())]
    cfg.write_text(text + "\n".join(lines) + "\n")
    return DaemonProcess(cfg, sock, tmp / f"d{i}.log").start()


async def until(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not met within {timeout} s")
        await asyncio.sleep(0.05)


async def run(rounds: int, mib: int, tmp: Path) -> dict[str, Any]:
    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    path = write_checkpoint(tmp / "m.safetensors", mib << 20, 12, seed=0)
    fp = fingerprint_files(path)
    secret = tmp / "secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex() + "\n")
    ports = [free_port(), free_port()]
    # Paced to ~1 s a fill, so that the kill lands while bytes move.
    # prefer = "peers": a paced fill measures slower than the files, and would not be asked again.
    borrower = start(tmp, sockdir, 1, ports, secret, path, {"fingerprints": f'{{ m = "{fp}" }}', "prefer": '"peers"',
                                                             "max_fill_bytes_per_s": f'"{mib}MiB"'})
    assert borrower.proc is not None
    pid = borrower.proc.pid
    out: dict[str, Any] = {"mib": mib, "rounds": []}
    lender = None
    try:
        async with Client(borrower.socket) as b:
            await b.load("m")  # from the files: the baseline holds the files' arena too
            await b.evict("m")
            out["before"] = fds_by_kind(pid)
            print("before", out["before"], flush=True)
            for r in range(rounds):
                lender = start(tmp, sockdir, 0, ports, secret, path, {})
                assert lender.proc is not None
                async with Client(lender.socket) as a:
                    await a.load("m")

                async def offered() -> bool:
                    st = await b.status()
                    return any(p["retry_in_s"] == 0 and any(m["fingerprint"] == fp for m in p["models"])
                               for p in st["peers"]["peers"])

                await until(offered, 60)
                await b.load("m")  # a good fill: ends the failures in a row
                await b.evict("m")
                load = asyncio.ensure_future(b.load("m"))

                async def moving() -> bool:
                    got = (await b.status())["loading"].get("m")
                    return got is not None and 0 < got["bytes_done"] < got["bytes_total"] // 2

                await until(moving)
                os.kill(lender.proc.pid, signal.SIGKILL)
                lender.proc.wait()
                await asyncio.wait_for(load, 60)
                at_once = fds_by_kind(pid)  # the load back from the files, nothing waited for
                await b.evict("m")
                await asyncio.sleep(2.0)  # UCX's own progress: what it closes on its schedule, it has closed
                row = {"round": r + 1, "fills": (await b.status())["peers"]["fills"], "fds_at_once": at_once,
                       "fds": fds_by_kind(pid)}
                out["rounds"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        if lender is not None and lender.proc is not None and lender.proc.poll() is None:
            lender.stop()
        out["borrower_exit"] = borrower.stop()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--mib", type=int, default=96, help="the model's size; the fill is paced to this many MiB/s")
    p.add_argument("--out", type=Path, default=RESULTS / "dead-lenders.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="wc-dead-lenders-") as tmp:
        res = asyncio.run(run(a.rounds, a.mib, Path(tmp)))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
