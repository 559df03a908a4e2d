"""Several GPUs, one daemon: automatic placement, engines pinned to each GPU,
a TP=2 model placed automatically, and, for one big model, the three ways a replica on a
second GPU gets its bytes, side by side in one run: a peer copy from the first GPU, a
promotion from the pinned host tier, and a load from the page cache.

    python3 -m benchmarks multi-gpu --size-gib 8 --reps 3 --out multi_gpu.json

Needs two GPUs or more (any number: placement uses all of them, the copy comparison the
first two). Each copy is timed two ways: the ``load`` request's wall time seen by the
client, and the daemon's own account of the fill (its log line: allocate, fill, seal,
table). GB/s is the model's tensor bytes over that time. The page cache is warmed (one
read of the file) before the runs, so "files" is a warm page-cache load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default

GIB = 1 << 30
# The daemon's line for a fill (server/residency/fill.py): verb, entry, bytes, seconds, GB/s.
FILL_LINE = re.compile(r"(loaded|promoted|copied from \S+ \(peer\) to) (\S+): \d+ tensors, (\d+) bytes in ([\d.]+)s "
                       r"\(([\d.]+) GB/s")
SOURCE_OF_VERB = {"loaded": "files", "promoted": "host"}


def fills(log: Path, entry: str) -> list[dict[str, Any]]:
    out = []
    for m in FILL_LINE.finditer(log.read_text(errors="replace")):
        if m.group(2) == entry:
            out.append({"source": SOURCE_OF_VERB.get(m.group(1), "peer"), "bytes": int(m.group(3)),
                        "seconds": float(m.group(4)), "gbps": float(m.group(5))})
    return out


def warm(path: Path) -> None:
    with path.open("rb") as f:
        while f.read(64 << 20):
            pass


async def clear(c: Any, entry: str) -> None:
    """Evict one replica down to nothing (device -> host tier -> gone)."""
    for _ in range(3):
        state = next(m["state"] for m in await c.models() if m["name"] == entry)
        if state not in ("resident", "host"):
            return
        await c.evict(entry)


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from weightcache import Client
    from weightcache.tools.spawn import DaemonProcess, config_text
    from weightcache.tools.synth import write_checkpoint

    n = torch.cuda.device_count()
    gpus = [f"cuda:{i}" for i in range(n)]
    big = write_checkpoint(work / "big.safetensors", int(args.size_gib * GIB), 200, seed=1)
    small = {k: write_checkpoint(work / f"{k}.safetensors", GIB // 2, 40, seed=i + 2) for i, k in enumerate("ab")}
    tp = [write_checkpoint(work / f"tp{r}.safetensors", GIB // 2, 40, seed=10 + r) for r in range(2)]
    budget = f"{int(2 * args.size_gib + 4)}GiB"
    sock = tempfile.mktemp(prefix="wc-mg-", suffix=".sock", dir="/tmp")
    cfg, log = work / "daemon.toml", work / "daemon.log"
    models: list[dict[str, Any]] = [{"name": "big", "path": str(big), "device": "auto"},
              *({"name": k, "path": str(p), "device": "auto"} for k, p in small.items()),
              {"name": "tp", "device": "auto", "shards": [{"path": str(p)} for p in tp]}]
    cfg.write_text(config_text(sock, {"cpu": "1GiB", **dict.fromkeys(gpus, budget)}, models,
                               {"host_budget": f"{int(args.size_gib + 1)}GiB", "request_timeout_s": 600}))
    result: dict[str, Any] = {"gpus": n, "gpu_name": torch.cuda.get_device_name(0), "size_gib": args.size_gib,
                              "budget_per_gpu": budget, "placement": [], "pinned_engines": [], "tp": None, "copies": []}
    p2p = {f"{a}->{b}": torch.cuda.can_device_access_peer(b, a) for a in range(n) for b in range(n) if a != b}
    result["peer_access"] = p2p
    with DaemonProcess(cfg, sock, log):
        async with Client(sock) as c:
            # 1. placement of models nobody names a device for, then engines pinned to each GPU
            for k in small:
                m = await c.load(k)
                result["placement"].append({"model": k, "device": m["device"], "reason": m["placement"]["reason"],
                                            "detail": m["placement"]["detail"]})
            for g in gpus:
                t = time.perf_counter()
                async with c.attach("a", device=g) as w:
                    dt = time.perf_counter() - t
                    dev = {x.device.index for x in w.values()}
                    result["pinned_engines"].append({"engine_on": g, "tensors_on": sorted(dev), "source": w.source,
                                                     "attach_s": round(dt, 4)})
            # 2. a TP=2 model placed automatically
            await c.load("tp")
            ranks = sorted((m["rank"], m["device"], m["placement"]["reason"]) for m in await c.models()
                           if (m.get("replica_of") or "").startswith("tp@") and m["state"] == "resident")
            result["tp"] = [{"rank": r, "device": d, "reason": why} for r, d, why in ranks]
            for k in [*small, "tp"]:  # out of the way of the copies
                for m in await c.models():
                    if m["name"].startswith(f"{k}@"):
                        await clear(c, m["name"])
            # 3. peer copy vs host-tier promotion vs page-cache load, same model, same target GPU
            a, b = gpus[0], gpus[1]
            src, dst = f"big@{a}", f"big@{b}"
            warm(big)
            for rep in range(args.reps):
                for source in ("peer", "host", "files"):
                    await clear(c, dst)
                    if source == "peer":
                        await c.load("big", device=a)
                    else:
                        await clear(c, src)  # no peer to copy from
                        if source == "host":
                            await c.load("big", device=b)
                            await c.evict(dst)  # down to the host tier
                    seen = len(fills(log, dst))
                    t = time.perf_counter()
                    m = await c.load("big", device=b)
                    wall = time.perf_counter() - t
                    fill = fills(log, dst)[seen:]
                    got = fill[-1]["source"] if fill else "?"
                    row = {"rep": rep, "asked": source, "source": got, "bytes": m["nbytes"], "wall_s": round(wall, 4),
                           "wall_gbps": round(m["nbytes"] / wall / 1e9, 2),
                           "daemon_s": fill[-1]["seconds"] if fill else None, "daemon_gbps": fill[-1]["gbps"] if fill else None}
                    result["copies"].append(row)
                    print(f"rep {rep} {source:5s}: got {got}, {row['wall_s']:.3f} s wall ({row['wall_gbps']} GB/s), "
                          f"daemon {row['daemon_s']} s ({row['daemon_gbps']} GB/s)", flush=True)
    return result


def table(r: dict[str, Any]) -> str:
    lines = [f"{r['gpus']} x {r['gpu_name']}, model {r['size_gib']} GiB, budget {r['budget_per_gpu']} per GPU",
             "peer access: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in r["peer_access"].items()), "",
             "placement (no device named):"]
    lines += [f"  {p['model']}: {p['detail']}" for p in r["placement"]]
    lines += ["engines pinned to each GPU (attach a, device=...):"]
    lines += [f"  engine on {e['engine_on']}: tensors on {e['tensors_on']}, source {e['source']}, {e['attach_s'] * 1e3:.1f} ms"
              for e in r["pinned_engines"]]
    lines += ["TP=2 model, placed: " + ", ".join(f"rank {t['rank']} on {t['device']} ({t['reason']})" for t in r["tp"] or []), "",
              "| source | runs | wall s (median) | GB/s wall (median) | GB/s daemon fill (median) |",
              "| --- | --- | --- | --- | --- |"]
    for s in ("peer", "host", "files"):
        rows = [x for x in r["copies"] if x["asked"] == s and x["source"] == s]
        if rows:
            d = [x["daemon_gbps"] for x in rows if x["daemon_gbps"] is not None]
            lines.append(f"| {s} | {len(rows)} | {statistics.median(x['wall_s'] for x in rows):.3f} | "
                         f"{statistics.median(x['wall_gbps'] for x in rows):.1f} | "
                         f"{statistics.median(d) if d else float('nan'):.1f} |")
        missed = [x for x in r["copies"] if x["asked"] == s and x["source"] != s]
        if missed:
            lines.append(f"| {s}: {len(missed)} run(s) came from {sorted({x['source'] for x in missed})} instead | | | | |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=8.0, help="the big model's size (the issue asks for >= 4)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=RESULTS / "multi-gpu.json", help="write the results as JSON here")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("multi_gpu.py needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print(f"multi_gpu.py needs two CUDA GPUs or more; this host has "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", file=sys.stderr)
        return 2
    import asyncio

    with tempfile.TemporaryDirectory(prefix="wc-mg-", dir=args.workdir) as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    sys.exit(main())
