"""Closing the file descriptors that came with frames, daemon and client alike."""

from __future__ import annotations

import os
from collections.abc import Iterable


def close_fds(fds: Iterable[int]) -> None:
    """Close ``fds``, a run of consecutive numbers with one ``os.closerange``.

    Why not an os.close each: every call lets go of the GIL, and while another thread
    computes the caller waits up to a switch interval (5 ms), or to the end of that
    thread's C call, to take it back. The 253 fds of one refused frame, closed one by
    one on the event loop beside a fill's hashing, were 50-60 ms stalls with the loop
    thread blocked, not on a CPU (docs/benchmarks.md, "Session 19"). Fds that arrive
    together are numbered in a run: the kernel gives out the lowest free numbers.
    """
    ordered = sorted(fds)
    if not ordered:
        return
    start = prev = ordered[0]
    for fd in ordered[1:]:
        if fd != prev + 1:
            os.closerange(start, prev + 1)
            start = fd
        prev = fd
    os.closerange(start, prev + 1)
