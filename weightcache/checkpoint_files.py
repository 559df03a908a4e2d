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

import fnmatch
import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpoint, LoadFailed

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 16 * 2**20  # the largest real index (tens of thousands of tensors) is a few MiB; as the header cap


PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")  # PyTorch's pickled checkpoints (torch.save)
# How to turn a pickled checkpoint into safetensors, once: what an error about one ends with.
CONVERT_HINT = ("convert it to safetensors once: for a transformers model, `AutoModel.from_pretrained(DIR)"
                ".save_pretrained(NEW_DIR)` writes safetensors (the default); for any file, "
                "`safetensors.torch.save_file(torch.load(F, weights_only=True), F_NEW.safetensors)`")


def corrupt(path: str, reason: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{path}: {reason}", file=path, reason=reason)


def no_safetensors(directory: str, names: list[str]) -> LoadFailed:
    """The error for a directory (its entries ``names``) without a .safetensors file:
    if it holds PyTorch pickles, what they are and how to convert them."""
    pickles = sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in PICKLE_PATTERNS))
    if not pickles:
        return LoadFailed(f"{directory}: directory holds no .safetensors files", file=directory, reason="empty")
    shown = ", ".join(pickles[:3]) + (f" and {len(pickles) - 3} more" if len(pickles) > 3 else "")
    return LoadFailed(f"{directory}: directory holds no .safetensors files, but {len(pickles)} PyTorch pickle "
                      f"file(s) ({shown}): weightcache serves safetensors checkpoints only; {CONVERT_HINT}",
                      file=directory, reason="pickle")


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
            # e.g. the model's config.json: valid JSON, but no index
            what = "a model's config.json" if os.path.basename(index) == "config.json" else "JSON"
            raise LoadFailed(f"{index}: not a checkpoint index: {what} without a \"weight_map\"; give the checkpoint's "
                             f"directory, its *{INDEX_SUFFIX} or a .safetensors file", file=index, reason="not an index")
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
    pickles = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in PICKLE_PATTERNS)]
    if pickles:  # pytorch_model.bin.index.json
        raise LoadFailed(f"{index}: the index lists PyTorch pickle files ({pickles[0]}"
                         f"{f' and {len(pickles) - 1} more' if len(pickles) > 1 else ''}), not safetensors: "
                         f"weightcache serves safetensors checkpoints only; {CONVERT_HINT}", file=index, reason="pickle")
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
            raise no_safetensors(str(p), os.listdir(p))
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
