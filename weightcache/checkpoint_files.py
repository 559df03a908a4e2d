"""Which files a checkpoint path names, for those who read them by path: the client (its
register opens them, ``attach --verify`` compares them) and tools. A file, a
``*.safetensors.index.json`` (the shard files its ``weight_map`` lists), or a directory
(its one index, else every .safetensors file in it). The daemon applies the same rules
through fds, never by path (loader/sources.py, ``open_source``), with this module's
index parser and limits.

A leaf: it imports the errors only, so that the client reaches nothing of the loader,
even at call time (tests/test_architecture.py): importing loader/ for discovery pulled
in the parser, the reader and their imports.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpoint, LoadFailed

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 16 * 2**20  # the largest real index (tens of thousands of tensors) is a few MiB; as the header cap


def corrupt(path: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{path}: {reason}", file=path, reason=reason)


def read_capped(fd: int, cap: int) -> bytes | None:
    """All of ``fd`` (a regular file) from offset 0, or None if it holds more than ``cap`` bytes."""
    chunks: list[bytes] = []
    got = 0
    while got <= cap:
        b = os.pread(fd, min(cap + 1 - got, 1 << 20), got)
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return None if got > cap else b"".join(chunks)


def index_names(raw: bytes, index: str) -> list[str]:
    """The shard file names an index json lists (sorted, each once), relative to its
    directory; anything absolute or climbing out with '..' is refused."""
    try:
        data: Any = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or "weight_map" not in data:
            raise KeyError("weight_map")
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (ValueError, KeyError, TypeError) as exc:
        reason = f"invalid index: {type(exc).__name__}"
        if isinstance(exc, json.JSONDecodeError):
            reason += f": {exc.msg.partition(': ')[0]} at char {exc.pos}"
        elif not isinstance(exc, UnicodeDecodeError):
            reason += f": {exc}"
        raise corrupt(index, reason) from None
    except RecursionError:
        raise corrupt(index, "invalid index: nested too deeply") from None
    names = sorted(set(weight_map.values()))
    for n in names:
        if not n or os.path.isabs(n) or ".." in Path(n).parts or "\0" in n:
            raise corrupt(index, f"index names a file outside its directory: {n[:200]!r}")
    return names


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
                raise corrupt(str(index), "invalid index: not a regular file")
            raw = read_capped(fd, MAX_INDEX_BYTES)
        finally:
            os.close(fd)
    except OSError as exc:
        raise corrupt(str(index), f"invalid index: {type(exc).__name__}: {exc.strerror}") from None
    if raw is None:
        raise corrupt(str(index), f"invalid index: larger than {MAX_INDEX_BYTES >> 20} MiB")
    return [str(index.parent / n) for n in index_names(raw, str(index))]
