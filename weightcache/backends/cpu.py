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
faults it saves. Figures: scripts/cpu_arena_options.py, docs/benchmarks.md.

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
trust can change it (``_page_cache_refusal``); every other load is copied into a memfd:

- trusted (loader/trust.py, the rule the kept digests follow too): opened by the daemon
  itself, owned by root or the daemon's user and not writable by its group or others, or
  immutable / fs-verity; on a local file system;
- open for writing nowhere (a read lease, ``_open_for_writing``);
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
and it becomes a file arena or, at its first write, a memfd.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest, CorruptCheckpoint, LoadFailed, NoSpace
from ..loader.checkpoint import DTYPE_SIZES, Checkpoint, CheckpointFile
from ..loader.reader import contiguous_runs, pread_full, pread_hashing
from ..loader.sources import OpenedSource
from ..loader.trust import why_untrusted
from ..protocol.arena import MEMFD_SEALS, SEGMENT
from ..units import capacity, round_up
from .base import Arena, Backend, DmaRegion, DmaView, PublishedSource

log = logging.getLogger("weightcache.daemon")

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux >= 5.14; not in Python's mmap module

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _madvise(addr: int, length: int, advice: int) -> None:
    # ctypes releases the GIL for the call: populating a range reads it from disk when cold.
    _check(_libc.madvise(addr, length, advice), "madvise")


def _populate_supported() -> bool:
    """MADV_POPULATE_READ exists (Linux >= 5.14): an unknown advice is EINVAL even for an
    empty range, which is otherwise a no-op."""
    return _libc.madvise(None, 0, MADV_POPULATE_READ) == 0


def _identity(st: os.stat_result) -> tuple[int, ...]:
    # Not ctime: unlinking the old file (a rename over it) moves its ctime too, and that
    # leaves its bytes as they were.
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass
class HeldFile:
    """One checkpoint file of a file arena."""

    path: str  # for messages
    source_fd: int  # the loader's fd of this file: the reader names the file by it
    fd: int  # the arena's own read-only open of the same inode; clients get dups of it
    size: int
    identity: tuple[int, ...]  # dev, ino, size, mtime when bound
    addr: int = 0  # the daemon's read-only mapping of the whole file (0: not mapped)
    lock_start: int = 0  # [lock_start, lock_end): whole pages inside the tensor bytes, mlocked at seal
    lock_end: int = 0


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

    def __init__(self, arena: MemfdArena) -> None:
        assert arena.mapping is not None
        self._arena = arena
        self._view: memoryview | None = memoryview(arena.mapping)
        self._read: dict[int, list[int]] = {}  # fd -> [start, end] of what was read from it
        self._lock = threading.Lock()

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen: Callable[[memoryview], None] | None = None) -> None:
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


class _PageCacheWriter:
    """Makes a file arena's pages resident: each range the reader hands it is populated
    in the daemon's mapping of that file instead of being copied."""

    direct_io = False  # the page cache is the arena: O_DIRECT would bypass it
    serves_files = True  # trusted files' own pages: their digests are reused by file identity (loader/content.py)

    def __init__(self, arena: MemfdArena) -> None:
        assert arena.files is not None
        self._by_fd = {f.source_fd: f for f in arena.files}

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen: Callable[[memoryview], None] | None = None) -> None:
        f = self._by_fd.get(fd)
        if f is None or direct:  # the reader reads the fds the arena was bound to, buffered
            raise RuntimeError(f"fd {fd} is not a file bound to this arena")
        start = file_offset // PAGE * PAGE
        end = min(round_up(file_offset + nbytes, PAGE), round_up(f.size, PAGE))
        try:
            _madvise(f.addr + start, end - start, MADV_POPULATE_READ)
        except OSError as exc:
            if exc.errno == errno.EFAULT:  # a page past the end of the file: it shrank since it was parsed
                raise CorruptCheckpoint(f"{f.path}: file ended before byte {file_offset + nbytes} while loading (truncated?)",
                                        file=f.path, reason="truncated") from None
            raise LoadFailed(f"{f.path}: read failed: {os.strerror(exc.errno or 0)}", file=f.path,
                             reason=os.strerror(exc.errno or 0)) from None
        if seen is not None:
            # Nothing was copied: the hash is a pass over the populated mapping (read-only;
            # the pages are resident, so it reads memory, not the disk).
            with memoryview((ctypes.c_char * nbytes).from_address(f.addr + file_offset)).cast("B") as view:
                seen(view)

    def finish(self) -> None:
        pass


class CpuBackend(Backend):
    kind = "memfd"  # what engines publish on this device; attach replies say "file" or "memfd" per arena
    supports_dma = True  # host memory: NIXL's DRAM

    def __init__(self, device: str, page_cache: bool = True) -> None:
        super().__init__(device)
        # Off: every arena is a sealed memfd, the files' page cache never served.
        self.page_cache = page_cache and _populate_supported()
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
        why = self._page_cache_refusal(ckpt, files)
        held: list[HeldFile] = []
        try:
            if why is None:
                for rec, sf in zip(ckpt.files, files.files, strict=True):
                    held.append(self._hold(rec.path, sf.fd))
                    f = held[-1]
                    if f.identity != (rec.dev, rec.ino, rec.size, rec.mtime_ns):
                        why = f"{rec.path} changed since it was parsed"
                        break
        except OSError as exc:
            why = f"{exc.filename or 'a file'}: {exc.strerror}"
        if why is not None:
            for f in held:
                _release(f)
            arena.fallback = why
            log.info("load %s: copied into a sealed memfd, not served from the page cache: %s", arena.label, why)
            return
        # Whole pages inside each file's tensor bytes: what seal() mlocks.
        for i, f in enumerate(held):
            spans = [(t.file_offset, t.file_offset + t.nbytes) for t in ckpt.tensors if t.file == i and t.nbytes]
            if spans:
                f.lock_start = round_up(min(s for s, _ in spans), PAGE)
                f.lock_end = max(e for _, e in spans) // PAGE * PAGE
        arena.files = held
        arena.segments = _segments(ckpt)

    def _page_cache_refusal(self, ckpt: Checkpoint, files: OpenedSource) -> str | None:
        """Why ``files`` must be copied into a memfd rather than served from the page
        cache, or None (Note [page-cache arenas])."""
        if not self.page_cache:
            return "page-cache arenas are off (or the kernel lacks MADV_POPULATE_READ, Linux < 5.14)"
        why = why_untrusted(files)  # peers' fds, tenants' files, writable by others, network file systems
        if why is not None:
            return why
        for rec, sf in zip(ckpt.files, files.files, strict=True):
            writer = _open_for_writing(sf.fd)
            if writer is not None:
                return f"{rec.path}: {writer}"
            if not os.fstat(sf.fd).st_mode & 0o004:
                hidden = _bytes_beyond_tensors(ckpt, rec)
                if hidden:
                    # An engine's fd would let it read these too, and nobody may otherwise.
                    return (f"{rec.path} is not readable by every user and holds {hidden} byte(s) outside its header and "
                            "tensors, which an engine's fd of it would expose")
        for t in ckpt.tensors:
            if t.nbytes and t.file_offset % DTYPE_SIZES[t.dtype]:
                return f"tensor {t.name!r} is not aligned to its {t.dtype} elements in {ckpt.files[t.file].path}"
        return None

    @staticmethod
    def _hold(path: str, source_fd: int) -> HeldFile:
        """Open the inode behind ``source_fd`` anew (an open file description of the arena's
        own: flags clients set on their dups never reach the loader's), and map it."""
        fd = os.open(f"/proc/self/fd/{source_fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not os.path.samestat(st, os.fstat(source_fd)):  # cannot happen through /proc's magic links
                raise OSError(errno.ESTALE, "reopened another file", path)
            f = HeldFile(path=path, source_fd=source_fd, fd=fd, size=st.st_size, identity=_identity(st))
            if f.size:
                addr = _libc.mmap(None, f.size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, _MAP_FAILED):
                    e = ctypes.get_errno()
                    raise OSError(e, os.strerror(e), path)
                f.addr = addr
                # Cold pages are then read in 2 MiB folios, which engines map whole (a hint:
                # refused where transparent huge pages are off, and then nothing changes).
                with contextlib.suppress(OSError):
                    _madvise(addr, f.size, mmap.MADV_HUGEPAGE)
            return f
        except BaseException:
            os.close(fd)
            raise

    def _lock(self, arena: MemfdArena) -> None:
        assert arena.files is not None
        for f in arena.files:
            n = f.lock_end - f.lock_start
            if n <= 0:
                continue
            if _libc.mlock(f.addr + f.lock_start, n) == 0:
                arena.locked += n
                continue
            e = ctypes.get_errno()
            if not self._warned_mlock:
                self._warned_mlock = True
                log.warning("mlock refused (%s): page-cache arenas stay resident while mapped but the kernel may reclaim "
                            "them under memory pressure (engines then fault them back from disk); run the daemon as root, "
                            "with CAP_IPC_LOCK, or with LimitMEMLOCK=infinity", os.strerror(e))
            return

    def writer(self, arena: Arena, chunk_bytes: int) -> _MemfdWriter | _PageCacheWriter:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:
            return _PageCacheWriter(arena)
        self._make_memfd(arena)
        return _MemfdWriter(arena)

    def seal(self, arena: Arena) -> None:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:
            for f in arena.files:
                if _identity(os.fstat(f.fd)) != f.identity:
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
    def dma_source(self, arena: Arena) -> DmaView | None:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:  # a file arena: its bytes are the held files' mappings
            regions = [DmaRegion(ao, arena.files[f].addr + fo, n) for f, fo, ao, n in SEGMENT.iter_unpack(arena.segments)]
            return DmaView(regions, "DRAM")
        if arena.fd < 0:
            return None
        # Sealed: the daemon's own mapping is gone; a read-only one for the peer's read.
        addr = _libc.mmap(None, arena.nbytes, mmap.PROT_READ, mmap.MAP_SHARED, arena.fd, 0)
        if addr in (None, _MAP_FAILED):
            e = ctypes.get_errno()
            raise OSError(e, f"mmap: {os.strerror(e)}")
        return DmaView([DmaRegion(0, addr, arena.nbytes)], "DRAM", release=lambda: _libc.munmap(addr, arena.nbytes))

    def dma_target(self, arena: Arena) -> DmaView | None:
        assert isinstance(arena, MemfdArena) and arena.files is None
        # Pages reserved range by range (``prepare``), ahead of the reads: a whole 1 GiB
        # posix_fallocate took 430-540 ms on the CI VM before the first byte could move.
        self._make_memfd(arena, reserve=False)
        assert arena.mapping is not None
        return DmaView([DmaRegion(0, _address(arena.mapping), arena.nbytes)], "DRAM",
                       prepare=lambda offset, nbytes: self._reserve(arena, offset, nbytes))

    def _reserve(self, arena: MemfdArena, offset: int, nbytes: int) -> None:
        try:
            os.posix_fallocate(arena.fd, offset, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise NoSpace(f"host memory exhausted filling {arena.label} ({exc.strerror})", device=self.device,
                              needed=nbytes, fits_ever=False) from None
            raise

    # -- publish ----------------------------------------------------------------------
    def open_published(self, arena: dict[str, Any], fds: list[int]) -> MemfdSource:
        if len(fds) != 1:
            raise BadRequest(f"a memfd arena is published with 1 fd, not {len(fds)}")
        nbytes = arena.get("nbytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise BadRequest(f"arena nbytes must be a positive integer, got {nbytes!r}")
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

    # -- attach and free ----------------------------------------------------------------
    def export(self, arena: Arena) -> tuple[list[int], dict[str, Any]]:
        assert isinstance(arena, MemfdArena)
        if arena.files is None:
            return [os.dup(arena.fd)], {"kind": "memfd", "nbytes": arena.nbytes}
        for f in arena.files:
            # The held inode rewritten in place (by its owner or root): the bytes engines
            # would map are no longer the ones loaded. Say so rather than hand them out.
            if _identity(os.fstat(f.fd)) != f.identity:
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
        return fds, {"kind": "file", "nbytes": arena.nbytes, "files": [f.size for f in arena.files], "segments": arena.segments}

    def free(self, arena: Arena) -> None:
        assert isinstance(arena, MemfdArena)
        if arena.files is not None:
            for f in arena.files:
                _release(f)  # unmapping unlocks; the pages stay page cache, reclaimable
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


def _release(f: HeldFile) -> None:
    if f.addr:
        _libc.munmap(f.addr, f.size)
        f.addr = 0
    if f.fd >= 0:
        os.close(f.fd)
        f.fd = -1


def _bytes_beyond_tensors(ckpt: Checkpoint, rec: CheckpointFile) -> int:
    """Bytes of ``rec`` after its header that no tensor covers: gaps between tensors and
    a tail. safetensors writes none (the data follows the header, tensor after tensor)."""
    i = ckpt.files.index(rec)
    spans = sorted((t.file_offset, t.file_offset + t.nbytes) for t in ckpt.tensors if t.file == i and t.nbytes)
    covered, end = 0, rec.data_start
    for start, stop in spans:
        covered += max(0, stop - max(start, end))
        end = max(end, stop)
    return rec.size - rec.data_start - covered


def _segments(ckpt: Checkpoint) -> bytes:
    """The arena's byte ranges that are contiguous in one file, as wire segments."""
    return b"".join(SEGMENT.pack(r.file, r.file_offset, r.arena_offset, r.nbytes) for r in contiguous_runs(ckpt))


def _open_for_writing(fd: int) -> str | None:
    """Whether some process holds the file open for writing (an fd or a shared writable
    mapping, perhaps from before a chmod): a read lease is refused exactly then. Taken
    and dropped at once (held, a writer's open would signal the daemon with SIGIO). If
    the lease cannot be taken at all (not the owner, no CAP_LEASE), say so: unknown is
    not safe."""
    probe = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.fcntl(probe, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(probe, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return None
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            return "some process has it open for writing"
        return f"cannot tell whether some process has it open for writing (read lease: {exc.strerror})"
    finally:
        os.close(probe)
