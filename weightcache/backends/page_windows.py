"""Copies to the GPU straight from the page cache, for files wholly in it: the file is
mapped ``PROT_READ`` and its pages are registered with the driver
(``cuMemHostRegister(READ_ONLY)``) a window at a time, so the copy engine reads them where
they are, with no CPU copy into a staging buffer.

Note [two ways at once]
~~~~~~~~~~~~~~~~~~~~~~~
Registering page-cache pages is itself the cost (the driver pins them one by one: ~40
GB/s from one thread on the H200, and no faster from eight), so a load that waited for
its windows to be registered ran slower than the staging path (benchmarks/registered_reads.py).
Here neither waits for the other: one registrar thread registers windows from the load's
last byte backwards while the loader threads stage chunks from its first byte forwards
(backends/cuda_writer.py). A chunk whose windows are registered already is copied from
them; any other is staged, and the staged front stops the registrar where they meet. The
two rates add up, up to the copy engine's.

What this path keeps of the staging path's guarantees:

- The daemon's CPU never reads the mapping: a file truncated under the load cannot raise
  SIGBUS here. A registration that fails (the file changed) leaves the rest to the
  staging path, whose short read reports the change as it always has, and the reader
  checks the file's identity after the load.
- Only chunks whose every byte the GPU hashes come this way (``TaskHasher.device_only``):
  the fingerprint is computed on the GPU from the arena after the copy, as on the staging
  path; the host hashes only what it reads from a staging buffer.
- Cold files (O_DIRECT) never come this way: registering would fault their pages in one
  at a time. Nor does a file not wholly in the page cache (mincore on the mapping).

Registered pages stay pinned until their window is unregistered, after the load's copies
completed, in a thread of their own (``release``): the load is done once its bytes are in
place, and unregistering 10 GB took ~0.1 s on the H200.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from cuda.bindings import driver as cu

from .. import cuda_driver as drv

log = logging.getLogger("weightcache.daemon")

PAGE = mmap.PAGESIZE
WINDOW = 32 << 20  # a registration: chunks crossing a window's end are copied in two parts
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def wholly_cached(addr: int, size: int) -> bool:
    """Whether every page of the mapping at ``addr`` is in the page cache (mincore(2): the
    pages are asked about, never touched)."""
    pages = -(-size // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
        return False
    return bytes(vec).count(0) == 0 if pages else True


def probe_registration(ctx: Any, nbytes: int = 64 << 20) -> tuple[float, str]:
    """Register a shared-memory mapping of ``nbytes`` (pages present, as a cached file's
    are) read-only, then unregister it: returns (GB/s of the registration, "") or (0.0,
    why it failed). The backend decides at start whether loads use registered windows."""
    fd = os.memfd_create("wc-register-probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return 0.0, f"mmap failed: {os.strerror(ctypes.get_errno())}"
        try:
            ctypes.memset(addr, 1, nbytes)  # the pages exist before the driver pins them
            with drv.current(ctx):
                t = time.perf_counter()
                try:
                    drv.check(cu.cuMemHostRegister(addr, nbytes, cu.CU_MEMHOSTREGISTER_READ_ONLY))
                except drv.CudaError as exc:
                    return 0.0, str(exc)
                dt = time.perf_counter() - t
                drv.check(cu.cuMemHostUnregister(addr))
            return nbytes / max(dt, 1e-9) / 1e9, ""
        finally:
            _libc.munmap(ctypes.c_void_p(addr), nbytes)
    finally:
        os.close(fd)


class _File:
    __slots__ = ("addr", "fd", "index", "size", "windows")

    def __init__(self, index: int, fd: int, addr: int, size: int) -> None:
        self.index, self.fd, self.addr, self.size = index, fd, addr, size
        self.windows: set[int] = set()  # registered, by index


class PageWindows:
    """One load's mappings and registered windows (Note [two ways at once]).

    ``files``: (fd, size) in the load's order, each one the loader may copy without the
    host reading it (buffered, and hashed on the GPU or not at all); only those wholly
    in the page cache are mapped."""

    def __init__(self, ctx: Any, files: Sequence[tuple[int, int]], window: int = WINDOW) -> None:
        if window <= 0 or window % PAGE:
            raise ValueError(f"the registration window must be a positive multiple of {PAGE} bytes, not {window}")
        self._ctx = ctx
        self.window = window
        self._lock = threading.Lock()
        self._files: dict[int, _File] = {}
        self._order: list[_File] = []
        self._front = (-1, -1)  # (file index, window): the furthest a staged chunk reached
        self._registered: list[int] = []  # addresses, to unregister
        self.refused = 0
        self.registered_bytes = 0
        self.mapped_bytes = 0  # of files wholly cached
        self.register_s = 0.0
        self._stop = threading.Event()
        for i, (fd, size) in enumerate(files):
            if size <= 0 or fd in self._files:
                continue
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                continue
            if not wholly_cached(int(addr), size):
                _libc.munmap(ctypes.c_void_p(addr), size)
                continue
            f = _File(i, fd, int(addr), size)
            self._files[fd] = f
            self._order.append(f)
            self.mapped_bytes += size
        self._thread: threading.Thread | None = None
        if self._order:
            self._thread = threading.Thread(target=self._register_backwards, name="wc-register", daemon=True)
            self._thread.start()

    def __bool__(self) -> bool:
        return bool(self._order)

    def _register_backwards(self) -> None:
        t0 = time.perf_counter()
        try:
            with drv.current(self._ctx):
                for f in reversed(self._order):
                    for w in range(-(-f.size // self.window) - 1, -1, -1):
                        with self._lock:
                            # Stop a window short of the staged front: the chunk beside it is being staged.
                            if self._stop.is_set() or (f.index, w - 1) <= self._front:
                                return
                        lo = w * self.window
                        n = -(-(min(lo + self.window, f.size) - lo) // PAGE) * PAGE  # the mapping's last page is whole
                        try:
                            drv.check(cu.cuMemHostRegister(f.addr + lo, n, cu.CU_MEMHOSTREGISTER_READ_ONLY))
                        except drv.CudaError as exc:
                            self.refused += 1
                            log.info("page-cache window %d of fd %d not registered (%s): the rest is staged", w, f.fd, exc)
                            return
                        with self._lock:
                            self._registered.append(f.addr + lo)
                            f.windows.add(w)
                            self.registered_bytes += n
        finally:
            self.register_s = time.perf_counter() - t0

    def sources(self, fd: int, offset: int, nbytes: int) -> list[tuple[int, int]] | None:
        """The host addresses to copy ``nbytes`` at ``offset`` of ``fd`` from, one (address,
        length) per window they span (a copy whose source spans two registrations is
        refused by the driver); or None, and the caller stages the chunk: the registrar
        then keeps off its windows."""
        f = self._files.get(fd)
        first, last = offset // self.window, (offset + nbytes - 1) // self.window
        with self._lock:
            if f is None or offset + nbytes > f.size or not all(w in f.windows for w in range(first, last + 1)):
                if f is not None:
                    self._front = max(self._front, (f.index, last))
                return None
        out = []
        pos, end = offset, offset + nbytes
        while pos < end:
            n = min(end, (pos // self.window + 1) * self.window) - pos
            out.append((f.addr + pos, n))
            pos += n
        return out

    def staged(self, fd: int, offset: int, nbytes: int) -> None:
        """A chunk of ``fd`` the caller stages without asking ``sources``: the registrar keeps off it."""
        f = self._files.get(fd)
        if f is not None:
            with self._lock:
                self._front = max(self._front, (f.index, (offset + nbytes - 1) // self.window))

    def stop(self) -> None:
        """No more registrations (the load's chunks are all issued)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def release(self) -> None:
        """Unregister every window and unmap the files; called once the copies out of them
        completed (the writer's streams synchronized)."""
        self.stop()
        with drv.current(self._ctx):
            for addr in self._registered:
                drv.check(cu.cuMemHostUnregister(addr))
        self._registered.clear()
        for f in self._order:
            _libc.munmap(ctypes.c_void_p(f.addr), f.size)
        self._order.clear()
        self._files.clear()
