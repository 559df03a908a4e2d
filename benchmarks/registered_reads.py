"""Copies to the GPU straight from registered page-cache pages: a warm path for the CUDA
loader that was measured on the H200 and rejected.

It was slower than the staging path at every thread count: 20-24 GB/s against
staging's 35-41 GB/s in the same run (``python -m benchmarks loader-paths``, 9.15 GiB of 183 bf16
tensors, page cache warm). ``cuMemHostRegister`` of page-cache pages is the cost: 38-41
GB/s for 64-256 MiB windows from one thread and no faster from 8 (the driver serialises
it), then unregistering at 94-117 GB/s, all before or beside copies that the pinned
ceiling (55 GB/s) bounds anyway. InstantTensor's own registration switch
(INSTANTTENSOR_USE_INTERNAL_MEMORY_REGISTER=1) made its MMAP backend slower the same way
(19 vs 42 GB/s). Kept beside the probe that times it, for whoever tries again (a driver
whose registration scales with threads would change the answer).

Note [registered page-cache reads]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The staging path (``VmmWriter`` in cuda_writer.py) ``preadv``s each chunk into a pinned buffer
and copies it from there: every byte crosses host memory twice before the DMA engine
reads it a third time, and 8 threads of that reached 29 GB/s on the H200 against a
55 GB/s pinned host-to-device ceiling (``python -m benchmarks loader-paths``). Here the file is mapped
``PROT_READ`` and its page-cache pages are registered with the driver
(``cuMemHostRegister(READ_ONLY)``) a window at a time, so the DMA engine reads them where
they are. The daemon's CPU never touches the mapping: a file truncated meanwhile cannot
raise SIGBUS here, it makes the registration fail (the pages are faulted in by the
driver, which returns an error), and the chunk then takes the staging path, whose short
read reports the changed file as it always has.

Registered pages stay pinned until the window is unregistered, so the content copied is
what the pages held during the copy, and the fingerprint (hashed on the GPU from the
arena, after the copy) describes exactly the bytes that landed, as on the staging path.
Chunks that carry a piece hashed on the host (small pieces, or every piece of a file the
GPU does not hash) take the staging path: the host hash reads the bytes from the pinned
buffer. Cold reads (O_DIRECT) take it too: registering would fault the pages in through
the page cache, one 4 KiB read at a time.

Windows are registered by the first thread that needs one (the others wait for it) and
unregistered together when the load finishes (``close``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from typing import Any

from cuda.bindings import driver as cu

from weightcache import cuda_driver as drv

log = logging.getLogger("weightcache.daemon")

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Window:
    __slots__ = ("addr", "ok", "ready")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.addr = 0  # the registered range's start (registered ranges are unregistered by it)
        self.ok = False


class RegisteredReads:
    """One load's mappings and registered windows (see the Note above)."""

    def __init__(self, ctx: Any, window: int) -> None:
        if window <= 0 or window % PAGE:
            raise ValueError(f"the registration window must be a positive multiple of {PAGE} bytes, not {window}")
        self._ctx = ctx
        self.window = window
        self._lock = threading.Lock()
        self._maps: dict[int, tuple[int, int] | None] = {}  # fd -> (address, mapped length); None: not mappable
        self._windows: dict[tuple[int, int], _Window] = {}
        self.refused = 0  # windows the driver would not register (a file changed under the load)

    def sources(self, fd: int, offset: int, nbytes: int) -> list[tuple[int, int]] | None:
        """The host addresses to copy ``nbytes`` at ``offset`` of ``fd`` from, one
        (address, length) per window they span (a copy whose source spans two
        registrations is refused by the driver), or None: take the staging path."""
        mapped = self._mapping(fd)
        if mapped is None:
            return None
        base, length = mapped
        if offset + nbytes > length:
            return None
        out: list[tuple[int, int]] = []
        pos = offset
        end = offset + nbytes
        while pos < end:
            w = pos // self.window
            if not self._register(fd, w, base, length):
                return None
            n = min(end, (w + 1) * self.window) - pos
            out.append((base + pos, n))
            pos += n
        return out

    def _mapping(self, fd: int) -> tuple[int, int] | None:
        with self._lock:
            if fd in self._maps:
                return self._maps[fd]
            length = os.fstat(fd).st_size
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0) if length else None
            if addr in (None, _MAP_FAILED):
                self._maps[fd] = None
                return None
            self._maps[fd] = (int(addr), length)
            return self._maps[fd]

    def _register(self, fd: int, w: int, base: int, length: int) -> bool:
        with self._lock:
            win = self._windows.get((fd, w))
            mine = win is None
            if win is None:
                win = self._windows[(fd, w)] = _Window()
        if not mine:
            win.ready.wait()
            return win.ok
        try:
            lo = w * self.window
            n = -(-(min(lo + self.window, length) - lo) // PAGE) * PAGE  # whole pages: the mapping's last is whole
            drv.check(cu.cuMemHostRegister(base + lo, n, cu.CU_MEMHOSTREGISTER_READ_ONLY))
            win.addr, win.ok = base + lo, True
        except drv.CudaError as exc:
            self.refused += 1
            log.debug("page-cache window %d of fd %d not registered (%s): its chunks take the staging path", w, fd, exc)
        finally:
            win.ready.set()
        return win.ok

    def close(self) -> None:
        """Unregister every window and unmap the files. Called once the copies out of
        them have completed (the writer's streams synchronized)."""
        with drv.current(self._ctx):
            for win in self._windows.values():
                if win.ok:
                    drv.check(cu.cuMemHostUnregister(win.addr))
        self._windows.clear()
        for mapped in self._maps.values():
            if mapped is not None:
                _libc.munmap(mapped[0], mapped[1])
        self._maps.clear()
