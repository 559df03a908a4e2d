"""Pinned host memory the CUDA backend keeps: the loader threads' staging buffers, and
the host tier's pool and its copies. Page-locked, so copies to and from the GPU run at
PCIe speed."""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cuda.bindings import driver as cu

from .. import cuda_driver as drv
from .base import HostCopy, HostPool
from .extents import ExtentAllocator


@dataclass
class Staging:
    """A loader thread's pinned buffer and stream. The buffer is reused once the previous
    copy out of it has completed (stream sync)."""

    host_ptr: int
    view: memoryview
    stream: Any
    copied: Any  # an event recorded after a copy: the hash kernels wait for it, not the stream
    size: int
    busy: bool = False
    # Streams for the hash kernels of the pieces this buffer carried (backends/cuda_hash.py),
    # in turn: the thread's own, so a load waits only for its own kernels.
    hash_streams: list[Any] = field(default_factory=list)
    next_hash: int = 0
    # The C chunk loop's ring over this buffer and its slots' events (cuda_writer.py, Note
    # [the chunk loop in C]), made at its first use and kept with the buffer.
    loop: Any = None
    loop_events: list[Any] = field(default_factory=list)
    loop_clean: bool = False  # the last copy out of the buffer was the loop's: its slots' events cover it


class StagingPool:
    """Pinned staging buffers kept across loads. Allocating them per load (8 threads x
    16 MiB: cuMemHostAlloc, and cuMemFreeHost at the end) was part of the fixed cost
    every load paid; kept, they cost load_threads x load_depth x load_chunk_bytes of
    pinned host memory per GPU for the daemon's life, pinned at start (``prefill``)."""

    def __init__(self, ctx: Any, hash_streams: int) -> None:
        self._ctx = ctx
        self._hash_streams = hash_streams
        self._free: list[Staging] = []
        self._lock = threading.Lock()
        self.created: dict[int, int] = {}  # size -> buffers of that size allocated so far

    def prefill(self, count: int, size: int, stop: threading.Event | None = None) -> int:
        """Allocates buffers of ``size`` until ``count`` of them exist (those loads made
        count), so that the first load does not pay for them: pinning 12 x 16 MiB took the
        first load after a start 230-350 ms longer than the next on an H100. Called in the
        context, off the event loop; stops early once ``stop`` is set (the daemon is
        closing). Returns how many it allocated."""
        made = 0
        while stop is None or not stop.is_set():
            st = self._new(size, up_to=count)
            if st is None:
                break
            self.give_back(st)
            made += 1
        return made

    def take(self, size: int) -> Staging:
        with self._lock:
            for i, st in enumerate(self._free):
                if st.size == size:
                    return self._free.pop(i)
        made = self._new(size)
        assert made is not None  # no bound asked for
        return made

    def _new(self, size: int, up_to: int | None = None) -> Staging | None:
        """A new buffer of ``size``, counted in ``created`` (and not if it cannot be made);
        None if ``up_to`` of that size exist already (counted and checked at once, so that
        a prefill racing a load's ``take`` makes no buffer more than both need)."""
        with self._lock:
            if up_to is not None and self.created.get(size, 0) >= up_to:
                return None
            self.created[size] = self.created.get(size, 0) + 1
        try:
            return self._allocate(size)
        except BaseException:
            with self._lock:
                self.created[size] -= 1
            raise

    def _allocate(self, size: int) -> Staging:
        ptr = int(drv.check(cu.cuMemHostAlloc(size, 0)))
        view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        stream = drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        copied = drv.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        hashing = [drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(self._hash_streams)]
        return Staging(ptr, view, stream, copied, size, hash_streams=hashing)

    def give_back(self, st: Staging) -> None:
        """Called with the stream synchronized: nothing reads the buffer any more."""
        st.busy = False
        with self._lock:
            self._free.append(st)

    def close(self) -> None:
        with self._lock, drv.current(self._ctx):
            for st in self._free:
                drv.check(cu.cuStreamDestroy(st.stream))
                drv.check(cu.cuEventDestroy(st.copied))
                for ev in st.loop_events:
                    drv.check(cu.cuEventDestroy(ev))
                for hs in st.hash_streams:
                    drv.check(cu.cuStreamDestroy(hs))
                st.view.release()
                drv.check(cu.cuMemFreeHost(st.host_ptr))
            self._free.clear()


@dataclass
class PinnedCopy(HostCopy):
    """An arena's bytes in page-locked host memory: the host tier. Pinned so the copy
    back runs at PCIe speed (55 GB/s both ways on the H200 vs 6.3 pageable). The bytes
    may be in several pieces (``pieces``: host address, length; in arena order)."""

    pieces: list[tuple[int, int]] = field(default_factory=list)


class PinnedPool(HostPool):
    """The host tier's pinned memory, pinned once and carved into copies first-fit.

    Why a pool: on the H200, pinning 10 GB per demotion (cuMemHostAlloc) took ~4 s, and
    unpinning it (cuMemFreeHost) ~0.8 s during which the next load's driver calls waited
    (the warm loader fell from 30 to 8 GB/s in docs/benchmarks.md's run). Pinned once
    at start, in a thread (the socket answers meanwhile), with PORTABLE so every GPU's
    context may copy from it. A copy takes any free bytes, in pieces (backends/extents.py):
    the pool never refuses a copy while the tier's budget has room.
    """

    def __init__(self, ctx: Any, nbytes: int) -> None:
        self.nbytes = nbytes
        self._ctx = ctx
        self._base = 0
        self._ranges = ExtentAllocator(nbytes)
        self._returned = threading.Condition()  # notified when pieces come back
        self._ready = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._pin, name="wc-pin-host-pool", daemon=True).start()

    def _pin(self) -> None:
        try:
            with drv.current(self._ctx):
                self._base = int(drv.check(cu.cuMemHostAlloc(self.nbytes, cu.CU_MEMHOSTALLOC_PORTABLE)))
        except BaseException as exc:  # reported by alloc(); demotions then become evictions
            self._error = exc
        finally:
            self._ready.set()

    def alloc(self, n: int, wait_s: float = 30.0) -> list[tuple[int, int]] | None:
        """Host pieces (address, length) adding up to ``n`` bytes; None if fewer are free
        after ``wait_s``. The core admits a demotion only within the tier's budget, but
        a copy it dropped may still be on its way back: a demotion of it in flight
        returns its pieces when it ends."""
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"the pinned host pool could not be allocated: {self._error}")
        deadline = time.monotonic() + wait_s
        with self._returned:
            while (pieces := self._ranges.alloc(n)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._returned.wait(left)
        return [(self._base + off, length) for off, length in pieces]

    def free(self, pieces: list[tuple[int, int]]) -> None:
        with self._returned:
            self._ranges.free([(ptr - self._base, length) for ptr, length in pieces])
            self._returned.notify_all()

    def close(self) -> None:
        self._ready.wait()
        if self._base:
            with drv.current(self._ctx):
                drv.check(cu.cuMemFreeHost(self._base))
            self._base = 0
