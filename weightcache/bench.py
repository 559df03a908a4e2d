"""``weightcache bench``: every contender measured side by side in one run.

For one generated checkpoint (default 1 GiB, 200 bf16 tensors) on one device:

- ``safetensors.torch.load_file`` to the device, page cache warm and cold;
- the weightcache loader (daemon ``load``), warm and cold;
- attach latency through the real client API (p50/p99 over many attaches);
- restart-to-ready of a fresh engine process: the floor (spawn + import torch + CUDA
  init), with load_file, and with attach;
- ``status`` latency while a bigger model loads (the control plane must stay fast).

Cold runs drop the file's pages with ``posix_fadvise(DONTNEED)`` (no root needed);
each figure says which it is. Results print as a table and go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .restart import time_restart
from .spawn import DaemonProcess, config_text
from .synth import write_checkpoint

GIB = 2**30


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    os.sync()  # DONTNEED skips dirty pages
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: str | os.PathLike[str]) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def touch_all(tensors: Any) -> None:
    """Read every byte once (what a first forward pass does), device-side if on a GPU."""
    import torch

    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).max()
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()


def time_load_file_and_touch(path: Path, device: str) -> float:
    from safetensors.torch import load_file

    t = time.perf_counter()
    touch_all(load_file(str(path), device=device))
    return time.perf_counter() - t


async def _attach_and_touch(sock: str, name: str) -> float:
    from .client import Client

    async with Client(sock) as c:
        t = time.perf_counter()
        async with c.attach(name) as m:
            touch_all(m)
            return time.perf_counter() - t


def time_load_file(path: Path, device: str) -> float:
    import torch
    from safetensors.torch import load_file

    t = time.perf_counter()
    tensors = load_file(str(path), device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del tensors
    return dt


async def _evict_fully(c: Any, name: str) -> None:
    """Evict until the model is gone from every tier (with a host tier, one evict only
    demotes it, and the next load would be a promotion, not a read)."""
    for _ in range(3):
        if (await c.evict(name))["state"] not in ("resident", "host"):
            return


async def _daemon_load(sock: str, name: str) -> float:
    from .client import Client

    async with Client(sock) as c:
        await _evict_fully(c, name)
        t = time.perf_counter()
        await c.load(name)
        return time.perf_counter() - t


async def _host_tier_round_trip(sock: str, name: str) -> tuple[float, float]:
    """(demote time, promote time): evict once (device -> pinned host), load (-> device)."""
    from .client import Client

    async with Client(sock) as c:
        await c.load(name)
        t = time.perf_counter()
        assert (await c.evict(name))["state"] == "host", "the host tier did not take the model"
        demote = time.perf_counter() - t
        t = time.perf_counter()
        await c.load(name)
        return demote, time.perf_counter() - t


def disk_ceiling(path: Path, threads: int = 8, chunk: int = 16 << 20) -> float:
    """Cold read rate of the file with parallel O_DIRECT preads and nothing else (no
    copies): what any loader can at best reach from this disk. Bytes per second."""
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from .loader.reader import pread_direct

    drop_page_cache(path)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    local = threading.local()

    def read(off: int) -> None:
        if not hasattr(local, "buf"):
            local.buf = memoryview(mmap.mmap(-1, chunk + 8192))  # anonymous maps are page-aligned
        pread_direct(fd, local.buf, off, min(chunk, size - off))

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(0, size, chunk)))
    dt = time.perf_counter() - t
    os.close(fd)
    return size / dt


def time_fastsafetensors(path: Path, device: str) -> float:
    import torch
    from fastsafetensors import fastsafe_open

    t = time.perf_counter()
    with fastsafe_open(str(path), device=device, nogds=True) as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (not a dict)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del tensors
    return dt


async def _attach_latencies(sock: str, name: str, n: int) -> list[float]:
    from .client import Client

    out = []
    async with Client(sock) as c:
        for _ in range(n):
            t = time.perf_counter()
            async with c.attach(name) as m:
                out.append(time.perf_counter() - t)
                assert len(m)
            del m  # unmap now (a sync on CUDA), not inside the next attach's timing
    return out


async def _status_under_load(sock: str, name: str) -> dict[str, Any]:
    # This process holds torch's large heap: a gen-2 collection here took tens of ms and
    # showed up as *daemon* latency. Freeze the heap so the figure is the daemon's.
    gc.collect()
    gc.freeze()
    try:
        return await _status_probe(sock, name)
    finally:
        gc.unfreeze()


async def _status_probe(sock: str, name: str) -> dict[str, Any]:
    from .client import Client

    async with Client(sock) as c, Client(sock) as s:
        await _evict_fully(c, name)
        load = asyncio.ensure_future(c.load(name))
        lat: list[float] = []
        seen_loading = 0
        while not load.done():
            t = time.perf_counter()
            st = await s.status()
            lat.append(time.perf_counter() - t)
            seen_loading += name in st["loading"]
            await asyncio.sleep(0.001)
        t0 = time.perf_counter()
        await load
        return {"n": len(lat), "n_during_load": seen_loading, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
                "max_ms": max(lat) * 1e3, "load_tail_s": time.perf_counter() - t0}


def run_bench(args: argparse.Namespace) -> int:
    import torch

    console = Console()
    device = args.device
    work = Path(args.workdir or "/tmp/wc-bench")
    work.mkdir(parents=True, exist_ok=True)
    size = int(args.size_gib * GIB)
    ckpt = work / f"bench-{args.size_gib:g}g-{args.tensors}t.safetensors"
    big = work / f"big-{args.big_gib:g}g.safetensors"
    with console.status("generating checkpoints"):
        if not ckpt.exists():
            write_checkpoint(ckpt, size, args.tensors, seed=1)
        if not big.exists():
            write_checkpoint(big, int(args.big_gib * GIB), 40, seed=2)
    nbytes = ckpt.stat().st_size
    r: dict[str, Any] = {
        "device": device, "checkpoint_bytes": nbytes, "tensors": args.tensors, "python": platform.python_version(),
        "torch": torch.__version__, "cpus": os.cpu_count(), "host": platform.node(),
    }
    if device.startswith("cuda"):
        r["gpu"] = torch.cuda.get_device_name(torch.device(device))

    # -- safetensors.load_file, warm then cold ---------------------------------------
    warm_page_cache(ckpt)
    time_load_file(ckpt, device)  # first call pays one-time costs (CUDA context, allocator)
    warm = [time_load_file(ckpt, device) for _ in range(args.reps)]
    cold = []
    for _ in range(args.cold_reps):
        drop_page_cache(ckpt)
        cold.append(time_load_file(ckpt, device))
    r["load_file_warm_s"] = statistics.median(warm)
    warm_page_cache(ckpt)
    r["load_file_touch_warm_s"] = statistics.median(time_load_file_and_touch(ckpt, device) for _ in range(args.reps))
    r["load_file_cold_s"] = statistics.median(cold) if cold else None
    if args.cold_reps:
        try:
            r["disk_ceiling_GBps"] = max(disk_ceiling(ckpt) for _ in range(args.cold_reps)) / 1e9
        except OSError as exc:  # a file system without O_DIRECT
            r["disk_ceiling_error"] = str(exc)
    try:  # the peer loader, where it can be installed
        time_fastsafetensors(ckpt, device)
        r["fastsafetensors_warm_s"] = statistics.median(time_fastsafetensors(ckpt, device) for _ in range(args.reps))
        cold = []
        for _ in range(args.cold_reps):
            drop_page_cache(ckpt)
            cold.append(time_fastsafetensors(ckpt, device))
        r["fastsafetensors_cold_s"] = statistics.median(cold) if cold else None
    except Exception as exc:  # not installed, or fails on this host: say so in the results
        r["fastsafetensors_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    sock = str(work / "bench.sock")
    budget = {device: f"{int((nbytes + big.stat().st_size) * 1.1)}"}
    daemon_opts: dict[str, Any] = {"log_level": "info"}
    if device.startswith("cuda"):
        daemon_opts["host_budget"] = int(nbytes * 1.1)  # room to demote the bench model
    cfg = work / "bench.toml"
    cfg.write_text(config_text(sock, budget, [{"name": "bench", "path": str(ckpt), "device": device},
                                              {"name": "big", "path": str(big), "device": device}],
                               daemon=daemon_opts))
    log = work / "bench-daemon.log"
    log.unlink(missing_ok=True)
    with DaemonProcess(cfg, sock, log):
        # -- weightcache loader, warm then cold --------------------------------------
        warm_page_cache(ckpt)
        asyncio.run(_daemon_load(sock, "bench"))
        wl = [asyncio.run(_daemon_load(sock, "bench")) for _ in range(args.reps)]
        cl = []
        for _ in range(args.cold_reps):
            drop_page_cache(ckpt)
            cl.append(asyncio.run(_daemon_load(sock, "bench")))
        r["loader_warm_s"] = statistics.median(wl)
        r["loader_cold_s"] = statistics.median(cl) if cl else None

        # -- attach latency ------------------------------------------------------------
        lat = asyncio.run(_attach_latencies(sock, "bench", args.attaches))
        r["attach_n"] = len(lat)
        r["attach_p50_ms"] = pct(lat, 50) * 1e3
        r["attach_p99_ms"] = pct(lat, 99) * 1e3
        # Ready to compute: both ways, then every byte read once. In a fresh mapping each
        # time, so first-touch costs (page faults) are counted for both.
        r["attach_touch_s"] = statistics.median(asyncio.run(_attach_and_touch(sock, "bench")) for _ in range(args.reps))

        # -- host tier -----------------------------------------------------------------
        if device.startswith("cuda"):
            trips = [asyncio.run(_host_tier_round_trip(sock, "bench")) for _ in range(args.reps)]
            r["host_demote_s"] = statistics.median(t[0] for t in trips)
            r["host_promote_s"] = statistics.median(t[1] for t in trips)

        # -- restart to ready ------------------------------------------------------------
        restarts: dict[str, list[Any]] = {"floor": [], "disk": [], "cache": []}
        warm_page_cache(ckpt)
        for _ in range(args.restarts):
            for mode in ("floor", "disk", "cache"):
                restarts[mode].append(time_restart(mode, path=str(ckpt), model="bench", socket=sock, device=device))
        for mode, runs in restarts.items():
            r[f"restart_{mode}_s"] = statistics.median(x.ready_s for x in runs)
            r[f"restart_{mode}_weights_s"] = statistics.median(x.weights_s for x in runs)
        r["restart_cache_minus_floor_ms"] = (r["restart_cache_s"] - r["restart_floor_s"]) * 1e3
        r["restart_checksums_equal"] = len({x.checksum for x in restarts["disk"] + restarts["cache"]}) == 1
        extra = [x.extra_device_bytes for x in restarts["cache"] if x.extra_device_bytes is not None]
        r["attached_client_extra_device_bytes"] = max(extra) if extra else None

        # -- control plane during a load -------------------------------------------------
        drop_page_cache(big)
        r["status_during_load"] = asyncio.run(_status_under_load(sock, "big"))
        r["big_bytes"] = big.stat().st_size

    _report(console, r, nbytes)
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=1, default=str) + "\n")
        console.print(f"wrote {args.out}")
        png = Path(args.out).with_suffix(".png")
        if write_chart(r, png):
            console.print(f"wrote {png}")
        else:
            console.print("matplotlib is not installed: no chart (pip install matplotlib; weightcache bench --chart FILE.json)")
    return 0


def write_chart(r: dict[str, Any], png: Path) -> bool:
    """A bar chart of GB/s per way of getting the weights onto the device. False when
    matplotlib is missing (it is optional: the numbers are in the JSON either way)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n = r["checkpoint_bytes"]
    timed = [("load_file warm", r.get("load_file_warm_s")), ("load_file cold", r.get("load_file_cold_s")),
            ("fastsafetensors warm", r.get("fastsafetensors_warm_s")), ("fastsafetensors cold", r.get("fastsafetensors_cold_s")),
            ("weightcache loader warm", r.get("loader_warm_s")), ("weightcache loader cold", r.get("loader_cold_s")),
            ("host-tier promotion", r.get("host_promote_s"))]
    rows: list[tuple[str, float]] = [(label, n / s / 1e9) for label, s in timed if s]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh([x[0] for x in rows][::-1], [x[1] for x in rows][::-1],
            color=["#4c72b0" if "weightcache" in x[0] or "host" in x[0] else "#999999" for x in rows][::-1])
    for i, (_, v) in enumerate(rows[::-1]):
        ax.text(v, i, f" {v:.1f}", va="center")
    ax.set_xlabel("GB/s into device memory (higher is better)")
    ax.set_title(f"{r.get('gpu', 'CPU')}: {n / GIB:.1f} GiB, {r['tensors']} tensors; attach p50 {r['attach_p50_ms']:.2f} ms")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def _report(console: Console, r: dict[str, Any], nbytes: int) -> None:
    def gbps(s: float | None) -> str:
        return "-" if not s else f"{nbytes / s / 1e9:.2f}"

    t = Table(title=f"weightcache bench on {r['device']} ({r.get('gpu', 'CPU')}), {nbytes / GIB:.2f} GiB, {r['tensors']} tensors")
    t.add_column("what")
    t.add_column("time", justify="right")
    t.add_column("GB/s", justify="right")
    t.add_column("vs load_file (same run)", justify="right")
    lw, lc = r["load_file_warm_s"], r["load_file_cold_s"]
    t.add_row("safetensors load_file, page cache warm", f"{lw * 1e3:.1f} ms", gbps(lw), "1x")
    if lc:
        t.add_row("safetensors load_file, cold", f"{lc * 1e3:.1f} ms", gbps(lc), "1x")
    t.add_row("weightcache loader, warm", f"{r['loader_warm_s'] * 1e3:.1f} ms", gbps(r["loader_warm_s"]), f"{lw / r['loader_warm_s']:.2f}x")
    if r["loader_cold_s"]:
        t.add_row("weightcache loader, cold", f"{r['loader_cold_s'] * 1e3:.1f} ms", gbps(r["loader_cold_s"]),
                  f"{lc / r['loader_cold_s']:.2f}x" if lc else "-")
    if r.get("disk_ceiling_GBps"):
        share = f", loader cold = {nbytes / r['loader_cold_s'] / 1e9 / r['disk_ceiling_GBps']:.0%} of it" if r["loader_cold_s"] else ""
        t.add_row("disk ceiling: parallel O_DIRECT reads alone", "", f"{r['disk_ceiling_GBps']:.2f}", share.lstrip(", "))
    if r.get("fastsafetensors_warm_s"):
        fw, fc = r["fastsafetensors_warm_s"], r.get("fastsafetensors_cold_s")
        t.add_row("fastsafetensors, warm", f"{fw * 1e3:.1f} ms", gbps(fw), f"{lw / fw:.2f}x")
        if fc:
            t.add_row("fastsafetensors, cold", f"{fc * 1e3:.1f} ms", gbps(fc), f"{lc / fc:.2f}x" if lc else "-")
    if r.get("host_promote_s"):
        t.add_row("host tier: demote (device -> pinned host)", f"{r['host_demote_s'] * 1e3:.1f} ms", gbps(r["host_demote_s"]), "")
        t.add_row("host tier: promote (pinned host -> device)", f"{r['host_promote_s'] * 1e3:.1f} ms", gbps(r["host_promote_s"]),
                  f"{lw / r['host_promote_s']:.2f}x")
    t.add_row(f"attach p50 (n={r['attach_n']})", f"{r['attach_p50_ms']:.2f} ms", "", f"{lw * 1e3 / r['attach_p50_ms']:.0f}x faster than warm")
    t.add_row("attach p99", f"{r['attach_p99_ms']:.2f} ms", "", "")
    lt, at = r["load_file_touch_warm_s"], r["attach_touch_s"]
    t.add_row("load_file + read every byte once, warm", f"{lt * 1e3:.1f} ms", "", "1x")
    t.add_row("attach + read every byte once", f"{at * 1e3:.1f} ms", "", f"{lt / at:.2f}x")
    t.add_row("engine restart: floor (spawn+import torch)", f"{r['restart_floor_s']:.3f} s", "", "")
    t.add_row("engine restart: with load_file", f"{r['restart_disk_s']:.3f} s", "", "")
    t.add_row("engine restart: with attach", f"{r['restart_cache_s']:.3f} s", "",
              f"floor + {r['restart_cache_minus_floor_ms']:.0f} ms")
    s = r["status_during_load"]
    t.add_row(f"status during a {r['big_bytes'] / GIB:.1f} GiB cold load (n={s['n']})",
              f"p50 {s['p50_ms']:.2f} / p99 {s['p99_ms']:.2f} / max {s['max_ms']:.2f} ms", "", "")
    console.print(t)
    console.print(f"disk and cache restarts saw identical weights: {r['restart_checksums_equal']}; "
                  f"extra device memory of an attached client: {r['attached_client_extra_device_bytes']}")
