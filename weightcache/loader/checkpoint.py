"""Safetensors checkpoints: header parsing, multi-file discovery, arena layout, fingerprint.

We parse the header ourselves (8-byte little-endian length, then UTF-8 JSON) instead of
asking the safetensors package, because the daemon must reject a malformed file with a
precise reason before reserving memory for it, and needs the raw byte ranges to read
them in parallel straight into an arena. No torch here: dtypes stay safetensors names.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BadRequest, CorruptCheckpoint, LoadFailed

# safetensors dtype name -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors reference implementation's limit
INDEX_SUFFIX = ".safetensors.index.json"
ARENA_ALIGN = 256  # every tensor starts 256-byte aligned: what CUDA kernels and any dtype view need


@dataclass(frozen=True)
class CheckpointFile:
    path: str
    size: int
    mtime_ns: int
    data_start: int  # 8 + header length: file offset of the first tensor byte
    header: bytes  # raw JSON, part of the fingerprint


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    file: int  # index into Checkpoint.files
    file_offset: int  # absolute offset in that file
    nbytes: int
    arena_offset: int  # where it lives in the model's arena (ARENA_ALIGN-aligned)


@dataclass(frozen=True)
class Checkpoint:
    source: str
    files: tuple[CheckpointFile, ...]
    tensors: tuple[TensorInfo, ...]  # in arena order
    arena_bytes: int  # bytes the tensors need, before a backend rounds up
    fingerprint: str  # sha256 of every file's name, size and header

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def unchanged_on_disk(self) -> bool:
        """Cheap staleness check: every file still has the size and mtime we parsed."""
        for f in self.files:
            try:
                st = os.stat(f.path)
            except OSError:
                return False
            if st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
                return False
        return True

    def wire_tensors(self) -> list[list[Any]]:
        """The tensor table sent with an attach: [name, dtype, shape, arena_offset, nbytes]."""
        return [[t.name, t.dtype, list(t.shape), t.arena_offset, t.nbytes] for t in self.tensors]


def _corrupt(path: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{path}: {reason}", file=path, reason=reason)


def read_header(path: str) -> tuple[CheckpointFile, dict[str, Any]]:
    """Parse and validate one .safetensors file's header. Returns the file record and the
    tensor entries (``__metadata__`` removed), each checked against the file's size."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"file is {st.st_size} bytes, too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise _corrupt(path, f"header length {n} exceeds {MAX_HEADER_BYTES}")
            if 8 + n > st.st_size:
                raise _corrupt(path, f"header length {n} runs past the end of the {st.st_size}-byte file (truncated?)")
            raw = f.read(n)
    except FileNotFoundError:
        raise LoadFailed(f"{path}: file not found", file=path, reason="not found") from None
    except IsADirectoryError:
        raise LoadFailed(f"{path}: is a directory", file=path, reason="is a directory") from None
    except PermissionError:
        raise LoadFailed(f"{path}: permission denied", file=path, reason="permission denied") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _corrupt(path, f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    data_len = st.st_size - 8 - n
    spans = []
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            raise _corrupt(path, f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise _corrupt(path, f"tensor {name!r}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _corrupt(path, f"tensor {name!r}: shape must be a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise _corrupt(path, f"tensor {name!r}: data_offsets must be two integers")
        start, end = offs
        if not 0 <= start <= end:
            raise _corrupt(path, f"tensor {name!r}: data_offsets {offs} are not ordered")
        expected = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - start != expected:
            raise _corrupt(path, f"tensor {name!r}: {end - start} bytes for shape {shape} of {dtype} (needs {expected})")
        if end > data_len:
            raise _corrupt(path, f"tensor {name!r}: bytes {start}..{end} run past the data ({data_len} bytes; truncated?)")
        spans.append((start, end, name))
    spans.sort()
    for (_s0, e0, n0), (s1, _e1, n1) in itertools.pairwise(spans):
        if s1 < e0:
            raise _corrupt(path, f"tensors {n0!r} and {n1!r} overlap")
    rec = CheckpointFile(path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, data_start=8 + n, header=raw)
    return rec, header


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
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _corrupt(str(index), f"invalid index: {type(exc).__name__}: {exc}") from None
    names = sorted(set(weight_map.values()))
    for n in names:
        if os.path.isabs(n) or ".." in Path(n).parts:
            raise _corrupt(str(index), f"index names a file outside its directory: {n!r}")
    return [str(index.parent / n) for n in names]


def open_checkpoint(source: str | Path) -> Checkpoint:
    """Parse every header of a checkpoint and lay its tensors out in one arena."""
    paths = discover_files(source)
    files: list[CheckpointFile] = []
    tensors: list[TensorInfo] = []
    seen: dict[str, str] = {}
    digest = hashlib.sha256()
    cursor = 0
    for i, path in enumerate(paths):
        rec, header = read_header(path)
        files.append(rec)
        digest.update(f"{os.path.basename(path)}\0{rec.size}\0".encode())
        digest.update(rec.header)
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if name in seen:
                raise _corrupt(path, f"tensor {name!r} also appears in {seen[name]}")
            seen[name] = path
            start, end = e["data_offsets"]
            cursor = -(-cursor // ARENA_ALIGN) * ARENA_ALIGN
            tensors.append(TensorInfo(
                name=name, dtype=e["dtype"], shape=tuple(e["shape"]), file=i,
                file_offset=rec.data_start + start, nbytes=end - start, arena_offset=cursor,
            ))
            cursor += end - start
    return Checkpoint(
        source=str(source), files=tuple(files), tensors=tuple(tensors),
        arena_bytes=max(cursor, 1), fingerprint=digest.hexdigest(),
    )


def published_checkpoint(name: str, table: Any, arena_nbytes: int, fingerprint: str) -> Checkpoint:
    """Validate the tensor table an engine publishes ([name, dtype, shape, offset, nbytes]
    rows describing its own memory) as strictly as a file header: known dtypes, bytes that
    match shapes, aligned offsets, everything inside the arena, no overlaps."""

    def bad(reason: str) -> BadRequest:
        return BadRequest(f"publish {name!r}: {reason}", model=name, reason=reason)

    if not isinstance(table, list) or not table:
        raise bad("'tensors' must be a non-empty list of [name, dtype, shape, offset, nbytes]")
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for row in table:
        if not (isinstance(row, list) and len(row) == 5):
            raise bad(f"tensor row {row!r} is not [name, dtype, shape, offset, nbytes]")
        tname, dtype, shape, offset, nbytes = row
        if not isinstance(tname, str) or tname in seen:
            raise bad(f"tensor name {tname!r} is not a string or appears twice")
        seen.add(tname)
        if dtype not in DTYPE_SIZES:
            raise bad(f"tensor {tname!r}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise bad(f"tensor {tname!r}: shape must be a list of non-negative integers")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, nbytes)):
            raise bad(f"tensor {tname!r}: offset and nbytes must be integers")
        if nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise bad(f"tensor {tname!r}: {nbytes} bytes for shape {shape} of {dtype}")
        if offset < 0 or offset % ARENA_ALIGN or offset + nbytes > arena_nbytes:
            raise bad(f"tensor {tname!r}: bytes {offset}..{offset + nbytes} are not {ARENA_ALIGN}-aligned inside the {arena_nbytes}-byte arena")
        tensors.append(TensorInfo(name=tname, dtype=dtype, shape=tuple(shape), file=-1, file_offset=-1, nbytes=nbytes,
                                  arena_offset=offset))
    tensors.sort(key=lambda t: t.arena_offset)
    for a, b in itertools.pairwise(tensors):
        if b.arena_offset < a.arena_offset + a.nbytes:
            raise bad(f"tensors {a.name!r} and {b.name!r} overlap")
    end = max(t.arena_offset + t.nbytes for t in tensors)
    return Checkpoint(source=f"published:{name}", files=(), tensors=tuple(tensors), arena_bytes=max(end, 1),
                      fingerprint=fingerprint)
