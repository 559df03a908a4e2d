"""CUDA backend: arenas of VMM chunks exported as POSIX file descriptors.

An arena is ~1 GiB chunks (``cuMemCreate`` with the POSIX-fd handle type, rounded to the
allocation granularity) mapped back to back in one reserved VA range. Attach exports one
fd per chunk; the client imports them, maps them read-only into its own range and wraps
it as a torch tensor (client/cuda_mapping.py). Why VMM and not legacy ``cudaIpc*``: VMM
memory is reference counted, so the daemon releasing an arena never pulls memory from
under a client (legacy IPC is undefined behaviour there), and fds cross PID namespaces.

Chunk size: one chunk attached in 4.3 ms, 10 x 1 GiB in 5.1 ms, 37 x 256 MiB in 32 ms on
the H200 (a one-off probe of export + import + map per attach, run before this backend was
written; its output is not kept): export cost grows per fd, so chunks are big.
docs/benchmarks.md has this backend's attach figures since.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cuda.bindings import driver as cu

from .. import cuda_driver as drv
from ..errors import BadRequest, ConfigError, NoSpace
from ..protocol.arena import CUDA_VMM, ArenaDesc, VmmArenaDesc, chunk_sizes
from ..units import capacity
from .base import Arena, Backend, DmaView, HostCopy, HostPool, PublishedSource, Room, StagedRing
from .cuda_hash import HASH_STREAMS, GpuHasher, HashUnavailable
from .cuda_staging import Landing, StagedSource
from .cuda_writer import VmmWriter
from .extents import split_by_chunks
from .page_windows import PageWindows, probe_registration
from .pinned import PinnedCopy, PinnedPool, StagingPool
from .staging_loop import load_chunk_loop

log = logging.getLogger("weightcache.daemon")

# Registering page-cache pages slower than this (GB/s, probed at start) would add little
# beside the staging threads and take the driver's time from their copies.
REGISTER_MIN_GBPS = 10.0


@dataclass
class VmmArena(Arena):
    """Chunks mapped back to back in one reserved range. While it fills, chunks may be
    created as the device's room frees (``CudaBackend.grow``); ``mapped`` bytes of it
    are usable."""

    ordinal: int = 0
    # Per chunk, in order: its handle (None once released) and size (granularity-aligned).
    handles: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # planned at allocation: chunk_sizes(nbytes)
    va: int = 0  # base of the daemon's own mapping (read-write while filling, read-only after)
    mapped: int = 0  # bytes from va that are mapped (chunks created so far)
    export_fds: list[int] = field(default_factory=list)  # exported once at seal; attach sends dups
    grow_lock: threading.Lock = field(default_factory=threading.Lock)
    # Other GPUs (ordinals) granted read access to the daemon's mapping, to copy from it
    # (CudaBackend.copy_from_peer); the grant goes with the mapping when the arena is freed.
    readers: set[int] = field(default_factory=set)

    @property
    def kind(self) -> str:
        return CudaBackend.kind


@dataclass
class VmmSource(PublishedSource):
    """An engine's published VMM chunks, mapped read-only into the daemon's context."""

    va: int = 0


class CudaBackend(Backend):
    kind = CUDA_VMM
    supports_host_tier = True
    allocates_as_room_frees = True
    supports_writable_attach = True
    supports_dma = True
    dma_through_ring = True  # UCX's cuda_ipc does not take VMM memory: backends/cuda_staging.py

    def __init__(self, device: str, hash_on_gpu: bool = True) -> None:
        super().__init__(device)
        self.ordinal = drv.ordinal_of(device)
        self.gpu_uuid: str = drv.device_uuid(self.ordinal)
        self.uuid = self.gpu_uuid
        self.ctx = drv.primary_context(self.ordinal)
        self.granularity = drv.granularity(self.ordinal)
        self._prop = drv.allocation_prop(self.ordinal)
        self.host_pool: PinnedPool | None = None  # shared by every GPU's backend (use_host_pool)
        # The content hash on the GPU (backends/cuda_hash.py), unless it cannot run here:
        # then on the host, slower for a first load from a warm page cache, and said once.
        self.gpu_hash: GpuHasher | None = None
        self.gpu_hash_unavailable = ""
        if hash_on_gpu:
            try:
                self.gpu_hash = GpuHasher(self.ctx, self.ordinal)
                log.info("%s: the content hash runs on the GPU (kernel built in %.0f ms)", device, self.gpu_hash.compile_s * 1e3)
            except HashUnavailable as exc:
                self.gpu_hash_unavailable = str(exc)
                log.warning("%s: the content hash runs on the host, not the GPU: %s", device, exc)
        self.staging = StagingPool(self.ctx, HASH_STREAMS if self.gpu_hash is not None else 0)
        # The budget not held by chunks (``limit``): each chunk created takes from it,
        # each released gives back. Unlimited until the daemon sets the budget.
        self.room = Room(1 << 62)
        self._budget = 1 << 62
        self._peers: dict[int, bool] = {}  # ordinal -> can this GPU read its memory (can_copy_from)
        self.load_depth = 1
        self.page_cache_dma = False  # configure_loads
        # The writer's chunk loop in C (cuda_writer.py, Note [the chunk loop in C]), once
        # configure_loads loads it; until then every chunk is staged from Python.
        self.chunk_loop: ctypes.CDLL | None = None
        self.chunk_loop_missing: str | None = "not loaded (configure_loads)"
        self.loop_tasks = False  # a loader thread's tasks in one call of the loop (load_chunk_loop = "tasks")
        self._releases: list[threading.Thread] = []  # page-cache windows being unregistered after a load
        self._prefill: threading.Thread | None = None  # prepare_loads' staging buffers
        self._closing = threading.Event()  # tells the prefill to stop pinning

    def configure_loads(self, depth: int, page_cache_dma: str, chunk_loop: str = "auto") -> None:
        self.load_depth = depth
        if chunk_loop == "python":
            self.chunk_loop, self.chunk_loop_missing = None, 'off (load_chunk_loop = "python")'
        else:
            self.chunk_loop, self.chunk_loop_missing = load_chunk_loop()
            self.loop_tasks = chunk_loop == "tasks" and self.chunk_loop is not None
            if self.chunk_loop is not None:
                log.info("%s: loads copy %s through the C chunk loop", self.device,
                         "each loader thread's tasks in one call" if self.loop_tasks else "each chunk")
            elif chunk_loop in ("c", "tasks"):
                raise ConfigError(f"daemon.load_chunk_loop = \"{chunk_loop}\", but the C chunk loop is "
                                  f"{self.chunk_loop_missing}; build it or set \"auto\"", key="daemon.load_chunk_loop")
            else:
                log.warning("%s: the C chunk loop is %s: loads stage each chunk from Python, slower from a warm page "
                            "cache (docs/benchmarks.md, \"The chunk loop through the daemon\")", self.device, self.chunk_loop_missing)
        if page_cache_dma == "off":
            self.page_cache_dma = False
            return
        rate, why = probe_registration(self.ctx)
        if why:
            self.page_cache_dma = False
            log.info("%s: loads stage every chunk: the driver refused to register page-cache pages (%s)", self.device, why)
        elif page_cache_dma == "on" or rate >= REGISTER_MIN_GBPS:
            self.page_cache_dma = True
            log.info("%s: loads of files wholly in the page cache copy from registered pages too (registration "
                     "probed at %.1f GB/s)%s", self.device, rate,
                     "; those loads copy chunk by chunk, not a thread's tasks in one call" if self.loop_tasks else "")
        else:
            self.page_cache_dma = False
            log.info("%s: loads stage every chunk: registering page-cache pages probed at %.1f GB/s, under %.0f",
                     self.device, rate, REGISTER_MIN_GBPS)

    def prepare_loads(self, threads: int, chunk_bytes: int) -> None:
        """The loader threads' pinned staging buffers (``load_depth`` each), pinned in a
        thread at start as the host tier's pool is: the first load otherwise pins them
        itself (StagingPool.prefill says what that cost). Once per backend, at start."""
        if self._prefill is not None:
            raise RuntimeError(f"{self.device}: the loads are prepared once, at start")
        count, size = threads * self.load_depth, VmmWriter.staging_bytes(chunk_bytes)

        def pin() -> None:
            try:
                t = time.perf_counter()
                with drv.current(self.ctx):
                    made = self.staging.prefill(count, size, stop=self._closing)
                log.info("%s: %d pinned staging buffers of %d MiB ready in %.0f ms", self.device, made, size >> 20,
                         (time.perf_counter() - t) * 1e3)
            except drv.CudaError as exc:  # the first load pins them, or says why it cannot
                log.warning("%s: the staging buffers could not be pinned at start: %s", self.device, exc)

        self._prefill = threading.Thread(target=pin, name="wc-pin-staging", daemon=True)
        self._prefill.start()

    def page_windows(self, files: list[tuple[int, int]]) -> PageWindows | None:
        """Registered windows for one load of ``files`` ((fd, size), the loader's order), or None."""
        if not self.page_cache_dma or not files:
            return None
        windows = PageWindows(self.ctx, files)
        return windows if windows else None

    def release_windows(self, windows: PageWindows) -> None:
        """Unregister a finished load's windows in a thread: the load is done, its bytes in place."""
        def release() -> None:
            try:
                windows.release()
            except Exception:
                log.exception("%s: unregistering a load's page-cache windows failed", self.device)

        self._releases = [t for t in self._releases if t.is_alive()]
        t = threading.Thread(target=release, name="wc-unregister", daemon=True)
        self._releases.append(t)
        t.start()

    def total_memory(self) -> int:
        return drv.total_memory(self.ordinal)

    def content_hash(self) -> str:
        return "gpu" if self.gpu_hash is not None else f"host ({self.gpu_hash_unavailable or 'hash_on_gpu=False'})"

    def free_memory(self) -> int:
        return drv.free_memory(self.ctx)

    def capacity(self, nbytes: int) -> int:
        g = self.granularity
        return capacity(nbytes, g)


    def allocate(self, nbytes: int, label: str) -> VmmArena:
        arena = self._reserve(nbytes, label)
        self.grow(arena, arena.nbytes)
        return arena

    def limit(self, budget: int) -> None:
        self.room.give(budget - self._budget)
        self._budget = budget

    def allocate_as_room_frees(self, nbytes: int, label: str) -> VmmArena:
        # Chunks are created as the writer reaches them (``grow``), each once the room
        # has its bytes: the first while the victims' first chunks are still copied out.
        return self._reserve(nbytes, label, lazy=True)

    def _reserve(self, nbytes: int, label: str, lazy: bool = False) -> VmmArena:
        total = self.capacity(nbytes)
        arena = VmmArena(device=self.device, nbytes=total, label=label, ordinal=self.ordinal,
                         sizes=chunk_sizes(total, self.granularity))
        with drv.current(self.ctx):
            free = drv.free_memory(self.ctx)
            if not lazy and free < total:
                # The budget allowed it, but other processes (engines' KV caches) hold the GPU.
                raise NoSpace(f"{self.device} has {free} bytes free on the device, {label} needs {total} "
                              f"(memory outside weightcache's budget is in use)", device=self.device, needed=total,
                              device_free=free, fits_ever=False)
            arena.va = int(drv.check(cu.cuMemAddressReserve(total, 0, 0, 0)))
        return arena

    def grow(self, arena: VmmArena, upto: int) -> None:
        """Create and map chunks until ``upto`` bytes of the arena are usable (read-write),
        each after taking its bytes from the device's room (waiting for victims' chunks
        still being copied out)."""
        with arena.grow_lock, drv.current(self.ctx):
            while arena.mapped < upto:
                size = arena.sizes[len(arena.handles)]
                arena.room_wait_s += self.room.take(size)
                try:
                    self._create_chunk(arena, size)
                except BaseException:
                    self.room.give(size)
                    raise

    def _create_chunk(self, arena: VmmArena, size: int) -> None:
        """One chunk created, mapped read-write and appended (memory that fails half-way is released)."""
        try:
            handle = drv.check(cu.cuMemCreate(size, self._prop, 0))
        except drv.CudaError as exc:
            free = drv.free_memory(self.ctx)
            raise NoSpace(f"{self.device}: cannot allocate {size} bytes for {arena.label} ({exc.message}; "
                          f"{free} bytes free on the device: memory outside weightcache's budget is in use)",
                          device=self.device, needed=size, device_free=free, fits_ever=False) from None
        mapped = False
        try:
            drv.check(cu.cuMemMap(arena.va + arena.mapped, size, 0, handle, 0))
            mapped = True
            drv.set_access(arena.va + arena.mapped, size, self.ordinal, read_only=False)
        except BaseException:
            if mapped:
                cu.cuMemUnmap(arena.va + arena.mapped, size)
            cu.cuMemRelease(handle)
            raise
        arena.handles.append(handle)
        arena.mapped += size

    def writer(self, arena: Arena, chunk_bytes: int) -> VmmWriter:
        assert isinstance(arena, VmmArena)
        return VmmWriter(self, arena, chunk_bytes, self.load_depth)

    def seal(self, arena: Arena) -> None:
        # The daemon's own mapping becomes read-only too: nothing may change served bytes.
        assert isinstance(arena, VmmArena)
        self.grow(arena, arena.nbytes)  # the padding after the last tensor, if nothing wrote there
        with drv.current(self.ctx):
            drv.check(cu.cuCtxSynchronize())
            drv.set_access(arena.va, arena.nbytes, self.ordinal, read_only=True)
            # Export once: ~0.1 ms per chunk per call measured on the H200, while a dup of
            # the exported fd costs microseconds; attach latency is the product's number.
            for h in arena.handles:
                arena.export_fds.append(int(drv.check(cu.cuMemExportToShareableHandle(h, drv.FD_HANDLE, 0))))

    def can_copy_from(self, other: Backend) -> bool:
        if not isinstance(other, CudaBackend) or other.ordinal == self.ordinal:
            return False
        if other.ordinal not in self._peers:  # asked once per pair: the topology does not change
            self._peers[other.ordinal] = drv.can_access_peer(self.ordinal, other.ordinal)
        return self._peers[other.ordinal]

    def copy_from_peer(self, source_backend: Backend, source: Arena, arena: Arena, nbytes: int) -> None:
        # The source's chunks are already mapped in this process (one address space for
        # every GPU): granting this GPU read access to that mapping lets it read them over
        # NVLink or PCIe P2P, with no second mapping and no host bounce. The copy runs on
        # this GPU's own stream, chunk by chunk as the arena grows (its room, like a load).
        assert isinstance(source_backend, CudaBackend) and isinstance(source, VmmArena) and isinstance(arena, VmmArena)
        with source.grow_lock:
            if self.ordinal not in source.readers:
                with drv.current(source_backend.ctx):
                    drv.set_access(source.va, source.nbytes, self.ordinal, read_only=True)
                source.readers.add(self.ordinal)
        with drv.current(self.ctx):
            stream = drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            try:
                off = 0
                for size in arena.sizes:
                    n = min(size, nbytes - off)
                    if n <= 0:
                        break
                    if arena.mapped < off + n:
                        self.grow(arena, off + n)
                    drv.check(cu.cuMemcpyDtoDAsync(arena.va + off, source.va + off, n, stream))
                    off += n
                drv.check(cu.cuStreamSynchronize(stream))
            finally:
                drv.check(cu.cuStreamDestroy(stream))

    # -- a neighbour daemon's transfer engine (weightcache/peers/) ----------------------
    def dma_source(self, arena: Arena, slots: int, slot_bytes: int) -> DmaView | None:
        # Through a ring: UCX's cuda_ipc does not take VMM memory (cuda_staging.py says why).
        assert isinstance(arena, VmmArena)
        src = StagedSource(self.ctx, arena.va, slots, slot_bytes)
        ring = src.ring
        staged = StagedRing(ring.base, ring.slots, ring.slot_bytes, arena.nbytes, src.stage)
        return DmaView([], "VRAM", self.ordinal, release=src.close, staged=staged, context=lambda: drv.current(self.ctx))

    @property
    def can_land_dma(self) -> bool:
        return self.gpu_hash is not None

    def dma_landing(self, arena: Arena, slots: int, slot_bytes: int) -> Landing | None:
        assert isinstance(arena, VmmArena)
        if self.gpu_hash is None:  # a peer's bytes are checked where they land; the host would read them back
            return None
        return Landing(self.ctx, self.ordinal, self.gpu_hash, arena.va, functools.partial(self.grow, arena), slots, slot_bytes)

    def open_published(self, arena: ArenaDesc, fds: list[int]) -> VmmSource:
        assert isinstance(arena, VmmArenaDesc), arena.kind  # model_ops refused every other kind
        sizes = arena.chunks  # positive integers (parse_arena)
        if len(sizes) != len(fds):
            raise BadRequest(f"a cuda_vmm arena is published with one fd per chunk: {len(sizes)} chunks, {len(fds)} fds")
        if arena.device_uuid.lower() != self.gpu_uuid.lower():
            raise BadRequest(f"published memory is on {arena.device_uuid}, not on {self.device} ({self.gpu_uuid})")
        handles: list[Any] = []
        with drv.current(self.ctx):
            try:
                handles = [drv.check(cu.cuMemImportFromShareableHandle(fd, drv.FD_HANDLE)) for fd in fds]
                va = drv.map_chunks(handles, sizes, self.ordinal, read_only=True)
            except drv.CudaError as exc:
                # Not VMM memory of this GPU, or chunk sizes that do not match it: the
                # peer's mistake, not the daemon's.
                raise BadRequest(f"the published fds cannot be mapped as {self.device} VMM memory: {exc.message}") from None
            finally:
                for h in handles:
                    cu.cuMemRelease(h)  # the mapping keeps the memory
        return VmmSource(sum(sizes), va)

    def copy_published(self, source: PublishedSource, arena: Arena, nbytes: int) -> None:
        assert isinstance(arena, VmmArena) and isinstance(source, VmmSource)
        if nbytes > source.nbytes:  # parse_arena refuses this: never copy past what was mapped
            raise BadRequest(f"the published memory holds {source.nbytes} bytes, not {nbytes}")
        with drv.current(self.ctx):
            drv.check(cu.cuMemcpyDtoD(arena.va, source.va, nbytes))  # device to device, HBM speed
            drv.check(cu.cuCtxSynchronize())

    def close_published(self, source: PublishedSource) -> None:
        assert isinstance(source, VmmSource)
        if source.va:
            with drv.current(self.ctx):
                drv.unmap(source.va, source.nbytes)
            source.va = 0

    @contextlib.contextmanager
    def reading(self, arena: Arena) -> Iterator[Callable[[int, int], memoryview]]:
        # Through one pageable host buffer, grown to the largest read asked for (the store
        # reads at most loader/reader.HASH_BLOCK at a time); synchronous copies.
        assert isinstance(arena, VmmArena)
        buf = bytearray()
        holder: list[Any] = []

        def read(offset: int, n: int) -> memoryview:
            nonlocal buf
            if offset < 0 or offset + n > arena.nbytes:
                raise ValueError(f"bytes {offset}..{offset + n} are outside the {arena.nbytes}-byte arena")
            if n > len(buf):
                holder.clear()
                buf = bytearray(n)
                holder.append((ctypes.c_char * n).from_buffer(buf))
            if n:
                with drv.current(self.ctx):
                    drv.check(cu.cuMemcpyDtoH(ctypes.addressof(holder[0]), arena.va + offset, n))
            return memoryview(buf)[:n]

        try:
            yield read
        finally:
            holder.clear()

    def export(self, arena: Arena) -> tuple[list[int], dict[str, Any]]:
        assert isinstance(arena, VmmArena)
        fds = [os.dup(fd) for fd in arena.export_fds]
        return fds, VmmArenaDesc(arena.nbytes, list(arena.sizes), self.gpu_uuid).to_wire()

    def start_host_tier(self, nbytes: int) -> PinnedPool:
        return PinnedPool(self.ctx, nbytes)

    def use_host_pool(self, pool: HostPool) -> None:
        assert isinstance(pool, PinnedPool)
        self.host_pool = pool

    def demote(self, arena: Arena) -> PinnedCopy:
        # Chunk by chunk: copy it out, then release the chunks copied so far as soon as a
        # load waits for the room, so it fills its first chunks while the rest are still
        # being copied here. Not before: each cuMemUnmap stalls copies running meanwhile
        # (a probe on the H200: a promotion beside a demotion that
        # released every chunk ran at 40 GB/s against 52 alone; torch's copies in both
        # directions at once, without unmaps, at 51 each), and the last ones go at the end.
        assert isinstance(arena, VmmArena) and self.host_pool is not None
        try:
            pieces = self.host_pool.alloc(arena.nbytes)
            if pieces is None:  # the core admits a demotion only within the tier's budget: a bug if seen
                raise RuntimeError(f"fewer than {arena.nbytes} bytes free in the pinned pool")
            try:
                with drv.current(self.ctx):
                    # No context-wide synchronize: seal synchronized this arena's writes,
                    # and a load filling meanwhile must not be waited for.
                    stream = drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
                    try:
                        for i, segments in enumerate(split_by_chunks(pieces, arena.sizes)):
                            for ptr, off, n in segments:
                                drv.check(cu.cuMemcpyDtoHAsync(ptr, arena.va + off, n, stream))
                            drv.check(cu.cuStreamSynchronize(stream))
                            if self.room.waiting:
                                for j in range(i + 1):
                                    self._release_chunk(arena, j)
                    finally:
                        drv.check(cu.cuStreamDestroy(stream))
            except BaseException:
                self.host_pool.free(pieces)
                raise
            return PinnedCopy(arena.nbytes, pieces)
        finally:
            self._free(arena, synchronize=False)  # what the loop did not get to, on failure

    def promote(self, host: HostCopy, arena: Arena) -> None:
        # On a stream of its own, not the legacy default stream: that one would serialize
        # this copy with a demotion running at the same time in the other direction.
        assert isinstance(arena, VmmArena) and isinstance(host, PinnedCopy) and host.nbytes == arena.nbytes
        with drv.current(self.ctx):
            stream = drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            try:
                for segments in split_by_chunks(host.pieces, arena.sizes):
                    for ptr, off, n in segments:
                        if arena.mapped < off + n:
                            self.grow(arena, off + n)
                        drv.check(cu.cuMemcpyHtoDAsync(arena.va + off, ptr, n, stream))
                drv.check(cu.cuStreamSynchronize(stream))
            finally:
                drv.check(cu.cuStreamDestroy(stream))

    def free_host(self, host: HostCopy) -> None:
        assert self.host_pool is not None and isinstance(host, PinnedCopy)
        self.host_pool.free(host.pieces)

    def close(self) -> None:
        if self._prefill is not None:
            # It stops between two buffers; one cuMemHostAlloc of a chunk is what is left.
            self._closing.set()
            self._prefill.join()
        for t in self._releases:
            t.join()
        if self.gpu_hash is not None:
            self.gpu_hash.close()
        self.staging.close()
        if self.host_pool is not None:  # shared: the first backend to close frees it
            self.host_pool.close()

    def free(self, arena: Arena) -> None:
        assert isinstance(arena, VmmArena)
        self._free(arena)

    def _free(self, arena: VmmArena, synchronize: bool = True) -> None:
        """Release every chunk still held, then the address range."""
        with drv.current(self.ctx):
            if synchronize and arena.mapped:
                drv.check(cu.cuCtxSynchronize())  # no copy may still touch what is unmapped
            for i in range(len(arena.handles)):
                self._release_chunk(arena, i)
            for fd in arena.export_fds:
                if fd >= 0:
                    os.close(fd)
            arena.export_fds.clear()
            if arena.va:
                drv.check(cu.cuMemAddressFree(arena.va, arena.nbytes))
                arena.va = 0
            arena.handles.clear()
            arena.mapped = 0

    def _release_chunk(self, arena: VmmArena, i: int) -> None:
        # A client that imported the chunk keeps its memory alive past this (refcounted).
        handle = arena.handles[i]
        if handle is None:
            return
        off = sum(arena.sizes[:i])
        if i < len(arena.export_fds) and arena.export_fds[i] >= 0:
            os.close(arena.export_fds[i])
            arena.export_fds[i] = -1
        drv.check(cu.cuMemUnmap(arena.va + off, arena.sizes[i]))
        drv.check(cu.cuMemRelease(handle))
        arena.handles[i] = None
        self.room.give(arena.sizes[i])
