"""A checkpoint's tensors in columns, and the attach reply's table encoded from them.

Why columns and not a tuple of TensorInfo: a NamedTuple is a tuple *subclass*, and
CPython's collector untracks only exact tuples, so every TensorInfo a model keeps stays
tracked for the daemon's life and every full collection walks it. Beside a tenant's
100k-tensor checkpoints those walks (tens of ms each, holding the interpreter lock) were
part of what another tenant's attach waited behind. Here a model keeps nine
buffers whatever its tensor count: nothing per tensor for the collector to walk, ~60
bytes a tensor instead of ~350, and the columns cross a pipe from the parse worker
(parse_worker.py) as bytes. A TensorInfo is made when a row is read and freed by its
reference count when dropped.

The table also keeps, in name order, what the content fingerprint hashes of each row
after its name (``\\0 dtype \\0 shape \\0``, Note [content fingerprint], reader.py):
made where the rows are (in the parse worker for a big header), so the fill hashes the
header half without a row object a tensor. That is what the daemon's threads had built
at every load of a 100k-tensor file, 1.65-1.82 s of Python holding the interpreter lock;
it costs ~7 bytes a tensor plus two 8-byte columns, counted with the rest
(buffer_bytes).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import msgpack

# safetensors dtype name -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
# A row's dtype is one byte: its index here. The parse worker's reply carries these codes,
# so DTYPE_SIZES is appended to, never reordered.
DTYPES = tuple(DTYPE_SIZES)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
TABLE_SLICE = 4096  # rows packed per C call: ~2 ms each, after which the event loop may take the lock
_INT_COLUMNS = ("file", "file_offset", "nbytes", "arena_offset")
Bytes = bytes | memoryview  # a byte column: its own bytes, or a view of the parse worker's reply


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


class TensorTable(Sequence[TensorInfo]):
    """The rows of a checkpoint's tensors, in arena order. Read-only."""

    __slots__ = (
        "_dims",
        "_dtypes",
        "_n",
        "_name_ends",
        "_names",
        "_shape_ends",
        "_tail_ends",
        "_tails",
        "arena_offset",
        "file",
        "file_offset",
        "name_order",
        "nbytes",
    )

    def __init__(self, names: Bytes, name_ends: memoryview, dtypes: Bytes, shape_ends: memoryview, dims: memoryview,
                 file: memoryview, file_offset: memoryview, nbytes: memoryview, arena_offset: memoryview,
                 name_order: memoryview, tails: Bytes, tail_ends: memoryview) -> None:
        n = len(dtypes)
        if not all(len(c) == n for c in (name_ends, shape_ends, file, file_offset, nbytes, arena_offset, name_order, tail_ends)):
            raise ValueError("tensor table columns differ in length")
        if n and (name_ends[-1] != len(names) or shape_ends[-1] != len(dims) or tail_ends[-1] != len(tails)):
            raise ValueError("tensor table names, shapes or tails do not end where their columns say")
        if dtypes and max(dtypes) >= len(DTYPES):
            raise ValueError("tensor table holds an unknown dtype code")
        if not _permutation(name_order, n):
            raise ValueError("tensor table's name order is not one of its rows each")
        self._n = n
        self._names, self._name_ends, self._dtypes = names, name_ends, dtypes
        self._shape_ends, self._dims = shape_ends, dims
        self.file, self.file_offset, self.nbytes, self.arena_offset = file, file_offset, nbytes, arena_offset
        self.name_order, self._tails, self._tail_ends = name_order, tails, tail_ends

    @classmethod
    def of(cls, rows: Iterable[TensorInfo]) -> TensorTable:
        names: list[bytes] = []
        name_ends, shape_ends, dims = array("Q"), array("Q"), array("q")
        dtypes = bytearray()
        cols: dict[str, array[int]] = {"file": array("q"), "file_offset": array("q"), "nbytes": array("q"),
                                        "arena_offset": array("q")}
        end = 0
        for t in rows:
            b = t.name.encode()
            names.append(b)
            end += len(b)
            name_ends.append(end)
            dtypes.append(DTYPE_CODE[t.dtype])
            dims.extend(t.shape)
            shape_ends.append(len(dims))
            cols["file"].append(t.file)
            cols["file_offset"].append(t.file_offset)
            cols["nbytes"].append(t.nbytes)
            cols["arena_offset"].append(t.arena_offset)
        # Name order on the UTF-8 bytes: the same as on the names (code point order).
        order = array("Q", sorted(range(len(names)), key=names.__getitem__))
        tails: list[bytes] = []
        tail_ends = array("Q")
        end = 0
        for i in order:
            s = shape_ends[i - 1] if i else 0
            h = b"\0%s\0%s\0" % (DTYPES[dtypes[i]].encode(), ",".join(map(str, dims[s : shape_ends[i]])).encode())
            tails.append(h)
            end += len(h)
            tail_ends.append(end)
        return cls(b"".join(names), _exact(name_ends), bytes(dtypes), _exact(shape_ends), _exact(dims),
                   **{k: _exact(a) for k, a in cols.items()}, name_order=_exact(order), tails=b"".join(tails),
                   tail_ends=_exact(tail_ends))

    # -- the parse worker's reply --------------------------------------------------------

    def to_wire(self) -> list[memoryview]:
        """The twelve buffers, as bytes views (of one buffer when the table came from the
        parse worker's reply)."""
        return [memoryview(self._names), self._name_ends.cast("B"), memoryview(self._dtypes), self._shape_ends.cast("B"),
                self._dims.cast("B"), *(getattr(self, c).cast("B") for c in _INT_COLUMNS), self.name_order.cast("B"),
                memoryview(self._tails), self._tail_ends.cast("B")]

    @classmethod
    def from_wire(cls, parts: list[Any]) -> TensorTable:
        """The table from :meth:`to_wire`'s buffers; ValueError if they do not make one."""
        if not (isinstance(parts, list) and len(parts) == 12 and all(isinstance(p, (bytes, memoryview)) for p in parts)):
            raise ValueError("tensor table reply is not twelve byte strings")
        parts = [memoryview(p).cast("B") for p in parts]  # views of what was passed, never copies

        def col(raw: memoryview, unsigned: bool = False) -> memoryview:
            if len(raw) % 8:
                raise ValueError("tensor table column is not whole integers")
            return raw.cast("Q") if unsigned else raw.cast("q")

        names, name_ends, dtypes, shape_ends, dims, file, file_offset, nbytes, arena_offset, order, tails, tail_ends = parts
        return cls(names, col(name_ends, unsigned=True), dtypes, col(shape_ends, unsigned=True), col(dims), col(file),
                   col(file_offset), col(nbytes), col(arena_offset), col(order, unsigned=True), tails,
                   col(tail_ends, unsigned=True))

    # -- Sequence --------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def _row(self, i: int) -> TensorInfo:
        a = self._name_ends[i - 1] if i else 0
        s = self._shape_ends[i - 1] if i else 0
        return TensorInfo(str(self._names[a : self._name_ends[i]], "utf-8"), DTYPES[self._dtypes[i]],
                          tuple(self._dims[s : self._shape_ends[i]]), self.file[i], self.file_offset[i], self.nbytes[i],
                          self.arena_offset[i])

    @overload
    def __getitem__(self, i: int) -> TensorInfo: ...
    @overload
    def __getitem__(self, i: slice) -> list[TensorInfo]: ...

    def __getitem__(self, i: int | slice) -> TensorInfo | list[TensorInfo]:
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("tensor index out of range")
        return self._row(i)

    def __iter__(self) -> Iterator[TensorInfo]:
        names, name_ends, dtypes, shape_ends, dims = self._names, self._name_ends, self._dtypes, self._shape_ends, self._dims
        a = s = 0
        for i, (f, fo, nb, ao) in enumerate(zip(self.file, self.file_offset, self.nbytes, self.arena_offset, strict=True)):
            b, e = name_ends[i], shape_ends[i]
            yield TensorInfo(str(names[a:b], "utf-8"), DTYPES[dtypes[i]], tuple(dims[s:e]), f, fo, nb, ao)
            a, s = b, e

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return self.to_wire() == other.to_wire()
        if isinstance(other, Sequence):
            return len(other) == self._n and all(x == y for x, y in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorTable({self._n} tensors)"

    def fingerprint_rows(self) -> Iterator[tuple[int, Bytes, Bytes]]:
        """(row, its name, ``\\0 dtype \\0 shape \\0``) in name order: the header half of
        the content fingerprint (reader.py), made with the table."""
        names, name_ends, tails, tail_ends, a = self._names, self._name_ends, self._tails, self._tail_ends, 0
        for i, b in zip(self.name_order, tail_ends, strict=True):
            yield i, names[name_ends[i - 1] if i else 0 : name_ends[i]], tails[a:b]
            a = b

    # -- sums without a row object each ---------------------------------------------------

    @property
    def data_bytes(self) -> int:
        return sum(self.nbytes)

    @property
    def buffer_bytes(self) -> int:
        """What the columns hold."""
        return len(self._names) + len(self._dtypes) + len(self._tails) + sum(c.nbytes for c in (
            self._name_ends, self._shape_ends, self._dims, self.file, self.file_offset, self.nbytes, self.arena_offset,
            self.name_order, self._tail_ends))

    @property
    def wire_bound(self) -> int:
        """At least the bytes of wire_table(self): per row a fixarray, the name and dtype
        strings with their headers, a shape of at most 9 bytes a dimension and two ints."""
        return len(self._names) + 9 * len(self._dims) + 32 * self._n

    @property
    def columns_bound(self) -> int:
        """At least the bytes of wire_columns(self): the names, a dtype byte and four
        8-byte integers a tensor, 8 bytes a dimension, and the map around them."""
        return columns_bound(len(self._names), self._n, len(self._dims))


def _permutation(order: memoryview, n: int) -> bool:
    """``order`` holds each of 0..n-1 once (a 'Q' column: none below 0). In slices, each
    C call short: the parse worker's reply is checked on a daemon thread."""
    seen: set[int] = set()
    for s in range(0, n, TABLE_SLICE):
        part = order[s : s + TABLE_SLICE]
        if max(part) >= n:
            return False
        seen.update(part)
    return len(seen) == n


def _exact(a: array[int]) -> memoryview:
    """A column of exactly its length (an array grown by appends holds spare room)."""
    return memoryview(a.tobytes()).cast("Q") if a.typecode == "Q" else memoryview(a.tobytes()).cast("q")


def wire_table(tensors: Sequence[TensorInfo]) -> bytes:
    """The attach reply's table, msgpack: one [name, dtype, shape, arena_offset, nbytes]
    per tensor. A big one is packed in slices (msgpack packed 100k rows in one C call
    holding the lock 62-180 ms); the bytes are the same as one ``packb`` of every row."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_array_header(len(tensors))]
    rows: list[list[Any]] = []
    for t in tensors:
        rows.append([t.name, t.dtype, list(t.shape), t.arena_offset, t.nbytes])
        if len(rows) == TABLE_SLICE:
            parts.append(b"".join([packer.pack(r) for r in rows]))
            rows.clear()
    parts.append(b"".join([packer.pack(r) for r in rows]))
    return b"".join(parts)


def _little_endian(column: memoryview | array[int]) -> bytes:
    """An integer column's bytes, little-endian as the wire says, whatever the host's order."""
    if sys.byteorder == "little":
        return bytes(column)
    swapped = array(column.format if isinstance(column, memoryview) else column.typecode, column)
    swapped.byteswap()
    return swapped.tobytes()


def columns_bound(name_bytes: int, tensors: int, dims: int) -> int:
    """At least the bytes of wire_columns for tensors whose names take ``name_bytes`` and
    shapes ``dims`` dimensions in all."""
    return name_bytes + 33 * tensors + 8 * dims + 512


def wire_columns(tensors: Sequence[TensorInfo]) -> bytes:
    """The attach reply's table as columns, for a client that asks for them (attach's
    ``"table": "columns"``, docs/protocol.md): a msgpack map of a few byte strings in
    arena order, whatever the tensor count. A fresh engine reads it with a handful of
    objects in Python (protocol/pymsgpack.py); the rows of wire_table, one list a tensor
    and one a shape, took ~1 ms to decode there for 200 tensors. From a TensorTable the
    columns are its own buffers; a published table's rows are gathered once."""
    columns: dict[str, memoryview | array[int]]
    if isinstance(tensors, TensorTable):
        names, dtypes = bytes(tensors._names), bytes(tensors._dtypes)
        columns = {"name_ends": tensors._name_ends, "shape_ends": tensors._shape_ends, "dims": tensors._dims,
                   "offsets": tensors.arena_offset, "nbytes": tensors.nbytes}
    else:
        parts: list[bytes] = []
        name_ends, shape_ends, dims, offsets, nbytes = array("Q"), array("Q"), array("Q"), array("Q"), array("Q")
        codes, end = bytearray(), 0
        for t in tensors:
            b = t.name.encode()
            parts.append(b)
            end += len(b)
            name_ends.append(end)
            codes.append(DTYPE_CODE[t.dtype])
            dims.extend(t.shape)
            shape_ends.append(len(dims))
            offsets.append(t.arena_offset)
            nbytes.append(t.nbytes)
        names, dtypes = b"".join(parts), bytes(codes)
        columns = {"name_ends": name_ends, "shape_ends": shape_ends, "dims": dims, "offsets": offsets, "nbytes": nbytes}
    return msgpack.packb({"count": len(tensors), "dtype_names": list(DTYPES), "names": names, "dtypes": dtypes,
                          **{k: _little_endian(c) for k, c in columns.items()}}, use_bin_type=True)
