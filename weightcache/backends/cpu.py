"""CPU backend: a model's arena is its files' page cache where those files can be
trusted not to change, else a sealed memfd.

Note [page-cache arenas]
------------------------
Why not always a memfd: on a host without shmem huge pages (the CI VM:
``shmem_enabled = never``) a memfd is mapped 4 KiB at a time, 16 pages per fault, and
an engine's first read of 1 GiB paid ~80 ms of faults, while the same file's page
cache, in 2 MiB folios, maps a whole folio per fault (~10 ms): attach + read was 0.4x
``load_file`` + read. And the memfd was a second copy of what the page cache already
held. Prefaulting a memfd in the client (MADV_POPULATE_READ) costs the same as the
faults it saves. Figures: docs/benchmarks.md.

A **file arena** (wire kind ``"file"``, docs/protocol.md): at bind time the arena opens
each checkpoint file anew (its own read-only open file description, reached through the
loader's fd, so the very inode that was parsed) and maps it read-only. The fill makes
the tensors' pages resident (MADV_POPULATE_READ over each range the reader hands it, in
the reader's threads; MADV_HUGEPAGE first, so a cold read fills 2 MiB folios), and the
seal mlocks the whole pages inside the tensor bytes where the daemon may (root or
CAP_IPC_LOCK, else within RLIMIT_MEMLOCK; otherwise they stay populated but
reclaimable, and that is logged). Held mapped, the pages are also safe from reclaim
that takes only unmapped page cache (this VM's DAMON pages out unmapped file pages
idle for a minute). Clients get a dup of each file's fd and the arena-to-file segments,
and map the files themselves: no copy, no second copy.

The budget counts ``capacity(arena_bytes)``, at least the tensor bytes, and what is
mlocked is only whole pages inside those bytes, so never more. The header's page and
the partial pages at the ends of each file's tensor bytes are ordinary page cache.

Nothing seals a file, so a file is served this way only if nobody the daemon does not
trust can change it (``page_cache.hold_files``); every other load is copied into a memfd:

- trusted (loader/sources.py, TRUST: the rule the kept digests follow too): opened by the daemon
  itself, owned by root or the daemon's user and not writable by its group or others, or
  immutable / fs-verity; on a local file system;
- open for writing nowhere (a read lease, ``page_cache._open_for_writing``);
- every tensor aligned to its dtype within the file (a zero-copy view needs it);
- if not readable by every user (``safetensors.save_file`` writes mode 0600): no byte
  after the header that is not a tensor's, since an engine's fd reads the whole file.
  What the fd then shows beyond the tensors the model's access rules already give the
  engine is the header (names, dtypes, shapes, ``__metadata__``), the path and the
  file's stat: docs/reliability.md, "What an engine learns from a file's fd";
- Linux >= 5.14 (MADV_POPULATE_READ).

What attached engines see when a file changes:

- replaced by rename (how downloads and ``mv`` update a checkpoint): the arena holds the
  old inode, so engines keep the old bytes, whole; once nobody is attached the daemon
  notices the path's new inode and reloads.
- rewritten in place (``cp`` over it, ``truncate``): only root or the daemon's user can
  (the trusted operator, docs/reliability.md); engines attached then see the new bytes
  as they are written, and SIGBUS past a truncated end. The daemon cannot prevent that,
  only refuse to hand it out: each attach checks the held file's size and mtime and
  answers CORRUPT_CHECKPOINT when it changed, until nobody is attached and the
  model is reloaded from the new bytes. Operators update checkpoints by rename, or
  ``chattr +i`` them; ``CpuBackend(page_cache=False)`` copies everything to memfds.

A **memfd arena**: ``memfd_create`` + ``ftruncate`` + ``posix_fallocate`` (running out
of memory while *filling* a memfd cannot be caught: SIGBUS or the OOM killer; here it
is an error before any read) -> a writable shared mapping that the loader ``preadv``s
into, or a publish copies into -> mapping closed -> seals
``F_SEAL_WRITE|SHRINK|GROW|SEAL``: nobody, the daemon included, can change the bytes
again; clients map a dup ``PROT_READ``. Published weights always get one. When it was
filled from files, the pages the reader brought into the page cache are dropped again
(POSIX_FADV_DONTNEED; the kernel keeps pages someone maps), so the memfd is the only copy.

An arena is created empty; a load from files offers it the files first (``bind_files``)
and it becomes a file arena or, at its first write, a memfd. This module is the memfd
arena and the choice; backends/page_cache.py the file arena's mechanism.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import operator
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest, CorruptCheckpoint, NoSpace
from ..loader.checkpoint import Checkpoint
from ..loader.preads import pread_full, pread_hashing, read_batch
from ..loader.reader import TaskHasher
from ..loader.sources import OpenedSource
from ..protocol.arena import MEMFD, MEMFD_SEALS, SEGMENT, ArenaDesc, FileArenaDesc, MemfdArenaDesc
from ..units import capacity
from .base import Arena, Backend, DmaRegion, DmaView, PublishedSource
from .page_cache import (
    PAGE,
    HeldFile,
    PageCacheWriter,
    hold_files,
    mlock_files,
    populate_supported,
    release,
    segments,
)

log = logging.getLogger("weightcache.daemon")


@dataclass
class MemfdArena(Arena):
    """A CPU arena: empty until a load binds files to it (a file arena) or it is first
    written (a memfd)."""

    fd: int = -1  # the memfd, once the arena is one; owned by the arena until free()
    mapping: mmap.mmap | None = None  # the memfd's writable mapping, only while filling
    files: list[HeldFile] | None = None  # a file arena's files, in checkpoint order
    segments: bytes = b""  # a file arena's arena -> file ranges, packed as on the wire
    locked: int = 0  # bytes mlocked

    @property
    def kind(self) -> str:
        return "file" if self.files is not None else "memfd"


@dataclass
class MemfdSource(PublishedSource):
    mapping: mmap.mmap | None = None  # the engine's sealed memfd, mapped read-only


class _MemfdWriter:
    direct_io = False  # it reads straight into the mapping: no aligned bounce buffer
    serves_files = False  # a copy: the files could change after it
    device_hash_min: int | None = None  # hashed by the loader threads, from the mapping

    def __init__(self, arena: MemfdArena) -> None:
        assert arena.mapping is not None
        self._arena = arena
        self._view: memoryview | None = memoryview(arena.mapping)
        self._read: dict[int, list[int]] = {}  # fd -> [start, end] of what was read from it
        self._lock = threading.Lock()

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen: TaskHasher | None = None) -> None:
        assert self._view is not None and not direct
        # `with` releases the slice even when the read fails: a traceback that kept it
        # alive would pin the mapping (mmap.close() -> BufferError) and leak the arena.
        with self._view[arena_offset : arena_offset + nbytes] as dst:
            if seen is None:
                pread_full(fd, dst, file_offset)
            else:
                pread_hashing(fd, dst, file_offset, seen)
        with self._lock:
            span = self._read.setdefault(fd, [file_offset, file_offset + nbytes])
            span[0], span[1] = min(span[0], file_offset), max(span[1], file_offset + nbytes)

    def write_batch(self, fd: int, file_offset: int, arena_offsets: list[int], sizes: list[int],
                    seen: Callable[[list[memoryview]], None] | None = None) -> None:
        """Small tensors back to back in the file, each to its place in the mapping: one
        preadv (Note [small tensors in batches], loader/reader.py)."""
        assert self._view is not None
        # Slices made and released by map, in C: no bytecode per tensor.
        views = list(map(self._view.__getitem__, map(slice, arena_offsets, map(operator.add, arena_offsets, sizes))))
        read_batch(fd, views, file_offset, seen)
        end = file_offset + sum(sizes)
        with self._lock:
            span = self._read.setdefault(fd, [file_offset, end])
            span[0], span[1] = min(span[0], file_offset), max(span[1], end)

    def finish(self) -> None:
        # The view pins the mapping; drop it so seal() can close the mapping.
        if self._view is not None:
            self._view.release()
            self._view = None
        # The memfd now holds these bytes: their page cache would be a second copy.
        # (On a failed load too: the pages are as useless then.)
        for fd, (start, end) in self._read.items():
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        self._read.clear()


class CpuBackend(Backend):
    kind = MEMFD  # what engines publish on this device; attach replies say "file" or "memfd" per arena
    supports_dma = True  # host memory: NIXL's DRAM

    def __init__(self, device: str, page_cache: bool = True) -> None:
        super().__init__(device)
        # Off: every arena is a sealed memfd, the files' page cache never served.
        self.page_cache = page_cache and populate_supported()
        self._warned_mlock = False

    def total_memory(self) -> int:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def capacity(self, nbytes: int) -> int:
        return capacity(nbytes, PAGE)

    def allocate(self, nbytes: int, label: str) -> MemfdArena:
        # Nothing yet: whether this is a memfd or the files' pages is known at bind_files
        # or the first write.
        return MemfdArena(device=self.device, nbytes=self.capacity(nbytes), label=label)

    def _make_memfd(self, arena: MemfdArena, reserve: bool = True) -> None:
        """Turn an empty arena into a memfd of its full size, with its pages taken now
        (``reserve``; else by ``_reserve``, range by range)."""
        if arena.fd >= 0 or arena.files is not None:
            return
        size = arena.nbytes
        fd = os.memfd_create(f"weightcache:{arena.label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            # It costs nothing measurable (2.78 vs 2.77 GB/s fill rate, 1 GiB, the CI VM).
            if reserve:
                os.posix_fallocate(fd, 0, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # Not into a forked child: the daemon forks to start workers (the fill worker's
            # next one as a fill ends), and a child holding this writable mapping between
            # fork and exec made the seal fail (EBUSY).
            mapping.madvise(mmap.MADV_DONTFORK)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise NoSpace(f"host memory exhausted allocating {size} bytes for {arena.label} ({exc.strerror})",
                              device=self.device, needed=size, fits_ever=False) from None
            raise
        except BaseException:
            os.close(fd)
            raise
        arena.fd, arena.mapping = fd, mapping

    # -- page-cache arenas (Note [page-cache arenas]) ---------------------------------
    def bind_files(self, arena: Arena, ckpt: Checkpoint, files: OpenedSource) -> None:
        assert isinstance(arena, MemfdArena) and arena.fd < 0 and arena.files is None
        held: list[HeldFile] = []
        why: str | None = "page-cache arenas are off (or the kernel lacks MADV_POPULATE_READ, Linux < 5.14)"
        if self.page_cache:
            held, why = hold_files(ckpt, files)
        if why is not None:
            arena.fallback = why
            log.info("load %s: copied into a sealed memfd, not served from the page cache: %s", arena.label, why)
            return
        arena.files = held
        arena.segments = segments(ckpt)

    def _lock(self, arena: MemfdArena) -> None:
        assert arena.files is not None
        locked, err = mlock_files(arena.files)
        arena.locked += locked
        if err and not self._warned_mlock:
            self._warned_mlock = True
            log.warning("mlock refused (%s): page-cache arenas stay resident while mapped but the kernel may reclaim "
                        "them under memory pressure (engines then fault them back from disk); run the daemon as root, "
                        "with CAP_IPC_LOCK, or with LimitMEMLOCK=infinity", os.strerror(err))

    def writer(self, arena: Arena, chunk_bytes: int) -> _MemfdWriter | PageCacheWriter:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:
            return PageCacheWriter(arena.files)
        self._make_memfd(arena)
        return _MemfdWriter(arena)

    def seal(self, arena: Arena) -> None:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:
            for f in arena.files:
                if f.changed():
                    raise CorruptCheckpoint(f"{f.path}: checkpoint changed on disk while it was loading", file=f.path,
                                            reason="changed during load")
            self._lock(arena)
            log.info("load %s: served from the page cache of its %d file(s), %d bytes mlocked", arena.label,
                     len(arena.files), arena.locked)
            return
        self._make_memfd(arena)  # a model of no tensor bytes was never written to
        if arena.mapping is not None:
            arena.mapping.close()  # F_SEAL_WRITE fails (EBUSY) while a writable mapping exists
            arena.mapping = None
        fcntl.fcntl(arena.fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)

    # -- a neighbour daemon's transfer engine (weightcache/peers/) ----------------------
    def dma_files(self, arena: Arena) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]]] | None:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:
            return [(f.fd, f.size) for f in arena.files], [(f, fo, ao, n) for f, fo, ao, n in SEGMENT.iter_unpack(arena.segments)]
        if arena.fd < 0:
            return None
        return [(arena.fd, arena.nbytes)], [(0, 0, 0, arena.nbytes)]

    def dma_target(self, arena: Arena) -> DmaView | None:
        assert isinstance(arena, MemfdArena) and arena.files is None
        # Pages reserved range by range (``prepare``), ahead of the reads: a whole 1 GiB
        # posix_fallocate took 430-540 ms on the CI VM before the first byte could move.
        self._make_memfd(arena, reserve=False)
        assert arena.mapping is not None
        return DmaView([DmaRegion(0, _address(arena.mapping), arena.nbytes)], "DRAM",
                       prepare=lambda offset, nbytes: self._reserve(arena, offset, nbytes), fd=arena.fd)

    def _reserve(self, arena: MemfdArena, offset: int, nbytes: int) -> None:
        try:
            os.posix_fallocate(arena.fd, offset, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise NoSpace(f"host memory exhausted filling {arena.label} ({exc.strerror})", device=self.device,
                              needed=nbytes, fits_ever=False) from None
            raise

    # -- publish ----------------------------------------------------------------------
    def open_published(self, arena: ArenaDesc, fds: list[int]) -> MemfdSource:
        assert isinstance(arena, MemfdArenaDesc), arena.kind  # model_ops refused every other kind
        if len(fds) != 1:
            raise BadRequest(f"a memfd arena is published with 1 fd, not {len(fds)}")
        nbytes = arena.nbytes  # a positive integer (parse_arena)
        try:
            # Only memfds (and other shmem files) know seals: a regular file, a FIFO, a
            # socket or /dev/zero is refused here, before anything maps it.
            seals = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS)
            size = os.fstat(fds[0]).st_size
        except OSError:
            raise BadRequest("the published fd is not a memfd; publish a sealed memfd") from None
        if not seals & fcntl.F_SEAL_WRITE or not seals & fcntl.F_SEAL_SHRINK:
            # Unsealed, the engine could change the bytes while (or after) we copy them.
            raise BadRequest("publish a sealed memfd (F_SEAL_WRITE and F_SEAL_SHRINK)")
        if size < nbytes:
            raise BadRequest(f"the published memfd is {size} bytes, not {nbytes}")
        try:
            return MemfdSource(nbytes, mmap.mmap(fds[0], nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        except (OSError, ValueError) as exc:
            raise BadRequest(f"the published memfd cannot be mapped: {exc}") from None

    def copy_published(self, source: PublishedSource, arena: Arena, nbytes: int) -> None:
        # Published weights are memory of their own: always a memfd, never a file.
        assert isinstance(arena, MemfdArena) and arena.files is None
        assert isinstance(source, MemfdSource) and source.mapping is not None
        self._make_memfd(arena)
        assert arena.mapping is not None
        arena.mapping[:nbytes] = source.mapping[:nbytes]

    def close_published(self, source: PublishedSource) -> None:
        assert isinstance(source, MemfdSource)
        if source.mapping is not None:
            source.mapping.close()
            source.mapping = None

    @contextlib.contextmanager
    def reading(self, arena: Arena) -> Iterator[Callable[[int, int], memoryview]]:
        # A publish's arena is a sealed memfd: views of one read-only mapping of it.
        assert isinstance(arena, MemfdArena) and arena.files is None and arena.fd >= 0
        m = mmap.mmap(arena.fd, arena.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        whole = memoryview(m)
        try:
            yield lambda offset, n: whole[offset : offset + n]
        finally:
            whole.release()
            m.close()

    # -- attach and free ----------------------------------------------------------------
    def export(self, arena: Arena) -> tuple[list[int], dict[str, Any]]:
        assert isinstance(arena, MemfdArena)
        if arena.files is None:
            return [os.dup(arena.fd)], MemfdArenaDesc(arena.nbytes).to_wire()
        for f in arena.files:
            # The held inode rewritten in place (by its owner or root): the bytes engines
            # would map are no longer the ones loaded. Say so rather than hand them out.
            if f.changed():
                raise CorruptCheckpoint(
                    f"{f.path}: the checkpoint file was changed in place since it was loaded; attaches are refused until "
                    "no engine is attached, then it is reloaded (replace checkpoint files by rename instead)",
                    file=f.path, reason="changed in place")
        fds: list[int] = []
        try:
            for f in arena.files:
                fds.append(os.dup(f.fd))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds, FileArenaDesc(arena.nbytes, [f.size for f in arena.files], arena.segments).to_wire()

    def free(self, arena: Arena) -> None:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:
            for f in arena.files:
                release(f)  # unmapping unlocks; the pages stay page cache, reclaimable
            arena.files = None
            arena.locked = 0
        if arena.fd >= 0:
            os.close(arena.fd)
            arena.fd = -1
        if arena.mapping is not None:
            # If a view still exists, its pages go when it is collected; the fd is closed.
            with contextlib.suppress(BufferError):
                arena.mapping.close()
            arena.mapping = None


def _address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts. The ctypes object that tells it holds a buffer export of
    the mapping (close() would then fail with BufferError): dropped at once."""
    probe = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe
