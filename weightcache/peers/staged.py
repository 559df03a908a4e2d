"""Filling a GPU arena from a peer through device rings (backends/cuda_staging.py says why
rings): the fill strategy for backends whose arenas a transfer engine cannot write.

Note [a staged fill]
--------------------
The arena's bytes, from its first tensor's to its last tensor's end, move in chunks of
one slot. For chunk i, in order, up to ``slots`` at once:

1. on a staged lend (the lender's GPU), ``stage`` asks the lender to copy the chunk into
   its slot i % slots, and the reply says it is there (wire.py); from a lender's host
   memory (DRAM regions) the chunk is read where it is;
2. one NIXL read per lender region brings it into this daemon's slot i % slots, once
   that slot's last chunk has landed and been copied out (reads complete in any order:
   chunk i - slots may still be in flight when chunk i - 1's read is done);
3. once read, the slot is copied on into the arena (one stream, in the order landed),
   and the lender's slot is asked for chunk i + slots.

When every chunk has landed, the bytes between tensors are zeroed (the lender's are not
covered by the fingerprint), every piece is hashed by the GPU, and the fingerprint is
computed from the pieces' digests and this daemon's own parse of its files, as fill.py's
Note [a peer's bytes are checked] says: a wrong byte anywhere fails the fill before the
arena is sealed. A host lender's regions must hold every tensor byte (checked before the
first read); its chunks are read where the regions hold them.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..backends import Arena, Backend
from ..backends.base import Landing
from ..config.peers import RING_SLOTS
from ..errors import LoadFailed
from ..loader import Checkpoint, Progress
from ..loader.reader import HASH_BLOCK, fingerprint, plan_tasks, tensor_digests
from .fill import Lent
from .transport import Extent, TransferFailed, Transport

log = logging.getLogger("weightcache.peers")


class CannotLand(LoadFailed):
    """This daemon cannot take a GPU fill now (no device memory for its ring): not the
    peer's failure, so the peer is not backed off for it."""


class StageRequests(Protocol):
    """The lend's control connection, as the fill's thread uses it (peers/__init__.py)."""

    def request(self, seq: int, slot: int, offset: int, nbytes: int) -> None:
        """Ask for chunk ``seq``'s bytes in ``slot`` (returns at once)."""

    def staged(self, seq: int, stall_s: float) -> bool:
        """Whether the lender said chunk ``seq`` is staged (without waiting); TransferFailed
        once it refused, the connection ended, or ``stall_s`` passed since the request."""


def held(offset: int, nbytes: int, dst: int, regions: Sequence[tuple[int, int, int]], starts: list[int]) -> list[Extent]:
    """The reads of the parts of arena bytes [offset, offset + nbytes) that a lender's
    host regions ((arena_offset, addr, nbytes), in arena order; ``starts`` their
    arena_offsets) hold, each to ``dst`` plus its distance from ``offset``. A file
    arena's regions hold the tensors' bytes, not the padding between them; a tensor byte
    no region holds lands as whatever the slot held, and fails the fingerprint."""
    out = []
    k = max(bisect.bisect_right(starts, offset) - 1, 0)
    for ao, addr, n in regions[k:]:
        if ao >= offset + nbytes:
            break
        lo, hi = max(offset, ao), min(offset + nbytes, ao + n)
        if lo < hi:
            out.append(Extent(dst + lo - offset, addr + lo - ao, hi - lo))
    return out


def uncovered(ckpt: Checkpoint, regions: Sequence[tuple[int, int, int]], starts: list[int]) -> str | None:
    """The name of a tensor whose bytes a lender's host regions (in arena order) do not
    all hold, or None: a hostile lender's short regions must fail before any read, not
    leave arena bytes unwritten (a GPU arena's unmapped)."""
    for t in ckpt.tensors:
        pos, end = t.arena_offset, t.arena_offset + t.nbytes
        k = max(bisect.bisect_right(starts, pos) - 1, 0)
        for ao, _addr, n in regions[k:]:
            if pos >= end or ao > pos:
                break
            pos = max(pos, ao + n)
        if pos < end:
            return t.name
    return None


def gaps(ckpt: Checkpoint, end: int) -> list[tuple[int, int]]:
    """Arena bytes [0, end) that no tensor holds, as (offset, nbytes)."""
    out, pos = [], 0
    for start, n in sorted((t.arena_offset, t.nbytes) for t in ckpt.tensors if t.nbytes):
        if start > pos:
            out.append((pos, start - pos))
        pos = max(pos, start + n)
    if end > pos:
        out.append((pos, end - pos))
    return out


@dataclass(frozen=True)
class StagedFill:
    """A fill strategy (server/residency/fill.py) for arenas that land through a ring (Note [a staged fill])."""

    transport: Transport
    backend: Backend
    lent: Lent
    expected: str  # the fingerprint this daemon's files have
    stop: Callable[[], str | None]
    stages: StageRequests
    timeout_s: float
    max_bytes_per_s: int | None = None
    stall_s: float = 5.0
    slots: int = RING_SLOTS
    slot_bytes: int = 64 * 2**20  # of this daemon's ring ([peers] gpu_ring_bytes / RING_SLOTS)

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        staged = self.lent.staged
        # This daemon's ring never bigger than its own: a lender's claim sizes none of its memory.
        slots, slot_bytes = ((min(staged.slots, self.slots), min(staged.slot_bytes, self.slot_bytes)) if staged
                             else (self.slots, self.slot_bytes))
        try:
            landing = self.backend.dma_landing(arena, slots, slot_bytes)
        except Exception as exc:  # the ring's device memory refused
            raise CannotLand(f"no device memory for a fill's ring ({slots} x {slot_bytes} bytes): {exc}") from None
        if landing is None:  # Peers.fill asks can_land_dma first
            raise CannotLand(f"the {arena.device} backend cannot check a peer's bytes on the device")
        try:
            with landing.context():
                return self._fill(ckpt, landing, progress)
        finally:
            landing.close()

    def _fill(self, ckpt: Checkpoint, landing: Landing, progress: Progress) -> str:
        ring = landing.ring
        slots, size = ring.slots, ring.slot_bytes
        end = max((t.arena_offset + t.nbytes for t in ckpt.tensors if t.nbytes), default=0)
        chunks = [(o, min(size, end - o)) for o in range(0, end, size)]
        staged = self.lent.staged
        # Every chunk's reads, in order; a staged lend's chunk is one read from its slot.
        extents: list[Extent] = []
        first_of: dict[int, int] = {}  # index into extents -> the chunk it starts
        starts = [r[0] for r in self.lent.regions]
        if staged is None:
            missing = uncovered(ckpt, self.lent.regions, starts)
            if missing is not None:
                raise LoadFailed(f"the peer's copy does not fit this checkpoint's layout: its regions do not hold "
                                 f"tensor {missing!r}'s bytes")
        for i, (o, n) in enumerate(chunks):
            first_of[len(extents)] = i
            dst = ring.addr(i % slots)
            if staged is not None:
                extents.append(Extent(dst, staged.addr + (i % slots) * staged.slot_bytes, n))
            else:
                extents += held(o, n, dst, self.lent.regions, starts)
        # Pieces in arena order, each with the chunk its last byte is in.
        pieces: list[tuple[tuple[int, int], int, int]] = []
        for task in plan_tasks(ckpt, HASH_BLOCK):
            at = task.arena_offset
            for p in task.pieces:
                pieces.append(((p.tensor, p.index), at, p.nbytes))
                at += p.nbytes
        pieces.sort(key=lambda p: p[1])
        in_slot: list[int] = [-1] * slots  # the chunk each slot holds or is reading
        left = [0] * len(chunks)  # bytes still to read, per chunk
        i = -1
        for k, e in enumerate(extents):
            i = first_of.get(k, i)
            left[i] += e.nbytes
        landed = [not n for n in left]  # a chunk the lender holds nothing of (padding): nothing to land
        tensor_bytes = [0] * len(chunks)  # what each chunk brings of the tensors: the progress shown
        for _, at, nb in pieces:
            while nb:
                c = at // size
                take = min(nb, (c + 1) * size - at)
                tensor_bytes[c] += take
                at, nb = at + take, nb - take
        local: list[BaseException] = []
        state = {"next_extent": 0, "posted": 0}
        stage_wait = {"since": 0.0, "total": 0.0}  # reads held back for the lender's stage replies
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        if staged is not None:
            for i in range(min(slots, len(chunks))):
                self.stages.request(i, i, *chunks[i])

        def ready(k: int) -> bool:
            """Whether read ``k`` may be posted now. A chunk's first read waits for its
            slot's last chunk to have landed (reads complete in any order: that one's may
            still be in flight) and for the lender's word that the chunk is staged; any
            read waits while the rate cap is ahead. Never blocks: meanwhile the transport
            polls the reads in flight, and their landing asks for the next chunks."""
            i = first_of.get(k)
            if i is not None:
                if i >= slots and not landed[i - slots]:
                    return False
                if staged is not None and not self.stages.staged(i, self.stall_s):
                    stage_wait["since"] = stage_wait["since"] or time.monotonic()
                    return False
                if stage_wait["since"]:
                    stage_wait["total"] += time.monotonic() - stage_wait["since"]
                    stage_wait["since"] = 0.0
            return not self.max_bytes_per_s or state["posted"] / self.max_bytes_per_s <= time.monotonic() - t0

        def pace(nbytes: int, dst: int) -> None:
            """Before each read: its chunk's slot copied out here (the copy was issued when
            the chunk before landed; waits only for the device)."""
            k = state["next_extent"]
            state["next_extent"] = k + 1
            i = first_of.get(k)
            if i is not None:
                landing.wait(i % slots)
                in_slot[i % slots] = i
            state["posted"] += nbytes

        def on_done(dst: int, nbytes: int) -> None:
            slot = (dst - ring.base) // size
            i = in_slot[slot]
            left[i] -= nbytes  # pace, ready and on_done all run in the transport's read thread
            if left[i]:
                return
            o, n = chunks[i]
            try:
                landing.land(slot, o, n)  # may grow the arena: wait for room, or NoSpace
            except Exception as exc:  # this daemon's, not the peer's: ends the read (stop), raised as itself
                local.append(exc)
                return
            progress.add(tensor_bytes[i])
            landed[i] = True
            if staged is not None and i + slots < len(chunks):
                self.stages.request(i + slots, slot, *chunks[i + slots])

        def stop() -> str | None:
            return "this daemon could not land a chunk" if local else self.stop()

        try:
            self.transport.read(self.lent.metadata, extents, landing.memory, landing.device_id, self.lent.memory,
                                self.lent.device_id, window=slots, on_done=on_done, stop=stop, deadline=deadline,
                                stall_s=self.stall_s, pace=pace, ready=ready)
        except TransferFailed as exc:
            if local:
                raise local[0] from None
            got = sum(n for (_, n), ok in zip(chunks, landed, strict=True) if ok)
            raise LoadFailed(f"reading from the peer failed after {got} of {end} bytes: {exc}",
                             reason="peer transfer failed") from None
        moved = time.monotonic()
        landing.zero(gaps(ckpt, end))  # first: it maps what no chunk reached (padding only)
        landing.hash_landed(pieces)  # every chunk landed: every piece is in (Note [a staged fill])
        digests: dict[Any, bytes] = landing.digests()
        log.info("fill from a peer: %d chunks of %d bytes moved in %.1f ms (%.1f ms of it waiting for the lender's "
                 "stages), hashed in %.1f ms", len(chunks), size, (moved - t0) * 1e3, stage_wait["total"] * 1e3,
                 (time.monotonic() - moved) * 1e3)
        nonzero = [i for i, t in enumerate(ckpt.tensors) if t.nbytes]
        got = fingerprint(ckpt, {**tensor_digests(ckpt, digests, nonzero),
                                 **tensor_digests(ckpt, {}, [i for i, t in enumerate(ckpt.tensors) if not t.nbytes])})
        if got != self.expected:
            raise LoadFailed(f"the peer's bytes do not match this checkpoint's fingerprint (got {got[:16]}…, expected "
                             f"{self.expected[:16]}…): a peer that holds other bytes under this layout",
                             reason="peer bytes do not match the fingerprint")
        return got
