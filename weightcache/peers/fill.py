"""Filling a new arena from a peer's copy over NIXL, checked against the fingerprint.

Note [a peer's bytes are checked]
---------------------------------
The fill reads the lender's regions into this daemon's fresh arena in tasks of whole
hash pieces (loader/reader.py's ``plan_tasks``: HASH_BLOCK pieces cut from each
tensor's first byte), ``WINDOW`` reads in flight, and hashes each task's pieces on a
thread of its own as soon as its bytes are in and out of the reader's reach (through the
fill worker: below its Watermark, lend_worker.py), while later reads run. When every read is
done, the fingerprint is computed from those piece digests and *this daemon's own* parse
of its files (names, dtypes, shapes, arena layout: the peer's copy only has to fit it),
exactly as a load from the files would compute it (Note [content fingerprint]), and the
fill fails unless it equals the fingerprint this daemon expected of its files. So every
piece's digest is checked against the fingerprint before the arena is sealed and the
model becomes attachable; a wrong byte anywhere makes the fill fail, and the load falls
back to the files. The lender is never asked for digests: it could lie about them.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..backends import Arena, Backend
from ..errors import LoadFailed
from ..loader import Checkpoint, Progress
from ..loader.reader import HASH_BLOCK, Task, TaskHasher, fingerprint, plan_tasks, tensor_digests
from .lend_worker import FillWorker
from .transport import Extent, TransferFailed, Transport

# Bytes per read request (whole pieces): at 64 MiB and 4 in flight, 1 GiB over CMA on
# the 2-core VM read as fast as one request for the whole GiB (docs/benchmarks.md), and
# hashing starts after the first 64 MiB instead of after the last byte.
TASK_BYTES = 64 * 2**20
WINDOW = 4
PREPARE_AHEAD = 2 * TASK_BYTES
HASH_THREADS = 2


@dataclass(frozen=True)
class Lent:
    """What a lender answered ``lend`` with (wire.py)."""

    metadata: bytes
    memory: str
    device_id: int
    regions: tuple[tuple[int, int, int], ...]  # (arena_offset, addr, nbytes), arena order
    staged: Staged | None = None  # a GPU lend's ring (wire.py): no regions then

    @classmethod
    def parse(cls, reply: dict[str, Any]) -> Lent:
        md, memory, dev, regions = (reply.get(k) for k in ("metadata", "memory", "device_id", "regions"))
        if not isinstance(md, bytes) or memory not in ("DRAM", "VRAM") or not isinstance(dev, int) or not isinstance(regions, list):
            raise ValueError("lend: the reply is malformed")
        out = []
        for r in regions:
            if not (isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and x >= 0 for x in r)):
                raise ValueError("lend: a region is malformed")
            out.append((r[0], r[1], r[2]))
        out.sort()
        staged = Staged.parse(reply["staged"]) if "staged" in reply else None
        if staged is not None and out:
            raise ValueError("lend: a staged lend has no regions")
        return cls(md, str(memory), dev, tuple(out), staged)


MAX_STAGE_SLOTS = 64
# Per slot. The floor keeps a lender's reply from cutting a fill into millions of chunks
# (the chunk is the smaller of the two sides' slots); the ceiling is [peers] gpu_ring_bytes's.
MIN_STAGE_BYTES = 2**21
MAX_STAGE_BYTES = 2**30


@dataclass(frozen=True)
class Staged:
    """A staged lend's ring: ``slots`` x ``slot_bytes`` at the lender's ``addr``."""

    addr: int
    slots: int
    slot_bytes: int

    @classmethod
    def parse(cls, value: Any) -> Staged:
        if not isinstance(value, dict):
            raise ValueError("lend: staged is malformed")
        addr, slots, size = (value.get(k) for k in ("addr", "slots", "slot_bytes"))
        if not (isinstance(addr, int) and addr >= 0 and isinstance(slots, int) and 0 < slots <= MAX_STAGE_SLOTS
                and isinstance(size, int) and MIN_STAGE_BYTES <= size <= MAX_STAGE_BYTES):
            raise ValueError(f"lend: staged needs an address, 1..{MAX_STAGE_SLOTS} slots of {MIN_STAGE_BYTES}..{MAX_STAGE_BYTES} bytes")
        return cls(addr, slots, size)


def extents_for(task_offset: int, nbytes: int, local_base: int, regions: tuple[tuple[int, int, int], ...]) -> list[Extent]:
    """The reads that bring arena bytes [task_offset, task_offset + nbytes) from the
    lender's regions to ``local_base + offset``. Raises ValueError where the regions do
    not cover them all (a peer whose arena is laid out otherwise)."""
    out = []
    pos, end = task_offset, task_offset + nbytes
    for ao, addr, n in regions:
        if ao + n <= pos:
            continue
        if ao > pos or pos >= end:
            break
        take = min(end, ao + n) - pos
        out.append(Extent(local_base + pos, addr + (pos - ao), take))
        pos += take
    if pos < end:
        raise ValueError(f"the peer's regions do not cover arena bytes {pos}..{end}")
    return out


@dataclass(frozen=True)
class PeerFill:
    """A fill strategy (server/residency/fill.py): ``lent``'s bytes read over NIXL into the arena,
    every piece hashed, the fingerprint checked (Note [a peer's bytes are checked])."""

    transport: Transport | None  # the daemon's own agent; host fills read through ``worker`` instead
    backend: Backend
    lent: Lent
    expected: str  # the fingerprint this daemon's files have
    stop: Callable[[], str | None]  # why to stop now (the lender's connection closed, the load cancelled), or None
    timeout_s: float
    max_bytes_per_s: int | None = None
    stall_s: float = 5.0  # no read completing for this long while some are in flight: give up
    # The fill worker that reads into host arenas (lend_worker.py, Note [a fill lands in a
    # worker]); None only where a caller reads with ``transport`` itself (unit tests).
    worker: FillWorker | None = None

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        if self.lent.staged is not None:  # a GPU lend: peers/staged.py's fill, which __init__ chooses for GPU targets
            raise LoadFailed("a GPU lend's ring fills GPU arenas only")
        view = self.backend.dma_target(arena)
        if view is None or len(view.regions) != 1:
            raise LoadFailed(f"the {arena.device} backend offers no memory a peer's transfer can write")
        if view.memory != "DRAM":
            # The pieces are hashed from host memory here; a GPU arena's need the device's
            # hash kernel (backends/cuda_hash.py) behind a backend hook that does not exist yet.
            raise LoadFailed(f"a fill from a peer into {view.memory} cannot check its pieces yet")
        base = view.regions[0].addr
        # The arena's bytes below this offset are out of the reach of whatever reads the
        # lender's bytes, so a piece there may be hashed: all of them where the daemon's own
        # agent reads, the fill worker's Watermark where it does (lend_worker.py, Note [a
        # fill lands in a worker]).
        safe = [view.regions[0].nbytes]
        if self.worker is not None:
            if view.fd is None:
                raise LoadFailed(f"the {arena.device} backend's arena has no file the fill worker can map")
            safe[0] = 0
            read: Callable[..., None] = functools.partial(self.worker.read, view.fd, base, view.regions[0].nbytes,
                                                          on_safe=lambda upto: hash_below(upto))
        elif self.transport is not None:
            read = self.transport.read
        else:
            raise LoadFailed("no NIXL agent to read a peer's copy with")
        # Capped, a read is at most ~1/8 s of the rate (at least one piece): the cap holds
        # within that, not per 64 MiB.
        size = TASK_BYTES if not self.max_bytes_per_s else min(TASK_BYTES, self.max_bytes_per_s // 8)
        tasks = plan_tasks(ckpt, size)
        by_dst: dict[int, Task] = {}
        extents: list[Extent] = []
        left: dict[int, int] = {}  # id(task) -> its bytes still to come
        try:
            for task in tasks:
                es = extents_for(task.arena_offset, task.nbytes, base, self.lent.regions)
                for e in es:
                    by_dst[e.dst] = task
                extents += es
                left[id(task)] = task.nbytes
        except ValueError as exc:
            raise LoadFailed(f"the peer's copy does not fit this checkpoint's layout: {exc}") from None
        pieces: dict[tuple[int, int], bytes] = {}
        hashes: list[Future[None]] = []
        t0 = time.monotonic()
        done_bytes = 0
        lock = threading.Lock()

        def hash_task(task: Task) -> None:
            view_mem = (ctypes_view(base + task.arena_offset, task.nbytes))
            with view_mem as mv:
                TaskHasher(task, pieces)(mv)

        waiting: list[Task] = []  # every byte in, not yet out of the reader's reach

        def hash_below(upto: int) -> None:
            with lock:
                safe[0] = max(safe[0], upto)
                ready = [t for t in waiting if t.arena_offset + t.nbytes <= safe[0]]
                waiting[:] = [t for t in waiting if t.arena_offset + t.nbytes > safe[0]]
            hashes.extend(pool.submit(hash_task, t) for t in ready)

        def on_done(dst: int, nbytes: int) -> None:
            nonlocal done_bytes
            task = by_dst[dst]
            with lock:
                left[id(task)] -= nbytes
                if not left[id(task)]:
                    waiting.append(task)
                done_bytes += nbytes
            progress.add(nbytes)
            hash_below(0)

        posted = 0
        # The target's pages are reserved a task ahead of the reads (DmaView.prepare), in
        # a thread of its own, up to PREPARE_AHEAD bytes beyond the last read posted (or, through
        # the fill worker, allowed: lend_worker.py's FillWorker.read).
        prepared = threading.Condition()
        ready = [0, 0]  # [bytes of the arena prepared, bytes posted]
        failure: list[BaseException] = []
        quit_prep = threading.Event()

        def preparer() -> None:
            try:
                for task in tasks:
                    with prepared:
                        prepared.wait_for(lambda: ready[0] - ready[1] < PREPARE_AHEAD or quit_prep.is_set())
                    if quit_prep.is_set():
                        return
                    view.prepare(task.arena_offset, task.nbytes)
                    with prepared:
                        ready[0] = task.arena_offset + task.nbytes
                        prepared.notify_all()
            except BaseException as exc:
                failure.append(exc)
                with prepared:
                    prepared.notify_all()

        def pace(nbytes: int, dst: int) -> None:
            """The read's bytes prepared, and never ahead of the rate cap."""
            nonlocal posted
            with prepared:
                ready[1] = dst - base + nbytes
                prepared.notify_all()
                prepared.wait_for(lambda: ready[0] >= dst - base + nbytes or bool(failure))
            if failure:
                raise failure[0]
            if self.max_bytes_per_s:
                ahead = posted / self.max_bytes_per_s - (time.monotonic() - t0)
                while ahead > 0 and self.stop() is None:
                    time.sleep(min(ahead, 0.05))
                    ahead = posted / self.max_bytes_per_s - (time.monotonic() - t0)
            posted += nbytes

        prep = threading.Thread(target=preparer, name="wc-peer-prepare")
        prep.start()
        with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="wc-peer-hash") as pool:
            try:
                read(self.lent.metadata, extents, view.memory, view.device_id, self.lent.memory,
                     self.lent.device_id, window=WINDOW, on_done=on_done, stop=self.stop,
                     deadline=t0 + self.timeout_s, stall_s=self.stall_s, pace=pace)
            except TransferFailed as exc:
                if failure:  # the target could not be prepared (host memory exhausted)
                    raise failure[0] from None
                raise LoadFailed(f"reading from the peer failed after {done_bytes} of {ckpt.data_bytes} bytes: {exc}",
                                 reason="peer transfer failed") from None
            finally:
                quit_prep.set()
                with prepared:
                    prepared.notify_all()
                prep.join()
            hash_below(view.regions[0].nbytes)  # the read is over: nothing else writes the arena
            for f in hashes:
                f.result()
        nonzero = [i for i, t in enumerate(ckpt.tensors) if t.nbytes]
        missing = [ckpt.tensors[i].name for i in nonzero
                   if any((i, k) not in pieces for k in range(-(-ckpt.tensors[i].nbytes // HASH_BLOCK)))]
        if missing:
            raise LoadFailed(f"{len(missing)} tensor(s) were not read from the peer, e.g. {missing[0]!r}")
        digests = tensor_digests(ckpt, pieces, nonzero)
        empty = tensor_digests(ckpt, {}, [i for i, t in enumerate(ckpt.tensors) if not t.nbytes])
        got = fingerprint(ckpt, {**digests, **empty})
        if got != self.expected:
            raise LoadFailed(f"the peer's bytes do not match this checkpoint's fingerprint (got {got[:16]}…, expected "
                             f"{self.expected[:16]}…): a peer that holds other bytes under this layout",
                             reason="peer bytes do not match the fingerprint")
        return got


def ctypes_view(addr: int, nbytes: int) -> memoryview:
    """A read-only view of ``nbytes`` of this process's memory at ``addr`` (the arena's
    writable mapping, which outlives the view: it is released before the fill returns)."""
    import ctypes

    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B").toreadonly()
