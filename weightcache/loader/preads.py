"""Reading a file's bytes into caller-owned buffers: full, scattered, O_DIRECT and
hashing preads, and the page-cache residency probe. A leaf of the loader: the reader
plans the work, the backends' writers call these to move the bytes (a writer never
reaches back into the reader)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Callable

from ..errors import CorruptCheckpoint
from ..units import round_up

IOV_MAX = 1024  # Linux: the most buffers one preadv takes

DIRECT_ALIGN = 4096


def pread_direct(fd: int, buf: memoryview, offset: int, nbytes: int) -> int:
    """Read ``nbytes`` at ``offset`` from an O_DIRECT fd into the page-aligned ``buf``
    (at least ``nbytes + 2 * DIRECT_ALIGN`` long); offsets and lengths are widened to the
    alignment O_DIRECT needs. Returns where the wanted bytes start in ``buf``."""
    start = offset // DIRECT_ALIGN * DIRECT_ALIGN
    skew = offset - start
    want = round_up(skew + nbytes, DIRECT_ALIGN)
    got = 0
    while got < skew + nbytes:
        n = os.preadv(fd, [buf[got:want]], start + got)
        if n == 0:
            raise CorruptCheckpoint(f"file ended at {start + got} while reading (truncated?)", reason="truncated")
        got += n
    return skew


def resident_fraction(fd: int, size: int, samples: int = 32) -> float:
    """Share of the file's pages in the page cache: ``samples`` pages asked with mincore(2)
    on an untouched mapping. ``preadv(RWF_NOWAIT)``, the probe used before, starts readahead
    of each page it misses (3 MiB file: 0% after DONTNEED, 100% probed again 50 ms later)."""
    if size <= 0:
        return 1.0
    libc = _libc()
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return 1.0  # a file system that cannot map it: assume warm and read buffered
    try:
        page = mmap.PAGESIZE
        pages = -(-size // page)
        vec = ctypes.c_ubyte()
        hits = 0
        for i in range(samples):
            if libc.mincore(ctypes.c_void_p(addr + pages * i // samples * page), page, ctypes.byref(vec)) != 0:
                return 1.0
            hits += vec.value & 1
        return hits / samples
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)


_MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def pread_full(fd: int, view: memoryview, offset: int, path: str = "") -> None:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is a corrupt checkpoint."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise CorruptCheckpoint(f"{path}: file ended at {offset + got} while reading (truncated?)", file=path, reason="truncated")
        got += n


def pread_scattered(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` in order from ``fd``'s bytes at ``offset`` on, IOV_MAX views a
    preadv; a short file is a corrupt checkpoint."""
    for k in range(0, len(views), IOV_MAX):
        group = views[k : k + IOV_MAX]
        want = sum(map(len, group))
        got = os.preadv(fd, group, offset)
        if got < want:  # a signal or the file's end: the rest one view at a time (rare: no need to be quick)
            at = offset
            for v in group:
                if got >= len(v):
                    got -= len(v)
                else:
                    with v[got:] as rest:
                        pread_full(fd, rest, at + got)
                    got = 0
                at += len(v)
        offset += want


def read_batch(fd: int, views: list[memoryview], offset: int, seen: Callable[[list[memoryview]], None] | None) -> None:
    """A batch of small tensors (Note [small tensors in batches], loader/reader.py):
    ``views`` filled by :func:`pread_scattered`, handed to ``seen`` (the hash), and
    released whatever happens: a view kept alive pins the mapping it is a slice of."""
    try:
        pread_scattered(fd, views, offset)
        if seen is not None:
            seen(views)
    finally:
        list(map(memoryview.release, views))


# A load that hashes reads this much at a time and hashes it at once, so the hash reads
# bytes still in the core's cache (2 MiB of L2 here) rather than a whole chunk back from
# memory. One thread, 1 GiB from a warm page cache in 16 MiB chunks (2-core VM): reads
# alone 152 ms, + hash of each whole chunk 199 ms, + hash per 1 MiB slice 173 ms, per
# 256 KiB 186 ms (medians of 5).
HASH_SLICE = 1 << 20


def pread_hashing(fd: int, view: memoryview, offset: int, seen: Callable[[memoryview], None]) -> None:
    """``pread_full``, handing each slice of ``view`` to ``seen`` as soon as it is read."""
    for off in range(0, len(view), HASH_SLICE):
        with view[off : off + HASH_SLICE] as part:
            pread_full(fd, part, offset + off)
            seen(part)
