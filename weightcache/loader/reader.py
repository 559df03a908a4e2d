"""Parallel reads of a checkpoint's byte ranges into an arena, and the content fingerprint
computed from the bytes on their way.

Worker threads each take a chunk (default 16 MiB: the H200 probe's best, see
docs/benchmarks.md) and hand it to the backend's ArenaWriter, which reads it straight to
its destination: ``preadv`` into the memfd mapping on the CPU backend, into a pinned
staging buffer then a copy on the thread's own stream on CUDA. ``preadv`` releases the GIL,
so threads overlap real I/O.

The sections, each under its banner: THE CONTENT FINGERPRINT (Note [content
fingerprint], Note [small tensors in batches]: pieces, tasks, batches, the hashers, the
digests kept per file), and READING (the writer's contract and ``read_checkpoint``).
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from typing import Protocol

import xxhash

from ..errors import CorruptCheckpoint, LoadFailed
from .checkpoint import Checkpoint, parse_checkpoint
from .preads import IOV_MAX, pread_full, read_batch, resident_fraction
from .sources import OpenedSource, open_source, why_untrusted
from .tensor_table import TensorTable

# ===============================================================================================
# THE CONTENT FINGERPRINT
# ===============================================================================================
# Content fingerprints: an xxh3-128 of every tensor's bytes, hashed by the loader threads
# while the bytes pass through.
#
# Note [content fingerprint]
# --------------------------
# A checkpoint's ``fingerprint`` covers its tensors' values, not only its headers: a file
# rewritten in place with new values and the same shapes gets a new one, since engines
# key published, processed weights on it. It is
#
#     xxh3_128( for each tensor in name order: name \\0 dtype \\0 shape \\0 digest(tensor) )
#
# where ``digest(tensor)`` is the xxh3_128 of the concatenated xxh3_128 digests of the
# tensor's pieces: its bytes cut every HASH_BLOCK bytes from the tensor's first byte. So
# it depends on the tensors alone (names, dtypes, shapes, bytes), never on the chunk size,
# the number of loader threads, the order they finish in, which file of a sharded
# checkpoint a tensor sits in, its offset there, or ``__metadata__``: the same tensors
# saved as one file or as three give the same fingerprint.
#
# The reader (READING, below) cuts its work into *tasks*: runs of whole pieces, contiguous in
# file and arena, of at most max(chunk, HASH_BLOCK) bytes. A thread reads a task's chunks
# in order and feeds each piece's hasher from the bytes the writer just placed (the memfd
# mapping, the pinned staging buffer, the populated page-cache mapping), so a piece never
# spans two threads. xxh3 releases the GIL for the buffers it hashes (`gil_pace_while_*`
# in weightcache bench's JSON), so hashing runs in parallel across loader threads.
#
# Files served from their own page cache (CPU file arenas, backends/cpu.py) are not
# copied, so their hash is a pass over the mapping. Tensor digests are kept per file
# identity (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns; FileDigests) for those
# files and for any file only root or the daemon's uid can change, on a local file system
# (loader/sources.py, TRUST): any write moves st_ctime, so a reload after eviction
# does not hash again. Every other load hashes the bytes it copies: a peer's file could
# change under a stale cache entry (through a writable mapping, st_ctime moves only at the
# next write fault).
#
# Where the hash runs: on the CPU backend, here, on the loader threads. On CUDA, for files
# that cannot change unseen (above), pieces over 256 KiB are hashed by a kernel on the GPU
# once copied there (backends/cuda_hash.py; the writer takes them from
# TaskHasher.device_done), the rest here from the pinned staging buffer: on the H200
# hashing on the host made the first load of 9.15 GiB from a warm page cache 1.44x slower
# with 8 loader threads and 2.13x with 16, the kernel 1.00x and 1.11x (the latter within
# that run's noise; docs/benchmarks.md, "Content fingerprint"), because the host hash reads
# every byte back from host memory, which such a load is bound by. Other files, hashed at
# every load, are hashed here: the kernel takes GPU time from the engines on that GPU
# (backends/cuda_hash.py says how much), and a tenant's loads must not.


# Piece size. Big enough that the per-piece Python work (a slice, an update, a digest,
# ~1 us) is nothing next to hashing it (16 MiB at ~18 GB/s: ~1 ms), and equal to the
# default chunk, so default loads keep their chunks.
HASH_BLOCK = 16 * 2**20
DIGEST_BYTES = 16  # xxh3_128
EMPTY_DIGEST = xxhash.xxh3_128_digest(b"")  # the digest of a tensor of no bytes: no pieces
CANCEL_POLL_S = 0.05  # how often the reader's own thread looks at ``cancelled`` during a load
DIGEST_SLICE = 4096  # rows a read_digests step maps in C, holding the GIL: under 1.5 ms on the 2-core VM


@dataclass(frozen=True)
class Piece:
    """HASH_BLOCK bytes (or fewer at the tensor's end) of one tensor."""

    tensor: int  # index into Checkpoint.tensors
    index: int  # which block of the tensor
    nbytes: int


@dataclass(frozen=True)
class Task:
    """Bytes contiguous in one file and in the arena, read in order by one thread."""

    file: int
    file_offset: int
    arena_offset: int
    nbytes: int
    pieces: tuple[Piece, ...]  # covering exactly these bytes, in order


def plan_tasks(ckpt: Checkpoint, chunk: int) -> list[Task]:
    """The checkpoint's bytes as tasks of whole pieces, at most max(chunk, HASH_BLOCK)
    bytes each (a task longer than ``chunk`` is read as several chunks, in order)."""
    return _tasks(((i, *p) for i, p in enumerate(places(ckpt))), max(chunk, HASH_BLOCK))


def _tasks(rows: Iterable[tuple[int, int, int, int, int]], cap: int) -> list[Task]:
    """Tasks of (index, file, file offset, nbytes, arena offset) rows, in order."""
    tasks: list[Task] = []
    cur: list[Piece] = []
    start = (0, 0, 0)  # file, file offset, arena offset of the current task
    size = 0
    end = (-1, -1, -1)  # where the current task's bytes end, in file and arena

    def close() -> None:
        nonlocal cur, size
        if cur:
            tasks.append(Task(start[0], start[1], start[2], size, tuple(cur)))
        cur, size = [], 0

    for i, file, file_offset, nbytes, arena_offset in rows:
        if nbytes == 0:
            continue
        if (file, file_offset, arena_offset) != end:
            close()  # not contiguous with what came before: a new run
        for k, off in enumerate(range(0, nbytes, HASH_BLOCK)):
            n = min(HASH_BLOCK, nbytes - off)
            if size + n > cap:
                close()
            if not cur:
                start = (file, file_offset + off, arena_offset + off)
            cur.append(Piece(i, k, n))
            size += n
        end = (file, file_offset + nbytes, arena_offset + nbytes)
    close()
    return tasks


# Note [small tensors in batches]
# -------------------------------
# The arena starts every tensor at a 256-byte boundary and a file packs them, so tensors
# of a few bytes are each a run of their own: plan_tasks made a Task, a Piece and a
# TaskHasher for each, and the fill called the writer, preadv and the hash once a tensor.
# A tenant's file of 100,000 one-byte tensors (safetensors.torch.save_file) cost 3.0-4.2 s
# of CPU per load holding the GIL (user time of read_checkpoint into a memfd arena, 2
# threads, 2-core VM; 0.08 s for the same file of empty tensors), against the
# other tenants. Tensors of at most SMALL_TENSOR bytes that follow each other in one file
# are therefore read as a Batch: one preadv of up to BATCH_TENSORS buffers straight into
# their places in the arena, and one xxh3 each from those buffers, with the iteration in
# C (map over the views), nothing per tensor in bytecode but the plan's one pass. Each
# such tensor is one piece (SMALL_TENSOR < HASH_BLOCK), and the xxh3 of its bytes in one
# call is the digest TaskHasher makes in steps: the fingerprint is the same.
# The same loads: 0.10-0.44 s (the plan's pass, read_digests and fingerprint the most of it).
# Every writer has write_batch: the memfd one reads into the mapping, the file arena
# populates the batch's range once and hashes from the mapping (backends/page_cache.py),
# the CUDA one stages the batch's span of the arena in its pinned buffer and copies it at
# once (backends/cuda_writer.py). python -m benchmarks small-tensors on the H200 host, one task a
# tensor -> batched: memfd 3.84 -> 0.46 s, page cache 4.03 -> 0.27 s, VMM 8.47 -> 0.30 s.
SMALL_TENSOR = 64 * 2**10
BATCH_TENSORS = IOV_MAX  # one preadv a batch


@dataclass(frozen=True)
class Batch:
    """Small tensors back to back in one file, read and hashed together. In the arena they
    are in the same order (``arena_offsets`` increase, 256-byte aligned) and, first offset
    to last end, span at most the plan's chunk: a writer may stage the span in one buffer."""

    file: int
    file_offset: int
    nbytes: int  # the file's bytes from file_offset: the sum of sizes
    tensors: list[int]  # indexes into Checkpoint.tensors
    arena_offsets: list[int]
    sizes: list[int]


def plan_work(ckpt: Checkpoint, chunk: int) -> list[Task | Batch]:
    """plan_tasks for the tensors over SMALL_TENSOR (or ``chunk``) bytes, and the others in
    Batches of at most BATCH_TENSORS tensors and ``chunk`` bytes, in the file and in the
    arena (Note [small tensors in batches]): a writer may read a batch through a buffer of
    ``chunk`` bytes."""
    big: list[tuple[int, int, int, int, int]] = []
    batches: list[Task | Batch] = []
    tensors: list[int] = []
    arena: list[int] = []
    sizes: list[int] = []
    file = start = end = arena_start = arena_end = -1
    small = min(SMALL_TENSOR, chunk)
    for i, (f, fo, nb, ao) in enumerate(places(ckpt)):
        if nb > small:
            big.append((i, f, fo, nb, ao))
            continue
        if not nb:
            continue
        if (f != file or fo != end or len(tensors) == BATCH_TENSORS or end - start + nb > chunk
                or ao < arena_end or ao + nb - arena_start > chunk):
            if tensors:
                batches.append(Batch(file, start, end - start, tensors, arena, sizes))
            tensors, arena, sizes = [], [], []
            file, start, arena_start = f, fo, ao
        tensors.append(i)
        arena.append(ao)
        sizes.append(nb)
        end = fo + nb
        arena_end = ao + nb
    if tensors:
        batches.append(Batch(file, start, end - start, tensors, arena, sizes))
    return [*_tasks(big, max(chunk, HASH_BLOCK)), *batches]


def batch_hasher(batch: Batch, out: dict[tuple[int, int], bytes]) -> Callable[[list[memoryview]], None]:
    """What hashes a Batch's tensors from the views the writer hands in (each tensor's
    bytes, in order), storing each one's only piece digest in ``out``."""
    keys = list(zip(batch.tensors, repeat(0)))

    def seen(views: list[memoryview]) -> None:
        # Dict updates are atomic under the GIL; each key is written by one thread.
        out.update(zip(keys, map(xxhash.xxh3_128_digest, views), strict=True))

    return seen


def places(ckpt: Checkpoint) -> Iterable[tuple[int, int, int, int]]:
    """(file, file offset, nbytes, arena offset) of each tensor, in order: from the
    columns of a TensorTable, with no row object a tensor (a 100k-tensor file's are what
    a fill goes through several times)."""
    t = ckpt.tensors
    if isinstance(t, TensorTable):
        return zip(t.file, t.file_offset, t.nbytes, t.arena_offset, strict=True)
    return ((r.file, r.file_offset, r.nbytes, r.arena_offset) for r in t)


def columns(ckpt: Checkpoint) -> tuple[Sequence[int], Sequence[int], Sequence[int]]:
    """The file, file offset and nbytes of every tensor, as columns (a TensorTable's own)."""
    t = ckpt.tensors
    if isinstance(t, TensorTable):
        return t.file, t.file_offset, t.nbytes
    return [r.file for r in t], [r.file_offset for r in t], [r.nbytes for r in t]


class TaskHasher:
    """Feeds one task's pieces from the bytes as they arrive, chunk by chunk, in order.

    It carries the reader's plan for the task (``on_device``): with ``device_min`` (the
    writer's ``device_hash_min``, given for trusted files only), the writer, which can hash
    on its device (backends/cuda_hash.py), takes the pieces longer than that: they are
    counted here, not hashed, and each one, once its last byte has passed, waits in
    ``device_done`` as (piece, its offset in the task) until the writer takes it
    (``take_device_done``) and stores its digest in ``out`` itself. Without, every byte is
    hashed here, from the views the writer hands in."""

    def __init__(self, task: Task, out: dict[tuple[int, int], bytes], device_min: int | None = None) -> None:
        self.task = task
        self.out = out
        self._next = 0  # index of the next piece in task.pieces
        self.device_min = device_min
        self._piece: Piece | None = None
        self._on_device = False
        self._left = 0
        self._pos = 0  # bytes of the task seen so far
        self._start = 0  # where the current piece starts in the task
        self._h = xxhash.xxh3_128()
        self.device_done: list[tuple[Piece, int]] = []

    def __call__(self, view: memoryview) -> None:
        pos, n = 0, len(view)
        while pos < n:
            if self._piece is None:
                self._piece = self.task.pieces[self._next]
                self._next += 1
                self._left = self._piece.nbytes
                self._start = self._pos + pos
                self._on_device = self._device_hashes(self._piece, self._start)
                self._h.reset()
            take = min(self._left, n - pos)
            if not self._on_device:
                self._h.update(view[pos : pos + take] if take != n else view)
            pos += take
            self._left -= take
            if not self._left:
                if self._on_device:
                    self.device_done.append((self._piece, self._start))
                else:
                    # Dict stores are atomic under the GIL; each key is written by one thread.
                    self.out[(self._piece.tensor, self._piece.index)] = self._h.digest()
                self._piece = None
        self._pos += n

    def _device_hashes(self, piece: Piece, start: int) -> bool:
        """Whether the writer's device hashes ``piece``, which starts ``start`` bytes into the task."""
        # 16-byte aligned in the arena for the kernel's loads: every piece of a tensor
        # placed at a 256-byte offset is, the check only guards the rule.
        return self.device_min is not None and piece.nbytes > self.device_min and (self.task.arena_offset + start) % 16 == 0

    def device_only(self, n: int) -> bool:
        """Whether the next ``n`` bytes belong only to pieces the device hashes: the writer
        may then copy them without the host reading them (the hasher is fed any bytes of
        that length, which it counts and never reads)."""
        if self.device_min is None:
            return False
        start = self._pos
        if self._piece is not None:
            if not self._on_device:
                return False
            if n <= self._left:
                return True
            n -= self._left
            start += self._left
        pieces, i = self.task.pieces, self._next
        while n > 0:
            if i == len(pieces) or not self._device_hashes(pieces[i], start):
                return False
            n -= pieces[i].nbytes
            start += pieces[i].nbytes
            i += 1
        return True

    @property
    def on_device(self) -> bool:
        """Whether the reader planned the task's big pieces for the writer's device."""
        return self.device_min is not None

    def take_device_done(self) -> list[tuple[Piece, int]]:
        done, self.device_done = self.device_done, []
        return done


def tensor_digest(piece_digests: Iterable[bytes]) -> bytes:
    return xxhash.xxh3_128_digest(b"".join(piece_digests))


def tensor_digests(ckpt: Checkpoint, pieces: Mapping[tuple[int, int], bytes], which: Iterable[int]) -> dict[int, bytes]:
    """The digests of the tensors ``which`` (indexes) from their pieces' (``pieces``:
    (tensor, block) -> digest)."""
    sizes = [nb for _f, _fo, nb, _ao in places(ckpt)]
    return {i: tensor_digest(pieces[(i, k)] for k in range(-(-sizes[i] // HASH_BLOCK))) if sizes[i] else EMPTY_DIGEST
            for i in which}


def read_digests(ckpt: Checkpoint, pieces: Mapping[tuple[int, int], bytes],
                 known: Mapping[int, Mapping[tuple[int, int], bytes]], reader: str) -> list[bytes]:
    """Every tensor's digest after a read: from its pieces' (``pieces``), or for the files
    in ``known`` (index -> (file offset, size) -> digest) from there. RuntimeError if a
    tensor read has a piece missing (``reader``, the writer's name, did not report its
    bytes: a bug, never a fingerprint). A tensor of no bytes costs a list slot.

    The rows are picked and looked up by map and compress, in C: for a file of 100k
    one-byte tensors 76-108 ms against 111-185 ms as one loop (medians of 7, runs alternated,
    2-core VM; tried for fingerprint and file_digests, slicing memoryviews by map was
    slower than their loops). A tensor of one piece has the xxh3 of that piece's digest.

    By DIGEST_SLICE rows: a map over a whole column is one bytecode, and the interpreter
    switches threads only between bytecodes, so over 100k rows each held the GIL ~20 ms
    while the event loop, at its next syscall, waited for it (a stall the loop watch
    named in close_fds' os.close: 59 of 60 ms blocked)."""
    files, offsets, sizes = columns(ckpt)
    digests = [EMPTY_DIGEST] * len(sizes)
    missing: list[int] = []
    for lo in range(0, len(sizes), DIGEST_SLICE):
        hi = min(lo + DIGEST_SLICE, len(sizes))
        missing += _read_digests_of(range(lo, hi), files[lo:hi], sizes[lo:hi], offsets, sizes, digests, pieces, known)
    if missing:
        raise RuntimeError(f"{reader} did not report the bytes of {len(missing)} tensor(s), "
                           f"e.g. {ckpt.tensors[min(missing)].name!r}")
    return digests


def _read_digests_of(rows: range, files: Sequence[int], row_sizes: Sequence[int], offsets: Sequence[int],
                     sizes: Sequence[int], digests: list[bytes], pieces: Mapping[tuple[int, int], bytes],
                     known: Mapping[int, Mapping[tuple[int, int], bytes]]) -> list[int]:
    """read_digests for ``rows`` (``files``, ``row_sizes``: their slices of the columns);
    the rows missing a piece."""
    for f, got in known.items():
        mine = list(compress(rows, map(f.__eq__, files)))
        keys = zip(map(offsets.__getitem__, mine), map(sizes.__getitem__, mine), strict=True)
        list(map(digests.__setitem__, mine, map(got.__getitem__, keys)))
    unknown = map(operator.not_, map(known.__contains__, files))
    read = list(compress(rows, map(operator.and_, map(bool, row_sizes), unknown)))  # read here, of some bytes
    one = list(compress(read, map(HASH_BLOCK.__ge__, map(sizes.__getitem__, read))))
    missing: list[int] = []
    try:
        list(map(digests.__setitem__, one, map(xxhash.xxh3_128_digest, map(pieces.__getitem__, zip(one, repeat(0))))))
    except KeyError:
        missing = [i for i in one if (i, 0) not in pieces]
    for i in compress(read, map(HASH_BLOCK.__lt__, map(sizes.__getitem__, read))):
        try:
            digests[i] = tensor_digest([pieces[(i, k)] for k in range(-(-sizes[i] // HASH_BLOCK))])
        except KeyError:
            missing.append(i)
    return missing


def file_digests(ckpt: Checkpoint, digests: Sequence[bytes], file: int) -> dict[tuple[int, int], bytes]:
    """(file offset, size) -> digest of the tensors of ``file`` (FileDigests' entry)."""
    return {(fo, nb): digests[i] for i, (f, fo, nb, _ao) in enumerate(places(ckpt)) if f == file}


def fingerprint(ckpt: Checkpoint, digests: Mapping[int, bytes] | Sequence[bytes]) -> str:
    """The checkpoint's content fingerprint (Note [content fingerprint]), 32 hex digits.
    A TensorTable has the rest made (tensor_table.py): read_checkpoint of a file of
    100k empty tensors took 0.10-0.11 s of its thread's CPU with them, 1.65-1.82 s making
    a row object per tensor for this and for the digests (six runs each, alternated, on
    the loaded 2-core VM)."""
    h = xxhash.xxh3_128()
    if isinstance(ckpt.tensors, TensorTable):
        for i, name, tail in ckpt.tensors.fingerprint_rows():
            h.update(name)
            h.update(tail)
            h.update(digests[i])
        return h.hexdigest()
    for i in sorted(range(len(ckpt.tensors)), key=lambda j: ckpt.tensors[j].name):
        t = ckpt.tensors[i]
        h.update(f"{t.name}\0{t.dtype}\0{','.join(map(str, t.shape))}\0".encode())
        h.update(digests[i])
    return h.hexdigest()


FileIdentity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


class FileDigests:
    """Tensor digests of files that cannot change unseen (Note [content fingerprint]), by
    file identity: a file loaded again unchanged (after an eviction) is not hashed again. Bounded: the least
    recently used files' digests go first (a file's cost is 16 bytes per tensor)."""

    def __init__(self, max_files: int = 4096) -> None:
        self._max = max_files
        # identity -> (file offset, size) -> tensor digest
        self._by_file: OrderedDict[FileIdentity, dict[tuple[int, int], bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, identity: FileIdentity) -> dict[tuple[int, int], bytes] | None:
        with self._lock:
            got = self._by_file.get(identity)
            if got is not None:
                self._by_file.move_to_end(identity)
            return got

    def put(self, identity: FileIdentity, digests: dict[tuple[int, int], bytes]) -> None:
        with self._lock:
            self._by_file[identity] = digests
            self._by_file.move_to_end(identity)
            while len(self._by_file) > self._max:
                self._by_file.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._by_file.clear()


FILE_DIGESTS = FileDigests()


# ===============================================================================================
# READING
# ===============================================================================================

class ArenaWriter(Protocol):
    """Fills one arena. ``write_from_file`` is called from several threads at once, each
    with a disjoint destination range; it returns when the bytes are in place (or queued
    on a stream that ``finish`` synchronizes). A writer that can read O_DIRECT fds (it
    owns page-aligned buffers) says so with ``direct_io``; it is then told per call.

    ``seen``, when given, is the task's content hash (Note [content fingerprint] in
    above), with the reader's plan for it: it is handed the ``nbytes`` read, in
    order, in one or more read-only views (host memory, each valid only during its
    call); where ``seen.on_device``, the writer also hashes on its device the pieces it
    hands over (``take_device_done``), and those digests are in place once ``finish``
    returns. The writer reads the plan, it never makes one.

    A writer may also have ``write_batch(fd, file_offset, arena_offsets, sizes, seen)``:
    the file's bytes from ``file_offset`` on (``fd`` is the source's buffered fd) go,
    ``sizes[k]`` at a time, to ``arena_offsets[k]``, and ``seen``, when given, gets every tensor's bytes at once as a
    list of read-only views (content.batch_hasher). With it the reader reads small
    tensors in batches (Note [small tensors in batches], above); without, one task each.

    And, with ``loop_tasks`` true, ``task_loop(tasks, fds, hashed, out)``: a TaskLoop
    that runs those tasks whole, read buffered from ``fds[i]``, each piece hashed on the
    device into ``out`` where ``hashed[i]`` (the reader hands it only tasks whose every
    piece the device may hash), or None where it copies chunk by chunk after all (the
    CUDA writer's C loop, backends/cuda_writer.py, Note [a thread's tasks in one call]).

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


class TaskLoop(Protocol):
    """A writer's tasks run without Python between their chunks (ArenaWriter's ``task_loop``):
    every loader thread calls ``run`` until it says no task is left; ``stop`` makes them
    claim no more."""

    ntasks: int

    def run(self) -> tuple[int, bool]:
        """Runs some of the tasks on this thread: (bytes done, whether tasks may be left).
        Raises TaskError for a task that failed."""
        ...

    def stop(self) -> None: ...


class TaskError(Exception):
    """A task of a TaskLoop failed; ``error`` says why (CorruptCheckpoint, OSError, a driver's error)."""

    def __init__(self, task: Task, error: Exception) -> None:
        super().__init__(str(error))
        self.task = task
        self.error = error


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
        # The tasks the writer can run whole without Python between their chunks: read
        # buffered, and every piece hashed on its device or none at all (the CUDA writer's
        # C loop, backends/cuda_writer.py, Note [a thread's tasks in one call]).
        loop: TaskLoop | None = None
        if getattr(writer, "loop_tasks", False):  # not planned for a writer that copies chunk by chunk anyway
            picked: list[Task] = []
            hashed: list[bool] = []
            for t in tasks:
                if isinstance(t, Task) and not direct[t.file]:
                    h = content_hash and t.file not in known
                    if not h or TaskHasher(t, pieces, device_min).device_only(t.nbytes):
                        picked.append(t)
                        hashed.append(h)
            loop = writer.task_loop(picked, [fds[t.file] for t in picked], hashed, pieces)  # type: ignore[attr-defined]
            if loop is not None:
                taken = set(map(id, picked))
                tasks = [t for t in tasks if id(t) not in taken]
        failed = threading.Event()  # once one chunk fails, the others stop early

        def stop() -> None:
            failed.set()
            if loop is not None:
                loop.stop()

        def fail(file: int, exc: Exception) -> BaseException:
            stop()
            path = ckpt.files[file].path
            if isinstance(exc, CorruptCheckpoint):
                return CorruptCheckpoint(f"{path}: {exc.details.get('reason', exc.message)}", file=path,
                                         reason=exc.details.get("reason"))
            assert isinstance(exc, OSError)
            return LoadFailed(f"{path}: read failed: {exc.strerror}", file=path, reason=exc.strerror)

        def check_cancelled() -> None:
            if cancelled():
                stop()
                raise LoadFailed("load cancelled", reason="cancelled")

        def work_looped() -> None:
            assert loop is not None
            while not failed.is_set():
                check_cancelled()
                try:
                    n, more = loop.run()
                except TaskError as exc:
                    stop()
                    if isinstance(exc.error, (CorruptCheckpoint, OSError)):
                        raise fail(exc.task.file, exc.error) from None
                    raise exc.error from None
                if progress is not None:
                    progress.add(n)
                if not more:
                    return

        def work_batch(batch: Batch) -> None:
            if failed.is_set():
                return
            check_cancelled()
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

        def work(task: Task | Batch | None) -> None:
            try:
                if task is None:
                    return work_looped()
                if isinstance(task, Batch):
                    return work_batch(task)
                return work_task(task)
            except BaseException:  # every failure stops the others: the arena's growth refused, a driver's error
                stop()
                raise

        def work_task(task: Task) -> None:
            seen = TaskHasher(task, pieces, device_min) if content_hash and task.file not in known else None
            for off in range(0, task.nbytes, chunk):
                n = min(chunk, task.nbytes - off)
                if failed.is_set():
                    return
                check_cancelled()
                try:
                    writer.write_from_file(fds[task.file], task.file_offset + off, task.arena_offset + off, n,
                                           direct[task.file], seen=seen)
                except (CorruptCheckpoint, OSError) as exc:
                    raise fail(task.file, exc) from None
                if progress is not None:
                    progress.add(n)

        nice = loader_nice(ckpt, nice)
        # No more threads than chunks of bytes to read: a file of many tiny tensors is work
        # for the GIL, not for the disk. A tenant's 100k one-byte tensors (100 KB) took
        # 0.19 s into a memfd with one or two threads and 0.25 s with eight, and each
        # thread more is one more the event loop contends with for the GIL at its every
        # syscall (python -m benchmarks small-tensors --threads N, 2-core VM).
        looped = loop.ntasks if loop is not None else 0
        workers = min(threads, max(1, len(tasks) + looped), max(1, -(-ckpt.data_bytes // chunk)))
        # Each thread takes the loop's tasks first (None: its one call at a time into the
        # loop's shared table), then the others.
        items: list[Task | Batch | None] = [*([None] * min(workers, looped)), *tasks]
        cancel_seen = False
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wc-load",
                                initializer=_lower_priority, initargs=(nice,)) as pool:
            futures = [pool.submit(work, item) for item in items]
            pending = set(futures)
            # A thread in the loop looks at ``cancelled`` only between its calls (up to
            # its byte budget): this thread does, every CANCEL_POLL_S, and stops the loop.
            while pending and not failed.is_set():
                _done, pending = wait(pending, timeout=CANCEL_POLL_S, return_when=FIRST_EXCEPTION)
                if not failed.is_set() and cancelled():
                    cancel_seen = True
                    stop()
            for future in futures:  # the first failure, in the work's order; the pool's exit waits for the rest
                future.result()
        if cancel_seen:
            raise LoadFailed("load cancelled", reason="cancelled")
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
