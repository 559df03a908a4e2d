"""Extents over one region: how the pinned host pool hands out host copies. Pure, so it
is tested without a GPU (tests/test_extents.py).

Why extents and not one contiguous range per copy: under churn a first-fit pool
fragmented, and demotions failed with room to spare (on an H200, 125 failed demotions in
60 s with an 8 GiB tier and 3 GiB models). A host copy made of several pieces
costs one copy call per piece, and any free bytes can take a demotion: an allocation
succeeds exactly when ``free_bytes >= n``.
"""

from __future__ import annotations

import threading

Extent = tuple[int, int]  # (offset, length)


class ExtentAllocator:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[Extent] = [(0, size)] if size > 0 else []  # sorted by offset, merged
        self._lock = threading.Lock()

    def alloc(self, n: int) -> list[Extent] | None:
        """Pieces adding up to exactly ``n`` bytes, lowest addresses first (few pieces
        while the pool is young: the free list starts as one range); None if fewer than
        ``n`` bytes are free."""
        if n <= 0:
            raise ValueError(f"cannot allocate {n} bytes")
        with self._lock:
            if sum(length for _, length in self._free) < n:
                return None
            out: list[Extent] = []
            need = n
            while need:
                off, length = self._free[0]
                take = min(length, need)
                out.append((off, take))
                need -= take
                if take == length:
                    self._free.pop(0)
                else:
                    self._free[0] = (off + take, length - take)
            return out

    def free(self, extents: list[Extent]) -> None:
        with self._lock:
            merged: list[Extent] = []
            for o, length in sorted([*self._free, *extents]):
                if merged and merged[-1][0] + merged[-1][1] > o:
                    raise ValueError(f"extent ({o}, {length}) overlaps free space: freed twice?")
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((o, length))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)

    @property
    def free_extents(self) -> int:
        """How many pieces the free space is in (1 when unfragmented)."""
        with self._lock:
            return len(self._free)


def split_by_chunks(pieces: list[Extent], chunks: list[int]) -> list[list[tuple[int, int, int]]]:
    """Where each chunk of an arena lies in a host copy: for chunk *i* (sizes ``chunks``,
    back to back), the (host address, arena offset, length) segments of ``pieces`` (host
    address, length; in arena order) that hold its bytes."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in chunks]
    i = 0  # the piece being consumed
    used = 0  # bytes of it consumed
    pos = 0
    for c, size in enumerate(chunks):
        end = pos + size
        while pos < end:
            ptr, length = pieces[i]
            take = min(length - used, end - pos)
            out[c].append((ptr + used, pos, take))
            pos += take
            used += take
            if used == length:
                i, used = i + 1, 0
    return out
