"""Safetensors checkpoints: header parsing, multi-file discovery, arena layout, layout digest.

We parse the header ourselves (8-byte little-endian length, then UTF-8 JSON) instead of
asking the safetensors package, because the daemon must reject a malformed file with a
precise reason before reserving memory for it, and needs the raw byte ranges to read
them in parallel straight into an arena. No torch here: dtypes stay safetensors names.

Headers are read from the fds of an :class:`~weightcache.loader.sources.OpenedSource`
(``os.pread``), never by path: the reader then reads the data from the same fds, so what
was validated is what gets loaded (sources.py says why).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import heapq
import itertools
import json
import os
import re
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import CorruptCheckpoint, LoadFailed
from ..protocol.arena import ARENA_ALIGN
from ..units import round_up
from .sources import INDEX_SUFFIX, MAX_INDEX_BYTES, OpenedSource, SourceFile, index_names, open_source, read_capped

# safetensors dtype name -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
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
MAX_NAME_CHARS = 1024  # tensor names: real ones are < 200
LIMIT = 2**62  # bound on every dimension, offset and byte count: far past any real tensor, and msgpack-safe

# Note [held bytes]
# ~~~~~~~~~~~~~~~~~
# A model makes the daemon hold more than its arena: one TensorInfo per tensor (a 7-tuple,
# its name, shape and offsets as Python objects) and the attach reply's table (msgpack,
# encoded once per load). For 100,000 zero-byte tensors (a 7.4 MB header, 22-character
# names) tracemalloc measured 30.1 MiB for the tensors and 3.1 MiB for the table, ~350 bytes
# a tensor; before issue 25 the raw header (7.1 MiB) was kept too, and all of it after
# eviction, charged to nobody: a tenant with an 8 KiB quota made the daemon hold +201 MiB
# RSS with four such models. Now the estimate below (a little above what was measured) is
# added to the bytes a load is admitted for: it counts against the device's budget and
# the owner's quota like the arena, is returned with it, and the raw header is dropped
# once hashed. Evicted, a model keeps only its fingerprint and tensor count. So what a
# model makes the daemon hold beyond its arena is counted while resident (at the 16 MiB
# header cap, ~150k tensors, ~55 MiB), plus the parse's transient peak per io thread
# (~2x the parsed size, ~85 MiB measured for the 7.4 MB header).
HELD_PER_TENSOR = 320  # bytes per tensor besides its name (twice: tuple and table) and 9 per dimension
HELD_BASE_BYTES = 4096  # the Checkpoint, its file records and the model's record

@dataclass(frozen=True)
class CheckpointFile:
    path: str
    size: int
    mtime_ns: int
    dev: int  # with ino: which file this was, so a file replaced by rename counts as changed
    ino: int
    data_start: int  # 8 + header length: file offset of the first tensor byte
    header: bytes  # raw JSON, hashed into the layout digest by parse_checkpoint, which then keeps b"" (Note [held bytes])

    def same_file(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (self.dev, self.ino, self.size, self.mtime_ns)


class TensorInfo(NamedTuple):
    """One tensor of a checkpoint. A NamedTuple rather than a frozen dataclass: building one
    costs a quarter as much (0.24 vs 0.8 us here), which is most of validating a published
    table of 600k tensors. Fields are read by name only."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    file: int  # index into Checkpoint.files (-1 for a published table)
    file_offset: int  # absolute offset in that file (-1 for a published table)
    nbytes: int
    arena_offset: int  # where it lives in the model's arena (ARENA_ALIGN-aligned)


@dataclass(frozen=True)
class Checkpoint:
    source: str
    files: tuple[CheckpointFile, ...]
    tensors: tuple[TensorInfo, ...]  # in arena order
    arena_bytes: int  # bytes the tensors need, before a backend rounds up
    # What the tensors hold: names, dtypes, shapes and every byte (Note [content
    # fingerprint], loader/content.py). Known only once the bytes were read: "" from
    # parse_checkpoint until a load sets it (read_checkpoint returns it); a published
    # model's is the publisher's, bound to its uid.
    fingerprint: str
    # sha256 of every file's name, size and header: what the files look like, not what
    # their tensors hold (two files of the same shapes share it). Known at parse time.
    layout: str = ""

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @functools.cached_property
    def held_bytes(self) -> int:
        """What the daemon holds for this checkpoint beyond its arena while it is loaded:
        the parsed tensors and the attach reply's encoded table (Note [held bytes]).
        Computed once (parse_checkpoint does, in the io pool)."""
        return HELD_BASE_BYTES + sum(HELD_PER_TENSOR + 2 * len(t.name) + 9 * len(t.shape) for t in self.tensors)

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

    def wire_tensors(self) -> list[list[Any]]:
        """The tensor table sent with an attach: [name, dtype, shape, arena_offset, nbytes]."""
        return [[t.name, t.dtype, list(t.shape), t.arena_offset, t.nbytes] for t in self.tensors]


def _corrupt(path: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{path}: {reason}", file=path, reason=reason)


def show(v: Any, limit: int = 80) -> str:
    """repr for a message, cut short: values come from files and requests of any size."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def nbytes_of(shape: list[int], itemsize: int) -> int | None:
    """prod(shape) * itemsize, or None past LIMIT. Stops early: a long shape of huge dims
    would otherwise make one enormous product."""
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > LIMIT:
            return None
    return n


# -- the header's JSON ----------------------------------------------------------------------


class _HeaderError(Exception):
    """Raised from inside json.loads by the strict hooks below; becomes a CorruptCheckpoint."""


# Big headers are taken apart in slices of this many entries: freeing (or sorting) 100k
# objects in one C call held the interpreter lock for 20-45 ms against the daemon's
# event loop (issue 25; the loop's 1 ms sleeps measured beside a parse).
SLICE = 4096


def release_gradually(container: list[Any] | dict[Any, Any]) -> None:
    """Empty ``container`` a slice at a time (each slice's objects freed in one short C
    call, the interpreter lock free for other threads between slices), rather than in one
    cascade when its last reference goes."""
    if isinstance(container, dict):
        while len(container) > SLICE:
            for _ in range(SLICE):
                container.popitem()
        container.clear()
    else:
        while len(container) > SLICE:
            del container[-SLICE:]
        container.clear()


def sorted_gradually(items: list[Any], key: Callable[[Any], Any] | None = None) -> list[Any]:
    """``sorted(items, key=key)``, sorted a slice at a time and merged in Python, so that no
    single C call sorts 100k items (~40 ms holding the lock). Stable, like sorted."""
    if len(items) <= SLICE:
        return sorted(items, key=key)
    runs = [sorted(items[i : i + SLICE], key=key) for i in range(0, len(items), SLICE)]
    return list(heapq.merge(*runs, key=key))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, v in pairs:
            if k in seen:
                # The top level maps tensor names to entries (objects); inside an entry it is a field.
                what = "tensor" if isinstance(v, dict) else "key"
                raise _HeaderError(f"{what} {show(k)} appears twice in the header")
            seen.add(k)
    return d


def _small_int(s: str) -> int:
    if len(s) > 19 and len(s.lstrip("-")) > 19:
        raise _HeaderError("header holds an integer of more than 19 digits")
    return int(s)


def _no_float(s: str) -> float:
    raise _HeaderError("header holds a floating-point number (nothing in a safetensors header is one)")


def _no_constant(s: str) -> float:
    raise _HeaderError("header holds NaN or Infinity, which are not JSON")


def _parse_json(path: str, raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _corrupt(path, "header is not UTF-8 JSON (invalid UTF-8)") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_small_int, parse_float=_no_float,
                          parse_constant=_no_constant)
    except _HeaderError as exc:
        raise _corrupt(path, str(exc)) from None
    except RecursionError:
        raise _corrupt(path, "header is nested too deeply") from None
    except json.JSONDecodeError as exc:
        # exc.msg is the C scanner's fixed text; cut at ': ' in case a version appends the offending character.
        raise _corrupt(path, f"header is not UTF-8 JSON: {exc.msg.partition(': ')[0]} at char {exc.pos}") from None
    except (ValueError, TypeError) as exc:
        raise _corrupt(path, f"header is not valid JSON ({type(exc).__name__})") from None


# -- what a file is when it is not safetensors ----------------------------------------------

_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")


_CONVERT = "convert it, e.g. with safetensors.torch.save_file"


def _looks_like(head: bytes) -> tuple[str, str] | None:
    """(what the file looks like, what to do) for a known format that is not safetensors."""
    if head.startswith(b"PK\x03\x04"):
        return "a PyTorch zip checkpoint (.bin/.pt)", _CONVERT
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a Python pickle, e.g. a legacy PyTorch .bin/.pt checkpoint", _CONVERT
    if head.startswith(b"GGUF"):
        return "a GGUF file (llama.cpp)", "weightcache loads safetensors checkpoints only"
    return None


def _not_safetensors(path: str, head: bytes) -> CorruptCheckpoint:
    # Never the header length or any of the file's bytes: for a file the requester cannot
    # read, those would reveal its first bytes.
    known = _looks_like(head)
    if known is None:
        return _corrupt(path, "not a safetensors file (its header is not a JSON object)")
    return _corrupt(path, f"not a safetensors file (it looks like {known[0]}); {known[1]}")


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


def read_header(file: SourceFile) -> tuple[CheckpointFile, dict[str, Any]]:
    """Parse and validate one .safetensors file's header, read from ``file.fd`` with pread.
    Returns the file record and the tensor entries (``__metadata__`` removed), each checked
    against the file's size. Every malformation is a CorruptCheckpoint naming the file."""
    path, fd = file.path, file.fd
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoadFailed(f"{path}: not a regular file", file=path, reason="not a regular file")
        head = _pread_exact(fd, 16, 0)
        if len(head) < 8:
            raise _corrupt(path, f"file is {st.st_size} bytes, too short for the 8-byte header length")
        (n,) = struct.unpack_from("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
            # Sniff only here and after the JSON check below: a real header of 640 bytes
            # starts with the same two bytes as a pickle.
            if _looks_like(head) or not _OBJECT_START.match(head, 8):
                raise _not_safetensors(path, head)
            if n > MAX_HEADER_BYTES:
                raise _corrupt(path, f"header exceeds the {MAX_HEADER_BYTES >> 20} MiB limit")
            raise _corrupt(path, f"header runs past the end of the {st.st_size}-byte file (truncated?)")
        raw = _pread_exact(fd, n, 8)
    except OSError as exc:
        raise LoadFailed(f"{path}: read failed: {exc.strerror}", file=path, reason=exc.strerror) from None
    if len(raw) < n:
        raise _corrupt(path, "file ended inside the header (truncated while reading?)")
    if not _OBJECT_START.match(raw):
        raise _not_safetensors(path, head)
    header = _parse_json(path, raw)
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    data_len = st.st_size - 8 - n
    spans = []
    for name, e in header.items():
        if len(name) > MAX_NAME_CHARS:
            raise _corrupt(path, f"tensor {show(name)}: name longer than {MAX_NAME_CHARS} characters")
        if not isinstance(e, dict) or e.keys() != {"dtype", "shape", "data_offsets"}:
            raise _corrupt(path, f"tensor {show(name)}: entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise _corrupt(path, f"tensor {show(name)}: unsupported dtype {show(dtype)}")
        if type(shape) is not list or not all(type(d) is int and 0 <= d <= LIMIT for d in shape):
            raise _corrupt(path, f"tensor {show(name)}: shape must be a list of non-negative integers of at most 2**62")
        if not (type(offs) is list and len(offs) == 2 and all(type(o) is int and 0 <= o <= LIMIT for o in offs)):
            raise _corrupt(path, f"tensor {show(name)}: data_offsets must be two integers in [0, 2**62]")
        start, end = offs
        if start > end:
            raise _corrupt(path, f"tensor {show(name)}: data_offsets {offs} are not ordered")
        expected = nbytes_of(shape, DTYPE_SIZES[dtype])
        if expected is None:
            raise _corrupt(path, f"tensor {show(name)}: shape {show(shape)} of {dtype} is more than 2**62 bytes")
        if end - start != expected:
            raise _corrupt(path, f"tensor {show(name)}: {end - start} bytes for shape {show(shape)} of {dtype} (needs {expected})")
        if end > data_len:
            raise _corrupt(path, f"tensor {show(name)}: bytes {start}..{end} run past the data ({data_len} bytes; truncated?)")
        spans.append((start, end, name))
    spans = sorted_gradually(spans)
    for (_s0, e0, n0), (s1, _e1, n1) in itertools.pairwise(spans):
        if s1 < e0:
            raise _corrupt(path, f"tensors {show(n0)} and {show(n1)} overlap")
    release_gradually(spans)
    rec = CheckpointFile(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, dev=st.st_dev, ino=st.st_ino, data_start=8 + n,
                         header=raw)
    return rec, header


# -- discovery (by path: for clients and tools; the daemon uses open_source) ---------------


def discover_files(source: str | Path) -> list[str]:
    """The .safetensors files of a checkpoint: a file, an index json, or a directory."""
    p = Path(source)
    if not p.exists():
        raise LoadFailed(f"{p}: checkpoint path does not exist", file=str(p), reason="not found")
    if p.is_dir():
        indexes = sorted(p.glob(f"*{INDEX_SUFFIX}"))
        if len(indexes) > 1:
            raise LoadFailed(f"{p}: several index files {[i.name for i in indexes]}; name one as the path", file=str(p))
        if indexes:
            return _files_from_index(indexes[0])
        files = sorted(str(f) for f in p.glob("*.safetensors"))
        if not files:
            raise LoadFailed(f"{p}: directory holds no .safetensors files", file=str(p), reason="empty")
        return files
    if p.name.endswith(".json"):
        return _files_from_index(p)
    return [str(p)]


def _files_from_index(index: Path) -> list[str]:
    try:
        fd = os.open(index, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _corrupt(str(index), "invalid index: not a regular file")
            raw = read_capped(fd, MAX_INDEX_BYTES)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _corrupt(str(index), f"invalid index: {type(exc).__name__}: {exc.strerror}") from None
    if raw is None:
        raise _corrupt(str(index), f"invalid index: larger than {MAX_INDEX_BYTES >> 20} MiB")
    return [str(index.parent / n) for n in index_names(raw, str(index))]


# -- whole checkpoints ------------------------------------------------------------------------


def parse_checkpoint(opened: OpenedSource) -> Checkpoint:
    """Parse every header of an opened checkpoint (from its fds) and lay its tensors out in
    one arena: in file order, each file's tensors by file offset, ARENA_ALIGN-aligned."""
    if opened.closed:
        raise ValueError(f"{opened!r} is closed")
    files: list[CheckpointFile] = []
    tensors: list[TensorInfo] = []
    seen: dict[str, str] = {}
    digest = hashlib.sha256()
    cursor = 0
    for i, f in enumerate(opened.files):
        rec, header = read_header(f)
        files.append(rec)
        digest.update(f"{os.path.basename(f.path)}\0{rec.size}\0".encode())
        digest.update(rec.header)
        rec = dataclasses.replace(rec, header=b"")  # hashed into the layout: kept, it was the header's size again per model
        in_order = sorted_gradually(list(header.items()), key=lambda kv: kv[1]["data_offsets"][0])
        for name, e in in_order:
            if name in seen:
                raise _corrupt(f.path, f"tensor {show(name)} also appears in {seen[name]}")
            seen[name] = f.path
            start, end = e["data_offsets"]
            cursor = round_up(cursor, ARENA_ALIGN)
            tensors.append(TensorInfo(
                name=name, dtype=e["dtype"], shape=tuple(e["shape"]), file=i,
                file_offset=rec.data_start + start, nbytes=end - start, arena_offset=cursor,
            ))
            cursor += end - start
        release_gradually(in_order)
        release_gradually(header)
    release_gradually(seen)
    ckpt = Checkpoint(
        source=opened.source, files=tuple(files), tensors=tuple(tensors),
        arena_bytes=max(cursor, 1), fingerprint="", layout=digest.hexdigest(),
    )
    ckpt.held_bytes  # noqa: B018 -- computed here, in the io pool, not on the event loop
    return ckpt


def open_checkpoint(source: str | os.PathLike[str]) -> Checkpoint:
    """open_source + parse_checkpoint + close: for tests and tools. A daemon load keeps the
    OpenedSource open and reads the data from it (read_checkpoint)."""
    with open_source(source) as opened:
        return parse_checkpoint(opened)


# -- published tables ---------------------------------------------------------------------------
