#!/usr/bin/env python3
"""What requests waiting for room cost the event loop at each detach.

Two 8 MiB models are attached and a third cannot fit, so ``--connections`` x 32 (the
most one connection may have in flight) loads of it wait for room. Another connection
then attaches and detaches a resident model ``--rounds`` times: every detach notifies
the waiters. Prints the median and max time of those detaches and of a third
connection's ``status`` after each (docs/architecture.md, "Loading").

    python -m benchmarks waiter-herd --connections 60 --rounds 60
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from weightcache import Client
from weightcache.errors import WeightcacheError
from weightcache.tools.spawn import DaemonProcess, config_text
from weightcache.tools.synth import write_checkpoint

MIB = 2**20
PER_CONNECTION = 32  # daemon.max_requests_per_connection's default


async def measure(sock: str, connections: int, rounds: int) -> dict[str, float]:
    async with Client(sock) as holder, Client(sock) as churn, Client(sock) as probe:
        held = [holder.attach(name) for name in "ab"]  # kept referenced: attached until the end
        for h in held:
            await h.__aenter__()
        waiters = [Client(sock) for _ in range(connections)]
        for w in waiters:
            await w.connect()
        pending = [asyncio.ensure_future(w.load("c", wait_s=600)) for w in waiters for _ in range(PER_CONNECTION)]
        await asyncio.sleep(2)  # every load refused once and waiting (a few hundred ms here)
        if any(p.done() for p in pending):
            raise RuntimeError("loads of c did not wait for room: the setup is wrong")
        detach, status = [], []
        for _ in range(rounds):
            lease = churn.attach("a")
            await lease.__aenter__()
            t = time.monotonic()
            await lease.__aexit__(None, None, None)
            detach.append(time.monotonic() - t)
            t = time.monotonic()
            await probe.status()
            status.append(time.monotonic() - t)
        for p in pending:
            p.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for w in waiters:
            await w.close()
    return {"waiting": len(pending), "detach_p50_ms": statistics.median(detach) * 1e3, "detach_max_ms": max(detach) * 1e3,
            "status_p50_ms": statistics.median(status) * 1e3, "status_max_ms": max(status) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="wc-herd-", dir="/tmp") as tmp:
        d = Path(tmp)
        models = []
        for i, name in enumerate("abc"):
            write_checkpoint(d / f"{name}.safetensors", 8 * MIB, 40, seed=i)
            models.append({"name": name, "path": str(d / f"{name}.safetensors")})
        sock = str(d / "d.sock")
        cfg = d / "c.toml"
        cfg.write_text(config_text(sock, {"cpu": "20MiB"}, models, {"max_connections_per_uid": args.connections + 8}))
        with DaemonProcess(cfg, sock, d / "daemon.log"):
            try:
                r = asyncio.run(measure(sock, args.connections, args.rounds))
            except WeightcacheError as exc:
                print(f"failed: {exc}")
                return 1
    print(f"{r['waiting']} loads waiting: detach p50 {r['detach_p50_ms']:.1f} ms (max {r['detach_max_ms']:.1f}), "
          f"status after it p50 {r['status_p50_ms']:.1f} ms (max {r['status_max_ms']:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
