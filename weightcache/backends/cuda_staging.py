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

import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import xxhash
from cuda.bindings import driver as cu

from .. import cuda_driver as drv
from .cuda_hash import DIGEST_SLOTS, DigestBlock, GpuHasher

HASH_STREAMS = 64  # one warp per piece per launch: 64 streams let 64 pieces hash at once
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
    for the peer to read from there."""

    def __init__(self, ctx: Any, va: int, slots: int, slot_bytes: int) -> None:
        self._va = va
        self.ring = DeviceRing(ctx, slots, slot_bytes)
        # A stage's thread may outlive its lend's task (cancelled at shutdown): close waits for it.
        self._lock = threading.Lock()

    def stage(self, slot: int, offset: int, nbytes: int) -> None:
        """Copy arena bytes [offset, offset + nbytes) into ``slot``; returns once they are
        there. The request was checked against the arena and the ring (peers/server.py's
        ``check_stage``); ValueError once the lend has ended."""
        with self._lock, drv.current(self.ring.ctx):
            if not self.ring.base:
                raise ValueError("the lend has ended")
            drv.check(cu.cuMemcpyDtoDAsync(self.ring.addr(slot), self._va + offset, nbytes, self.ring.stream))
            drv.check(cu.cuStreamSynchronize(self.ring.stream))

    def close(self) -> None:
        with self._lock:
            self.ring.close()


class Landing:
    """The borrower's side: a peer's bytes land in a slot, are copied on into the arena
    (``land``, on one stream, in the order called), and the pieces are hashed by the GPU
    once every byte of them is in (``hash_landed``). The digests are the loader's exactly
    (backends/cuda_hash.py): the same kernel, or xxhash here for the pieces it does not take.

    The fill hashes once the last chunk landed, not as chunks land (peers/staged.py;
    docs/benchmarks.md has the rates of both on one GPU)."""

    memory = "VRAM"  # NIXL's name for the slots' memory

    def __init__(self, ctx: Any, ordinal: int, hasher: GpuHasher, va: int, grow: Callable[[int], None], slots: int,
                 slot_bytes: int) -> None:
        self._ctx, self._hasher, self._va, self._grow = ctx, hasher, va, grow
        self.device_id = ordinal
        self.ring = DeviceRing(ctx, slots, slot_bytes)
        self._hash_streams: list[Any] = []
        self._blocks: list[DigestBlock] = []
        self._launched: list[tuple[Any, DigestBlock, int]] = []  # (key, block, slot)
        self._host: list[tuple[Any, int, int]] = []  # (key, arena offset, nbytes): hashed in ``digests``
        self._landed_event: Any = None
        self._next_hash = 0
        try:
            with drv.current(ctx):
                self._landed_event = drv.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
                for _ in range(HASH_STREAMS):
                    self._hash_streams.append(drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
        except BaseException:
            self.close()
            raise

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
        ``land``-ed: the kernels wait for every copy landed so far."""
        if not pieces:
            return
        drv.check(cu.cuEventRecord(self._landed_event, self.ring.stream))
        for key, offset, nbytes in pieces:
            if nbytes < KERNEL_MIN or (self._va + offset) % KERNEL_ALIGN:
                self._host.append((key, offset, nbytes))
                continue
            stream = self._hash_streams[self._next_hash]
            self._next_hash = (self._next_hash + 1) % len(self._hash_streams)
            drv.check(cu.cuStreamWaitEvent(stream, self._landed_event, 0))
            if not self._blocks or self._blocks[-1].used == DIGEST_SLOTS:
                self._blocks.append(self._hasher.take_block())
            block = self._blocks[-1]
            self._hasher.launch(stream, self._va + offset, nbytes, block.dev + 16 * block.used)
            self._launched.append((key, block, block.used))
            block.used += 1

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
        for s in self._hash_streams:
            drv.check(cu.cuStreamSynchronize(s))
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
                for s in self._hash_streams:
                    drv.check(cu.cuStreamSynchronize(s))
            except drv.CudaError:
                synced = False
                raise
            finally:
                for s in self._hash_streams:
                    drv.check(cu.cuStreamDestroy(s))
                self._hash_streams.clear()
                if self._landed_event is not None:
                    drv.check(cu.cuEventDestroy(self._landed_event))
                    self._landed_event = None
                if synced:  # else a kernel may still write them: kept from other loads
                    for b in self._blocks:
                        self._hasher.give_back(b)
                self._blocks.clear()
                self.ring.close()
