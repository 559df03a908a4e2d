"""Where a miss's time goes, on one GPU: the per-load phases and concurrent misses.

Under churn with a single engine, 3 GiB loads had run at 12-17 GB/s, against ~30 GB/s
for a 9 GiB model in isolation: a fixed cost per load, now overlapped with the fill. This script measures, in one run:

1. ``isolated``: each model loaded from a warm page cache with nothing to evict, then
   promoted from the host tier with nothing to evict (the loader's and PCIe's rates);
2. ``churn``: one engine attaching the models round robin, so every miss has to make room
   (demoting the least recently used model) before it fills;
3. ``concurrent``: two misses at once vs the same two one after the other, from files
   and from the host tier (should the daemon queue loads or run them together?).

Every figure comes with the daemon's own phase breakdown (its "loaded"/"promoted" log
lines). Run on the GPU host: ``python -m benchmarks profile-loads --out results/profile-loads.json``
(``--load-threads N`` to compare the daemon's loader threads, ``--chunk-loop`` its
``load_chunk_loop``, one run each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from weightcache import Client
from weightcache.tools.daemon_log import load_lines
from weightcache.tools.spawn import DaemonProcess, config_text
from weightcache.tools.synth import write_checkpoint

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default

GIB = 2**30
async def timed_attach(c: Client, name: str) -> dict[str, Any]:
    t = time.perf_counter()
    async with c.attach(name, wait_s=60) as m:
        dt = time.perf_counter() - t
        return {"model": name, "s": dt, "source": m.source, "gb_s": m.nbytes / dt / 1e9}


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size = int(args.size_gib * GIB)
    names = [f"m{i}" for i in range(args.models)]
    paths = {n: write_checkpoint(work / f"{n}.safetensors", size, args.tensors, seed=i) for i, n in enumerate(names)}
    for p in paths.values():  # warm the page cache: these figures are about the loader, not the disk
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
    results: dict[str, Any] = {"size_bytes": size, "models": args.models, "tensors": args.tensors,
                               "load_threads": args.load_threads or "default", "load_chunk_loop": args.chunk_loop}
    sock = tempfile.mktemp(prefix="wc-prof-", suffix=".sock", dir="/tmp")
    cfg = work / "daemon.toml"
    budget = int(args.budget_models * size)
    gpu = args.device != "cpu"
    cfg.write_text(config_text(sock, {args.device: str(budget)},
                               [{"name": n, "path": str(p), "device": args.device} for n, p in paths.items()],
                               {**({"host_budget": f"{args.host_gib}GiB"} if gpu else {}),
                                **({"load_threads": args.load_threads} if args.load_threads else {}),
                                **({"load_chunk_loop": args.chunk_loop} if gpu else {})}))
    log = work / "daemon.log"
    log.unlink(missing_ok=True)  # DaemonProcess appends: a reused --workdir must not count an earlier run's loads
    with DaemonProcess(cfg, sock, log):
        async with Client(sock) as c, Client(sock) as c2:
            if gpu:
                await asyncio.sleep(args.host_gib / 8)  # the pinned pool is pinned in the background
            iso = []
            for n in names[:2]:  # nothing to evict: two fit
                iso.append(await timed_attach(c, n))
                await c.evict(n)  # demoted to the host tier
                if gpu:
                    iso.append(await timed_attach(c, n))  # promoted, nothing to evict
                    await c.evict(n)
            results["isolated"] = iso
            churn = []
            for i in range(args.rounds * len(names)):
                churn.append(await timed_attach(c, names[i % len(names)]))
            results["churn"] = churn
            for n in names:
                try:
                    await c.evict(n)
                    await c.evict(n)  # and out of the host tier
                except Exception:
                    pass
            conc: dict[str, Any] = {}
            # From files: two at once, then the same two one after the other.
            t = time.perf_counter()
            conc["files_together"] = await asyncio.gather(timed_attach(c, names[0]), timed_attach(c2, names[1]))
            conc["files_together_wall_s"] = time.perf_counter() - t
            for n in names[:2]:
                await c.evict(n)  # to the host tier
            t = time.perf_counter()
            conc["host_together"] = await asyncio.gather(timed_attach(c, names[0]), timed_attach(c2, names[1]))
            conc["host_together_wall_s"] = time.perf_counter() - t
            for n in names[:2]:
                await c.evict(n)
                await c.evict(n)
            t = time.perf_counter()
            conc["files_one_by_one"] = [await timed_attach(c, names[0]), await timed_attach(c, names[1])]
            conc["files_one_by_one_wall_s"] = time.perf_counter() - t
            for n in names[:2]:
                await c.evict(n)
            t = time.perf_counter()
            conc["host_one_by_one"] = [await timed_attach(c, names[0]), await timed_attach(c, names[1])]
            conc["host_one_by_one_wall_s"] = time.perf_counter() - t
            results["concurrent"] = conc
            results["status"] = await c.status()
    text = log.read_text()
    results["daemon_loads"] = load_lines(text)
    results["log_tail"] = text[-6000:]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--size-gib", type=float, default=3.0)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--models", type=int, default=4)
    ap.add_argument("--budget-models", type=float, default=2.5)
    ap.add_argument("--host-gib", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--load-threads", type=int, default=0, help="the daemon's load_threads (0: its default)")
    ap.add_argument("--chunk-loop", default="auto", choices=["auto", "c", "tasks", "python"],
                    help="the daemon's load_chunk_loop (GPU loads)")
    ap.add_argument("--out", type=Path, default=RESULTS / "profile-loads.json")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="wc-prof-"))
    work.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run(args, work))
    Path(args.out).write_text(json.dumps(results, indent=1))
    for key in ("isolated", "churn"):
        for r in results[key]:
            print(f"{key:9s} {r['model']} {r['source']:8s} {r['s'] * 1e3:7.1f} ms {r['gb_s']:6.1f} GB/s")
    for k, v in results["concurrent"].items():
        print(k, v if isinstance(v, float) else [f"{r['model']} {r['source']} {r['s'] * 1e3:.0f} ms" for r in v])
    by_verb: dict[str, list[dict[str, Any]]] = {}
    for r in results["daemon_loads"]:
        by_verb.setdefault(r["verb"], []).append(r)
    for verb, rs in by_verb.items():
        keys = sorted({k for r in rs for k in r["phases_ms"]})
        print(verb, "median ms:", {k: round(statistics.median(r["phases_ms"].get(k, 0) for r in rs), 1) for k in keys})


if __name__ == "__main__":
    main()
