#!/usr/bin/env python3
"""A daemon's RSS before and after its first loads, for two ``load_threads``.

On a GPU budget the abuse stress saw the daemon's RSS grow by 280-305 MiB (bound 512)
against ~130 on the CPU. The CUDA backend keeps one pinned staging buffer of
``load_chunk_bytes`` per loader thread for the daemon's life (backends/pinned.py), and
pinned pages are resident. If that is the difference, the growth at the first load
follows ``load_threads x load_chunk_bytes``. Each daemon: start, load a 64 KiB model
(5 tensors), an 8 MiB model (40 tensors), evict both, load the first again; RSS after
each step. Prints one JSON object.

    python3 -m benchmarks daemon-rss --device cuda:0 --threads 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from weightcache.client import Client
from weightcache.tools.spawn import DaemonProcess, config_text
from weightcache.tools.synth import write_checkpoint

MIB = 2**20


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def steps(sock: str, pid: int) -> dict[str, float]:
    out = {"started": rss_mib(pid)}
    async with Client(sock) as c:
        for step, op, model in (("tiny loaded", "load", "tiny"), ("small loaded", "load", "small"),
                                ("tiny evicted", "evict", "tiny"), ("small evicted", "evict", "small"),
                                ("tiny loaded again", "load", "tiny")):
            await getattr(c, op)(model)
            time.sleep(0.3)  # let frees settle before the sample
            out[step] = rss_mib(pid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--threads", default="1,8", help="load_threads to try, comma-separated")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wc-rss-"))
    tiny = write_checkpoint(work / "tiny.safetensors", 64 * 1024, 5, seed=1)
    small = write_checkpoint(work / "small.safetensors", 8 * MIB, 40, seed=2)
    results: dict[str, Any] = {"device": args.device, "load_chunk_bytes": 16 * MIB, "runs": {}}
    for threads in (int(t) for t in args.threads.split(",")):
        sock = str(work / f"d{threads}.sock")
        cfg = work / f"d{threads}.toml"
        models = [{"name": "tiny", "path": str(tiny), "device": args.device},
                  {"name": "small", "path": str(small), "device": args.device}]
        cfg.write_text(config_text(sock, {args.device: "256MiB"}, models, {"load_threads": threads, "log_level": "warning"}))
        daemon = DaemonProcess(cfg, sock, work / f"d{threads}.log").start()
        try:
            assert daemon.proc is not None
            run = asyncio.run(steps(sock, daemon.proc.pid))
        finally:
            daemon.stop()
        run["growth at the first load"] = round(run["tiny loaded"] - run["started"], 1)
        run["staging, load_threads x load_chunk_bytes"] = threads * 16
        results["runs"][str(threads)] = {k: round(v, 1) for k, v in run.items()}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
