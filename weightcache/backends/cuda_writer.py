"""The CUDA backend's arena writer: a load's bytes from the files into a VMM arena,
through per-thread pinned staging buffers (backends/pinned.py), hashed where the reader's
plan says (loader/reader.py, backends/cuda_hash.py).

Note [the chunk loop in C]
--------------------------
From a warm page cache the loader is bound by host memory: each byte is read out of the
page cache, written into a pinned buffer, and read again by the copy engine. Small
buffers, several in flight a thread, go faster, as if the staged bytes stayed in the
CPU's last-level cache until the DMA read them: on an H100 host (300 MiB L3), 12 threads
of 2 MiB slots, 3 in flight each, moved a warm 9.8 GB file to the GPU at 49.5-49.8 GB/s,
against 40-42 with one 16 MiB buffer a thread, and InstantTensor's best 39.7 in the same call
(benchmarks/native/staging_probe.c; docs/benchmarks.md). But each slot is a pread and
two driver calls; from Python, with twelve threads taking turns at the GIL, 2 MiB
chunks ran at 21 GB/s. So the slot loop is C (staging_loop.c, built at install as
``_staging_loop``, loaded with ctypes, which lets go of the GIL for the call; used by
default where it is built, ``load_chunk_loop``; through the daemon it loaded at 43.2 GB/s
against 40.1 staged from Python on one H100 host, and within the spread of it on another
where Python staging already reached 44.8: docs/benchmarks.md): a thread
hands it one chunk (``load_chunk_bytes``) and it runs the chunk's slots through the
first LOOP_SLOTS x LOOP_SLOT bytes of the thread's staging buffer, on that buffer's
stream. Chunks the host must hash from the buffer, and O_DIRECT reads, stay on the
Python path (the slots are overwritten before the call returns).

Note [a thread's tasks in one call]
-----------------------------------
With the loop, a thread still came back to Python for every 16 MiB chunk: the reader's
dispatch, the writer's checks, the context push and pop, the hasher's bookkeeping and the
hash kernels' launches, each a turn at the GIL among twelve threads. The writer with the
loop ran at 47.0 GB/s without the content hash on an H100 host where the same loop with
no Python around it (benchmarks/native/staging_probe.c) reached 51.7 (docs/benchmarks.md).
So the reader hands the writer, before its threads start, every task the loop can run
whole (``task_loop``: buffered, every piece hashed on the device or none at all), and
each loader thread makes one C call (``wc_stage_tasks``) that claims tasks one at a time
from the table they share, so the load's tail stays as even as one task, and launches each
task's hash kernels itself, into digest slots handed out here beforehand. A call returns
after LOOP_BUDGET bytes, so that the thread sees a cancel or another thread's failure, or
when a task ends past the arena's mapped bytes (a miss still waiting for its victims'
room): the thread grows the arena and calls again with that task. Off unless
``load_chunk_loop = "tasks"``: it has run against a stand-in driver (tests/test_chunk_loop.py),
not yet on a GPU, where what it gains is still to be measured (docs/benchmarks.md, "The
chunk loop through the daemon", has the command).
"""

from __future__ import annotations

import ctypes
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, Protocol

from cuda.bindings import driver as cu

from .. import cuda_driver as drv
from ..loader.preads import DIRECT_ALIGN, pread_direct, pread_full, pread_hashing, read_batch
from ..loader.reader import Task, TaskError, TaskHasher
from .cuda_hash import DEVICE_MIN, DIGEST_SLOTS, DigestBlock, GpuHasher
from .page_windows import PageWindows
from .pinned import Staging, StagingPool
from .staging_loop import LOOP_SLOT, LOOP_SLOTS, MAX_HASH_STREAMS, MAX_SLOTS, MORE, NEED_ROOM, STOPPED, Ring, Tasks, loop_failed

log = logging.getLogger("weightcache.daemon")

LOOP_BUDGET = 256 << 20  # bytes a thread's wc_stage_tasks call runs before it looks at Python again

class VmmArenaLike(Protocol):
    """What the writer reads of a VmmArena (cuda.py imports this module, not back)."""

    va: int
    mapped: int


class VmmDevice(Protocol):
    """What the writer uses of its CudaBackend."""

    ctx: Any
    device: str
    staging: StagingPool
    gpu_hash: GpuHasher | None
    chunk_loop: ctypes.CDLL | None  # staging_loop.py
    loop_tasks: bool  # a thread's tasks in one call of the loop (Note [a thread's tasks in one call])

    def grow(self, arena: Any, upto: int) -> None: ...

    def page_windows(self, files: list[tuple[int, int]]) -> PageWindows | None: ...

    def release_windows(self, windows: PageWindows) -> None: ...


class VmmWriter:
    """preadv into a per-thread pinned buffer, then an async host-to-device copy on that
    thread's own stream; where the C loop is built (``chunk_loop``) and the host need not
    read the chunk, in slots of it, several in flight (Note [the chunk loop in C]).
    Without the loop, 8 threads x 16 MiB reached 39 GB/s from page cache on the H200 in
    one process, and 31.9-41.4 GB/s through the daemon on two hosts of the same kind
    (docs/benchmarks.md). Copying straight from registered page-cache pages
    instead was slower (20-24 GB/s: the registration is the cost; benchmarks/registered_reads.py);
    with ``begin`` told of files wholly cached and the backend's ``load_page_cache_dma``
    on, a registrar registers them from the load's end while these threads stage from its
    start, and the chunks it got to first are copied from there (backends/page_windows.py).
    The buffers are page-aligned (cuMemHostAlloc), so O_DIRECT fds can read into them.

    The content hash: where the reader planned it (``TaskHasher.on_device``, for trusted
    files only, and only when ``device_hash_min`` said the backend has a GpuHasher,
    backends/cuda_hash.py), each
    piece longer than DEVICE_MIN is hashed by a kernel once its bytes are copied, on a
    hash stream that waits for the copies (an event on each stream of the thread's ring
    that carried its chunks), so the next read into a buffer never waits for a hash; the
    smaller pieces are hashed on the host from the buffer. Otherwise every piece is
    hashed on the host. ``depth`` buffers per thread, each with its own stream
    (``load_depth``, 1 by default), so a thread reads while its last copies run: with
    12 threads it neither helped nor hurt on the H100 hosts (docs/benchmarks.md, "The
    loader from the page cache (H100)"; benchmarks/loader_paths.py --depths)."""

    direct_io = True
    serves_files = False  # a copy in device memory

    def __init__(self, backend: VmmDevice, arena: VmmArenaLike, chunk: int, depth: int = 1) -> None:
        if depth < 1:
            raise ValueError(f"a loader thread needs at least one staging buffer, not {depth}")
        self._b = backend
        self._depth = depth
        self._arena = arena
        self._size = self.staging_bytes(chunk)
        self._local = threading.local()
        self._all: list[Staging] = []
        self._lock = threading.Lock()
        self._hasher = backend.gpu_hash
        self.device_hash_min: int | None = DEVICE_MIN if self._hasher is not None else None
        self._blocks: list[DigestBlock] = []  # taken from the hasher, in use
        self._slots: list[tuple[DigestBlock, int, dict[tuple[int, int], bytes], tuple[int, int]]] = []
        self._windows: PageWindows | None = None
        self._unread: memoryview | None = None  # fed to the hasher for bytes only the device hashes
        self.registered_bytes = 0  # copied from registered page-cache windows
        self._loop = backend.chunk_loop
        self.loop_tasks = backend.loop_tasks
        self.looped_bytes = 0  # copied by the C loop

    @staticmethod
    def staging_bytes(chunk: int) -> int:
        """A staging buffer's size for chunks of ``chunk`` bytes: room to widen a read to
        O_DIRECT alignment at both ends."""
        return chunk + 2 * DIRECT_ALIGN

    def begin(self, files: list[tuple[int, int]]) -> None:
        """The files (fd, size) this load may copy without the host reading them (buffered,
        hashed on the device or not at all), in the load's order: those wholly in the page
        cache are copied from registered pages where the registrar gets to them first
        (backends/page_windows.py, Note [two ways at once])."""
        self._windows = self._b.page_windows(files)

    def _staging(self) -> Staging:
        """The thread's next buffer of its ring of ``depth``: each has its own stream, so
        a thread reads into one while the copies out of the others run."""
        ring = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = []
            self._local.next = 0
        i = self._local.next
        self._local.next = (i + 1) % self._depth
        if i == len(ring):
            st = self._b.staging.take(self._size)
            ring.append(st)
            with self._lock:
                self._all.append(st)
        return ring[i]

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen: TaskHasher | None = None) -> None:
        if self._windows is not None and not direct:
            if seen is None or seen.device_only(nbytes):
                srcs = self._windows.sources(fd, file_offset, nbytes)
                if srcs is not None:
                    return self._copy_registered(srcs, arena_offset, nbytes, seen)
            else:
                self._windows.staged(fd, file_offset, nbytes)
        if self._loop is not None and not direct and (seen is None or seen.device_only(nbytes)):
            return self._copy_looped(fd, file_offset, arena_offset, nbytes, seen)
        with drv.current(self._b.ctx):
            st = self._staging()
            st.loop_clean = False  # the loop's slots wait for this copy first
            if st.busy:
                drv.check(cu.cuStreamSynchronize(st.stream))
            hashed = False
            # The big pieces on the GPU where the reader planned it (trusted files only).
            on_device = seen is not None and seen.on_device
            if direct:
                skew = pread_direct(fd, st.view, file_offset, nbytes)
            else:
                skew = 0
                with st.view[:nbytes] as dst:
                    if seen is None or on_device:
                        pread_full(fd, dst, file_offset)
                    else:  # hashed on the host: slice by slice as it is read
                        pread_hashing(fd, dst, file_offset, seen)
                        hashed = True
            if self._arena.mapped < arena_offset + nbytes:  # its chunk waits for a victim's room
                self._b.grow(self._arena, arena_offset + nbytes)
            drv.check(cu.cuMemcpyHtoDAsync(self._arena.va + arena_offset, st.host_ptr + skew, nbytes, st.stream))
            st.busy = True
            if seen is not None and not hashed:
                # Hashed from the pinned buffer while the copy out of it runs (both only
                # read it): every piece from disk (O_DIRECT) when the GPU does not hash
                # this file, only the small ones when it does. The buffer is reused after
                # the next call's sync.
                with st.view[skew : skew + nbytes] as view:
                    seen(view)
                if on_device:
                    self._hash_on_device(seen, st)

    def _copy_looped(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, seen: TaskHasher | None) -> None:
        """The chunk through the C loop's slots in the thread's first staging buffer, on its
        stream; the host never reads it, the device hashes what the hasher hands it."""
        assert self._loop is not None
        with drv.current(self._b.ctx):
            st, ring = self._loop_ring()
            if self._arena.mapped < arena_offset + nbytes:
                self._b.grow(self._arena, arena_offset + nbytes)
            code = self._loop.wc_stage_copy(ctypes.byref(ring), fd, file_offset, self._arena.va + arena_offset, nbytes)
            st.busy = True
            st.loop_clean = True
            if code:
                raise loop_failed(code, f"{nbytes} bytes at {file_offset}")
            with self._lock:
                self.looped_bytes += nbytes
            if seen is not None:
                self._hash_unread(seen, st, nbytes)

    def _hash_unread(self, seen: TaskHasher, st: Staging, nbytes: int) -> None:
        """A chunk the host never read (device pieces only: ``device_only``): the hasher
        counts ``nbytes`` it is fed but never reads, and the device hashes what it hands over."""
        if self._unread is None or len(self._unread) < nbytes:
            self._unread = memoryview(bytes(self._size))
        seen(self._unread[:nbytes])
        self._hash_on_device(seen, st)

    def _loop_ring(self) -> tuple[Staging, Ring]:
        """The thread's first staging buffer and the C loop's ring over it, free for the
        loop's slots. Called in the context."""
        st = self._staging_first()
        ring = self._ring(st)
        if st.busy and not st.loop_clean:
            # A copy the Python path queued out of this buffer: the slots overlap it.
            drv.check(cu.cuStreamSynchronize(st.stream))
            ring.busy[:] = [0] * MAX_SLOTS
        return st, ring

    def _staging_first(self) -> Staging:
        """The thread's first staging buffer (the C loop's slots), taken if it has none yet."""
        ring = getattr(self._local, "ring", None)
        if not ring:
            return self._staging()
        return ring[0]

    def _ring(self, st: Staging) -> Ring:
        """The C loop's view of ``st``: its slots, their events, its stream. Kept on the
        buffer across loads (the pool keeps the buffer, and so the events)."""
        ring = st.loop
        if ring is None:
            slots = max(1, min(LOOP_SLOTS, st.size // LOOP_SLOT))
            ring = Ring(stream=int(st.stream), nslots=slots, slot_bytes=min(LOOP_SLOT, st.size), buf=st.host_ptr)
            while len(st.loop_events) < slots:  # kept with the buffer, destroyed with it (StagingPool.close)
                st.loop_events.append(drv.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
            for k in range(slots):
                ring.events[k] = int(st.loop_events[k])
            assert len(st.hash_streams) <= MAX_HASH_STREAMS
            ring.copied = int(st.copied)
            ring.nhash = len(st.hash_streams)
            for k, hs in enumerate(st.hash_streams):
                ring.hash_streams[k] = int(hs)
            st.loop = ring
        return ring

    def task_loop(self, tasks: Sequence[Task], fds: Sequence[int], hashed: Sequence[bool],
                  out: dict[tuple[int, int], bytes]) -> TaskLoop | None:
        """The loop that runs ``tasks`` whole, each read from ``fds[i]``, its pieces hashed on
        the device into ``out`` where ``hashed[i]`` (every one of them longer than
        ``device_hash_min`` and aligned: the reader's choice), or None where this writer
        copies chunk by chunk (not asked to, ``loop_tasks``; no C loop built; page-cache
        windows in use). Note [a thread's tasks in one call]."""
        if not self.loop_tasks or self._loop is None or self._windows is not None or not tasks:
            return None
        if any(hashed) and self._hasher is None:
            raise ValueError("tasks to hash on a device without a hasher")
        return TaskLoop(self, tasks, fds, hashed, out)

    def _run_tasks(self, table: Tasks, tasks: Sequence[Task]) -> tuple[int, int, int]:
        """One thread's turn at ``table``: (bytes done, the C loop's last code, the task it
        was at); a task past the arena's mapped bytes is grown for here, and run next."""
        assert self._loop is not None
        done, at = ctypes.c_ulonglong(), ctypes.c_longlong()
        total, resume = 0, -1
        with drv.current(self._b.ctx):
            st, ring = self._loop_ring()
            while True:
                code = self._loop.wc_stage_tasks(ctypes.byref(ring), ctypes.byref(table), resume, LOOP_BUDGET,
                                                 ctypes.byref(done), ctypes.byref(at))
                st.busy = st.loop_clean = True
                total += done.value
                if code != NEED_ROOM:
                    break
                task = tasks[at.value]
                self._b.grow(self._arena, task.arena_offset + task.nbytes)
                with self._lock:  # the C side reads it atomically; raised, never lowered
                    table.mapped = max(table.mapped, self._arena.mapped)
                resume = at.value
        with self._lock:
            self.looped_bytes += total
        return total, code, at.value

    def _copy_registered(self, srcs: list[tuple[int, int]], arena_offset: int, nbytes: int, seen: TaskHasher | None) -> None:
        """Copies from registered page-cache pages on the next stream of the thread's ring; the
        host never reads them, the device hashes what the hasher hands it."""
        with drv.current(self._b.ctx):
            st = self._staging()  # its stream; the buffer is not touched
            if self._arena.mapped < arena_offset + nbytes:
                self._b.grow(self._arena, arena_offset + nbytes)
            pos = self._arena.va + arena_offset
            for addr, n in srcs:
                drv.check(cu.cuMemcpyHtoDAsync(pos, addr, n, st.stream))
                pos += n
            st.busy = True
            with self._lock:
                self.registered_bytes += nbytes
            if seen is not None:
                self._hash_unread(seen, st, nbytes)

    def write_batch(self, fd: int, file_offset: int, arena_offsets: list[int], sizes: list[int],
                    seen: Callable[[list[memoryview]], None] | None = None) -> None:
        """Small tensors (Note [small tensors in batches], loader/reader.py): one preadv
        into the staging buffer laid out as the arena's span of the batch, hashed on the
        host from there, and one copy of the span to the device."""
        base = arena_offsets[0]
        span = arena_offsets[-1] + sizes[-1] - base  # at most the chunk: the plan's rule
        if self._windows is not None:
            self._windows.staged(fd, file_offset, span)
        starts = list(map(operator.sub, arena_offsets, repeat(base)))
        with drv.current(self._b.ctx):
            st = self._staging()
            st.loop_clean = False  # the loop's slots wait for this copy first
            if st.busy:
                drv.check(cu.cuStreamSynchronize(st.stream))
            if span != sum(sizes):
                # The padding between the tensors goes to the arena with them, and this
                # buffer last held another load's bytes, maybe another tenant's: zeroed.
                ctypes.memset(st.host_ptr, 0, span)
            with st.view[:span] as whole:
                read_batch(fd, list(map(whole.__getitem__, map(slice, starts, map(operator.add, starts, sizes)))),
                           file_offset, seen)
            if self._arena.mapped < base + span:
                self._b.grow(self._arena, base + span)
            drv.check(cu.cuMemcpyHtoDAsync(self._arena.va + base, st.host_ptr, span, st.stream))
            st.busy = True

    def _hash_on_device(self, seen: TaskHasher, st: Staging) -> None:
        """Launch the kernels of the pieces whose last bytes this call copied."""
        assert self._hasher is not None
        done = seen.take_device_done()
        if not done:
            return
        stream = st.hash_streams[st.next_hash]
        st.next_hash = (st.next_hash + 1) % len(st.hash_streams)
        # A piece's earlier chunks went out on the other streams of the thread's ring (a
        # task is one thread's, chunk after chunk, each on the ring's next buffer): the
        # kernel waits for the copies on every one of them, not only this call's. Waiting
        # for this stream alone hashed bytes still in flight with ``load_depth`` > 1 and
        # chunks smaller than a piece: wrong fingerprints, 4 of 12 such loads on an H100.
        for other in self._local.ring:
            if other.busy:
                drv.check(cu.cuEventRecord(other.copied, other.stream))
                drv.check(cu.cuStreamWaitEvent(stream, other.copied, 0))
        for piece, start in done:
            block, slot = self._slot()
            self._hasher.launch(stream, self._arena.va + seen.task.arena_offset + start, piece.nbytes, block.dev + 16 * slot)
            with self._lock:
                self._slots.append((block, slot, seen.out, (piece.tensor, piece.index)))

    def _slot(self) -> tuple[DigestBlock, int]:
        assert self._hasher is not None
        with self._lock:
            if not self._blocks or self._blocks[-1].used == DIGEST_SLOTS:
                self._blocks.append(self._hasher.take_block())
            block = self._blocks[-1]
            block.used += 1
            return block, block.used - 1

    def finish(self) -> None:
        windows, self._windows = self._windows, None
        if windows is not None:
            windows.stop()
        self._finish()  # if the streams cannot be synchronized, a copy may still read the windows: kept
        if windows is not None:
            log.info("%s: %.2f of %.2f GB registered in %.3f s, %.2f GB copied from there (the rest staged)",
                     self._b.device, windows.registered_bytes / 1e9, windows.mapped_bytes / 1e9, windows.register_s,
                     self.registered_bytes / 1e9)
            self._b.release_windows(windows)

    def _finish(self) -> None:
        with drv.current(self._b.ctx):
            synced = False
            try:
                for st in self._all:
                    drv.check(cu.cuStreamSynchronize(st.stream))
                    for hs in st.hash_streams:
                        drv.check(cu.cuStreamSynchronize(hs))
                synced = True
                for block, slot, out, key in self._slots:
                    out[key] = block.digest(slot)
            finally:
                for st in self._all:
                    self._b.staging.give_back(st)
                self._all.clear()
                self._slots.clear()
                if synced:
                    for block in self._blocks:
                        assert self._hasher is not None
                        self._hasher.give_back(block)
                # else a kernel may still write them: kept from other loads (64 KiB each)
                self._blocks.clear()


class TaskLoop:
    """A load's tasks in the C loop's shared table (staging_loop.c's wc_tasks), their
    pieces' digest slots handed out beforehand. Note [a thread's tasks in one call]."""

    def __init__(self, writer: VmmWriter, tasks: Sequence[Task], fds: Sequence[int], hashed: Sequence[bool],
                 out: dict[tuple[int, int], bytes]) -> None:
        n = len(tasks)
        self._writer = writer
        self._tasks = tasks
        offsets: list[int] = []  # each hashed piece's first byte in the arena
        sizes: list[int] = []
        outs: list[int] = []
        counts: list[int] = []
        for task, h in zip(tasks, hashed, strict=True):
            pos = task.arena_offset
            for piece in task.pieces if h else ():
                block, slot = writer._slot()
                offsets.append(pos)
                sizes.append(piece.nbytes)
                outs.append(block.dev + 16 * slot)
                with writer._lock:
                    writer._slots.append((block, slot, out, (piece.tensor, piece.index)))
                pos += piece.nbytes
            counts.append(len(offsets))

        def array(kind: Any, values: Sequence[int]) -> Any:
            return (kind * max(1, len(values)))(*values)

        u64, i64 = ctypes.c_ulonglong, ctypes.c_longlong
        # Kept here: the table points into them while any thread may read it.
        self._arrays = (array(ctypes.c_int, fds), array(i64, [t.file_offset for t in tasks]),
                        array(u64, [t.arena_offset for t in tasks]), array(u64, [t.nbytes for t in tasks]),
                        array(i64, [0, *counts]), array(u64, offsets), array(u64, sizes), array(u64, outs))
        fd, file_offset, arena_offset, nbytes, first_piece, piece_offset, piece_nbytes, piece_out = self._arrays
        hasher = writer._hasher
        self.table = Tasks(ntasks=n, next=0, stop=0, mapped=writer._arena.mapped, base=writer._arena.va, fd=fd,
                           file_offset=file_offset, arena_offset=arena_offset, nbytes=nbytes, first_piece=first_piece,
                           piece_offset=piece_offset, piece_nbytes=piece_nbytes, piece_out=piece_out,
                           kernel=hasher.kernel_handle if offsets and hasher is not None else None)
        self.ntasks = n

    def stop(self) -> None:
        """The threads claim no more tasks (a failure or a cancel elsewhere in the load)."""
        self.table.stop = 1

    def run(self) -> tuple[int, bool]:
        """Runs tasks of the table on this thread's staging ring, up to LOOP_BUDGET bytes:
        (bytes done, whether tasks may be left). Raises TaskError for a task that failed."""
        done, code, at = self._writer._run_tasks(self.table, self._tasks)
        if code in (0, STOPPED):
            return done, False
        if code == MORE:
            return done, True
        if at < 0:  # failed before it claimed a task (no driver)
            raise loop_failed(code, "the task loop")
        task = self._tasks[at]
        raise TaskError(task, loop_failed(code, f"{task.nbytes} bytes at {task.file_offset}"))
