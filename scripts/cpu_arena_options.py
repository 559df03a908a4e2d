"""The ways a CPU arena can be served, measured side by side (issue 13).

For one checkpoint (default 1 GiB, 200 bf16 tensors, page cache warm), each option is
built the way the daemon would build it, then an "engine" maps it the way the client
would, and three things are timed, each interleaved with ``safetensors.torch.load_file``
doing the same on the same page cache:

- usable: get the tensors (map + views; for load_file, the call);
- ready: get the tensors, then read every byte once (``t.view(torch.uint8).max()`` per
  tensor, as ``weightcache bench`` does);
- pages: get the tensors, then read one byte per 4 KiB page (the mapping cost alone).

Options (prototypes in this process, except ``daemon``):

- ``memfd``: today's arena: a sealed memfd filled with ``preadv``, mapped plainly;
- ``memfd+populate``: the client runs ``MADV_POPULATE_READ`` (Linux >= 5.14) over its
  mapping before handing out tensors (on the critical path);
- ``memfd+populate-bg``: the same in a background thread; tensors handed out at once and
  read while the thread runs (the populate time alone is reported too: an engine with
  that much other work before its first forward gets the populated speed);
- ``memfd+thp``: ``MADV_HUGEPAGE`` on the daemon's filling mapping and the client's; huge
  only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows it (reported);
- ``memfd-hugetlb``: ``MFD_HUGETLB``; needs reserved hugetlb pages (vm.nr_hugepages);
- ``shmem-huge``: with ``--huge-tmpfs DIR`` (a tmpfs mounted ``huge=always``): the arena
  as a file there, i.e. shmem in 2 MiB folios: what a memfd gets on a host whose
  ``shmem_enabled`` is ``within_size`` or ``always`` (a memfd cannot be made huge
  otherwise without root changing that host-wide setting);
- ``memfd+dontneed``: the memfd, then ``POSIX_FADV_DONTNEED`` on the file (no second copy);
- ``file(mlock)`` / ``file(populate)``: the page cache itself: the daemon maps the file
  and locks it (MAP_LOCKED) or only populates it, and the client maps a read-only fd
  of the file, tensors at their file offsets;
- ``file+populate``: the same with ``MADV_POPULATE_READ`` in the client;
- ``daemon``: what was built: a real daemon process and the real client
  (``SyncClient.attach``, socket round trip included), the file served from its page
  cache; ``daemon(memfd)``: the same daemon with the file made group-writable, so it
  copies it into a memfd (and drops the file's pages).

The page cache's folio sizes decide how fast a file mapping faults (``--page-cache``):
``read`` drops the file and reads it back with read() (readahead's folios), ``hugepage``
reads it back through a MADV_HUGEPAGE mapping (2 MiB folios: what the daemon's own cold
load gives), ``small`` reads it back with readahead off (4 KiB folios: a kernel or file
system without large folios), ``as-is`` leaves it.

Resident memory per option is counted exactly, not from noisy system totals: the file's
pages in the page cache (``mincore``) + the memfd's pages (``st_blocks``) + the page
tables of the processes (``VmPTE``), after the engine read every byte; /proc/meminfo
deltas are recorded beside it.

This VM is shared: each timing waits for a quiet moment and is repeated while other
tasks waited for a CPU (``/proc/pressure/cpu``) for more than a tenth of it.

    .venv/bin/python scripts/cpu_arena_options.py --reps 5 --page-cache hugepage --out /tmp/cpu-arena-options.json
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import functools
import gc
import json
import mmap
import os
import platform
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from weightcache.client.mapping import tensor_views
from weightcache.loader.checkpoint import Checkpoint, open_checkpoint
from weightcache.protocol.arena import MEMFD_SEALS
from weightcache.tools.bench_measure import drop_page_cache, memfd_bytes
from weightcache.tools.spawn import DaemonProcess, config_text
from weightcache.tools.synth import kept_checkpoint

MADV_POPULATE_READ = 22  # Linux >= 5.14; not in Python's mmap module
MAP_LOCKED = 0x2000  # x86-64 and arm64
PAGE = mmap.PAGESIZE
HUGE = 2 << 20
CHUNK = 16 << 20

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def madvise(addr: int, length: int, advice: int) -> None:
    """ctypes, not mmap.madvise: CPython's holds the GIL for the whole call, and a
    populate in a background thread must not stop the engine's thread."""
    if libc.madvise(addr, length, advice) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def map_file(fd: int, size: int) -> int:
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(addr)


def cached_bytes(path: Path) -> int:
    """Bytes of the file in the page cache (mincore over a fresh mapping faults nothing)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = map_file(fd, size)
    finally:
        os.close(fd)
    try:
        vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(b & 1 for b in vec.raw) * PAGE
    finally:
        libc.munmap(addr, size)


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":")
        out[k] = int(v.split()[0]) * 1024
    return out


def proc_status(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def smaps_of(addr: int) -> dict[str, int]:
    """The smaps counters (bytes) of this process's mapping that contains ``addr``."""
    found: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= addr < hi
        elif inside and line.split()[-1] == "kB":
            found[head.rstrip(":")] = int(line.split()[1]) * 1024
    return found


def touch_all(tensors: Any) -> None:
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).max()


def touch_pages(tensors: Any) -> None:
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::PAGE].max()


def settle() -> None:
    gc.collect()


# -- the page cache's state ------------------------------------------------------------------


def drop(path: Path) -> None:
    drop_page_cache(path)


def prepare_page_cache(path: Path, how: str) -> None:
    """Put the whole file in the page cache, in the folios ``how`` makes (module doc)."""
    if how == "as-is":
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
        return
    drop(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if how == "hugepage":
            addr = map_file(fd, size)
            madvise(addr, size, mmap.MADV_HUGEPAGE)
            madvise(addr, size, MADV_POPULATE_READ)
            libc.munmap(addr, size)
            return
        if how == "small":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        while os.read(fd, 64 << 20):
            pass
    finally:
        os.close(fd)


def file_pmd_share(path: Path) -> float:
    """Share of the file a fresh mapping maps with PMDs (2 MiB folios) once touched."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(m, dtype=torch.uint8)
    t[::PAGE].max()
    share = smaps_of(t.data_ptr()).get("FilePmdMapped", 0) / size
    del t
    settle()
    m.close()
    return share


# -- a 2-core VM shared with other work: time only in quiet moments -------------------------
#
# Other processes (test suites, builds) take whole cores for seconds at a time here, and a
# read of 1 GiB on 2 torch threads then takes 10-50x longer. CPU pressure (PSI: time that
# runnable tasks waited for a CPU) tells a disturbed timing from a clean one: each timing
# waits for a quiet moment, and is repeated if tasks waited for a CPU for more than a tenth
# of it. The file's pages are checked before each timing that reads them: this VM's DAMON
# pages out unmapped page cache idle for a minute.

QUIET_WAIT_S = 180.0
STATS = {"timings": 0, "retried": 0, "disturbed": 0, "page_cache_refilled": 0}


def psi_cpu_us() -> int:
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return 0
    return int(line.rsplit("total=", 1)[1])


def wait_quiet(window: float = 0.3, limit: float = 0.02) -> bool:
    """Until CPU pressure over ``window`` is under ``limit`` of it; False after QUIET_WAIT_S."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while time.monotonic() < deadline:
        a = psi_cpu_us()
        time.sleep(window)
        if psi_cpu_us() - a < limit * window * 1e6:
            return True
    return False


def quiet_timing(fn: Callable[[], Any], tries: int = 6) -> Any:
    """``fn()`` (which returns its duration, alone or first in a tuple) in a quiet moment;
    repeated while other tasks waited for a CPU for more than a tenth of that duration.
    Returns the least disturbed attempt."""
    best: tuple[float, Any] | None = None
    STATS["timings"] += 1
    for attempt in range(tries):
        settle()
        wait_quiet()
        before = psi_cpu_us()
        out = fn()
        dt = out[0] if isinstance(out, tuple) else out
        share = (psi_cpu_us() - before) / 1e6 / max(dt, 1e-9)
        if best is None or share < best[0]:
            best = (share, out)
        if share <= 0.1:
            return out
        STATS["retried"] += attempt == 0
    STATS["disturbed"] += 1
    assert best is not None
    return best[1]


# -- prototypes: the daemon's side ---------------------------------------------------------------


@dataclass
class Arena:
    """What the daemon would hold and send: one fd of ``size`` bytes, and the tensor table
    relative to it."""

    fd: int
    size: int
    table: list[list[Any]]
    build_s: float
    holds: list[Any] = field(default_factory=list)  # the daemon's own mappings
    note: str = ""

    def close(self) -> None:
        for m in self.holds:
            m.close()
        os.close(self.fd)


def fill_memfd(ckpt: Checkpoint, path: Path, *, thp: bool = False, hugetlb: bool = False) -> Arena:
    t = time.perf_counter()
    align = HUGE if hugetlb else PAGE
    size = -(-ckpt.arena_bytes // align) * align
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugetlb else 0)
    fd = os.memfd_create("arena-options", flags)
    try:
        os.ftruncate(fd, size)
        if not hugetlb:
            os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if thp:
            m.madvise(mmap.MADV_HUGEPAGE)
        src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        view = memoryview(m)
        try:
            jobs = [(x.file_offset + off, x.arena_offset + off, min(CHUNK, x.nbytes - off))
                    for x in ckpt.tensors for off in range(0, x.nbytes, CHUNK)]

            def one(job: tuple[int, int, int]) -> None:
                fo, ao, n = job
                with view[ao: ao + n] as dst:
                    got = 0
                    while got < n:
                        got += os.preadv(src, [dst[got:]], fo + got)

            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                list(pool.map(one, jobs))
        finally:
            view.release()
            os.close(src)
        m.close()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)
    except BaseException:
        os.close(fd)
        raise
    table = [[x.name, x.dtype, list(x.shape), x.arena_offset, x.nbytes] for x in ckpt.tensors]
    return Arena(fd, size, table, time.perf_counter() - t)


def fill_huge_shmem(ckpt: Checkpoint, path: Path, tmpfs: Path) -> Arena:
    """The arena as a file on a tmpfs mounted huge=always: shmem in 2 MiB folios, filled
    like a memfd (tmpfs files cannot be sealed; the bytes and folios are what count)."""
    t = time.perf_counter()
    size = -(-ckpt.arena_bytes // HUGE) * HUGE
    target = tmpfs / "arena"
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.unlink(target)  # freed with its last fd or mapping, like a memfd
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with memoryview(m) as view:
                for x in ckpt.tensors:
                    with view[x.arena_offset: x.arena_offset + x.nbytes] as dst:
                        got = 0
                        while got < x.nbytes:
                            got += os.preadv(src, [dst[got:]], x.file_offset + got)
        finally:
            os.close(src)
        m.close()
    except BaseException:
        os.close(fd)
        raise
    table = [[x.name, x.dtype, list(x.shape), x.arena_offset, x.nbytes] for x in ckpt.tensors]
    return Arena(fd, size, table, time.perf_counter() - t)


def hold_file(ckpt: Checkpoint, path: Path, *, lock: bool) -> Arena:
    """The page-cache arena: the daemon maps the whole file read-only and makes it
    resident (MAP_LOCKED pins it; else MADV_POPULATE_READ, reclaimable)."""
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    size = os.fstat(fd).st_size
    note = ""
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (MAP_LOCKED if lock else 0), prot=mmap.PROT_READ)
    except OSError as exc:  # RLIMIT_MEMLOCK without CAP_IPC_LOCK: EAGAIN
        if not lock or exc.errno != errno.EAGAIN:
            raise
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        note = "MAP_LOCKED refused (RLIMIT_MEMLOCK); populated only"
    if not lock or note:
        m.madvise(MADV_POPULATE_READ)
    table = [[x.name, x.dtype, list(x.shape), x.file_offset, x.nbytes] for x in ckpt.tensors]
    return Arena(fd, size, table, time.perf_counter() - t, holds=[m], note=note)


class Attached:
    """A prototype's client side: map the fd read-only, views, maybe populate."""

    def __init__(self, arena: Arena, *, populate: str = "", thp: bool = False) -> None:
        m = mmap.mmap(arena.fd, arena.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.slab = torch.frombuffer(m, dtype=torch.uint8)
        self.addr = self.slab.data_ptr()
        if thp:
            madvise(self.addr, arena.size, mmap.MADV_HUGEPAGE)
        self.populate_s = 0.0
        self.thread: threading.Thread | None = None
        if populate == "sync":
            t = time.perf_counter()
            madvise(self.addr, arena.size, MADV_POPULATE_READ)
            self.populate_s = time.perf_counter() - t
        elif populate == "bg":
            def run() -> None:
                t = time.perf_counter()
                madvise(self.addr, arena.size, MADV_POPULATE_READ)
                self.populate_s = time.perf_counter() - t

            self.thread = threading.Thread(target=run, daemon=True)
            self.thread.start()
        self.tensors = tensor_views(self.slab, arena.table)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.join()


# -- contenders -------------------------------------------------------------------------------


class Contender:
    name = ""
    compare_load_file = True  # False where the option drops the file's pages
    build_s = 0.0
    note = ""

    def setup(self, ckpt: Checkpoint, path: Path) -> None: ...

    @contextmanager
    def attach(self) -> Iterator[tuple[Any, int, float]]:
        """(tensors, address of the first tensor, populate seconds) for one fresh mapping."""
        raise NotImplementedError
        yield

    def daemon_bytes(self) -> dict[str, int]:
        """Memory the daemon's side holds beyond the file's page cache."""
        return {}

    def teardown(self) -> None: ...


class Prototype(Contender):
    def __init__(self, name: str, build: Callable[[Checkpoint, Path], Arena], populate: str = "", thp: bool = False,
                 after_build: Callable[[Path], None] | None = None) -> None:
        self.name, self.build, self.populate, self.thp, self.after_build = name, build, populate, thp, after_build
        self.compare_load_file = after_build is None
        self.arena: Arena | None = None

    def setup(self, ckpt: Checkpoint, path: Path) -> None:
        self.arena = self.build(ckpt, path)
        self.build_s, self.note = self.arena.build_s, self.arena.note
        if self.after_build:
            self.after_build(path)

    @contextmanager
    def attach(self) -> Iterator[tuple[Any, int, float]]:
        assert self.arena is not None
        a = Attached(self.arena, populate=self.populate, thp=self.thp)
        try:
            yield a.tensors, a.addr, a.populate_s if self.populate != "bg" else -1.0
        finally:
            a.close()

    def daemon_bytes(self) -> dict[str, int]:
        assert self.arena is not None
        link = f"/proc/self/fd/{self.arena.fd}"
        shmem = os.readlink(link).startswith("/memfd:") or self.name == "shmem-huge"
        return {"memfd": os.stat(link).st_blocks * 512 if shmem else 0}

    def teardown(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class RealDaemon(Contender):
    """A daemon process and the real client: what was built."""

    def __init__(self, name: str, copy: bool) -> None:
        self.name, self.copy = name, copy
        self.compare_load_file = True
        self.work = Path(tempfile.mkdtemp(prefix="wc-opt-", dir="/tmp"))
        self.daemon: DaemonProcess | None = None
        self.client: Any = None
        self.path: Path | None = None
        self.mode = 0

    def setup(self, ckpt: Checkpoint, path: Path) -> None:
        from weightcache import SyncClient

        self.path, self.mode = path, path.stat().st_mode
        if self.copy:
            path.chmod(0o664)  # others could rewrite it: the daemon copies it into a memfd
        sock = str(self.work / "d.sock")
        cfg = self.work / "d.toml"
        size = path.stat().st_size
        cfg.write_text(config_text(sock, {"cpu": str(2 * size)}, [{"name": "m", "path": str(path)}], {"log_level": "info"}))
        self.daemon = DaemonProcess(cfg, sock, self.work / "d.log").start()
        self.client = SyncClient(sock)
        t = time.perf_counter()
        self.client.load("m")
        self.build_s = time.perf_counter() - t

    @contextmanager
    def attach(self) -> Iterator[tuple[Any, int, float]]:
        with self.client.attach("m") as m:
            self.note = f"arena {m.arena_kind}"
            yield m, next(iter(m.values())).data_ptr(), 0.0

    def daemon_bytes(self) -> dict[str, int]:
        assert self.daemon is not None and self.daemon.proc is not None
        pid = self.daemon.proc.pid
        return {"memfd": memfd_bytes(pid), "daemon_page_tables": proc_status(pid, "VmPTE"), "mlocked": proc_status(pid, "VmLck")}

    def teardown(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.daemon is not None:
            self.daemon.stop()
        if self.path is not None and self.copy:
            self.path.chmod(self.mode)


def _dontneed(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def contenders(huge_tmpfs: Path | None) -> list[Contender]:
    huge = [Prototype("shmem-huge", lambda c, p: fill_huge_shmem(c, p, huge_tmpfs))] if huge_tmpfs else []
    return [
        Prototype("memfd", fill_memfd),
        Prototype("memfd+populate", fill_memfd, populate="sync"),
        Prototype("memfd+populate-bg", fill_memfd, populate="bg"),
        Prototype("memfd+thp", lambda c, p: fill_memfd(c, p, thp=True), thp=True),
        Prototype("memfd-hugetlb", lambda c, p: fill_memfd(c, p, hugetlb=True)),
        *huge,
        Prototype("memfd+dontneed", fill_memfd, after_build=_dontneed),
        Prototype("file(mlock)", lambda c, p: hold_file(c, p, lock=True)),
        Prototype("file(populate)", lambda c, p: hold_file(c, p, lock=False)),
        Prototype("file+populate", lambda c, p: hold_file(c, p, lock=True), populate="sync"),
        RealDaemon("daemon", copy=False),
        RealDaemon("daemon(memfd)", copy=True),
    ]


# -- measuring --------------------------------------------------------------------------------


def time_attach(c: Contender, what: str) -> tuple[float, float, dict[str, int]]:
    """(seconds, populate seconds, smaps of the mapping) for one fresh mapping."""
    t = time.perf_counter()
    with c.attach() as (tensors, addr, pop):
        if what == "ready":
            touch_all(tensors)
        elif what == "pages":
            touch_pages(tensors)
        dt = time.perf_counter() - t
        smaps = smaps_of(addr) if what == "ready" else {}
        del tensors
    settle()
    return dt, pop, smaps


def time_load_file(path: Path, what: str) -> float:
    t = time.perf_counter()
    tensors = load_file(str(path))
    if what == "ready":
        touch_all(tensors)
    elif what == "pages":
        touch_pages(tensors)
    dt = time.perf_counter() - t
    del tensors
    settle()
    return dt


def measure(c: Contender, ckpt: Checkpoint, path: Path, reps: int, page_cache: str) -> dict[str, Any]:
    size = path.stat().st_size

    def keep_cached() -> None:
        if c.compare_load_file and cached_bytes(path) < size - 64 * PAGE:
            STATS["page_cache_refilled"] += 1
            prepare_page_cache(path, page_cache)

    prepare_page_cache(path, page_cache)
    settle()
    mi0 = meminfo()
    pte0 = proc_status("self", "VmPTE")
    try:
        c.setup(ckpt, path)
    except OSError as exc:
        c.teardown()
        return {"option": c.name, "error": f"{type(exc).__name__}: {exc}"}
    try:
        res: dict[str, Any] = {"option": c.name, "build_s": c.build_s}
        attach: dict[str, list[float]] = {"usable": [], "ready": [], "pages": []}
        lf: dict[str, list[float]] = {"usable": [], "ready": [], "pages": []}
        pops: list[float] = []
        smaps: dict[str, int] = {}
        # Memory first, with one engine attached that has read every byte: before the
        # timings refill the page cache for load_file where the option dropped it.
        with c.attach() as (tensors, _addr, _pop):
            touch_all(tensors)
            held = c.daemon_bytes()
            in_cache = cached_bytes(path)
            pte = proc_status("self", "VmPTE") - pte0 + held.get("daemon_page_tables", 0)
            mi1 = meminfo()
            del tensors
        settle()
        total = in_cache + held.get("memfd", 0) + pte
        for _ in range(reps):
            for what in ("usable", "ready", "pages"):
                keep_cached()
                dt, pop, sm = quiet_timing(functools.partial(time_attach, c, what))
                attach[what].append(dt)
                if what == "ready":
                    pops.append(pop)
                    smaps = sm
                if c.compare_load_file:
                    keep_cached()
                    lf[what].append(quiet_timing(functools.partial(time_load_file, path, what)))
        res.update({
            "note": c.note,
            "attach_ms": {k: statistics.median(v) * 1e3 for k, v in attach.items()},
            "attach_ms_all": {k: [round(x * 1e3, 1) for x in v] for k, v in attach.items()},
            "load_file_ms": {k: statistics.median(v) * 1e3 for k, v in lf.items()} if c.compare_load_file else None,
            "load_file_ms_all": {k: [round(x * 1e3, 1) for x in v] for k, v in lf.items()} if c.compare_load_file else None,
            "populate_ms": statistics.median(pops) * 1e3 if any(p > 0 for p in pops) else None,
            "client_mapping": {k: smaps.get(k, 0) for k in ("Rss", "FilePmdMapped", "ShmemPmdMapped", "Locked")},
            "memory": {"file_in_page_cache": in_cache, "memfd": held.get("memfd", 0), "page_tables": pte,
                       "mlocked_by_daemon": held.get("mlocked"), "total": total, "ratio": total / size,
                       "meminfo_delta": {k: mi1[k] - mi0[k] for k in ("Cached", "Shmem", "Mlocked", "PageTables", "FileHugePages")}},
        })
        if c.compare_load_file:
            res["ratio_ready"] = res["load_file_ms"]["ready"] / res["attach_ms"]["ready"]  # > 1: attach faster
        return res
    finally:
        c.teardown()
        settle()


def environment(path: Path) -> dict[str, Any]:
    def read(p: str) -> str:
        try:
            return Path(p).read_text().strip()
        except OSError:
            return "n/a"

    limits = read("/proc/self/limits")
    return {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "checkpoint_bytes": path.stat().st_size, "euid": os.geteuid(),
            "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_shmem_enabled": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
            "nr_hugepages": read("/proc/sys/vm/nr_hugepages"),
            "read_ahead_kb": read(f"/sys/dev/block/{os.major(path.stat().st_dev)}:{os.minor(path.stat().st_dev)}/queue/read_ahead_kb"),
            "memlock_limit": limits.split("Max locked memory")[1].split("\n")[0].split()[:2] if "Max locked memory" in limits else "n/a"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/wc-arena-options")
    ap.add_argument("--only", nargs="*", help="option names to run (default: all)")
    ap.add_argument("--page-cache", choices=["hugepage", "read", "small", "as-is"], default="hugepage",
                    help="the folios the file is in the page cache in, before each option (module doc)")
    ap.add_argument("--huge-tmpfs", type=Path, help="a tmpfs mounted huge=always, for the shmem-huge option")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    path = kept_checkpoint(Path(args.dir) / f"ckpt-{args.size_gib:g}g-{args.tensors}t.safetensors", int(args.size_gib * 2**30),
                           args.tensors, seed=1)
    ckpt = open_checkpoint(path)
    env = environment(path)
    prepare_page_cache(path, args.page_cache)
    env["page_cache"] = args.page_cache
    env["file_pmd_mapped_share"] = round(file_pmd_share(path), 3)
    print(json.dumps(env), flush=True)
    results = []
    for c in contenders(args.huge_tmpfs):
        if args.only and c.name not in args.only:
            continue
        r = measure(c, ckpt, path, args.reps, args.page_cache)
        results.append(r)
        if "error" in r:
            print(f"{c.name:18s} unavailable: {r['error']}", flush=True)
            continue
        a, lf, mem = r["attach_ms"], r["load_file_ms"], r["memory"]
        lf_txt = (f"load_file usable {lf['usable']:5.1f} ready {lf['ready']:6.1f} pages {lf['pages']:6.1f} | "
                  f"ratio {r['ratio_ready']:.2f}x") if lf else "load_file n/a (file dropped)"
        pop = f" populate {r['populate_ms']:.1f}" if r["populate_ms"] is not None else ""
        cm = r["client_mapping"]
        print(f"{c.name:18s} build {r['build_s'] * 1e3:7.1f} ms | attach usable {a['usable']:5.1f} ready {a['ready']:6.1f} "
              f"pages {a['pages']:6.1f}{pop} | {lf_txt} | resident {mem['ratio']:.3f}x "
              f"(cache {mem['file_in_page_cache'] >> 20} MiB, memfd {mem['memfd'] >> 20} MiB, PTE {mem['page_tables'] >> 10} KiB) "
              f"| client PMD-mapped {(cm['FilePmdMapped'] + cm['ShmemPmdMapped']) >> 20} MiB {r['note']}", flush=True)
    print(f"timings {STATS['timings']}, retried for CPU pressure {STATS['retried']}, still disturbed {STATS['disturbed']}, "
          f"page cache refilled {STATS['page_cache_refilled']}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "results": results, "stats": STATS}, indent=1))


if __name__ == "__main__":
    main()
