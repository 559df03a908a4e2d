"""First-fit ranges over one region: how the pinned host pool hands out copies. Pure,
so it is tested without a GPU (tests/test_firstfit.py)."""

from __future__ import annotations

import threading


class FirstFit:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, merged
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` free bytes, or None if no single free range is that long."""
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= n:
                    self._free[i : i + 1] = [(off + n, length - n)] if length > n else []
                    return off
        return None

    def free(self, off: int, n: int) -> None:
        with self._lock:
            merged: list[tuple[int, int]] = []
            for o, length in sorted([*self._free, (off, n)]):
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((o, length))
            self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)
