"""Parallel reads of a checkpoint's byte ranges into an arena.

Worker threads each take a chunk (default 16 MiB: the H200 probe's best, see
docs/benchmarks.md) and hand it to the backend's ArenaWriter, which reads it straight to
its destination: ``preadv`` into the memfd mapping on the CPU backend, into a pinned
staging buffer then a copy on the thread's own stream on CUDA. ``preadv`` releases the GIL,
so threads overlap real I/O.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from ..errors import CorruptCheckpoint, LoadFailed
from .checkpoint import Checkpoint, parse_checkpoint
from .content import (
    FILE_DIGESTS,
    Batch,
    FileIdentity,
    Task,
    TaskHasher,
    batch_hasher,
    file_digests,
    fingerprint,
    places,
    plan_tasks,
    plan_work,
    read_digests,
)
from .preads import pread_full, read_batch, resident_fraction
from .sources import OpenedSource, open_source
from .trust import why_untrusted


class ArenaWriter(Protocol):
    """Fills one arena. ``write_from_file`` is called from several threads at once, each
    with a disjoint destination range; it returns when the bytes are in place (or queued
    on a stream that ``finish`` synchronizes). A writer that can read O_DIRECT fds (it
    owns page-aligned buffers) says so with ``direct_io``; it is then told per call.

    ``seen``, when given, is the task's content hash (Note [content fingerprint] in
    content.py), with the reader's plan for it: it is handed the ``nbytes`` read, in
    order, in one or more read-only views (host memory, each valid only during its
    call); where ``seen.on_device``, the writer also hashes on its device the pieces it
    hands over (``take_device_done``), and those digests are in place once ``finish``
    returns. The writer reads the plan, it never makes one.

    A writer may also have ``write_batch(fd, file_offset, arena_offsets, sizes, seen)``:
    the file's bytes from ``file_offset`` on (``fd`` is the source's buffered fd) go,
    ``sizes[k]`` at a time, to ``arena_offsets[k]``, and ``seen``, when given, gets every tensor's bytes at once as a
    list of read-only views (content.batch_hasher). With it the reader reads small
    tensors in batches (Note [small tensors in batches], content.py); without, one task each.

    What the reader asks of a writer to plan: ``serves_files`` is true for a writer whose
    arena is the files' own trusted pages (a CPU file arena): their digests may then be
    reused by file identity. ``device_hash_min``, when set, is the size above which the
    writer can hash a piece on its device itself (backends/cuda_hash.py); the reader
    plans the big pieces of trusted files for it then."""

    direct_io: bool
    serves_files: bool
    device_hash_min: int | None

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen: TaskHasher | None = None) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class CopyRange:
    file: int
    file_offset: int
    arena_offset: int
    nbytes: int


def contiguous_runs(ckpt: Checkpoint) -> list[CopyRange]:
    """The checkpoint's bytes as runs contiguous both in one file and in the arena:
    neighbouring tensors merged (the arena pads each tensor to 256 bytes; the file does
    not, so a run ends where padding begins)."""
    runs: list[list[int]] = []  # [file, file_offset, arena_offset, nbytes]
    for t in ckpt.tensors:
        if t.nbytes == 0:
            continue
        last = runs[-1] if runs else None
        if last and last[0] == t.file and last[1] + last[3] == t.file_offset and last[2] + last[3] == t.arena_offset:
            last[3] += t.nbytes
        else:
            runs.append([t.file, t.file_offset, t.arena_offset, t.nbytes])
    return [CopyRange(*r) for r in runs]


def copy_ranges(ckpt: Checkpoint, chunk: int) -> list[CopyRange]:
    """The contiguous runs cut into chunks of at most ``chunk`` bytes."""
    out = []
    for f, fo, ao, n in ((r.file, r.file_offset, r.arena_offset, r.nbytes) for r in contiguous_runs(ckpt)):
        for off in range(0, n, chunk):
            out.append(CopyRange(f, fo + off, ao + off, min(chunk, n - off)))
    return out


def open_for_reading(fd: int, size: int, writer: ArenaWriter, mode: str) -> tuple[int, bool, str]:
    """Choose buffered or O_DIRECT reads of the open file ``fd`` (``size`` bytes). ``mode``
    "auto" uses O_DIRECT only for a cold file (< 50% in page cache): from page cache
    buffered reads reached 28 GB/s on the H200, O_DIRECT is bound by the disk; cold,
    O_DIRECT reached 2.26 GB/s vs 1.83 buffered (a one-off probe of parallel reads on the
    H200 before this loader was written, not kept; docs/benchmarks.md has the loader's own
    cold and warm figures, O_DIRECT chosen by this rule).

    O_DIRECT is a property of an open file, so it takes a second fd: it is opened through
    ``/proc/self/fd/N``, which reaches the same inode as ``fd`` whatever its path names by
    now. Returns (fd to read, direct, why); when ``direct`` that fd is new and the caller
    closes it, otherwise it is ``fd`` itself."""
    if mode == "off" or not writer.direct_io:
        return fd, False, "buffered"
    if mode == "auto":
        frac = resident_fraction(fd, size)
        if frac >= 0.5:
            return fd, False, f"buffered ({frac:.0%} in page cache)"
    try:
        dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:  # tmpfs and some FUSE file systems refuse O_DIRECT
        return fd, False, f"buffered (O_DIRECT refused: {exc.strerror})"
    try:
        same = os.path.samestat(os.fstat(dfd), os.fstat(fd))
    except OSError:
        same = False
    if not same:  # cannot happen through /proc's magic links; never read another file if it did
        os.close(dfd)
        return fd, False, "buffered (O_DIRECT reopen reached another file)"
    return dfd, True, "O_DIRECT"


# Loader threads are niced only for loads whose time is the kernel's copying: a thread at
# nice 19 that runs Python holds the GIL while the kernel gives its core to others, and
# the event loop waits until it runs again. An asyncio loop timing sleep(1 ms) beside one
# such thread running Python, two CPU hogs at nice 0 on the 2-core VM: max lateness 355
# and 524 ms at nice 19, 22 and 23 ms at nice 0 (two runs each); in the header-bomb stress
# py-spy --gil caught a 4 KiB cold load's niced thread holding the GIL 112 ms. Small loads
# and loads of many small tensors (per-piece hashing is Python) run at the loop's nice.
NICE_MIN_BYTES = 64 * 2**20
NICE_MIN_BYTES_PER_TENSOR = 2**20


def loader_nice(ckpt: Checkpoint, nice: int) -> int:
    """The niceness ``ckpt``'s loader threads take: ``nice`` for big tensors in bulk, else 0."""
    data = ckpt.data_bytes
    return nice if data >= NICE_MIN_BYTES and data >= NICE_MIN_BYTES_PER_TENSOR * len(ckpt.tensors) else 0


def _lower_priority(nice: int) -> None:
    """Loader threads yield the CPU to the event loop thread. On a small host a load
    saturates every core with kernel copy work; at nice 0 the loop waited behind it and
    ``status`` p99 reached 16-29 ms, at nice 19 4 ms (docs/benchmarks.md). Linux applies
    nice per thread, and raising it needs no privilege."""
    if not nice:  # loader_nice chose the loop's
        return
    # Refused in some sandboxes: loads still work then, only at equal priority.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class Progress:
    """Bytes done of a load, updated from worker threads, read by the event loop."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n

    def snapshot(self) -> dict[str, float | None]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else None
        return {"bytes_done": self.done, "bytes_total": self.total, "bytes_per_s": rate, "eta_s": eta}


def read_checkpoint(
    ckpt: Checkpoint,
    opened: OpenedSource,
    writer: ArenaWriter,
    *,
    threads: int,
    chunk: int,
    progress: Progress | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    nice: int = 19,
    direct_io: str = "auto",
    log: Callable[[str], None] = lambda _msg: None,
    content_hash: bool = True,
) -> str | None:
    """Read every tensor of ``ckpt`` into the arena behind ``writer`` from the fds of
    ``opened`` (the files ``ckpt`` was parsed from; no path is opened here), hashing the
    bytes on the way. Returns the content fingerprint (Note [content fingerprint]); None
    only with ``content_hash=False``, which the bench uses to show what hashing costs.
    Blocking: run it in a thread. Raises CorruptCheckpoint if a file is short or changed
    while being read. ``opened`` stays open: its owner closes it."""
    try:
        with opened.reading():  # its fds stay open until these reads end, whoever closes it meanwhile
            return _read(ckpt, opened, writer, threads=threads, chunk=chunk, progress=progress, cancelled=cancelled,
                         nice=nice, direct_io=direct_io, log=log, content_hash=content_hash)
    finally:
        # On every failure too, the earliest included: the writer synchronizes and drops its
        # buffers (a view of a memfd arena kept alive pins its mapping: the arena leaks).
        # After a load that succeeded, _read called it already: a second call does nothing.
        writer.finish()


def _identity(fd: int) -> FileIdentity:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read(ckpt: Checkpoint, opened: OpenedSource, writer: ArenaWriter, *, threads: int, chunk: int,
          progress: Progress | None, cancelled: Callable[[], bool], nice: int, direct_io: str,
          log: Callable[[str], None], content_hash: bool) -> str | None:
    if len(opened.files) != len(ckpt.files):
        raise ValueError(f"{opened!r} is not the open source of {ckpt.source} ({len(ckpt.files)} files)")
    if not ckpt.matches(opened):  # changed since parsing: say so before reading gigabytes
        raise CorruptCheckpoint(f"{ckpt.source}: checkpoint changed on disk before it was loaded", file=ckpt.source,
                                reason="changed during load")
    # Files whose tensor digests are known (loaded before, unchanged, and changed only by
    # the trusted): index -> (file offset, size) -> digest (the size too: an empty tensor
    # shares its offset with the next one). Their bytes are loaded but not hashed again.
    trusted = why_untrusted(opened) is None
    reuse = content_hash and (writer.serves_files or trusted)
    identities = [_identity(sf.fd) for sf in opened.files] if reuse else []
    known: dict[int, dict[tuple[int, int], bytes]] = {}
    for i, ident in enumerate(identities):
        got = FILE_DIGESTS.get(ident)
        if got is not None and all((fo, nb) in got for f, fo, nb, _ao in places(ckpt) if f == i):
            known[i] = got
    pieces: dict[tuple[int, int], bytes] = {}
    fds: list[int] = []
    direct: list[bool] = []
    extra: list[int] = []  # O_DIRECT fds opened here
    try:
        for f, sf in zip(ckpt.files, opened.files, strict=True):
            fd, is_direct, why = open_for_reading(sf.fd, f.size, writer, direct_io)
            if fd != sf.fd:
                extra.append(fd)
            fds.append(fd)
            direct.append(is_direct)
            log(f"{f.path}: {why}")
        tasks: list[Task | Batch] = [*plan_work(ckpt, chunk)] if hasattr(writer, "write_batch") else [*plan_tasks(ckpt, chunk)]
        # Hashed on the device only for files that cannot change unseen: they are hashed
        # once per version (their digests are kept), where a peer's files are hashed at
        # every load, and the device's kernels take time from the engines computing on
        # that GPU (0.56 of an engine's matmul rate during such a load on the H200,
        # python -m benchmarks hash-contention): a tenant's loads must not take it from the others.
        device_min = writer.device_hash_min if trusted else None
        if hasattr(writer, "begin"):  # the files it may copy without the host reading them
            writer.begin([(fds[i], f.size) for i, f in enumerate(ckpt.files)
                          if not direct[i] and (not content_hash or i in known or device_min is not None)])
        failed = threading.Event()  # once one chunk fails, the others stop early

        def fail(file: int, exc: Exception) -> BaseException:
            failed.set()
            path = ckpt.files[file].path
            if isinstance(exc, CorruptCheckpoint):
                return CorruptCheckpoint(f"{path}: {exc.details.get('reason', exc.message)}", file=path,
                                         reason=exc.details.get("reason"))
            assert isinstance(exc, OSError)
            return LoadFailed(f"{path}: read failed: {exc.strerror}", file=path, reason=exc.strerror)

        def work_batch(batch: Batch) -> None:
            if failed.is_set():
                return
            if cancelled():
                failed.set()
                raise LoadFailed("load cancelled", reason="cancelled")
            seen = batch_hasher(batch, pieces) if content_hash and batch.file not in known else None
            try:
                # The buffered fd, never an O_DIRECT one: the tensors' views are unaligned,
                # and they are a small share of the bytes, so the page cache is no loss.
                writer.write_batch(opened.files[batch.file].fd, batch.file_offset,  # type: ignore[attr-defined]
                                   batch.arena_offsets, batch.sizes, seen)
            except (CorruptCheckpoint, OSError) as exc:
                raise fail(batch.file, exc) from None
            if progress is not None:
                progress.add(batch.nbytes)

        def work(task: Task | Batch) -> None:
            if isinstance(task, Batch):
                return work_batch(task)
            seen = TaskHasher(task, pieces, device_min) if content_hash and task.file not in known else None
            for off in range(0, task.nbytes, chunk):
                n = min(chunk, task.nbytes - off)
                if failed.is_set():
                    return
                if cancelled():
                    failed.set()
                    raise LoadFailed("load cancelled", reason="cancelled")
                try:
                    writer.write_from_file(fds[task.file], task.file_offset + off, task.arena_offset + off, n,
                                           direct[task.file], seen=seen)
                except CorruptCheckpoint as exc:
                    failed.set()
                    path = ckpt.files[task.file].path
                    raise CorruptCheckpoint(f"{path}: {exc.details.get('reason', exc.message)}", file=path,
                                            reason=exc.details.get("reason")) from None
                except OSError as exc:
                    failed.set()
                    path = ckpt.files[task.file].path
                    raise LoadFailed(f"{path}: read failed: {exc.strerror}", file=path, reason=exc.strerror) from None
                if progress is not None:
                    progress.add(n)

        nice = loader_nice(ckpt, nice)
        # No more threads than chunks of bytes to read: a file of many tiny tensors is work
        # for the GIL, not for the disk. A tenant's 100k one-byte tensors (100 KB) took
        # 0.19 s into a memfd with one or two threads and 0.25 s with eight, and each
        # thread more is one more the event loop contends with for the GIL at its every
        # syscall (python -m benchmarks small-tensors --threads N, 2-core VM).
        workers = min(threads, max(1, len(tasks)), max(1, -(-ckpt.data_bytes // chunk)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wc-load",
                                initializer=_lower_priority, initargs=(nice,)) as pool:
            # list() re-raises the first worker error; the pool's exit waits for the rest.
            list(pool.map(work, tasks))
        writer.finish()  # the bytes in place, and the digests hashed on the device with them
    finally:
        for fd in extra:
            os.close(fd)
    if not ckpt.matches(opened):
        raise CorruptCheckpoint(f"{ckpt.source}: checkpoint changed on disk while it was loading", file=ckpt.source, reason="changed during load")
    if not content_hash:
        return None
    digests = read_digests(ckpt, pieces, known, type(writer).__name__)
    if reuse:
        for i, ident in enumerate(identities):
            # Kept only for a file unchanged from before the read to now (ctime included).
            if i not in known and _identity(opened.files[i].fd) == ident:
                FILE_DIGESTS.put(ident, file_digests(ckpt, digests, i))
    return fingerprint(ckpt, digests)


class _HashingWriter:
    """Reads into a per-thread buffer only to hash it: the fingerprint without an arena."""

    direct_io = False
    serves_files = False
    device_hash_min: int | None = None  # every piece hashed on the host, from its buffer

    def __init__(self, chunk: int) -> None:
        self._chunk = chunk
        self._local = threading.local()

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen: TaskHasher | None = None) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self._chunk))
        with buf[:nbytes] as dst:
            pread_full(fd, dst, file_offset)
            if seen is not None:
                seen(dst)

    def write_batch(self, fd: int, file_offset: int, arena_offsets: list[int], sizes: list[int],
                    seen: Callable[[list[memoryview]], None] | None = None) -> None:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(self._chunk))
        ends = list(accumulate(sizes))  # a batch is at most the chunk (plan_work)
        read_batch(fd, list(map(buf.__getitem__, map(slice, [0, *ends[:-1]], ends))), file_offset, seen)

    def finish(self) -> None:
        pass


def fingerprint_files(source: str | os.PathLike[str], *, threads: int = 4, chunk: int = 16 * 2**20) -> str:
    """The fingerprint the daemon gives a load of ``source`` (a file, directory or index),
    computed here by reading every byte: for tools and tests, and for an engine that
    wants to know which files an attached model came from."""
    with open_source(source) as opened:
        return fingerprint_opened(parse_checkpoint(opened), opened, threads=threads, chunk=chunk, nice=0)


def fingerprint_opened(ckpt: Checkpoint, opened: OpenedSource, *, threads: int, chunk: int, nice: int,
                       cancelled: Callable[[], bool] = lambda: False) -> str:
    """The fingerprint of the files ``ckpt`` was parsed from, read from ``opened`` into
    nothing but a hash (a per-thread buffer): what a load of them would give."""
    fp = read_checkpoint(ckpt, opened, _HashingWriter(chunk), threads=threads, chunk=chunk, nice=nice, direct_io="off",
                         cancelled=cancelled)
    assert fp is not None
    return fp
