"""The timings ``weightcache bench`` is made of, each one measurement of one contender.

A checkpoint is a path as the daemon takes it: one .safetensors file, a directory as
transformers' ``save_pretrained`` writes it (``model.safetensors``, or shards and their
``model.safetensors.index.json``) or an index json (:func:`checkpoint_paths`). Every
helper that takes a ``path`` here takes any of them; a loader's timing covers all of the
checkpoint's files, one after the other into one dict of tensors, as an engine loads a
sharded model.

Cold runs drop the files' pages with ``posix_fadvise(DONTNEED)`` (no root needed).
Functions that talk to the daemon are coroutines, each with its own connection(s);
torch and safetensors are imported inside the functions that use them.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..checkpoint_files import discover_files
from .bench_result import StatusLatency


def checkpoint_paths(path: str | os.PathLike[str]) -> list[Path]:
    """The .safetensors files of a checkpoint path: the path itself for a file; for a
    directory or an index json, its files by the daemon's rules (checkpoint_files)."""
    p = Path(path)
    if p.is_dir() or p.name.endswith(".json"):
        return [Path(f) for f in discover_files(p)]
    return [p]


def checkpoint_bytes(path: str | os.PathLike[str]) -> int:
    """The size of a checkpoint's files, together (the bench's GB/s and ratios are of it)."""
    return sum(f.stat().st_size for f in checkpoint_paths(path))


def memfd_bytes(pid: int | str) -> int:
    """Bytes of memory in a process's memfds (a CPU daemon's sealed copies)."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(link).startswith("/memfd:"):
                total += os.stat(link).st_blocks * 512
        except OSError:  # closed while we looked
            pass
    return total


def page_cache_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the checkpoint's files in the page cache: mincore over a fresh mapping of
    each (which faults nothing in)."""
    return sum(_file_page_cache_bytes(f) for f in checkpoint_paths(path))


def _file_page_cache_bytes(path: Path) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.stat(path).st_size
    if not size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap {path}")
    try:
        vec = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore {path}")
        return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
    finally:
        libc.munmap(addr, size)


# A cold run whose file stays this much cached is refused: its figure would be a warm one.
COLD_CACHED_MAX = 0.05


def drop_page_cache(path: str | os.PathLike[str], *, check: bool = True) -> None:
    """Drop the checkpoint's pages from the page cache. DONTNEED leaves pages that a
    process maps (and a tmpfs keeps them all), so with ``check`` it then counts what
    stayed (mincore) and raises where more than COLD_CACHED_MAX of the files did: on the
    H200 a mapping that InstantTensor's MMAP backend left in the bench
    process kept a 9.8 GB file cached, and the loader's "cold" load ran at warm speed
    (0.28 s) with nothing saying so."""
    files = checkpoint_paths(path)
    os.sync()  # DONTNEED skips dirty pages
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if check:
        size = sum(f.stat().st_size for f in files)
        cached = sum(_file_page_cache_bytes(f) for f in files)
        if size and cached > COLD_CACHED_MAX * size:
            raise RuntimeError(f"{path}: {cached} of {size} bytes stay in the page cache after POSIX_FADV_DONTNEED "
                               "(a process maps them, or a tmpfs holds them): a cold run would read warm pages")


def warm_page_cache(path: str | os.PathLike[str]) -> None:
    for p in checkpoint_paths(path):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


READ_EVERY_BYTE = "t.reshape(-1).view(torch.uint8).max() for every tensor, then a device sync"  # what touch_all does


def touch_all(tensors: Any) -> None:
    """Read every byte once (what a first forward pass does), device-side if on a GPU."""
    import torch

    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).max()
    if any(t.is_cuda for t in tensors.values()):
        torch.cuda.synchronize()


def load_files(files: list[Path], device: str) -> dict[str, Any]:
    """``load_file`` of each file, one after the other, into one dict (an engine's loop
    over a sharded checkpoint)."""
    from safetensors.torch import load_file

    if len(files) == 1:
        return load_file(str(files[0]), device=device)
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f), device=device))
    return tensors


def time_load_file_and_touch(path: Path, device: str) -> float:
    files = checkpoint_paths(path)
    import safetensors.torch  # noqa: F401  (imported before the clock, as on the first call)

    t = time.perf_counter()
    touch_all(load_files(files, device))
    return time.perf_counter() - t


async def attach_and_touch(sock: str, name: str) -> float:
    from ..client import Client

    async with Client(sock) as c:
        t = time.perf_counter()
        async with c.attach(name) as m:
            touch_all(m)
            return time.perf_counter() - t


def time_load_file(path: Path, device: str) -> float:
    import safetensors.torch  # noqa: F401
    import torch

    files = checkpoint_paths(path)
    t = time.perf_counter()
    tensors = load_files(files, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del tensors
    return dt


async def evict_fully(c: Any, name: str) -> None:
    """Evict until the model is gone from every tier (with a host tier, one evict only
    demotes it, and the next load would be a promotion, not a read)."""
    for _ in range(3):
        if (await c.evict(name))["state"] not in ("resident", "host"):
            return


async def _drop_when_unmapped(path: str | os.PathLike[str], timeout: float = 10.0) -> None:
    """Drop the checkpoint's pages; the daemon unmaps an evicted arena in a thread, so
    retry until they are gone (a mapped page is not dropped)."""
    from ..loader.preads import resident_fraction

    deadline = time.monotonic() + timeout
    fds = [os.open(f, os.O_RDONLY) for f in checkpoint_paths(path)]
    try:
        while True:
            drop_page_cache(path, check=False)
            if all(resident_fraction(fd, os.fstat(fd).st_size) < COLD_CACHED_MAX for fd in fds):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{path} stayed in the page cache for {timeout:g} s after the model's eviction "
                                   "(a process maps it): a cold load would read warm pages")
            await asyncio.sleep(0.05)
    finally:
        for fd in fds:
            os.close(fd)


async def daemon_load(sock: str, name: str, cold: str | os.PathLike[str] | None = None) -> float:
    """One load of ``name`` after evicting it; with ``cold``, that checkpoint's pages are
    dropped after the eviction: a CPU model served from its page cache keeps it mapped
    (and mlocked) while resident, where a drop could not reach it."""
    from ..client import Client

    async with Client(sock) as c:
        await evict_fully(c, name)
        if cold is not None:
            await _drop_when_unmapped(cold)
        t = time.perf_counter()
        await c.load(name)
        return time.perf_counter() - t


async def host_tier_round_trip(sock: str, name: str) -> tuple[float, float]:
    """(demote time, promote time): evict once (device -> pinned host), load (-> device)."""
    from ..client import Client

    async with Client(sock) as c:
        await c.load(name)
        t = time.perf_counter()
        assert (await c.evict(name))["state"] == "host", "the host tier did not take the model"
        demote = time.perf_counter() - t
        t = time.perf_counter()
        await c.load(name)
        return demote, time.perf_counter() - t


def disk_ceiling(path: Path, threads: int = 8, chunk: int = 16 << 20) -> float:
    """Cold read rate of the checkpoint's files (one after the other) with parallel
    O_DIRECT preads and nothing else (no copies): what any loader can at best reach from
    this disk. Bytes per second."""
    drop_page_cache(path)
    files = checkpoint_paths(path)
    return sum(f.stat().st_size for f in files) / sum(_direct_read_s(f, threads, chunk) for f in files)


def _direct_read_s(path: Path, threads: int, chunk: int) -> float:
    import mmap
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ..loader.preads import pread_direct

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
    return dt


def time_fastsafetensors(path: Path, device: str) -> float:
    import torch
    from fastsafetensors import fastsafe_open

    files = checkpoint_paths(path)
    t = time.perf_counter()
    tensors: dict[str, Any] = {}
    for p in files:  # one file after the other, as load_file's figure
        with fastsafe_open(str(p), device=device, nogds=True) as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118  (not a dict)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del tensors
    return dt


def time_runai_streamer(path: Path, device: str) -> float:
    """runai-model-streamer as vLLM's ``--load-format runai_streamer`` uses it (one process,
    not distributed): stream the file into CPU memory with the library's defaults, and
    copy each tensor to the device as it arrives (vLLM's weight loader copies it into the
    parameter), then sync."""
    import torch
    from runai_model_streamer import SafetensorsStreamer

    cuda = device.startswith("cuda")
    files = [str(f) for f in checkpoint_paths(path)]
    t = time.perf_counter()
    tensors = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cpu")  # every file in one stream, as vLLM passes them
        for name, tensor in streamer.get_tensors():
            tensors[name] = tensor.to(device) if cuda else tensor
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del tensors
    return dt


INSTANTTENSOR_BACKENDS = ("default", "buffered", "mmap", "mmap_registered")
# Set in the process that loads: InstantTensor reads it when it starts (off by default).
INSTANTTENSOR_ENV = {"mmap_registered": {"INSTANTTENSOR_USE_INTERNAL_MEMORY_REGISTER": "1"}}


def time_instanttensor(path: Path, device: str, backend: str = "default") -> float:
    """InstantTensor's ``safe_open`` as vLLM and SGLang document it for fast starts: every
    tensor iterated into a dict on ``device`` (a GPU: the library has no CPU target),
    then a sync. ``backend``: "default" (the library's choice: direct I/O for a file on
    disk), "buffered" (``BackendPolicy.BUFFERED``: io_uring or AIO through the page
    cache), "mmap" (``Backend.MMAP``: worker threads copy from a mapping of the file
    into pinned buffers) or "mmap_registered" (MMAP in a process started with
    INSTANTTENSOR_USE_INTERNAL_MEMORY_REGISTER=1, :func:`time_instanttensor_in_child`:
    the mapping registered with the driver and copied from without a CPU copy)."""
    import torch
    from instanttensor import Backend, BackendPolicy, safe_open

    chosen = {"default": None, "buffered": BackendPolicy.BUFFERED, "mmap": Backend.MMAP, "mmap_registered": Backend.MMAP}[backend]
    files = checkpoint_paths(path)
    torch.empty(1, device=device)  # the CUDA context, before the clock
    t = time.perf_counter()
    tensors: dict[str, Any] = {}
    for p in files:  # one file after the other, as load_file's figure
        with safe_open(str(p), framework="pt", device=torch.device(device).index or 0, backend=chosen) as f:
            for name, tensor in f.tensors():
                tensors[name] = tensor
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del tensors
    return dt


def time_instanttensor_in_child(path: Path, device: str, backend: str = "default") -> float:
    """:func:`time_instanttensor` in a fresh process: its MMAP backend keeps a mapping of
    the file after ``safe_open`` closes, which kept the bench's later cold runs warm when
    it ran in the bench's own process (``drop_page_cache``)."""
    code = ("import sys; from pathlib import Path; from weightcache.tools.bench_measure import time_instanttensor; "
            "print(time_instanttensor(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))")
    out = subprocess.run([sys.executable, "-c", code, str(path), device, backend], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **INSTANTTENSOR_ENV.get(backend, {})})
    if out.returncode:
        raise RuntimeError(f"instanttensor ({backend}) failed: {out.stderr.strip()[-300:]}")
    return float(out.stdout.split()[-1])


async def attach_latencies(sock: str, name: str, n: int) -> list[float]:
    from ..client import Client

    out = []
    async with Client(sock) as c:
        for _ in range(n):
            t = time.perf_counter()
            async with c.attach(name) as m:
                out.append(time.perf_counter() - t)
                assert len(m)
            del m  # unmap now (a sync on CUDA), not inside the next attach's timing
    return out


async def status_under_load(sock: str, name: str) -> StatusLatency:
    # This process holds torch's large heap: a gen-2 collection here took tens of ms and
    # showed up as *daemon* latency. Freeze the heap so the figure is the daemon's.
    gc.collect()
    gc.freeze()
    try:
        return await _status_probe(sock, name)
    finally:
        gc.unfreeze()


async def _status_probe(sock: str, name: str) -> StatusLatency:
    from ..client import Client

    async with Client(sock) as c, Client(sock) as s:
        await evict_fully(c, name)
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
        return StatusLatency(n=len(lat), n_during_load=seen_loading, p50_ms=pct(lat, 50) * 1e3, p99_ms=pct(lat, 99) * 1e3,
                             max_ms=max(lat) * 1e3, load_tail_s=time.perf_counter() - t0)
