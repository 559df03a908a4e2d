"""Where a CUDA load from a warm page cache spends its time, and what a path that skips
the CPU copy gains, against InstantTensor and through the daemon.

The daemon's loader reads each chunk with ``preadv`` into a pinned staging buffer, then
copies it to the GPU: every byte crosses host memory twice before the DMA reads it a
third time. This tool measures, side by side in one process on one GPU:

- ``pinned H2D``: the copy engine's ceiling, from one pinned buffer;
- ``staging``: the daemon's own writer (read_checkpoint into a VMM arena, hash on), at
  several thread counts and staging depths (``--depths``: buffers per thread);
- ``staging+dma`` (``--dma``): the same with the daemon's page-cache windows beside it
  (backends/page_windows.py: registered from the load's end while the threads stage from
  its start); every variant's fingerprint must agree;
- ``registered`` (``--registered``): the file mmapped (PROT_READ) and its page-cache pages registered with
  ``cuMemHostRegister(READ_ONLY)`` in aligned windows, each chunk copied to the GPU
  straight from them (the CPU never touches the mapping: a file truncated meanwhile
  cannot raise SIGBUS in the daemon), hashed on the GPU as today; chunks holding a piece
  that the host hashes go the staging way;
- ``mapped-copy`` / ``mapped-populate`` (``--mapped``): the staging variants with each
  chunk copied by user-space memmove out of a shared mapping of the file instead of
  ``preadv`` (InstantTensor's MMAP way; glibc streams big copies with non-temporal
  stores), the second with MADV_POPULATE_READ of each chunk first. A measurement only:
  the daemon never reads through a mapping (a file truncated under it raises SIGBUS);
- `` nohash`` (``--nohash``): each staging variant also with the content hash off, so
  what the fingerprint's kernels cost the load is read off side by side;
- ``register`` alone: what pinning page-cache pages costs per window size.

With ``--anchors``, InstantTensor's backends and load_file, each in a fresh process; with
``--daemon``, the daemon end to end at given load settings, warm, and cold beside the
O_DIRECT ceiling (``--cold``). docs/benchmarks.md ("The loader from the page cache (H100)") has the commands.

    python -m benchmarks loader-paths --size-gib 9.15 --tensors 183   # writes results/loader-paths.json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from cuda.bindings import driver as cu

from benchmarks.registered_reads import RegisteredReads
from weightcache import cuda_driver as drv
from weightcache.backends import cuda_writer
from weightcache.backends.cuda import CudaBackend
from weightcache.backends.cuda_writer import VmmWriter
from weightcache.backends.page_windows import probe_registration
from weightcache.loader import open_source, parse_checkpoint, read_checkpoint
from weightcache.loader.reader import FILE_DIGESTS
from weightcache.tools.bench_measure import INSTANTTENSOR_BACKENDS, INSTANTTENSOR_ENV, warm_page_cache
from weightcache.tools.synth import kept_checkpoint

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default

PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def map_file(fd: int, size: int) -> int:
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(addr)


class Timers:
    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, k: str, dt: float) -> None:
        with self._lock:
            self.s[k] = self.s.get(k, 0.0) + dt


LOOP_LABELS = {"tasks": " tasks", "c": " c-loop", "python": ""}  # --loops, as the variants' names say them


class TimedStaging(VmmWriter):
    """The daemon's writer, its phases timed (summed over threads): ``write_s`` a chunk's
    whole call (or a thread's call into the task loop), ``wait_copy_s`` the wait for the
    copy out of the buffer it reuses (the writer's own wait then finds the stream idle),
    ``read_s`` the preadv into it. ``loop``: "tasks" (the daemon's way where the C loop is
    built: a thread's tasks in one call), "c" (the C loop a chunk at a time), "python"
    (every chunk staged from Python)."""

    def __init__(self, *a: Any, timers: Timers, depth: int = 1, dma: bool = False, loop: str = "tasks") -> None:
        super().__init__(*a, depth=depth)
        self.t = timers
        self.dma = dma
        self.loop_tasks = loop == "tasks"
        if loop == "python":
            self._loop = None

    def _run_tasks(self, *a: Any) -> tuple[int, int, int]:
        t = time.perf_counter()
        out = super()._run_tasks(*a)
        self.t.add("write_s", time.perf_counter() - t)
        return out

    def begin(self, files: list[tuple[int, int]]) -> None:
        if self.dma:  # the daemon's two ways at once (backends/page_windows.py)
            super().begin(files)

    def _staging(self):  # type: ignore[no-untyped-def]
        st = super()._staging()
        if st.busy:
            t = time.perf_counter()
            drv.check(cu.cuStreamSynchronize(st.stream))
            self.t.add("wait_copy_s", time.perf_counter() - t)
        return st

    def write_from_file(self, fd, file_offset, arena_offset, nbytes, direct=False, seen=None):  # type: ignore[override]
        t = time.perf_counter()
        super().write_from_file(fd, file_offset, arena_offset, nbytes, direct, seen)
        self.t.add("write_s", time.perf_counter() - t)

    def finish(self) -> None:  # the streams' last copies and hash kernels, then the digests read
        t = time.perf_counter()
        super().finish()
        self.t.add("finish_s", time.perf_counter() - t)


def _timed_reads(timers: Timers) -> Callable[[], None]:
    """Times the writer's preadv (cuda_writer's pread_full) into ``timers["read_s"]``;
    returns what puts the untimed one back."""
    plain = cuda_writer.pread_full

    def timed(*a: Any, **kw: Any) -> None:
        t = time.perf_counter()
        try:
            plain(*a, **kw)
        finally:
            timers.add("read_s", time.perf_counter() - t)

    cuda_writer.pread_full = timed

    def restore() -> None:
        cuda_writer.pread_full = plain

    return restore


NOHASH = " nohash"  # a variant's name suffix: loaded with the content hash off

MADV_POPULATE_READ = 22  # Linux 5.14: maps the range's pages, an I/O error returned, not raised as SIGBUS


def _mapped_reads(timers: Timers, maps: dict[int, tuple[int, int]], populate: bool) -> Callable[[], None]:
    """The writer's preadv replaced by a user-space copy out of a shared mapping of the
    file (``maps``: fd -> (address, size)), as InstantTensor's MMAP backend reads: glibc's
    memmove streams big copies with non-temporal stores, which the kernel's copy to user
    does not. ``populate``: each chunk's pages mapped first with MADV_POPULATE_READ (one
    kernel walk instead of a fault per fault-around window). Timed into ``read_s``;
    returns what puts the preadv back. A measurement only: a file truncated under the copy
    raises SIGBUS here."""
    plain = cuda_writer.pread_full

    def mapped(fd: int, view: memoryview, offset: int, path: str = "") -> None:
        t = time.perf_counter()
        base, size = maps[fd]
        if offset + len(view) > size:
            raise ValueError(f"{path}: a read past the mapping ({offset}+{len(view)} > {size})")
        if populate:
            lo = (base + offset) // PAGE * PAGE
            if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(base + offset + len(view) - lo), MADV_POPULATE_READ):
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(view)), base + offset, len(view))
        timers.add("read_s", time.perf_counter() - t)

    cuda_writer.pread_full = mapped

    def restore() -> None:
        cuda_writer.pread_full = plain

    return restore


def warm_staging(backend: CudaBackend, threads: int, depth: int, chunk: int) -> None:
    """Allocates the staging buffers a variant needs before it is timed, as a daemon does at
    start (CudaBackend.prepare_loads): a variant that found too few in the pool would time
    cuMemHostAlloc of the rest (~0.1 s for 16 x 16 MiB)."""
    with drv.current(backend.ctx):
        backend.staging.prefill(threads * depth, VmmWriter.staging_bytes(chunk))


class Registered(VmmWriter):
    """Copies straight from registered page-cache pages (benchmarks/registered_reads.py)."""

    def __init__(self, backend, arena, chunk, *, maps: dict[int, tuple[int, int]], window: int, timers: Timers) -> None:
        super().__init__(backend, arena, chunk)
        self._loop = None  # the chunks it cannot copy from registered pages are staged from Python, as measured before
        self.reads = RegisteredReads(backend.ctx, window)
        self.t = timers
        self.zeros = memoryview(bytearray(chunk))
        self.fallback_bytes = 0

    def write_from_file(self, fd, file_offset, arena_offset, nbytes, direct=False, seen=None):  # type: ignore[override]
        t0 = time.perf_counter()
        device_only = seen is None or seen.device_only(nbytes)
        with drv.current(self._b.ctx):
            srcs = None if direct or not device_only else self.reads.sources(fd, file_offset, nbytes)
            self.t.add("register_s", time.perf_counter() - t0)
            if srcs is None:
                self.fallback_bytes += nbytes
                super().write_from_file(fd, file_offset, arena_offset, nbytes, direct, seen)
                self.t.add("fallback_s", time.perf_counter() - t0)
                return
            st = self._staging()
            if st.busy:
                t = time.perf_counter()
                drv.check(cu.cuStreamSynchronize(st.stream))
                self.t.add("wait_copy_s", time.perf_counter() - t)
            if self._arena.mapped < arena_offset + nbytes:
                self._b.grow(self._arena, arena_offset + nbytes)
            pos = arena_offset
            for addr, n in srcs:
                drv.check(cu.cuMemcpyHtoDAsync(self._arena.va + pos, addr, n, st.stream))
                pos += n
            st.busy = True
            if seen is not None:
                seen(self.zeros[:nbytes])  # device pieces only: counted, never read
                self._hash_on_device(seen, st)
        self.t.add("write_s", time.perf_counter() - t0)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            t = time.perf_counter()
            self.reads.close()
            self.t.add("unregister_s", time.perf_counter() - t)



def load_once(path: Path, backend: CudaBackend, threads: int, chunk: int, make: Callable[..., Any],
              mapped: str = "", content_hash: bool = True) -> dict[str, Any]:
    """One load into a fresh arena with the writer ``make`` builds; ``mapped`` ("copy" or
    "populate"): the chunks copied out of a mapping of the file (_mapped_reads), not read;
    ``content_hash`` off: the fingerprint's kernels and host hashing left out (what they cost)."""
    FILE_DIGESTS.clear()
    timers = Timers()
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        maps = {sf.fd: (map_file(sf.fd, f.size), f.size) for sf, f in zip(opened.files, ckpt.files, strict=True)}
        try:
            t0 = time.perf_counter()
            arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "loader-paths")
            timers.add("allocate_s", time.perf_counter() - t0)
            restore = _mapped_reads(timers, maps, mapped == "populate") if mapped else _timed_reads(timers)
            try:
                w = make(backend, arena, chunk, maps=maps, timers=timers)
                t = time.perf_counter()
                fp = read_checkpoint(ckpt, opened, w, threads=threads, chunk=chunk, nice=0, direct_io="off",
                                     content_hash=content_hash)
                timers.add("read_checkpoint_s", time.perf_counter() - t)
                t = time.perf_counter()
                backend.seal(arena)
                timers.add("seal_s", time.perf_counter() - t)
                dt = time.perf_counter() - t0
            finally:
                restore()
                backend.free(arena)
        finally:
            for addr, size in maps.values():
                libc.munmap(addr, size)
    return {"s": dt, "GBps": ckpt.data_bytes / dt / 1e9, "fingerprint": fp, "fallback_bytes": getattr(w, "fallback_bytes", None),
            "registered_bytes": w.registered_bytes, "looped_bytes": getattr(w, "looped_bytes", 0),
            **{k: round(v, 4) for k, v in timers.s.items()}}


def register_cost(path: Path, backend: CudaBackend, windows: list[int], threads: int) -> dict[str, float]:
    out = {}
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size // PAGE * PAGE
    base = map_file(fd, size)
    try:
        for win in windows:
            offs = list(range(0, size - win + 1, win))

            # The pool's threads have no current context of their own.
            def reg(off: int, win: int = win) -> None:
                with drv.current(backend.ctx):
                    drv.check(cu.cuMemHostRegister(base + off, win, cu.CU_MEMHOSTREGISTER_READ_ONLY))

            def unreg(off: int) -> None:
                with drv.current(backend.ctx):
                    drv.check(cu.cuMemHostUnregister(base + off))

            for n in (1, threads):
                with ThreadPoolExecutor(n) as pool:
                    t = time.perf_counter()
                    list(pool.map(reg, offs))
                    r = time.perf_counter() - t
                    t = time.perf_counter()
                    list(pool.map(unreg, offs))
                    u = time.perf_counter() - t
                gb = len(offs) * win / 1e9
                out[f"register_{win >> 20}MiB_{n}thr_GBps"] = round(gb / r, 1)
                out[f"unregister_{win >> 20}MiB_{n}thr_GBps"] = round(gb / u, 1)
    finally:
        libc.munmap(base, size)
        os.close(fd)
    return out


def pinned_h2d(backend: CudaBackend, nbytes: int = 1 << 30) -> float:
    with drv.current(backend.ctx):
        host = int(drv.check(cu.cuMemHostAlloc(nbytes, 0)))
        dev = int(drv.check(cu.cuMemAlloc(nbytes)))
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            drv.check(cu.cuMemcpyHtoD(dev, host, nbytes))
            best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
        drv.check(cu.cuMemFree(dev))
        drv.check(cu.cuMemFreeHost(host))
    return round(best, 1)


def anchors(path: Path, device: str, reps: int, only: list[str] | None = None) -> dict[str, Any]:
    """load_file and InstantTensor's three backends on the same file, each in a fresh
    process (a library's pools and pinned buffers do not outlive its run), best of
    ``reps``; InstantTensor's MMAP once more with its own page-cache registration on
    (INSTANTTENSOR_USE_INTERNAL_MEMORY_REGISTER=1, off by default). Each process has
    initialised CUDA before it is timed."""
    import subprocess
    import sys

    out: dict[str, Any] = {}
    for label in ("load_file", *(f"instanttensor_{b}" for b in INSTANTTENSOR_BACKENDS)):
        if only and label not in only:
            continue
        for _ in range(reps):
            # CUDA initialised before the clock starts, as in an engine that has its context
            # already (~0.2 s on the H200: a third of InstantTensor's whole load).
            code = ("import sys, torch; from pathlib import Path; from weightcache.tools import bench_measure as m; "
                    f"torch.zeros(1, device={device!r}); torch.cuda.synchronize(); p = Path({str(path)!r}); "
                    + (f"print(m.time_load_file(p, {device!r}))" if label == "load_file"
                       else f"print(m.time_instanttensor(p, {device!r}, {label.split('_', 1)[1]!r}))"))
            env = {**os.environ, **INSTANTTENSOR_ENV.get(label.split("_", 1)[1], {})}
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
            if r.returncode:
                out[label] = {"error": r.stderr.strip().splitlines()[-1:] }
                break
            s = float(r.stdout.strip().splitlines()[-1])
            out.setdefault(label, []).append(round(path.stat().st_size / s / 1e9, 2))
        print(label, out[label], flush=True)
    return out


def daemon_spec(spec: str) -> dict[str, Any]:
    """``T[:cMIB][:dDEPTH][:dma][:loop|:tasks|:py][:cold]`` -> the daemon's load settings: T
    threads, MIB chunks, DEPTH staging buffers per thread, page-cache windows on ("dma") or
    off, chunks through the C chunk loop (the default where it is built; "loop": required),
    a thread's tasks in one call of it ("tasks") or staged from Python ("py"); "cold" asks
    through_daemon for cold loads too."""
    parts = spec.split(":")
    out: dict[str, Any] = {"load_threads": int(parts[0]), "load_page_cache_dma": "off"}
    for part in parts[1:]:
        if part == "cold":
            continue  # through_daemon's
        if part == "dma":
            out["load_page_cache_dma"] = "auto"  # the daemon probes registration at start and says what it chose
        elif part == "loop":
            out["load_chunk_loop"] = "c"
        elif part == "py":
            out["load_chunk_loop"] = "python"
        elif part == "tasks":
            out["load_chunk_loop"] = "tasks"
        elif part.startswith("c"):
            out["load_chunk_bytes"] = int(part[1:]) << 20
        elif part.startswith("d"):
            out["load_depth"] = int(part[1:])
        else:
            raise SystemExit(f"--daemon: {spec!r}: {part!r} is none of cMIB, dDEPTH, dma, loop, tasks, py")
    return out


def through_daemon(path: Path, device: str, specs: list[str], reps: int, workdir: Path, cold: int = 0) -> dict[str, Any]:
    """The product end to end, as the issue measured it: a daemon with each of ``specs``'
    load settings (daemon_spec) evicts the model and loads it again through the client,
    page cache warm, content hash on; the first load (staging buffers allocated) not
    counted. With ``cold``, that many loads more from a dropped page cache, each beside the
    disk's O_DIRECT ceiling (bench_measure.disk_ceiling), and how many of the file's bytes
    the page cache held after the drop (mincore)."""
    import asyncio

    from weightcache.tools.bench_measure import daemon_load, disk_ceiling, drop_page_cache, page_cache_bytes, status_under_load
    from weightcache.tools.spawn import DaemonProcess, config_text

    out: dict[str, Any] = {}
    for spec in specs:
        tag = spec.replace(":", "_")
        sock = str(workdir / f"paths-{tag}.sock")
        cfg = workdir / f"paths-{tag}.toml"
        log = workdir / f"paths-{tag}.log"
        cfg.write_text(config_text(sock, {device: str(int(path.stat().st_size * 1.2))},
                                   [{"name": "m", "path": str(path), "device": device}],
                                   daemon={**daemon_spec(spec), "log_level": "info"}))
        with DaemonProcess(cfg, sock, log):
            asyncio.run(daemon_load(sock, "m"))
            runs = [asyncio.run(daemon_load(sock, "m")) for _ in range(reps)]
            # what more loader threads cost the control plane: status, back to back, during a load
            st = asyncio.run(status_under_load(sock, "m"))
            colds, ceilings, left = [], [], []
            for _ in range(cold if "cold" in spec.split(":") else 0):
                ceilings.append(round(disk_ceiling(path) / 1e9, 3))
                drop_page_cache(path)
                left.append(page_cache_bytes(path))
                colds.append(round(path.stat().st_size / asyncio.run(daemon_load(sock, "m", cold=path)) / 1e9, 3))
            if cold:
                warm_page_cache(path)  # the next setting's warm loads
        r = out[spec] = {"GBps": [round(path.stat().st_size / s / 1e9, 2) for s in runs]}
        if colds:  # only the settings marked cold load from a dropped page cache
            r["cold"] = {"GBps": colds, "odirect_ceiling_GBps": ceilings, "cached_bytes_after_drop": left,
                         "ratio": round(max(colds) / max(ceilings), 3)}
            print(f"daemon {spec} cold", r["cold"], flush=True)
        lines = log.read_text().splitlines()
        # The daemon's own account of each load, phase by phase (residency/fill.py's log line).
        r["phases"] = [line.split(" in ", 1)[-1].strip() for line in lines if "loaded m:" in line]
        r["start"] = [line for line in lines if "page cache" in line or "page-cache" in line or "registered" in line][:6]
        r["status_during_load_ms"] = {"n": st.n, "p50": round(st.p50_ms, 3), "p99": round(st.p99_ms, 3), "max": round(st.max_ms, 3)}
        print(f"daemon {spec}", json.dumps(r), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--size-gib", type=float, default=9.15)
    p.add_argument("--tensors", type=int, default=183)
    p.add_argument("--path", default=None, help="an existing checkpoint instead of a generated one")
    p.add_argument("--threads", default="8,12,16")
    p.add_argument("--windows-mib", default="64,256")
    p.add_argument("--chunk-mib", default="16")
    p.add_argument("--depths", default="1", help="staging buffers per loader thread, each of these")
    p.add_argument("--loops", default="tasks,c,python", help="each staging variant with a thread's tasks in one C call "
                   "('tasks', the daemon's way), through the C chunk loop a chunk at a time ('c') and/or "
                   "with every chunk staged from Python ('python')")
    p.add_argument("--dma", action="store_true", help="also each staging variant with the page-cache windows beside it")
    p.add_argument("--registered", action="store_true", help="also the registered-only writer (Registered)")
    p.add_argument("--mapped", action="store_true", help="also each staging variant copying out of a mapping of the "
                   "file instead of preadv, with and without MADV_POPULATE_READ per chunk")
    p.add_argument("--nohash", action="store_true", help="also each staging variant with the content hash off "
                   "(what the fingerprint's kernels cost the load)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--workdir", default="/tmp/wc-loader-paths")
    p.add_argument("--anchors", action="store_true", help="also load_file and InstantTensor, each in a fresh process")
    p.add_argument("--anchor-kinds", default="", help="only these anchors (load_file, instanttensor_default, "
                   "instanttensor_buffered, instanttensor_mmap, instanttensor_mmap_registered); all by default")
    p.add_argument("--daemon", default="", help="also time the daemon's load end to end with these settings "
                   "(T[:cMIB][:dDEPTH][:dma][:loop|:tasks|:py], comma-separated: e.g. 8,16:c4:d3:dma,12:py)")
    p.add_argument("--cold", type=int, default=0, help="with --daemon: cold loads for each setting marked :cold, each beside the O_DIRECT ceiling")
    p.add_argument("--only-ends", action="store_true", help="skip the in-process variants: only --anchors and --daemon")
    p.add_argument("--out", type=Path, default=RESULTS / "loader-paths.json")
    a = p.parse_args()
    path = Path(a.path) if a.path else kept_checkpoint(Path(a.workdir) / f"paths-{a.size_gib:g}g.safetensors",
                                                       int(a.size_gib * 2**30), a.tensors)
    os.sync()
    warm_page_cache(path)
    backend = CudaBackend(a.device)
    if {"tasks", "c"} & set(a.loops.split(",")):
        backend.configure_loads(1, "off", "auto")  # the C chunk loop where built, for the variants that use it
    res: dict[str, Any] = {"nbytes": path.stat().st_size, "pinned_h2d_GBps": pinned_h2d(backend), "runs": {}}
    windows = [int(w) << 20 for w in a.windows_mib.split(",")]
    if a.dma:
        rate, why = probe_registration(backend.ctx)
        res["register_probe"] = {"GBps": round(rate, 1), "refused": why}
        backend.page_cache_dma = not why
    print(json.dumps(res, indent=1), flush=True)
    if a.anchors:  # before the daemon's cold loads, which leave the page cache cold
        res["anchors_GBps"] = anchors(path, a.device, a.reps, [k for k in a.anchor_kinds.split(",") if k])
    if a.daemon:  # the product end to end next: it counts most where the call is cut short
        res["daemon"] = through_daemon(path, a.device, a.daemon.split(","), a.reps + 1, Path(a.workdir), a.cold)
    variants: list[tuple[str, int, int, Callable[..., Any], str]] = []
    for threads in (int(t) for t in a.threads.split(",")):
        for chunk in (int(c) << 20 for c in a.chunk_mib.split(",")):
            for depth in (int(d) for d in a.depths.split(",")):
                def staged(b: CudaBackend, ar: Any, c: int, maps: Any, timers: Timers, depth: int = depth,
                           loop: str = "python") -> TimedStaging:
                    return TimedStaging(b, ar, c, timers=timers, depth=depth, loop=loop)

                for loop in a.loops.split(","):
                    if loop not in LOOP_LABELS:
                        raise SystemExit(f"--loops: {loop!r} is none of {', '.join(LOOP_LABELS)}")
                    if loop != "python" and backend.chunk_loop is None:
                        raise SystemExit(f"--loops {loop}: the C chunk loop is {backend.chunk_loop_missing} (make native)")
                    for suffix in ("", NOHASH) if a.nohash else ("",):
                        variants.append((f"staging {threads}thr {chunk >> 20}M x{depth}{LOOP_LABELS[loop]}{suffix}",
                                         threads, chunk, functools.partial(staged, loop=loop), ""))
                for how in ("copy", "populate") if a.mapped else ():
                    variants.append((f"mapped-{how} {threads}thr {chunk >> 20}M x{depth}", threads, chunk, staged, how))
                if a.dma:
                    variants.append((f"staging+dma {threads}thr {chunk >> 20}M x{depth}", threads, chunk,
                                     lambda b, ar, c, maps, timers, depth=depth: TimedStaging(b, ar, c, timers=timers, depth=depth,
                                                                                              dma=True), ""))
            for win in windows if a.registered else ():
                variants.append((f"registered {threads}thr {chunk >> 20}M win{win >> 20}M", threads, chunk,
                                 lambda b, ar, c, maps, timers, win=win: Registered(b, ar, c, maps=maps, window=win, timers=timers), ""))
    if not a.only_ends:
        for threads in (int(t) for t in a.threads.split(",")):
            for chunk in (int(c) << 20 for c in a.chunk_mib.split(",")):
                warm_staging(backend, threads, max(int(d) for d in a.depths.split(",")), chunk)
    for rep in range(0 if a.only_ends else a.reps):
        for name, threads, chunk, make, mapped in variants if rep % 2 == 0 else variants[::-1]:
            try:
                r = load_once(path, backend, threads, chunk, make, mapped, content_hash=not name.endswith(NOHASH))
            except drv.CudaError as e:  # one path refused by the driver: say so, time the others
                res.setdefault("errors", {})[name] = str(e)
                print(name, "failed:", e, flush=True)
                continue
            res["runs"].setdefault(name, []).append(r)
            print(name, json.dumps(r), flush=True)
    if not a.only_ends:  # what registering page-cache pages costs, per window size
        res["register_cost"] = register_cost(path, backend, [2 << 20, 16 << 20, *windows], 8)
    fps = {r["fingerprint"] for rs in res["runs"].values() for r in rs if r["fingerprint"] is not None}
    res["fingerprints_agree"] = len(fps) <= 1
    res["best_GBps"] = {k: max(r["GBps"] for r in v) for k, v in res["runs"].items()}
    print(json.dumps({"best_GBps": res["best_GBps"], "fingerprints_agree": res["fingerprints_agree"]}, indent=1))
    backend.close()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["fingerprints_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
