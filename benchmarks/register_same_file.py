"""One register of many fds of one file whose header length says 16 MiB: how long the
daemon takes to refuse it and how much of its memory it keeps (docs/reliability.md,
"What a register may cost"). Starts its own daemon (tenant_register on, CPU budget);
run it as the daemon's user.

    python -m benchmarks register-same-file [--fds 32] [--header-mib 16]   # writes results/register-same-file.json
"""

from __future__ import annotations

import argparse
import array
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import msgpack

from weightcache.protocol import encode_frame
from weightcache.tools.spawn import DaemonProcess, config_text

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def call(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> dict:
    data = encode_frame(msg)
    if fds:
        sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[1:]
    sock.sendall(data)
    buf = b""
    while True:
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        n = int.from_bytes(buf[:4], "big")
        reply, buf = msgpack.unpackb(buf[4 : 4 + n], raw=False), buf[4 + n :]
        if reply.get("id") == msg["id"]:
            return reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fds", type=int, default=32)
    ap.add_argument("--header-mib", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS / "register-same-file.json", help="write the figures here as JSON")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="wc-samefile-", dir="/tmp")
    big = os.path.join(d, "big.safetensors")
    n = args.header_mib * 2**20
    with open(big, "wb") as f:  # a length field, a "{", and a hole: no disk
        f.write(n.to_bytes(8, "little") + b"{")
        f.truncate(8 + n)
    cfg, sock_path = os.path.join(d, "c.toml"), os.path.join(d, "s.sock")
    with open(cfg, "w") as f:
        f.write(config_text(sock_path, {"cpu": "1GiB"}, [], {"tenant_register": True}))
    with DaemonProcess(cfg, sock_path, os.path.join(d, "daemon.log")) as daemon:
        assert daemon.proc is not None
        time.sleep(1)
        before = rss(daemon.proc.pid)
        fds = [os.open(big, os.O_RDONLY) for _ in range(args.fds)]
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock_path)
            call(s, {"id": 1, "op": "hello", "protocol": 1, "client": "register_same_file"})
            t = time.monotonic()
            r = call(s, {"id": 2, "op": "register", "name": "same", "path": d, "fds": len(fds),
                         "files": [[f"f{i}.safetensors" for i in range(len(fds))]]}, fds)
            took = time.monotonic() - t
        after = rss(daemon.proc.pid)
    what = "registered" if r.get("ok") else f"{r['error']['code']}: {r['error']['message'][:100]}"
    print(f"{args.fds} fds of one file with a {args.header_mib} MiB header: {what}")
    print(f"register took {took:.3f} s; daemon RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
          f"(+{(after - before) / 2**20:.1f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"fds": args.fds, "header_mib": args.header_mib, "reply": r, "register_s": took,
                                    "rss_before": before, "rss_after": after}, indent=1) + "\n")


if __name__ == "__main__":
    main()
