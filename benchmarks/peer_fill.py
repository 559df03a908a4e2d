"""A model filled from a neighbour daemon over NIXL, against the same daemon's cold load
from its files and against NIXL's raw rate between two processes.

One checkpoint (default 1 GiB, 64 bf16 tensors) is written twice, in two directories:
the lender daemon serves ``a/model.safetensors`` (a page-cache arena, as its load makes
it), the borrower's config names ``b/model.safetensors`` with the fingerprint pinned.
Then, ``--rounds`` times, interleaved:

- ``fill``: the borrower evicts the model and loads it: filled from the lender over NIXL
  (source "neighbour"; every piece hashed, the fingerprint checked; ``prefer = "peers"``,
  or the borrower would read its files once it had measured them faster);
- ``files (cold)``: the lender evicts its copy (no peer offers it), the borrower's file
  is dropped from the page cache (POSIX_FADV_DONTNEED, checked with mincore probes),
  and the borrower loads it from its files; then the lender loads it again;
- ``raw``: two fresh processes with the daemon's own NIXL agent code, the reader's
  first (untimed) read warming UCX's connection
  (weightcache/peers/transport.py): one maps ``a/model.safetensors`` read-only with its
  pages mapped (MAP_POPULATE, as the lender daemon's file arena has them) and registers
  it, the other reads all of it into a fresh, fallocated memfd, in the fill's
  request size and window; ``raw (one request)`` reads it in one request; ``raw +
  allocating the memfd`` counts the memfd's ``posix_fallocate`` too, which the daemon's
  fill pays (its arena) and the plain raw rows do not.

Rates are data bytes over the wall time of the client's ``load`` call (fill, files) or
of the read (raw). Writes JSON to ``--out``.

    python -m benchmarks peer-fill --gib 1 --rounds 7 --out results/peer-fill-cpu.json

``--vram 0,1`` measures only NIXL's raw GPU-to-GPU rate between two processes (one per
GPU, or ``0,0`` for one GPU), with the fill's request size and window, into memory
zeroed before each round, and checks that every byte arrived (a sum of the words at both
ends): the bar a GPU fill is held to. Both ends are exportable VMM chunks, as the
daemon's CUDA arenas are (``--vram-alloc torch``: torch's allocator, cudaMalloc).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from weightcache import Client
from weightcache.config import PeersConfig
from weightcache.loader import fingerprint_files
from weightcache.loader.preads import resident_fraction
from weightcache.peers.fill import TASK_BYTES, WINDOW
from weightcache.protocol.framing import HEADER, decode_payload, encode_frame
from weightcache.tools.spawn import DaemonProcess, config_text, free_port
from weightcache.tools.synth import write_checkpoint

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default



def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(encode_frame(msg))


def recv(sock: socket.socket) -> dict[str, Any]:
    (n,) = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
    return decode_payload(sock.recv(n, socket.MSG_WAITALL), max_bin_len=1 << 24, max_str_len=1 << 24)


# -- raw NIXL: two processes, the daemon's transport code, no daemon --------------------
def raw_lender(path: str) -> None:
    """Map ``path`` read-only and populated (as a file arena holds it: in page cache, its
    pages mapped when the daemon loads it), register it, serve one read."""
    from weightcache.backends.page_cache import map_readonly
    from weightcache.peers.transport import Transport

    t = Transport()
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    addr = map_readonly(fd, size, populate=True)
    reg = t.register([(addr, size)], "DRAM")
    stop = threading.Event()
    pump = threading.Thread(target=t.progress, args=(stop,))  # as the lender daemon does while it lends
    with socket.create_server(("127.0.0.1", 0)) as ls:
        print(f"PORT {ls.getsockname()[1]}", flush=True)  # NIXL logs to stdout too: the line is marked
        conn, _ = ls.accept()
        with conn:
            send(conn, {"metadata": t.metadata(), "addr": addr, "nbytes": size})
            pump.start()
            recv(conn)  # done
    stop.set()
    pump.join()
    t.deregister(reg)


def raw_read(port: int, one_request: bool, allocate_timed: bool = False) -> dict[str, float]:
    from weightcache.backends.cpu import _address
    from weightcache.peers.transport import Extent, Transport

    t = Transport()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        info = recv(conn)
        size = info["nbytes"]
        # One untimed read first: a fresh process's first read sets up UCX's connection to
        # the lender (the daemons' first fill took 2.5-3.0 s, their next ~0.6 s); the timed
        # read is a warm one, as the fill rows' median is.
        warm = mmap.mmap(-1, TASK_BYTES)
        t.read(info["metadata"], [Extent(_address(warm), info["addr"], min(TASK_BYTES, size))], "DRAM", 0, "DRAM", 0,
               window=1, on_done=lambda _d, _n: None, stop=lambda: None, deadline=time.monotonic() + 600)
        warm.close()
        ta = time.monotonic()
        fd = os.memfd_create("raw-target")
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # as the daemon's memfd arena
        m = mmap.mmap(fd, size)
        base = _address(m)
        step = size if one_request else TASK_BYTES
        extents = [Extent(base + o, info["addr"] + o, min(step, size - o)) for o in range(0, size, step)]
        t0 = ta if allocate_timed else time.monotonic()
        t.read(info["metadata"], extents, "DRAM", 0, "DRAM", 0, window=WINDOW, on_done=lambda _d, _n: None,
               stop=lambda: None, deadline=t0 + 600)
        dt = time.monotonic() - t0
        send(conn, {"op": "done"})
        m.close()
        os.close(fd)
    return {"bytes": size, "seconds": dt}


def run_raw(path: Path, one_request: bool, allocate_timed: bool = False) -> dict[str, float]:
    lender = subprocess.Popen([sys.executable, __file__, "raw-lender", str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert lender.stdout is not None
        port = next(int(line.split()[1]) for line in lender.stdout if line.startswith("PORT "))
        out = subprocess.run([sys.executable, __file__, "raw-read", str(port), "1" if one_request else "0",
                              "1" if allocate_timed else "0"],
                             check=True, capture_output=True, text=True)
        return json.loads(next(x[7:] for x in out.stdout.splitlines() if x.startswith("RESULT ")))  # type: ignore[no-any-return]
    finally:
        lender.wait(timeout=60)


# -- raw NIXL between GPUs (for the H200; no daemon can lend VRAM yet) ----------------------
def vram_buffer(nbytes: int, alloc: str) -> Any:
    """A uint8 tensor of ``nbytes`` on this process's GPU: torch's allocator (cudaMalloc)
    or, with ``alloc`` "vmm", exportable VMM chunks of up to 1 GiB mapped back to back,
    the memory the daemon's CUDA arenas are (client/libcuda.py's ``create_exported``)."""
    import torch

    dev = torch.cuda.current_device()
    if alloc == "torch":
        return torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
    if alloc == "vmm-fabric":
        return _fabric_buffer(nbytes, dev)
    from weightcache.client.libcuda import driver

    torch.cuda.init()
    drv = driver()
    g = drv.granularity(dev)
    left, sizes = -(-nbytes // g) * g, []
    while left:
        sizes.append(min(left, (1 << 30) // g * g))
        left -= sizes[-1]
    with drv.current(drv.primary_context(dev)):
        va, fds = drv.create_exported(sizes, dev)
    for fd in fds:
        os.close(fd)

    class Range:  # the process keeps the range until it exits
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (va, False), "version": 3, "strides": None}

    return torch.as_tensor(Range(), device=f"cuda:{dev}")


def _fabric_buffer(nbytes: int, dev: int) -> Any:
    """VMM chunks exportable as a POSIX fd and as a fabric handle: UCX's cuda_ipc
    recognises VMM memory for IPC by its fabric handle (a probe: not what the daemon
    allocates)."""
    import torch
    from cuda.bindings import driver as cu

    def check(res: Any) -> Any:
        err, *rest = res if isinstance(res, tuple) else (res,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {err}")
        return rest[0] if len(rest) == 1 else rest

    torch.cuda.init()
    torch.empty(1, device=f"cuda:{dev}")  # the primary context, current
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = (cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                 | cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    g = check(cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
    size = -(-nbytes // g) * g
    h = check(cu.cuMemCreate(size, prop, 0))
    va = check(cu.cuMemAddressReserve(size, 0, 0, 0))
    check(cu.cuMemMap(va, size, 0, h, 0))
    desc = cu.CUmemAccessDesc()
    desc.location = prop.location
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    check(cu.cuMemSetAccess(va, size, [desc], 1))

    class Range:  # the process keeps the range until it exits
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (int(va), False), "version": 3,
                                    "strides": None}

    return torch.as_tensor(Range(), device=f"cuda:{dev}")


def vram_sum(buf: Any) -> int:
    """The bytes' sum as int32 words: equal on both ends when every byte arrived."""
    import torch

    return int(buf[: buf.numel() // 4 * 4].view(torch.int32).sum(dtype=torch.int64))


def vram_lender(nbytes: int, alloc: str) -> None:
    import torch

    from weightcache.peers.transport import Transport

    buf = vram_buffer(nbytes, alloc)
    buf.copy_(torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=buf.device))
    torch.cuda.synchronize()
    t = Transport()
    reg = t.register([(buf.data_ptr(), nbytes)], "VRAM", torch.cuda.current_device())
    stop = threading.Event()
    pump = threading.Thread(target=t.progress, args=(stop,))
    with socket.create_server(("127.0.0.1", 0)) as ls:
        print(f"PORT {ls.getsockname()[1]}", flush=True)
        conn, _ = ls.accept()
        with conn:
            send(conn, {"metadata": t.metadata(), "addr": buf.data_ptr(), "nbytes": nbytes,
                        "device_id": torch.cuda.current_device(), "sum": vram_sum(buf)})
            pump.start()
            recv(conn)
    stop.set()
    pump.join()
    t.deregister(reg)


def vram_read(port: int, rounds: int, alloc: str, step: int = TASK_BYTES, window: int = WINDOW) -> dict[str, Any]:
    import torch

    from weightcache.peers.transport import Extent, Transport

    t = Transport()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        info = recv(conn)
        size = info["nbytes"]
        dst = vram_buffer(size, alloc)
        dev = torch.cuda.current_device()
        out = []
        for _ in range(rounds):
            dst.zero_()
            torch.cuda.synchronize()
            extents = [Extent(dst.data_ptr() + o, info["addr"] + o, min(step, size - o)) for o in range(0, size, step)]
            t0 = time.monotonic()
            t.read(info["metadata"], extents, "VRAM", dev, "VRAM", info["device_id"], window=window,
                   on_done=lambda _d, _n: None, stop=lambda: None, deadline=t0 + 600)
            out.append(time.monotonic() - t0)
        exact = vram_sum(dst) == info["sum"]
        send(conn, {"op": "done"})
    return {"seconds": out, "bytes_arrived": exact}


def run_vram(gib: float, rounds: int, lender_gpu: str, reader_gpu: str, alloc: str, step: int = TASK_BYTES,
             window: int = WINDOW) -> dict[str, Any]:
    nbytes = int(gib * 2**30)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": lender_gpu}
    lender = subprocess.Popen([sys.executable, __file__, "vram-lender", str(nbytes), alloc], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert lender.stdout is not None
        port = next(int(line.split()[1]) for line in lender.stdout if line.startswith("PORT "))
        out = subprocess.run([sys.executable, __file__, "vram-read", str(port), str(rounds), alloc, str(step), str(window)],
                             capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": reader_gpu})
        # UCX's own lines (UCX_PROTO_INFO=y names the protocol and transport it chose)
        sys.stderr.write("".join(x + "\n" for x in out.stdout.splitlines() if not x.startswith("RESULT "))[-6000:])
        sys.stderr.write(out.stderr[-4000:])
        if out.returncode:
            raise RuntimeError(f"the reader failed (exit {out.returncode}): {out.stderr[-3000:]}")
        got = json.loads(next(x[7:] for x in out.stdout.splitlines() if x.startswith("RESULT ")))
    finally:
        lender.wait(timeout=120)
    secs = got["seconds"]
    return {"gib": gib, "alloc": alloc, "lender_gpu": lender_gpu, "reader_gpu": reader_gpu, "seconds": secs,
            "bytes_arrived": got["bytes_arrived"], "gb_per_s_median": nbytes / statistics.median(secs) / 1e9,
            "gb_per_s_best": nbytes / min(secs) / 1e9}


# -- the daemons --------------------------------------------------------------------------
def start(tmp: Path, i: int, model: Path, ports: list[int], fp: str | None, device: str, ring: str = "") -> DaemonProcess:
    sock = str(tmp / f"d{i}.sock")
    budget = f"{max(6, 2 * model.stat().st_size // 2**30 + 2)}GiB"  # the model, and room for a second copy in flight
    text = config_text(sock, {device: budget}, [{"name": "m", "path": str(model), "device": device}], {"log_level": "info"})
    key = tmp / "peer.key"  # both daemons prove the same key (peers/auth.py)
    if not key.exists():
        key.write_bytes(os.urandom(32).hex().encode() + b"\n")
        key.chmod(0o600)
    text += (f'\n[peers]\nlisten = "127.0.0.1:{ports[i]}"\naddresses = ["127.0.0.1:{ports[1 - i]}"]\nrefresh_s = 0.2\n'
             f'secret_file = "{key}"\n'
             + (f'fingerprints = {{ m = "{fp}" }}\n' if fp else "")
             + (f'gpu_ring_bytes = "{ring}"\n' if ring else "")
             + 'prefer = "peers"\n'  # every round's fill from the peer: what is measured here, whatever is faster
             # The lender's window of LENDS_PER_MODEL lends (5 x timeout_s, peers/server.py) kept
             # short, so that every round is lent: at the default 120 s, the 5th round was refused.
             + ('timeout_s = 4\n' if i == 0 else ""))
    tag = f"d{i}-{ring}" if ring else f"d{i}"
    cfg = tmp / f"{tag}.toml"
    cfg.write_text(text)
    return DaemonProcess(cfg, sock, tmp / f"{tag}.log").start()


async def offers(c: Client) -> int:
    st = await c.status()
    return sum(len(p["models"]) for p in st["peers"]["peers"])


async def until(pred: Any, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > end:
            raise TimeoutError
        await asyncio.sleep(0.05)


async def pair_rounds(args: argparse.Namespace, lender: DaemonProcess, borrower: DaemonProcess, rows: dict[str, list[float]],
                      fill_row: str, files_row: str, a_path: Path, b_path: Path, fp: str, gpu: bool) -> None:
    """``args.rounds`` rounds on one pair of daemons, interleaved: a fill from the lender,
    the borrower's load from its files, and (on the CPU) the raw rows; then both stop."""
    try:
        async with Client(lender.socket) as a, Client(borrower.socket) as b:
            await a.load("m")
            for _ in range(args.rounds):
                # fill from the lender
                await until(lambda: offers(b))
                t0 = time.monotonic()
                await b.load("m")
                dt = time.monotonic() - t0
                row = next(m for m in await b.models() if m["name"] == "m")
                assert row["source"] == "neighbour" and row["fingerprint"] == fp, row
                rows[fill_row].append(dt)
                await b.evict("m")
                # cold from the files: nobody offers it, its pages dropped
                await until(lambda: _no_leases(a))  # the lend's lease ends as the lender reads "done"
                await a.evict("m")
                await until(lambda: _none(offers(b)))
                fd = os.open(b_path, os.O_RDONLY)
                try:
                    # The evicted arena's mapping goes in a thread: until then pages stay. On
                    # the GPU the files' row is the loader from the page cache.
                    for _ in range(0 if gpu else 50):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        warm = resident_fraction(fd, os.fstat(fd).st_size, samples=256)
                        if warm < 0.02:
                            break
                        await asyncio.sleep(0.1)
                finally:
                    os.close(fd)
                if not gpu:
                    assert warm < 0.1, f"{warm:.0%} of the file still in page cache"
                else:
                    await b.load("m")  # the page cache warmed by a load of its own, then evicted
                    await b.evict("m")
                t0 = time.monotonic()
                await b.load("m")
                dt = time.monotonic() - t0
                row = next(m for m in await b.models() if m["name"] == "m")
                assert row["source"] == "files", row
                rows[files_row].append(dt)
                await b.evict("m")
                await a.load("m")
                # raw NIXL between two processes
                for key, one, alloc in (() if gpu else (("raw", False, False), ("raw (one request)", True, False),
                                                        ("raw + allocating the memfd", False, True))):
                    r = run_raw(a_path, one, alloc)
                    rows[key].append(r["seconds"])
    finally:
        lender.stop()
        borrower.stop()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="wc-peerbench-"))
    try:
        a_path = write_checkpoint(tmp / "a" / "model.safetensors", int(args.gib * 2**30), args.tensors, mode=0o644)
        (tmp / "b").mkdir()
        b_path = tmp / "b" / "model.safetensors"
        shutil.copyfile(a_path, b_path)
        b_path.chmod(0o644)
        for f in (a_path, b_path):  # written back: DONTNEED drops clean pages only
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fp = fingerprint_files(b_path)
        ports = [free_port(), free_port()]
        gpu = args.device != "cpu"
        files_row = "files (warm)" if gpu else "files (cold)"
        rows: dict[str, list[float]] = {"fill": [], files_row: []}
        if not gpu:
            rows.update({"raw": [], "raw (one request)": [], "raw + allocating the memfd": []})
        rings = args.gpu_rings.split(",") if gpu else [""]
        for ring in rings:
            fill_row = "fill" if ring == rings[0] else f"fill (gpu_ring_bytes {ring})"
            rows.setdefault(fill_row, [])
            lender = start(tmp, 0, a_path, ports, None, args.device, ring)
            borrower = start(tmp, 1, b_path, ports, fp, args.device, ring)
            await pair_rounds(args, lender, borrower, rows, fill_row, files_row, a_path, b_path, fp, gpu)
        if gpu:  # NIXL's own rate between two cudaMalloc buffers, the staged fill's request size and window
            from weightcache.config.peers import RING_SLOTS

            v = run_vram(a_path.stat().st_size / 2**30, args.rounds, "0", "0", "torch", PeersConfig().slot_bytes, RING_SLOTS)
            rows["raw (cudaMalloc to cudaMalloc)"] = v["seconds"]
            assert v["bytes_arrived"], v
        data = a_path.stat().st_size
        out: dict[str, Any] = {"gib": args.gib, "file_bytes": data, "rounds": args.rounds,
                               "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rows": {}}
        for k, secs in rows.items():
            out["rows"][k] = {"seconds": secs, "median_s": statistics.median(secs), "best_s": min(secs),
                              "gb_per_s_median": data / statistics.median(secs) / 1e9, "gb_per_s_best": data / min(secs) / 1e9}
        rows_out = out["rows"]
        raw = "raw (cudaMalloc to cudaMalloc)" if gpu else "raw"
        out["device"] = args.device
        out["fill_vs_raw"] = rows_out["fill"]["gb_per_s_median"] / rows_out[raw]["gb_per_s_median"]
        out["fill_vs_raw_best"] = rows_out["fill"]["gb_per_s_best"] / rows_out[raw]["gb_per_s_best"]
        out["load_avg_after"] = os.getloadavg()
        return out
    finally:
        if args.logs:  # the daemons' logs: each load's phases (allocate, fill, seal) are in them
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in tmp.glob("d*.log"):
                shutil.copy(log, args.logs / log.name)
        shutil.rmtree(tmp, ignore_errors=True)


async def _no_leases(c: Client) -> bool:
    return (await c.status())["leases"] == 0


async def _none(c: Any) -> bool:
    return (await c) == 0


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "raw-lender":
        raw_lender(sys.argv[2])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "raw-read":
        print("RESULT " + json.dumps(raw_read(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1")))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "vram-lender":
        vram_lender(int(sys.argv[2]), sys.argv[3])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "vram-read":
        print("RESULT " + json.dumps(vram_read(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "peer-fill.json")
    p.add_argument("--device", default="cpu", help="the daemons' device (cuda:0: two daemons on one GPU, the files' row "
                   "from the page cache, the raw row between two cudaMalloc buffers)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--gpu-rings", default="512MiB", help="with a GPU --device: [peers] gpu_ring_bytes of each pair of daemons "
                   "in turn, e.g. 512MiB,2GiB (the first is the fill row, the others are rows of their own)")
    p.add_argument("--logs", type=Path, help="copy the daemons' logs here")
    p.add_argument("--vram", metavar="LENDER_GPU,READER_GPU",
                   help="only raw NIXL between two GPU processes (CUDA_VISIBLE_DEVICES of each, e.g. 0,0 or 0,1)")
    p.add_argument("--vram-alloc", choices=["torch", "vmm", "vmm-fabric"], default="vmm",
                   help="with --vram: the GPU memory at both ends, torch's allocator or VMM chunks as the daemon's arenas (default)")
    args = p.parse_args()
    if args.vram:
        lg, rg = args.vram.split(",")
        res = run_vram(args.gib, args.rounds, lg, rg, args.vram_alloc)
        print(json.dumps(res, indent=1))
        if args.out:
            args.out.write_text(json.dumps(res, indent=1) + "\n")
        return
    out = asyncio.run(bench(args))
    for k, r in out["rows"].items():
        print(f"{k:20s} median {r['median_s'] * 1e3:8.1f} ms  {r['gb_per_s_median']:6.2f} GB/s  best {r['gb_per_s_best']:6.2f} GB/s  "
              f"({', '.join(f'{s * 1e3:.0f}' for s in r['seconds'])} ms)")
    print(f"fill / raw: {out['fill_vs_raw']:.0%} (medians), {out['fill_vs_raw_best']:.0%} (best of each)")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
