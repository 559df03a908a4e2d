"""The arena on the wire, defined once for the daemon that exports arenas and the client
that maps them (docs/protocol.md, "attach" and "publish"): both ends import it, so the
layout cannot drift between them (the segment format was written twice, and
each backend built its reply's arena map by hand while the client parsed it by hand).
:func:`parse_attach` reads a whole attach reply around its arena, for the client.

An arena travels as a map, ``{"kind": ..., "nbytes": ..., ...}``, beside its fds. Each
kind is a record here that builds that map (``to_wire``) and is parsed back from it
(:func:`parse_arena`), checking what a client must check before it maps anything:

- :class:`MemfdArenaDesc`: one sealed memfd (attach replies on the CPU, CPU publishes);
- :class:`FileArenaDesc`: the checkpoint's own files, one fd each, and the segments
  that say where each arena range lies in them (attach replies on the CPU);
- :class:`VmmArenaDesc`: CUDA VMM chunks, one fd each, on the GPU named by its UUID
  (attach replies on a GPU, GPU publishes).

An attach reply's map also says ``writable`` (the daemon adds it per request); a publish
request's never does. The tensor table beside it is one :class:`TensorRow` per tensor
(a publish request, and an attach reply by default) or, in the attach reply this
client asks for, the same rows as a few byte columns (:func:`column_rows`).

The records are plain classes with ``__slots__``, not dataclasses: an engine imports
this module on its restart path (with the attach half, client/mapping.py, at the first
attach or while connecting), and making one frozen dataclass with slots cost ~0.5 ms on
the 2-core VM (a plain class ~6 us), more than the rest of this module.
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from ..errors import BadRequest

# Every tensor starts ARENA_ALIGN-aligned within its arena: what CUDA kernels and any
# dtype's view need. Checkpoint layouts (loader/layout.py) and published tables
# (client/publish.py, loader/published.py) both follow it.
ARENA_ALIGN = 256

# One segment of a "file" arena: file index, file offset, arena offset, byte count.
SEGMENT = struct.Struct("<4Q")

# A memfd arena (attach replies, publish requests) carries these seals: no writable
# mapping, no resize, no more seal changes.
MEMFD_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

MEMFD, FILE, CUDA_VMM = "memfd", "file", "cuda_vmm"  # the wire's arena kinds

# A VMM arena's chunks: ~1 GiB each, granularity-rounded (export cost grows per fd:
# backends/cuda.py), the last one the rest. The daemon's arenas and an engine's
# published memory are laid out alike.
CHUNK_BYTES = 1 << 30


def chunk_sizes(total: int, granularity: int) -> list[int]:
    """The chunks of a VMM arena of ``total`` bytes (a multiple of ``granularity``)."""
    from ..units import capacity  # the daemon's and publish's: not an attach's, which imports this module

    chunk = capacity(CHUNK_BYTES, granularity)
    return [min(chunk, total - off) for off in range(0, total, chunk)]


class TensorRow(tuple[str, str, list[int], int, int]):
    """One row of a tensor table, in the wire's order: ``nbytes`` bytes at byte
    ``offset`` of the arena (a multiple of ARENA_ALIGN), C-contiguous, ``dtype`` a
    safetensors dtype name. msgpack sends it as the array it is (a tuple); readers
    unpack rows positionally in this order. Written out rather than a NamedTuple, which
    cost ~0.3 ms to create at import (see the module docstring)."""

    __slots__ = ()

    def __new__(cls, name: str, dtype: str, shape: list[int], offset: int, nbytes: int) -> TensorRow:
        return tuple.__new__(cls, (name, dtype, shape, offset, nbytes))

    @property
    def name(self) -> str:
        return self[0]

    @property
    def dtype(self) -> str:
        return self[1]

    @property
    def shape(self) -> list[int]:
        return self[2]

    @property
    def offset(self) -> int:
        return self[3]

    @property
    def nbytes(self) -> int:
        return self[4]

    def __repr__(self) -> str:
        return f"TensorRow{tuple(self)!r}"


class MemfdArenaDesc:
    """One sealed memfd of ``nbytes`` bytes (MEMFD_SEALS): map it whole, read-only."""

    __slots__ = ("nbytes", "writable")
    kind = MEMFD

    def __init__(self, nbytes: int, *, writable: bool = False) -> None:
        self.nbytes = nbytes
        self.writable = writable  # what the attach reply said; a memfd is never mapped writable

    @property
    def fd_count(self) -> int:
        return 1

    def to_wire(self) -> dict[str, Any]:
        return {"kind": MEMFD, "nbytes": self.nbytes}


class FileArenaDesc:
    """The checkpoint's files served from their page cache: fd ``i`` is mapped over its
    first ``files[i]`` bytes; ``segments`` (SEGMENT records, sorted by arena offset) say
    which file bytes are which arena bytes."""

    __slots__ = ("files", "nbytes", "segments", "writable")
    kind = FILE

    def __init__(self, nbytes: int, files: list[int], segments: bytes, *, writable: bool = False) -> None:
        self.nbytes = nbytes
        self.files = files
        self.segments = segments
        self.writable = writable

    @property
    def fd_count(self) -> int:
        return len(self.files)

    def segment_list(self) -> list[tuple[int, int, int, int]]:
        """``(file, file_offset, arena_offset, nbytes)`` per segment."""
        return list(SEGMENT.iter_unpack(self.segments))

    def to_wire(self) -> dict[str, Any]:
        return {"kind": FILE, "nbytes": self.nbytes, "files": self.files, "segments": self.segments}


class VmmArenaDesc:
    """CUDA VMM chunks of ``chunks[i]`` bytes, one exported POSIX fd each, mapped back to
    back in one range on the GPU whose UUID is ``device_uuid``."""

    __slots__ = ("chunks", "device_uuid", "nbytes", "writable")
    kind = CUDA_VMM

    def __init__(self, nbytes: int, chunks: list[int], device_uuid: str, *, writable: bool = False) -> None:
        self.nbytes = nbytes
        self.chunks = chunks
        self.device_uuid = device_uuid
        self.writable = writable

    @property
    def fd_count(self) -> int:
        return len(self.chunks)

    def to_wire(self) -> dict[str, Any]:
        return {"kind": CUDA_VMM, "nbytes": self.nbytes, "chunks": self.chunks, "device_uuid": self.device_uuid}


ArenaDesc = MemfdArenaDesc | FileArenaDesc | VmmArenaDesc


def _sizes(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(type(n) is int and n > 0 for n in value):
        raise BadRequest(f"{what} must list positive sizes, got {value!r}"[:300])
    return value


def parse_arena(wire: Any) -> ArenaDesc:
    """An arena map as it came off the wire -> its record. Raises BadRequest, naming the
    field, for an unknown kind or a field of the wrong shape: nothing is mapped from a
    description that does not hold together."""
    if not isinstance(wire, dict):
        raise BadRequest(f"the arena must be a map, got {type(wire).__name__}")
    kind, nbytes, writable = wire.get("kind"), wire.get("nbytes"), wire.get("writable", False)
    if type(nbytes) is not int or nbytes <= 0:
        raise BadRequest(f"{kind} arena: 'nbytes' must be a positive integer, got {nbytes!r}"[:300])
    if type(writable) is not bool:
        raise BadRequest(f"{kind} arena: 'writable' must be a boolean, got {writable!r}"[:300])
    if kind == MEMFD:
        return MemfdArenaDesc(nbytes, writable=writable)
    if kind == FILE:
        segments = wire.get("segments")
        if not isinstance(segments, bytes) or len(segments) % SEGMENT.size:
            raise BadRequest(f"file arena: 'segments' must be bytes, {SEGMENT.size} per segment")
        return FileArenaDesc(nbytes, _sizes(wire.get("files"), "file arena: 'files'"), segments, writable=writable)
    if kind == CUDA_VMM:
        uuid = wire.get("device_uuid")
        if not isinstance(uuid, str):
            raise BadRequest(f"cuda_vmm arena: 'device_uuid' must be a string, got {uuid!r}"[:300])
        chunks = _sizes(wire.get("chunks"), "cuda_vmm arena: 'chunks'")
        if sum(chunks) < nbytes:  # a copy of nbytes would run past the mapped chunks
            raise BadRequest(f"cuda_vmm arena: its chunks hold {sum(chunks)} bytes, fewer than its nbytes {nbytes}")
        return VmmArenaDesc(nbytes, chunks, uuid, writable=writable)
    raise BadRequest(f"unknown arena kind {kind!r}"[:200])


def taken(rows: list[Any]) -> Iterator[Any]:
    """The rows of ``rows``, each removed from the list as it is handed out (the list is
    empty at the end). An attach reply's table is read this way so that each row and
    its shape list are freed once their view is made: all of them alive beside the
    views were ~400 more GC-tracked objects at once, for 200 tensors, and a fresh
    engine's span from the import to usable tensors then reached a gen-1 collection of
    what its own ``import torch`` left (2.0-2.6 ms on the 2-core VM)."""
    rows.reverse()
    while rows:
        yield rows.pop()


MAX_WIRE_INT = 2**62  # the largest dimension, offset or size the daemon accepts in a table (loader/published.py)
_COLUMNS = ("names", "name_ends", "dtypes", "shape_ends", "dims", "offsets", "nbytes")


def _u64(cols: dict[str, Any], key: str, count: int | None) -> memoryview:
    raw = cols[key]
    if len(raw) % 8 or (count is not None and len(raw) != 8 * count):
        raise BadRequest(f"attach reply's column table: {key!r} holds {len(raw)} bytes, not {count} 8-byte integers")
    view = memoryview(raw).cast("Q")
    if sys.byteorder != "little":  # the wire's integers are little-endian
        import array

        swapped = array.array("Q", view)
        swapped.byteswap()
        view = memoryview(swapped)
    return view


def column_rows(cols: Any) -> Iterator[tuple[str, str, list[int], int, int]]:
    """An attach reply's table as columns (``"table": "columns"``, docs/protocol.md) ->
    its rows, (name, dtype, shape, offset, nbytes) in arena order, each made as it is
    taken, so that at most one row is alive beside the views. Raises BadRequest for
    columns that do not hold together: here, before any row, for their lengths, ends,
    dtype codes and values; while the rows are taken, for a name or shape that ends
    before it starts or a name that is not UTF-8 (the attach's lease ends either way)."""
    if not isinstance(cols, dict) or not all(isinstance(cols.get(k), bytes) for k in _COLUMNS):
        raise BadRequest(f"attach reply's column table needs byte strings {', '.join(_COLUMNS)}")
    count, dtype_names = cols.get("count"), cols.get("dtype_names")
    if type(count) is not int or count < 0 or not isinstance(dtype_names, list) \
            or not all(isinstance(d, str) for d in dtype_names):
        raise BadRequest("attach reply's column table needs 'count' (an int) and 'dtype_names' (strings)")
    names, dtypes = cols["names"], cols["dtypes"]
    name_ends, shape_ends, offsets, nbytes = (_u64(cols, k, count) for k in ("name_ends", "shape_ends", "offsets", "nbytes"))
    dims = _u64(cols, "dims", None).tolist()
    if len(dtypes) != count or (max(dtypes) if count else 0) >= max(len(dtype_names), 1) \
            or (name_ends[-1] if count else 0) != len(names) or (shape_ends[-1] if count else 0) != len(dims):
        raise BadRequest("attach reply's column table: its dtypes, names or shapes do not end where its columns say")
    if max(dims, default=0) > MAX_WIRE_INT or max(offsets, default=0) > MAX_WIRE_INT or max(nbytes, default=0) > MAX_WIRE_INT:
        raise BadRequest("attach reply's column table: a dimension, offset or size is above 2**62")
    return _rows(names, name_ends, [dtype_names[c] for c in dtypes], shape_ends, dims, offsets, nbytes)


def _rows(names: bytes, name_ends: Iterable[int], dtypes: list[str], shape_ends: Iterable[int], dims: list[int],
          offsets: Iterable[int], nbytes: Iterable[int]) -> Iterator[tuple[str, str, list[int], int, int]]:
    a = s = 0
    for b, dtype, e, offset, n in zip(name_ends, dtypes, shape_ends, offsets, nbytes, strict=True):
        if b < a or e < s:
            raise BadRequest("attach reply's column table: a name or shape ends before it starts")
        try:
            name = names[a:b].decode()
        except UnicodeDecodeError:
            raise BadRequest("attach reply's column table: a name is not UTF-8") from None
        yield name, dtype, dims[s:e], offset, n
        a, s = b, e


class AttachReply:
    """An attach reply read and checked: the arena as its typed record, its fds (as many
    as the arena needs), the lease, and the tensor table's rows (TensorRow order), each
    made or handed out once as it is taken (:func:`taken`, :func:`column_rows`)."""

    __slots__ = ("arena", "device", "fds", "fingerprint", "lease", "source", "tensors", "waited_s")

    def __init__(self, lease: int, fingerprint: str, device: str, arena: ArenaDesc, tensors: Iterator[Any],
                 fds: list[int], source: str, waited_s: float) -> None:
        self.lease = lease
        self.fingerprint = fingerprint
        self.device = device
        self.arena = arena
        self.tensors = tensors
        self.fds = fds  # the caller's to close, or to hand to the mapper that closes them
        # Where the daemon got the bytes: "resident" (a hit), "host", "files" or "peer".
        self.source = source
        self.waited_s = waited_s  # seconds the daemon waited for room that others held


def parse_attach(reply: dict[str, Any], fds: list[int]) -> AttachReply:
    """An attach reply and its fds -> :class:`AttachReply` (the client's reading of it).
    Raises BadRequest for a reply that does not hold together, closing the fds first:
    nothing is mapped from it."""
    try:
        arena = parse_arena(reply.get("arena"))
        if len(fds) != arena.fd_count:
            raise BadRequest(f"{arena.kind} arena needs {arena.fd_count} fds, {len(fds)} arrived")
        tensors, lease, fingerprint, device = reply.get("tensors"), reply.get("lease"), reply.get("fingerprint"), reply.get("device")
        if not isinstance(tensors, list | dict) or type(lease) is not int or not isinstance(fingerprint, str) \
                or not isinstance(device, str):
            raise BadRequest("an attach reply needs 'tensors' (rows or columns), 'lease' (an int), 'fingerprint' and "
                             "'device' (strings)")
        rows = taken(tensors) if isinstance(tensors, list) else column_rows(tensors)
        return AttachReply(lease, fingerprint, device, arena, rows, fds, str(reply.get("source", "resident")),
                           float(reply.get("waited_s", 0.0)))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
