"""Tensor tables an engine publishes: validated as strictly as a file header.

A publish request carries rows of ``[name, dtype, shape, offset, nbytes]`` describing
the engine's own memory. They become a ``Checkpoint`` without files, after the same
checks a header gets: known dtypes, bytes that match shapes, bounded numbers, aligned
offsets inside the arena, no overlaps.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

from ..errors import BadRequest
from ..protocol.arena import ARENA_ALIGN
from ..protocol.framing import Deferred
from .checkpoint import Checkpoint, gc_paused
from .layout import LIMIT, MAX_NAME_CHARS, nbytes_of, show
from .tensor_table import DTYPE_SIZES, TensorInfo


def published_checkpoint(name: str, table: Any, arena_nbytes: int, fingerprint: str) -> Checkpoint:
    """Validate the tensor table an engine publishes ([name, dtype, shape, offset, nbytes]
    rows describing its own memory; a request's table arrives as its msgpack bytes, a
    Deferred, and is decoded here, off the event loop) as strictly as a file header:
    string names of at most 1024 characters, each once; known dtypes (strings); dimensions, offsets and byte counts
    integers in [0, 2**62]; bytes that match shapes; aligned offsets; everything inside the
    arena (of > 0 bytes); no overlaps. Every failure is a BadRequest.

    Speed: a 600,000-row table of 2-D tensors validates in 0.76 s sent in arena order and
    0.87 s shuffled (reversed), median of 7, against 2.0 s and 2.2 s for the row-by-row loop
    it replaced (CPython 3.11 on the project's idle 2-core VM, where a bare 10M-iteration
    ``for`` loop takes 0.8 s). Tables are checked column by column with C-level builtins;
    only a table that fails that check (or has a shape of more than 16 dimensions) goes
    through the row-by-row check, which finds the first problem and names it."""

    def bad(reason: str) -> BadRequest:
        return BadRequest(f"publish {show(name)}: {reason}", model=name, reason=reason)

    if type(arena_nbytes) is not int or not 0 < arena_nbytes <= LIMIT:
        raise bad(f"arena nbytes {show(arena_nbytes)} must be a positive integer of at most 2**62")
    if isinstance(table, Deferred):
        with gc_paused():
            table = table.decode_list()
    if type(table) is not list or not table:
        raise bad("'tensors' must be a non-empty list of [name, dtype, shape, offset, nbytes]")
    with gc_paused() if len(table) > 10_000 else contextlib.nullcontext():
        tensors = _fast_table(table, arena_nbytes)
        if tensors is None:
            tensors = _checked_table(table, arena_nbytes, bad)
    end = tensors[-1].arena_offset + tensors[-1].nbytes  # sorted and disjoint: the last one ends last
    return Checkpoint(source=f"published:{name}", files=(), tensors=tensors, arena_bytes=max(end, 1), fingerprint=fingerprint)


_FAST_MAX_DIMS = 16  # longer shapes take the row-by-row path, whose product stops early


def _fast_table(table: list[Any], arena_nbytes: int) -> tuple[TensorInfo, ...] | None:
    """The tensors of a valid table, sorted by offset, or None if anything is off (or
    unusual): then _checked_table decides and explains. Every test here is one a row of
    _checked_table also makes, so this never accepts what that would refuse."""
    if set(map(type, table)) != {list} or set(map(len, table)) != {5}:
        return None
    names, dtypes, shapes, offsets, nbytes = (list(map(operator.itemgetter(i), table)) for i in range(5))
    if set(map(type, names)) != {str} or max(map(len, names)) > MAX_NAME_CHARS or len(set(names)) != len(names):
        return None
    if set(map(type, dtypes)) != {str} or not set(dtypes) <= DTYPE_SIZES.keys():
        return None
    if set(map(type, shapes)) != {list} or max(map(len, shapes)) > _FAST_MAX_DIMS:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) > LIMIT):
        return None
    # Both >= 0 here and offset + nbytes <= arena_nbytes <= 2**62 below bound them above.
    if set(map(type, offsets)) != {int} or set(map(type, nbytes)) != {int} or min(offsets) < 0 or min(nbytes) < 0:
        return None
    expected = map(operator.mul, map(math.prod, shapes), map(DTYPE_SIZES.__getitem__, dtypes))
    if not all(map(operator.eq, expected, nbytes)):
        return None
    if any(map(operator.mod, offsets, itertools.repeat(ARENA_ALIGN))) or max(map(operator.add, offsets, nbytes)) > arena_nbytes:
        return None
    if all(map(operator.le, offsets, itertools.islice(offsets, 1, None))):
        starts, sizes = offsets, nbytes  # already in arena order: what engines send
    else:
        # Stable by offset alone: where that puts an empty tensor after a non-empty one at the
        # same offset, the overlap test below fails and the row-by-row check (which sorts
        # by offset, then size) decides. When this path accepts, both orders are the same.
        order = sorted(range(len(table)), key=offsets.__getitem__)
        names, dtypes, shapes, starts, sizes = (list(map(col.__getitem__, order)) for col in (names, dtypes, shapes, offsets, nbytes))
    if not all(map(operator.ge, itertools.islice(starts, 1, None), map(operator.add, starts, sizes))):
        return None  # some tensor starts before the previous one ends
    # tuple.__new__ on zipped columns: no Python frame per tensor (0.14 s for 600k rows vs 0.23 through TensorInfo())
    rows = zip(names, dtypes, map(tuple, shapes), itertools.repeat(-1), itertools.repeat(-1), sizes, starts)
    return tuple(map(tuple.__new__, itertools.repeat(TensorInfo), rows))  # type: ignore[arg-type]


def _checked_table(table: list[Any], arena_nbytes: int, bad: Callable[[str], BadRequest]) -> tuple[TensorInfo, ...]:
    """Row by row: raises ``bad(reason)`` for the first problem."""
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for row in table:
        if type(row) is not list or len(row) != 5:
            raise bad(f"tensor row {show(row)} is not [name, dtype, shape, offset, nbytes]")
        tname, dtype, shape, offset, nbytes = row
        if type(tname) is not str or len(tname) > MAX_NAME_CHARS:
            raise bad(f"tensor name {show(tname)} is not a string of at most {MAX_NAME_CHARS} characters")
        if tname in seen:
            raise bad(f"tensor name {show(tname)} appears twice")
        seen.add(tname)
        itemsize = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise bad(f"tensor {show(tname)}: unsupported dtype {show(dtype)}")
        if type(shape) is not list or not all(type(d) is int and 0 <= d <= LIMIT for d in shape):
            raise bad(f"tensor {show(tname)}: shape must be a list of non-negative integers of at most 2**62")
        if type(offset) is not int or type(nbytes) is not int or not (0 <= offset <= LIMIT and 0 <= nbytes <= LIMIT):
            raise bad(f"tensor {show(tname)}: offset and nbytes must be integers in [0, 2**62]")
        if nbytes != nbytes_of(shape, itemsize):
            raise bad(f"tensor {show(tname)}: {nbytes} bytes for shape {show(shape)} of {dtype}")
        if offset % ARENA_ALIGN or offset + nbytes > arena_nbytes:
            raise bad(f"tensor {show(tname)}: bytes {offset}..{offset + nbytes} are not {ARENA_ALIGN}-aligned inside the "
                      f"{arena_nbytes}-byte arena")
        tensors.append(TensorInfo(tname, dtype, tuple(shape), -1, -1, nbytes, offset))
    # Empty tensors first among equal offsets: one at the start of another occupies none of its bytes.
    tensors.sort(key=operator.attrgetter("arena_offset", "nbytes"))
    for a, b in itertools.pairwise(tensors):
        if b.arena_offset < a.arena_offset + a.nbytes:
            raise bad(f"tensors {show(a.name)} and {show(b.name)} overlap")
    return tuple(tensors)
