"""Device rings a transfer engine can use, between a VMM arena and a neighbour daemon
(weightcache/peers/): the lender's arena is copied into one, the borrower's reads land in
another and are copied on into its arena, where their pieces are hashed.

Why rings and not the arenas themselves: UCX's ``cuda_ipc`` transport (what NIXL moves
GPU memory with on one host) takes memory from ``cuMemAlloc``/``cudaMalloc`` only. The
arenas' VMM chunks (POSIX-fd handles) it sends over loopback TCP instead: 0.46-0.50 GB/s
on one H200, against 416 GB/s between ``cudaMalloc`` buffers (docs/benchmarks.md, "GPU
memory: NIXL's own rate"). A device-to-device copy into or out of a ring runs at HBM
speed on either end, so the staged transfer keeps nearly the buffers' rate while the
arenas stay exportable VMM memory. Each ring is one ``cuMemAlloc`` (one registration
with NIXL), cut into slots.

The rings are device memory outside the budget (``[peers] gpu_ring_bytes``): one on the
lender for the length of a lend, one on the borrower for the length of a fill.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import xxhash
from cuda.bindings import driver as cu

from .. import cuda_driver as drv
from .cuda_hash import DIGEST_SLOTS, DigestBlock, GpuHasher, PieceTable

# The kernel's smallest piece (xxh3's "long" path) and its alignment; the rest is hashed here.
KERNEL_MIN = 241
KERNEL_ALIGN = 16


class DeviceRing:
    """``slots`` x ``slot_bytes`` of device memory from one ``cuMemAlloc`` (so NIXL
    registers it once), with one stream for the copies into or out of it."""

    def __init__(self, ctx: Any, slots: int, slot_bytes: int) -> None:
        self.ctx = ctx
        self.slots, self.slot_bytes = slots, slot_bytes
        self.base = 0
        self.stream: Any = None
        self.events: list[Any] = []
        with drv.current(ctx):
            try:
                self.base = int(drv.check(cu.cuMemAlloc(slots * slot_bytes)))
                # Zeroed: a peer may read a lender's ring (registered with NIXL) before any
                # stage, and cuMemAlloc hands back what this process freed earlier.
                drv.check(cu.cuMemsetD8(self.base, 0, slots * slot_bytes))
                self.stream = drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
                for _ in range(slots):
                    self.events.append(drv.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)))
            except BaseException:
                self.close()
                raise
        self.recorded = [False] * slots  # has the slot's event been recorded since the ring was made?

    def addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def close(self) -> None:
        with drv.current(self.ctx):
            if self.stream is not None:
                drv.check(cu.cuStreamSynchronize(self.stream))
            for ev in self.events:
                drv.check(cu.cuEventDestroy(ev))
            self.events.clear()
            if self.stream is not None:
                drv.check(cu.cuStreamDestroy(self.stream))
                self.stream = None
            if self.base:
                drv.check(cu.cuMemFree(self.base))
                self.base = 0


class StagedSource:
    """The lender's side: arena bytes copied into a slot on a peer's request (``stage``),
    for the peer to read from there.

    Note [stages pipelined]
    -----------------------
    A borrower keeps up to a ring's worth of ``stage`` requests outstanding. Copied and
    answered one at a time (a thread hop, the copy, a stream sync, the reply, and only
    then the next request read), 147 stages of 64 MiB took 0.31 ms each on one H100
    and the fill spent 40 of its 51-68 ms waiting for them (docs/benchmarks.md, session
    22). So ``stage`` only queues the request: one thread per lend issues each copy on
    the ring's stream as soon as it is asked for, and waits for the oldest copy only
    when nothing new is waiting to be issued, so the stream always holds every copy asked
    for; ``done`` is called in request order as each copy completes. A slot is copied
    into again only once the peer read it (it asks for the next chunk of a slot after
    that chunk's read), and copies on one stream run in order."""

    def __init__(self, ctx: Any, va: int, slots: int, slot_bytes: int) -> None:
        self._va = va
        self.ring = DeviceRing(ctx, slots, slot_bytes)
        self._asked: queue.SimpleQueue[tuple[int, int, int, Callable[[str | None], None]] | None] = queue.SimpleQueue()
        self._closing = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._copy_in_order, name="weightcache-stage", daemon=True)
        self._thread.start()

    def stage(self, slot: int, offset: int, nbytes: int, done: Callable[[str | None], None]) -> None:
        """Queue a copy of arena bytes [offset, offset + nbytes) into ``slot``; returns at
        once. ``done(None)`` is called (from the lend's copying thread, in request order)
        once the bytes are there, ``done(why)`` if they cannot be (the lend ended, or the
        copy failed). The request was checked against the arena and the ring
        (peers/server.py's ``check_stage``)."""
        with self._closing:
            if self._closed:
                done("the lend has ended")
                return
            self._asked.put((slot, offset, nbytes, done))

    def _copy_in_order(self) -> None:
        issued: collections.deque[tuple[int, Callable[[str | None], None]]] = collections.deque()  # (slot, done)
        try:
            self._copy(issued)
        finally:  # closed, or an error no stage expected: nothing is left waiting for its answer
            for _slot, done in issued:  # with copies in flight: the ring's close waits for them
                done("the lend has ended")
            while not self._asked.empty():
                if (item := self._asked.get_nowait()) is not None:
                    item[3]("the lend has ended")

    def _copy(self, issued: collections.deque[tuple[int, Callable[[str | None], None]]]) -> None:
        ring = self.ring
        why: str | None = None  # once a copy failed: every later stage is answered with it, and the lend ends
        while True:
            try:
                item = self._asked.get(block=not issued)
            except queue.Empty:  # nothing new to issue: wait for the oldest copy
                slot, done = issued.popleft()
                if why is None:
                    why = self._driver(cu.cuEventSynchronize, ring.events[slot])
                done(why)
                continue
            if item is None:
                return
            slot, offset, nbytes, done = item
            if self._closed:  # the lend ended: what was queued before close is answered, not copied
                why = why or "the lend has ended"
            if why is None:
                why = (self._driver(cu.cuMemcpyDtoDAsync, ring.addr(slot), self._va + offset, nbytes, ring.stream)
                       or self._driver(cu.cuEventRecord, ring.events[slot], ring.stream))
            issued.append((slot, done))

    def _driver(self, call: Callable[..., Any], *args: Any) -> str | None:
        """None once ``call(*args)`` succeeded in the ring's context; else what went wrong."""
        try:
            with drv.current(self.ring.ctx):
                drv.check(call(*args))
        except drv.CudaError as exc:
            return f"the lender's copy failed: {exc}"
        return None

    def close(self) -> None:
        """Stop the copying thread (every stage not answered yet is answered "the lend has
        ended"), then free the ring (its close waits for the copies on its stream)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._asked.put(None)  # after every stage queued before: those are answered first
        self._thread.join()
        self.ring.close()


class Landing:
    """The borrower's side: a peer's bytes land in a slot, are copied on into the arena
    (``land``, on one stream, in the order called), and the pieces are hashed by the GPU
    once every byte of them is in (``hash_landed``). The digests are the loader's exactly
    (backends/cuda_hash.py): the same kernel, or xxhash here for the pieces it does not take.

    The fill hashes once the last chunk landed, not as chunks land (peers/staged.py;
    docs/benchmarks.md has the rates of both on one GPU).

    Note [one launch for many pieces]
    ---------------------------------
    The pieces are hashed by one launch of the kernel with a block (one warp) per piece
    (cuda_hash.py's ``launch_many``). A launch per piece, on 64 streams taken in turn, let
    64 warps run at once, and hashed 9.8 GB in 43 ms on one H100 (the fill's
    log), ~3.5 GB/s a warp: the launch holds every piece at once, up to what the SMs' shared memory takes
    (32 KiB a warp). Without MPS a context has the GPU to itself while its kernels run, so
    the shorter launch also takes less of the GPU from the engines beside it."""

    memory = "VRAM"  # NIXL's name for the slots' memory

    def __init__(self, ctx: Any, ordinal: int, hasher: GpuHasher, va: int, grow: Callable[[int], None], slots: int,
                 slot_bytes: int) -> None:
        self._ctx, self._hasher, self._va, self._grow = ctx, hasher, va, grow
        self.device_id = ordinal
        self.ring = DeviceRing(ctx, slots, slot_bytes)
        self._blocks: list[DigestBlock] = []
        self._launched: list[tuple[Any, DigestBlock, int]] = []  # (key, block, slot)
        self._host: list[tuple[Any, int, int]] = []  # (key, arena offset, nbytes): hashed in ``digests``
        self._tables: list[PieceTable] = []  # read by the hash launches: freed once they are done

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The device's context current in this thread (the transport's registrations and
        reads of device memory run in it)."""
        with drv.current(self._ctx):
            yield

    def wait(self, slot: int) -> None:
        """Until the slot's last ``land`` has copied it out: the next read may overwrite it."""
        if self.ring.recorded[slot]:
            drv.check(cu.cuEventSynchronize(self.ring.events[slot]))

    def land(self, slot: int, offset: int, nbytes: int) -> None:
        """Copy the slot's first ``nbytes`` to arena offset ``offset`` (asynchronously)."""
        self._grow(offset + nbytes)
        drv.check(cu.cuMemcpyDtoDAsync(self._va + offset, self.ring.addr(slot), nbytes, self.ring.stream))
        drv.check(cu.cuEventRecord(self.ring.events[slot], self.ring.stream))
        self.ring.recorded[slot] = True

    def hash_landed(self, pieces: Sequence[tuple[Any, int, int]]) -> None:
        """Hash ``pieces`` ((key, arena offset, nbytes)), whose bytes have all been
        ``land``-ed: the launch follows every copy landed so far on the ring's stream."""
        on_gpu: list[tuple[int, int, int]] = []  # (data, nbytes, out): one launch (Note [one launch for many pieces])
        for key, offset, nbytes in pieces:
            if nbytes < KERNEL_MIN or (self._va + offset) % KERNEL_ALIGN:
                self._host.append((key, offset, nbytes))
                continue
            if not self._blocks or self._blocks[-1].used == DIGEST_SLOTS:
                self._blocks.append(self._hasher.take_block())
            block = self._blocks[-1]
            on_gpu.append((self._va + offset, nbytes, block.dev + 16 * block.used))
            self._launched.append((key, block, block.used))
            block.used += 1
        if on_gpu:  # on the ring's stream: after every copy landed so far
            self._tables.append(self._hasher.launch_many(self.ring.stream, on_gpu))

    def zero(self, gaps: Sequence[tuple[int, int]]) -> None:
        """Zero arena bytes no tensor holds ((offset, nbytes)), as a load leaves them: the
        peer's padding is not covered by the fingerprint, so it is not taken."""
        for offset, nbytes in gaps:
            self._grow(offset + nbytes)
            drv.check(cu.cuMemsetD8Async(self._va + offset, 0, nbytes, self.ring.stream))

    def digests(self) -> dict[Any, bytes]:
        """Every launched piece's digest and the small pieces' (copied to the host), once
        the copies and kernels are done."""
        drv.check(cu.cuStreamSynchronize(self.ring.stream))
        out = {key: block.digest(slot) for key, block, slot in self._launched}
        for key, offset, nbytes in self._host:
            buf = (ctypes.c_char * nbytes)()
            drv.check(cu.cuMemcpyDtoH(ctypes.addressof(buf), self._va + offset, nbytes))
            out[key] = xxhash.xxh3_128_digest(memoryview(buf).cast("B"))
        return out

    def close(self) -> None:
        """Waits for every copy and kernel, then frees the ring, the streams and the
        digest blocks (back to the hasher)."""
        with drv.current(self._ctx):
            synced = True
            try:
                if self.ring.stream is not None:
                    drv.check(cu.cuStreamSynchronize(self.ring.stream))
            except drv.CudaError:
                synced = False
                raise
            finally:
                if synced:  # else a kernel may still read or write them: kept from other loads
                    for t in self._tables:
                        t.free()
                    for b in self._blocks:
                        self._hasher.give_back(b)
                self._tables.clear()
                self._blocks.clear()
                self.ring.close()
