"""A safetensors header's JSON validated, and a checkpoint's tensors laid out in one arena.

Pure: no file is opened here. checkpoint.py reads the raw headers from the checkpoint's
fds and calls :func:`lay_out`, in its own thread for small headers or in a worker process
for big ones (parse_worker.py), which is why this is a module of its own: the worker
imports it without the rest of the loader.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint_files import corrupt
from ..protocol.arena import ARENA_ALIGN
from ..units import round_up
from .tensor_table import DTYPE_SIZES, TensorInfo, TensorTable

MAX_NAME_CHARS = 1024  # tensor names: real ones are < 200
LIMIT = 2**62  # bound on every dimension, offset and byte count: far past any real tensor, and msgpack-safe


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
# event loop (the loop's 1 ms sleeps measured beside a parse).
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
        raise corrupt(path, "header is not UTF-8 JSON (invalid UTF-8)") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_int=_small_int, parse_float=_no_float,
                          parse_constant=_no_constant)
    except _HeaderError as exc:
        raise corrupt(path, str(exc)) from None
    except RecursionError:
        raise corrupt(path, "header is nested too deeply") from None
    except json.JSONDecodeError as exc:
        # exc.msg is the C scanner's fixed text; cut at ': ' in case a version appends the offending character.
        raise corrupt(path, f"header is not UTF-8 JSON: {exc.msg.partition(': ')[0]} at char {exc.pos}") from None
    except (ValueError, TypeError) as exc:
        raise corrupt(path, f"header is not valid JSON ({type(exc).__name__})") from None


def validate_header(path: str, file_size: int, raw: bytes) -> dict[str, Any]:
    """The tensor entries of a raw header (``__metadata__`` removed), each checked against
    the file's size. Every malformation is a CorruptCheckpoint naming the file."""
    header = _parse_json(path, raw)
    if not isinstance(header, dict):
        raise corrupt(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise corrupt(path, "__metadata__ must map strings to strings")
    data_len = file_size - 8 - len(raw)
    spans = []
    for name, e in header.items():
        if len(name) > MAX_NAME_CHARS:
            raise corrupt(path, f"tensor {show(name)}: name longer than {MAX_NAME_CHARS} characters")
        if not isinstance(e, dict) or e.keys() != {"dtype", "shape", "data_offsets"}:
            raise corrupt(path, f"tensor {show(name)}: entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise corrupt(path, f"tensor {show(name)}: unsupported dtype {show(dtype)}")
        if type(shape) is not list or not all(type(d) is int and 0 <= d <= LIMIT for d in shape):
            raise corrupt(path, f"tensor {show(name)}: shape must be a list of non-negative integers of at most 2**62")
        if not (type(offs) is list and len(offs) == 2 and all(type(o) is int and 0 <= o <= LIMIT for o in offs)):
            raise corrupt(path, f"tensor {show(name)}: data_offsets must be two integers in [0, 2**62]")
        start, end = offs
        if start > end:
            raise corrupt(path, f"tensor {show(name)}: data_offsets {offs} are not ordered")
        expected = nbytes_of(shape, DTYPE_SIZES[dtype])
        if expected is None:
            raise corrupt(path, f"tensor {show(name)}: shape {show(shape)} of {dtype} is more than 2**62 bytes")
        if end - start != expected:
            raise corrupt(path, f"tensor {show(name)}: {end - start} bytes for shape {show(shape)} of {dtype} (needs {expected})")
        if end > data_len:
            raise corrupt(path, f"tensor {show(name)}: bytes {start}..{end} run past the data ({data_len} bytes; truncated?)")
        spans.append((start, end, name))
    spans = sorted_gradually(spans)
    for (_s0, e0, n0), (s1, _e1, n1) in itertools.pairwise(spans):
        if s1 < e0:
            raise corrupt(path, f"tensors {show(n0)} and {show(n1)} overlap")
    release_gradually(spans)
    return header


@dataclass(frozen=True)
class Layout:
    """What a checkpoint's raw headers make: its tensors laid out in one arena."""

    tensors: TensorTable
    arena_bytes: int
    layout: str  # Checkpoint.layout
    table: bytes | None = None  # the encoded attach table, where it was made with the layout


def lay_out(headers: Sequence[tuple[str, int, bytes]]) -> Layout:
    """Validate each file's raw header ((path, file size, raw header), in file order) and
    lay their tensors out in one arena: in file order, each file's tensors by file offset,
    ARENA_ALIGN-aligned. Pure: run here for small headers, in a worker process for big
    ones (parse_worker.py)."""
    tensors: list[TensorInfo] = []
    seen: dict[str, str] = {}
    digest = hashlib.sha256()
    cursor = 0
    for i, (path, size, raw) in enumerate(headers):
        header = validate_header(path, size, raw)
        digest.update(f"{os.path.basename(path)}\0{size}\0".encode())
        digest.update(raw)
        data_start = 8 + len(raw)
        in_order = sorted_gradually(list(header.items()), key=lambda kv: kv[1]["data_offsets"][0])
        for name, e in in_order:
            if name in seen:
                raise corrupt(path, f"tensor {show(name)} also appears in {seen[name]}")
            seen[name] = path
            start, end = e["data_offsets"]
            cursor = round_up(cursor, ARENA_ALIGN)
            tensors.append(TensorInfo(name=name, dtype=e["dtype"], shape=tuple(e["shape"]), file=i,
                                      file_offset=data_start + start, nbytes=end - start, arena_offset=cursor))
            cursor += end - start
        release_gradually(in_order)
        release_gradually(header)
    release_gradually(seen)
    table = TensorTable.of(tensors)
    release_gradually(tensors)
    return Layout(table, max(cursor, 1), digest.hexdigest())
