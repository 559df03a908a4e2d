"""Safetensors checkpoints: header parsing, arena layout, layout digest (which files a path
names: weightcache/checkpoint_files.py).

We parse the header ourselves (8-byte little-endian length, then UTF-8 JSON) instead of
asking the safetensors package, because the daemon must reject a malformed file with a
precise reason before reserving memory for it, and needs the raw byte ranges to read
them in parallel straight into an arena. No torch here: dtypes stay safetensors names.

Headers are read from the fds of an :class:`~weightcache.loader.sources.OpenedSource`
(``os.pread``), never by path: the reader then reads the data from the same fds, so what
was validated is what gets loaded (sources.py says why).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
import stat
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..checkpoint_files import CONVERT_HINT, corrupt
from ..errors import CorruptCheckpoint, LoadFailed
from . import parse_worker
from .layout import lay_out
from .sources import OpenedSource, SourceFile, open_source
from .tensor_table import TensorInfo, TensorTable, columns_bound, wire_columns, wire_table

# Header cap. The reference implementation allows 100 MiB; a JSON bomb that size (100 MiB
# of "[{},{},...]") peaked at 2.6 GB RSS in the old parser, and would at 3.0 GB in this one
# (one object of millions of tiny unique keys). At 16 MiB the worst bomb measured peaked at
# 0.55 GB ({"a":{},"b":{},...}; unique keys 0.47, [{},...] and [[],...] 0.44, [0,0,...]
# 0.12 GB) and took 2.8 s of CPU; a header over the cap is refused after reading 16 bytes
# (RSS stays at the 20 MB baseline). Peak RSS of a fresh child per bomb, from
# resource.getrusage(RUSAGE_CHILDREN).ru_maxrss, CPython 3.11, 2-core VM. Real headers
# take ~100 bytes per tensor: 16 MiB is ~150k tensors in one file, and sharded
# checkpoints stay well under 1 MiB per file.
MAX_HEADER_BYTES = 16 * 2**20
# The headers of one checkpoint together, from their 8-byte length fields, before any is
# read: per file alone, one register of 32 fds of one file with a 16 MiB header made the
# daemon read 512 MiB of headers into its heap and a 512 MiB request memfd for the parse
# worker (~1 GiB). The largest real checkpoints stay far below: ~100-150 bytes a tensor,
# and a trillion-parameter MoE with per-expert scales has ~150k tensors (~20 MB).
MAX_CHECKPOINT_HEADER_BYTES = 64 * 2**20

# Note [held bytes]
# ~~~~~~~~~~~~~~~~~
# A model makes the daemon hold more than its arena: its tensors' rows and the attach
# reply's table (msgpack, encoded once per load). Rows were one TensorInfo per tensor (a
# 7-tuple, its name, shape and offsets as Python objects): for 100,000 zero-byte tensors
# (a 7.4 MB header, 22-character names) tracemalloc measured 30.1 MiB for them and 3.1
# MiB for the table, ~350 bytes a tensor; with the raw header (7.1 MiB) was
# kept too, and all of it after eviction, charged to nobody: a tenant with an 8 KiB quota
# made the daemon hold +201 MiB RSS with four such models. Rows parsed from files are now
# columns (tensor_table.py): for the same file 11.0 MB in all, columns and table (the
# table 3.1 of it); 13.2 MB since the columns keep the header half of the content
# fingerprint too (the fill had built it from rows at every load, tensor_table.py). That,
# counted from the buffers themselves, is added to the bytes a
# load is admitted for, with a bound of the table as columns (the attach reply's other
# form, tensor_table.wire_columns: ~33 bytes a tensor and its name, 8 a dimension): it
# counts against the device's budget and the owner's quota like
# the arena, is returned with it, and the raw header is dropped once hashed. Evicted, a
# model keeps only its fingerprint and tensor count. A header of PARSE_APART_BYTES or more
# is parsed in a worker process (parse_worker.py): the parse's transient peak (~2x the
# parsed size in a thread of the daemon's, ~85 MiB for the 7.4 MB header) is the
# worker's; the daemon's own peak while it waits, the request and the reply in flight,
# was 47.6 MB for that header, 29.3 MB since the reply is read into the buffer the
# columns are views of (tracemalloc; parse_worker.py), freed when the parse returns.
# What a parse of a header holds while it runs, per byte of the header: in the daemon, the
# raw headers, the worker's request and its reply (29.3 MB for a 7.4 MB header: ~4x), and
# the parse's own peak (~85 MiB for it in a thread: ~12x), in the worker for big headers.
PARSE_BYTES_PER_HEADER_BYTE = 16


def parse_cost(header_bytes: int) -> int:
    """The memory a parse of ``header_bytes`` of headers holds at its peak (charged to a
    tenant's quota while it runs: cache/eviction.py)."""
    return PARSE_BYTES_PER_HEADER_BYTE * header_bytes


HELD_PER_TENSOR = 320  # a published table's rows (tuples): bytes per tensor besides its name (twice) and 9 per dimension
HELD_BASE_BYTES = 8192  # the Checkpoint, its file records, its columns' views and the model's record (4.6 KiB measured)

@dataclass(frozen=True)
class CheckpointFile:
    path: str
    size: int
    mtime_ns: int
    dev: int  # with ino: which file this was, so a file replaced by rename counts as changed
    ino: int
    data_start: int  # 8 + header length: file offset of the first tensor byte

    def same_file(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (self.dev, self.ino, self.size, self.mtime_ns)


@dataclass(frozen=True)
class Checkpoint:
    source: str
    files: tuple[CheckpointFile, ...]
    # In arena order: a TensorTable when parsed from files (tensor_table.py says why), a
    # tuple for a published table.
    tensors: Sequence[TensorInfo]
    arena_bytes: int  # bytes the tensors need, before a backend rounds up
    # What the tensors hold: names, dtypes, shapes and every byte (Note [content
    # fingerprint], loader/reader.py). Known only once the bytes were read: "" from
    # parse_checkpoint until a load sets it (read_checkpoint returns it); a published
    # model's is the publisher's, bound to its uid.
    fingerprint: str
    # sha256 of every file's name, size and header: what the files look like, not what
    # their tensors hold (two files of the same shapes share it). Known at parse time.
    layout: str = ""
    # The attach reply's table, when the parse worker encoded it already (else encoded_tables
    # encodes it).
    table: bytes | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def data_bytes(self) -> int:
        # Kept: a sum over 100k rows is one C call holding the GIL 1-2 ms, and the loop asked
        # for it per load, per models reply (the loop watch found it in a stall).
        if isinstance(self.tensors, TensorTable):
            return self.tensors.data_bytes
        return sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def held_bytes(self) -> int:
        """What the daemon holds for this checkpoint beyond its arena while it is loaded:
        the parsed tensors and the attach reply's encoded table (Note [held bytes]).
        Computed once (parse_checkpoint does, in the io pool)."""
        if isinstance(self.tensors, TensorTable):
            table = len(self.table) if self.table is not None else self.tensors.wire_bound
            return HELD_BASE_BYTES + self.tensors.buffer_bytes + table + self.tensors.columns_bound
        # Names counted in UTF-8 bytes, as both tables encode them: by characters, 1,000-emoji
        # names were under-counted ~3 bytes a character.
        name_bytes = sum(len(t.name.encode()) for t in self.tensors)
        rows = sum(HELD_PER_TENSOR + 9 * len(t.shape) for t in self.tensors) + 2 * name_bytes
        return HELD_BASE_BYTES + rows + columns_bound(name_bytes, len(self.tensors), sum(len(t.shape) for t in self.tensors))

    def unchanged_on_disk(self) -> bool:
        """Cheap staleness check by path: every file is still the same file (dev, inode) with
        the size and mtime we parsed. Only meaningful for files the daemon opened by path;
        for adopted fds use :meth:`matches`."""
        return self._unchanged(lambda i: os.stat(self.files[i].path))

    def matches(self, opened: OpenedSource) -> bool:
        """The open files are still those we parsed, unmodified: fstat of each fd matches the
        recorded dev, inode, size and mtime."""
        return len(opened.files) == len(self.files) and self._unchanged(lambda i: os.fstat(opened.files[i].fd))

    def _unchanged(self, stat_of: Callable[[int], os.stat_result]) -> bool:
        try:
            return all(rec.same_file(stat_of(i)) for i, rec in enumerate(self.files))
        except OSError:
            return False

    def encoded_tables(self) -> tuple[bytes, bytes]:
        """The tensor table sent with an attach, as rows and as columns (tensor_table's
        wire_table and wire_columns; a client asks for one)."""
        return self.table if self.table is not None else wire_table(self.tensors), wire_columns(self.tensors)


# -- what a file is when it is not safetensors ----------------------------------------------

_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")


def _looks_like(head: bytes) -> tuple[str, str] | None:
    """(what the file looks like, what to do) for a known format that is not safetensors."""
    if head.startswith(b"PK\x03\x04"):
        return "a PyTorch zip checkpoint (.bin/.pt)", CONVERT_HINT
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a Python pickle, e.g. a legacy PyTorch .bin/.pt checkpoint", CONVERT_HINT
    if head.startswith(b"GGUF"):
        return "a GGUF file (llama.cpp)", "weightcache loads safetensors checkpoints only"
    return None


def _not_safetensors(path: str, head: bytes) -> CorruptCheckpoint:
    # Never the header length or any of the file's bytes: for a file the requester cannot
    # read, those would reveal its first bytes.
    known = _looks_like(head)
    if known is None:
        return corrupt(path, "not a safetensors file (its header is not a JSON object)")
    return corrupt(path, f"not a safetensors file (it looks like {known[0]}); {known[1]}")


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset``: fewer only at the end of the file."""
    first = os.pread(fd, n, offset)
    if len(first) == n or not first:
        return first
    parts = [first]
    got = len(first)
    while got < n:
        b = os.pread(fd, n - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _header_length(file: SourceFile) -> tuple[os.stat_result, int, bytes]:
    """One .safetensors file's stat, header length and first 16 bytes, every check that
    needs only those done (a regular file; the length within MAX_HEADER_BYTES and the file)."""
    path, fd = file.path, file.fd
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoadFailed(f"{path}: not a regular file", file=path, reason="not a regular file")
        head = _pread_exact(fd, 16, 0)
    except OSError as exc:
        raise LoadFailed(f"{path}: read failed: {exc.strerror}", file=path, reason=exc.strerror) from None
    if len(head) < 8:
        raise corrupt(path, f"file is {st.st_size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack_from("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
        # Sniff only here and after the JSON check in read_raw_header: a real header of
        # 640 bytes starts with the same two bytes as a pickle.
        if _looks_like(head) or not _OBJECT_START.match(head, 8):
            raise _not_safetensors(path, head)
        if n > MAX_HEADER_BYTES:
            raise corrupt(path, f"header exceeds the {MAX_HEADER_BYTES >> 20} MiB limit")
        raise corrupt(path, f"header runs past the end of the {st.st_size}-byte file (truncated?)")
    return st, n, head


def header_lengths(opened: OpenedSource) -> list[tuple[os.stat_result, int, bytes]]:
    """Each file's (stat, header length, first 16 bytes), before any header is read: no
    file twice (one device and inode under two names or fds), and the headers together
    within MAX_CHECKPOINT_HEADER_BYTES. What a parse of them costs is known from these
    (server/residency/io.py's ``parse_charged`` charges it to the tenant's quota)."""
    with opened.reading():
        return _header_lengths(opened)


def _header_lengths(opened: OpenedSource) -> list[tuple[os.stat_result, int, bytes]]:
    out: list[tuple[os.stat_result, int, bytes]] = []
    seen: dict[tuple[int, int], str] = {}
    total = 0
    for f in opened.files:
        st, n, head = _header_length(f)
        first = seen.get((st.st_dev, st.st_ino))
        if first is not None:
            raise corrupt(f.path, f"the same file as {first} (device {st.st_dev}, inode {st.st_ino}): a checkpoint names "
                          "each file once")
        seen[(st.st_dev, st.st_ino)] = f.path
        total += n
        if total > MAX_CHECKPOINT_HEADER_BYTES:
            raise corrupt(f.path, f"the checkpoint's headers exceed the {MAX_CHECKPOINT_HEADER_BYTES >> 20} MiB limit "
                          f"together ({len(out) + 1} of its {len(opened.files)} files)")
        out.append((st, n, head))
    return out


def read_raw_header(file: SourceFile, st: os.stat_result, n: int, head: bytes) -> bytes:
    """One .safetensors file's raw header (the JSON's bytes), read from ``file.fd`` with
    pread, given what _header_length found."""
    path = file.path
    try:
        raw = _pread_exact(file.fd, n, 8)
    except OSError as exc:
        raise LoadFailed(f"{path}: read failed: {exc.strerror}", file=path, reason=exc.strerror) from None
    if len(raw) < n:
        raise corrupt(path, "file ended inside the header (truncated while reading?)")
    if not _OBJECT_START.match(raw):
        raise _not_safetensors(path, head)
    return raw


# -- whole checkpoints ------------------------------------------------------------------------


def parse_checkpoint(opened: OpenedSource) -> Checkpoint:
    """Parse every header of an opened checkpoint (from its fds) and lay its tensors out in
    one arena (lay_out). Headers of PARSE_APART_BYTES or more in all are validated and laid
    out in a worker process (parse_worker.py says why)."""
    with opened.reading():  # a close meanwhile (its register or load given up) waits for these reads
        heads = [(st, read_raw_header(f, st, n, head))
                 for f, (st, n, head) in zip(opened.files, header_lengths(opened), strict=True)]
    headers = [(f.path, st.st_size, raw) for f, (st, raw) in zip(opened.files, heads, strict=True)]
    apart = sum(len(raw) for _st, raw in heads) >= parse_worker.PARSE_APART_BYTES
    laid = parse_worker.lay_out_apart(headers) if apart else lay_out(headers)
    files = tuple(CheckpointFile(path=f.path, size=st.st_size, mtime_ns=st.st_mtime_ns, dev=st.st_dev, ino=st.st_ino,
                                 data_start=8 + len(raw))  # the raw header is hashed into the layout, not kept
                  for f, (st, raw) in zip(opened.files, heads, strict=True))
    ckpt = Checkpoint(source=opened.source, files=files, tensors=laid.tensors, arena_bytes=laid.arena_bytes, fingerprint="",
                      layout=laid.layout, table=laid.table)
    ckpt.held_bytes  # noqa: B018 -- computed here, in the io pool, not on the event loop
    return ckpt


def open_checkpoint(source: str | os.PathLike[str]) -> Checkpoint:
    """open_source + parse_checkpoint + close: for tests and tools. A daemon load keeps the
    OpenedSource open and reads the data from it (read_checkpoint)."""
    with open_source(source) as opened:
        return parse_checkpoint(opened)


# -- the collector, paused while big checkpoints become objects ---------------------------------


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collector off while a big checkpoint's objects are built: a parse, a published
    table, a fill of many tensors (server/residency/io.py's ``collector_paused``).
    Building 600k TensorInfos of a published table set off enough collections, each
    walking every live object, to take 0.6-0.9 s instead of 0.27 s (nothing built here
    forms a cycle). Counted, so that overlapping calls from several threads re-enable it
    once, and only if it was on."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()
