"""File arenas of the CPU backend: a trusted checkpoint's own page cache, held mapped
and made resident instead of copied. backends/cpu.py, Note [page-cache arenas], says
when a checkpoint is served this way and why; this module is the mechanism: holding
the files, populating their pages as the reader goes, mlocking them at seal, noticing
a file changed in place, and the reasons a checkpoint must be copied into a memfd.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

from ..errors import CorruptCheckpoint, LoadFailed
from ..loader.checkpoint import Checkpoint, CheckpointFile
from ..loader.reader import TaskHasher, contiguous_runs
from ..loader.sources import OpenedSource, why_untrusted
from ..loader.tensor_table import DTYPE_SIZES
from ..protocol.arena import SEGMENT
from ..units import round_up

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux >= 5.14; not in Python's mmap module

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _madvise(addr: int, length: int, advice: int) -> None:
    # ctypes releases the GIL for the call: populating a range reads it from disk when cold.
    _check(_libc.madvise(addr, length, advice), "madvise")


def populate_supported() -> bool:
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

    def changed(self) -> bool:
        """Whether the held inode was rewritten since it was bound (a rename over its path
        leaves it as it was)."""
        return _identity(os.fstat(self.fd)) != self.identity


class PageCacheWriter:
    """Makes a file arena's pages resident: each range the reader hands it is populated
    in the daemon's mapping of that file instead of being copied."""

    direct_io = False  # the page cache is the arena: O_DIRECT would bypass it
    serves_files = True  # trusted files' own pages: their digests are reused by file identity (loader/reader.py)
    device_hash_min: int | None = None  # hashed by the loader threads, from the populated mapping

    def __init__(self, files: list[HeldFile]) -> None:
        self._by_fd = {f.source_fd: f for f in files}

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen: TaskHasher | None = None) -> None:
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

    def write_batch(self, fd: int, file_offset: int, arena_offsets: list[int], sizes: list[int],
                    seen: Callable[[list[memoryview]], None] | None = None) -> None:
        """Small tensors back to back in the file (Note [small tensors in batches],
        loader/reader.py): their range populated at once, and hashed from the mapping.
        The arena is the file, so ``arena_offsets`` (the arena's own layout) are unused."""
        nbytes = sum(sizes)
        self.write_from_file(fd, file_offset, arena_offsets[0], nbytes)
        if seen is not None:
            f = self._by_fd[fd]
            ends = list(accumulate(sizes))
            with memoryview((ctypes.c_char * nbytes).from_address(f.addr + file_offset)).cast("B") as whole:
                # Slices made by map, in C: no bytecode per tensor; released by read_batch's rule.
                views = list(map(whole.__getitem__, map(slice, [0, *ends[:-1]], ends)))
                try:
                    seen(views)
                finally:
                    list(map(memoryview.release, views))

    def finish(self) -> None:
        pass


def hold_files(ckpt: Checkpoint, files: OpenedSource) -> tuple[list[HeldFile], str | None]:
    """The checkpoint's files held for a file arena, each with the whole pages inside its
    tensor bytes marked for mlock; or no files and why the checkpoint must be copied into
    a memfd instead (Note [page-cache arenas] in backends/cpu.py)."""
    why = _refusal(ckpt, files)
    held: list[HeldFile] = []
    try:
        if why is None:
            for rec, sf in zip(ckpt.files, files.files, strict=True):
                held.append(_hold(rec.path, sf.fd))
                f = held[-1]
                if f.identity != (rec.dev, rec.ino, rec.size, rec.mtime_ns):
                    why = f"{rec.path} changed since it was parsed; evict and load the model again once it is written"
                    break
    except OSError as exc:
        why = f"{exc.filename or 'a file'}: {exc.strerror}"
    if why is not None:
        for f in held:
            release(f)
        return [], why
    for i, f in enumerate(held):
        spans = [(t.file_offset, t.file_offset + t.nbytes) for t in ckpt.tensors if t.file == i and t.nbytes]
        if spans:
            f.lock_start = round_up(min(s for s, _ in spans), PAGE)
            f.lock_end = max(e for _, e in spans) // PAGE * PAGE
    return held, None


def _refusal(ckpt: Checkpoint, files: OpenedSource) -> str | None:
    """Why ``files`` must be copied into a memfd rather than served from the page cache,
    and what the operator can do about it (one line), or None."""
    why = why_untrusted(files)  # peers' fds, tenants' files, writable by others, network file systems
    if why is not None:
        return why
    for rec, sf in zip(ckpt.files, files.files, strict=True):
        writer = _open_for_writing(sf.fd, rec.path)
        if writer is not None:
            return f"{rec.path}: {writer}"
        if not os.fstat(sf.fd).st_mode & 0o004:
            hidden = _bytes_beyond_tensors(ckpt, rec)
            if hidden:
                # An engine's fd would let it read these too, and nobody may otherwise.
                return (f"{rec.path} is not readable by every user and holds {hidden} byte(s) outside its header and "
                        f"tensors, which an engine's fd of it would expose; chmod a+r {rec.path} if every user may read "
                        "them, else rewrite it without them (safetensors' save_file writes none)")
    for t in ckpt.tensors:
        if t.nbytes and t.file_offset % DTYPE_SIZES[t.dtype]:
            return (f"tensor {t.name!r} is not aligned to its {t.dtype} elements in {ckpt.files[t.file].path}; rewrite the "
                    "file with safetensors' save_file, which aligns every tensor")
    return None


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


def mlock_files(files: list[HeldFile]) -> tuple[int, int]:
    """mlock each file's whole tensor pages, in order, until the kernel refuses: the bytes
    locked, and the errno of the refusal (0 if none)."""
    locked = 0
    for f in files:
        n = f.lock_end - f.lock_start
        if n <= 0:
            continue
        if _libc.mlock(f.addr + f.lock_start, n) != 0:
            return locked, ctypes.get_errno()
        locked += n
    return locked, 0


def map_readonly(fd: int, size: int, populate: bool = False) -> int:
    """A read-only shared mapping of ``size`` bytes of ``fd`` (a sealed memfd a neighbour
    daemon's transfer engine reads, weightcache/peers/): its address; ``unmap`` undoes it.
    ``populate``: its page tables filled now (MAP_POPULATE), not by faults as it is read."""
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    addr = _libc.mmap(None, size, mmap.PROT_READ, flags, fd, 0)
    if addr in (None, _MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, f"mmap: {os.strerror(e)}")
    return int(addr)


def map_writable(fd: int, size: int) -> int:
    """A writable shared mapping of ``size`` bytes of ``fd`` (an arena's memfd that a
    peer's transfer fills in the fill worker, weightcache/peers/lend_worker.py): its
    address; ``unmap`` undoes it."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, f"mmap: {os.strerror(e)}")
    return int(addr)


def make_readonly(addr: int, size: int) -> None:
    """Take write access away from ``size`` bytes at ``addr`` (page-aligned) of a mapping
    from map_writable: a write into them then faults in this process."""
    _check(_libc.mprotect(addr, size, mmap.PROT_READ), "mprotect")


def unmap(addr: int, size: int) -> None:
    _libc.munmap(addr, size)


def release(f: HeldFile) -> None:
    """Unmap (which unlocks; the pages stay page cache, reclaimable) and close."""
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


def segments(ckpt: Checkpoint) -> bytes:
    """The arena's byte ranges that are contiguous in one file, as wire segments."""
    return b"".join(SEGMENT.pack(r.file, r.file_offset, r.arena_offset, r.nbytes) for r in contiguous_runs(ckpt))


def _open_for_writing(fd: int, path: str) -> str | None:
    """Whether some process holds the file open for writing (an fd or a shared writable
    mapping, perhaps from before a chmod): a read lease is refused exactly then. Taken
    and dropped at once (held, a writer's open would signal the daemon with SIGIO). If
    the lease cannot be taken at all (not the owner, no CAP_LEASE), say so: unknown is
    not safe. Each answer ends with what the operator can do."""
    probe = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.fcntl(probe, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(probe, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return None
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            return f"some process has it open for writing; close it (fuser -v {path} names it), then evict and load the model again"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return (f"cannot tell whether some process has it open for writing (read lease: {exc.strerror}); chown it to "
                    "the daemon's user, or give the daemon CAP_LEASE (systemd: AmbientCapabilities=CAP_LEASE)")
        return (f"cannot tell whether some process has it open for writing (read lease: {exc.strerror}); its file system "
                "takes no leases: copy it to a local ext4 or xfs one")
    finally:
        os.close(probe)
