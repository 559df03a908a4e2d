"""The published store's files on disk: a published model's tensors as a safetensors
file named by its content fingerprint, and a small JSON record per model name.

Layout of the store's directory (``[published] dir``, the daemon's alone)::

    blobs/<content fingerprint>.safetensors   the tensors; one file however many names hold them
    records/<xxh3 of the name>.json           name, owner, access lists, fingerprints, size, last use
    tmp/                                      files being written (emptied at every start)

Every file is written under tmp/, fsync'd, then renamed into place (and the directory
fsync'd): a reader sees a whole file or none. The content fingerprint is the loader's
(Note [content fingerprint] in reader.py): computed here from the bytes as they are
written, and again by the loader's threads when the file is read back, so a file whose
bytes changed on disk is caught at its next read. Records and files someone other
than root or the daemon's uid could have written are ignored (loader/sources.py's trust rule).

No server imports, no torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .checkpoint import Checkpoint
from .layout import MAX_NAME_CHARS
from .reader import EMPTY_DIGEST, HASH_BLOCK, fingerprint, tensor_digest
from .sources import untrusted_directory
from .tensor_table import DTYPE_SIZES

RECORD_VERSION = 1
MAX_RECORD_BYTES = 256 * 2**10  # a record is a few hundred bytes; its access lists at most 256 entries each
BLOB_SUFFIX = ".safetensors"
_HEX = frozenset("0123456789abcdef")


class StoreProblem(Exception):
    """A file of the store that cannot be used, and why (one line, naming it)."""


@dataclass(frozen=True)
class StoredRecord:
    """What the store keeps of one published model besides its tensors."""

    name: str
    device: str  # the daemon's name for it ("cpu", "cuda:0")
    owner: int  # the publisher's uid
    tenants: tuple[str, ...]  # whose quotas it counts against (cache/eviction.tenant_keys)
    allowed_uids: tuple[int, ...] | None
    allowed_gids: tuple[int, ...] | None
    fingerprint: str  # the publish's own, bound to the owner (protocol.tenant_fingerprint): what attach shows
    content: str  # the content fingerprint of the tensors: the blob's name
    nbytes: int  # the blob file's size
    tensors: int
    published: float  # wall-clock time of the publish
    used: float = field(default=0.0, compare=False)  # wall-clock time of its last publish or read back

    def to_json(self) -> bytes:
        return json.dumps({"version": RECORD_VERSION, **asdict(self)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredRecord:
        """The record ``data`` holds; StoreProblem saying what is wrong with it otherwise."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise StoreProblem(f"not a JSON record ({exc})") from None
        if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
            raise StoreProblem(f"not a version-{RECORD_VERSION} record")

        def get(key: str, ok: Callable[[Any], bool]) -> Any:
            v = raw.get(key)
            if not ok(v):
                raise StoreProblem(f"field {key!r} is missing or malformed")
            return v

        def uint(v: Any) -> bool:
            return type(v) is int and 0 <= v < 2**63

        def ids(v: Any) -> bool:
            return v is None or (isinstance(v, list) and len(v) <= 256 and all(uint(x) for x in v))

        def when(v: Any) -> bool:
            return type(v) in (int, float) and math.isfinite(v)

        content = get("content", lambda v: isinstance(v, str) and len(v) == 32 and set(v) <= _HEX)
        uids, gids = get("allowed_uids", ids), get("allowed_gids", ids)
        return cls(
            name=get("name", lambda v: isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS),
            device=get("device", lambda v: isinstance(v, str) and 0 < len(v) <= 64),
            owner=get("owner", uint),
            tenants=tuple(get("tenants", lambda v: isinstance(v, list) and len(v) <= 1024
                              and all(isinstance(t, str) and len(t) <= 32 for t in v))),
            allowed_uids=None if uids is None else tuple(uids), allowed_gids=None if gids is None else tuple(gids),
            fingerprint=get("fingerprint", lambda v: isinstance(v, str) and 0 < len(v) <= 512),
            content=content, nbytes=get("nbytes", uint), tensors=get("tensors", uint),
            published=get("published", when), used=get("used", when))


def record_key(name: str) -> str:
    """A record's file name: model names may hold characters a file name may not."""
    return xxhash.xxh3_128_hexdigest(name.encode()) + ".json"


def blob_path(root: Path, content: str) -> Path:
    return root / "blobs" / f"{content}{BLOB_SUFFIX}"


# -- the directory ---------------------------------------------------------------------
def prepare(root: Path) -> None:
    """Check (making it if missing, mode 0700, in a directory that exists) the store's
    directory and its subdirectories. Raises StoreProblem naming what to fix."""
    if root.is_symlink():
        raise StoreProblem(f"{root} is a symbolic link; give the directory itself")
    if not root.exists():
        if not root.parent.is_dir():
            raise StoreProblem(f"{root} does not exist, nor does its parent {root.parent}; create it (mode 0700, owned "
                               "by the daemon's user)")
        try:
            root.mkdir(mode=0o700)
        except OSError as exc:
            raise StoreProblem(f"{root} does not exist and cannot be made: {exc.strerror}") from None
    if not root.is_dir():
        raise StoreProblem(f"{root} is not a directory")
    _check_own_dir(root)
    where = untrusted_directory(str(root))
    if where is not None:
        who = "an owner that cannot be told" if where[1] < 0 else f"uid {where[1]}"
        raise StoreProblem(f"{root}: directory {where[0]} on the way can be changed by {who}, who could swap the "
                           "store's files; use a directory only root or the daemon's user can change")
    if not os.access(root, os.W_OK | os.X_OK):
        raise StoreProblem(f"{root} is not writable by the daemon's user (uid {os.geteuid()})")
    for sub in ("blobs", "records", "tmp"):
        d = root / sub
        if d.is_symlink() or (d.exists() and not d.is_dir()):
            raise StoreProblem(f"{d} is not a directory; remove it")
        if not d.exists():
            d.mkdir(mode=0o700)
        _check_own_dir(d)


def clean_tmp(root: Path) -> list[str]:
    """Empty tmp/ of what a write cut short left (the store's lock held); one line each."""
    cleaned = []
    for entry in os.scandir(root / "tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
        cleaned.append(f"removed {entry.path}, left by a write that did not finish")
    return cleaned


def lock(root: Path) -> int:
    """Take the store's lock (``lock`` in it, flock'd) for as long as the returned fd is
    open: two daemons writing one store would remove each other's files being written
    and each count only its own against the budget."""
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreProblem(f"{root} is in use by another daemon (it holds {root / 'lock'}); give each daemon its own "
                           "directory") from None
    return fd


def _check_own_dir(d: Path) -> None:
    st = os.lstat(d)
    if st.st_uid not in (0, os.geteuid()):
        raise StoreProblem(f"{d} is owned by uid {st.st_uid}, who could change what the store holds; chown it to the "
                           f"daemon's user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise StoreProblem(f"{d} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w {d}")


def _trusted_file(path: Path, st: os.stat_result) -> str | None:
    """Why a file of the store cannot be trusted, or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid not in (0, os.geteuid()):
        return f"{path} is owned by uid {st.st_uid}, who could have written it"
    if st.st_mode & 0o022:
        return f"{path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def index(root: Path) -> tuple[list[StoredRecord], list[tuple[str, str]], list[str]]:
    """The store's usable records, and what was wrong with the others: ``bad`` (path, why)
    are records or blobs that cannot be used and are the daemon's to remove (truncated,
    malformed, a blob missing or of the wrong size), ``ignored`` lines name files someone
    else could have written, left alone and not served. Blobs no record names are bad too
    (a publish stopped between its blob and its record)."""
    records: list[StoredRecord] = []
    bad: list[tuple[str, str]] = []
    ignored: list[str] = []
    named: set[str] = set()
    blobs: dict[str, os.stat_result] = {}
    for entry in os.scandir(root / "blobs"):
        blobs[entry.name] = entry.stat(follow_symlinks=False)
    for entry in sorted(os.scandir(root / "records"), key=lambda e: e.name):
        path = Path(entry.path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            ignored.append(f"record {path}: cannot be opened ({exc.strerror})")
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            why = _trusted_file(path, st)
            if why is not None:
                ignored.append(f"record {why}")
                continue
            data = f.read(MAX_RECORD_BYTES + 1)
        try:
            if len(data) > MAX_RECORD_BYTES:
                raise StoreProblem(f"more than {MAX_RECORD_BYTES} bytes")
            rec = StoredRecord.from_json(data)
            if record_key(rec.name) != entry.name:
                raise StoreProblem(f"it names model {rec.name!r}, whose record is another file")
        except StoreProblem as exc:
            bad.append((str(path), f"record {path}: {exc}"))
            continue
        blob = f"{rec.content}{BLOB_SUFFIX}"
        bst = blobs.get(blob)
        if bst is None:
            bad.append((str(path), f"record {path} ({rec.name!r}): its file {blob} is missing"))
            continue
        why = _trusted_file(root / "blobs" / blob, bst)
        if why is not None:
            ignored.append(f"model {rec.name!r}: {why}")
            named.add(blob)  # not the daemon's to remove either
            continue
        if bst.st_size != rec.nbytes:
            bad.append((str(path), f"record {path} ({rec.name!r}): its file {blob} is {bst.st_size} bytes, "
                                   f"not {rec.nbytes} (truncated or replaced)"))
            continue
        named.add(blob)
        records.append(rec)
    for blob, bst in blobs.items():
        if blob not in named and _trusted_file(root / "blobs" / blob, bst) is None:
            bad.append((str(root / "blobs" / blob), f"{root / 'blobs' / blob}: no record names it"))
    return records, bad, ignored


# -- writing ---------------------------------------------------------------------------
def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp(root: Path, label: str) -> tuple[Path, int]:
    path = root / "tmp" / f"{label}.{os.getpid()}.{time.monotonic_ns()}"
    return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def blob_header(ckpt: Checkpoint) -> bytes:
    """The safetensors header of ``ckpt``'s tensors laid out back to back in arena order,
    with its 8-byte length, padded to 8 bytes as safetensors pads it."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt", "weightcache": "published"}}
    pos = 0
    for t in ckpt.tensors:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def blob_size(ckpt: Checkpoint) -> int:
    return len(blob_header(ckpt)) + ckpt.data_bytes


def write_blob(root: Path, ckpt: Checkpoint, read: Callable[[int, int], memoryview],
               cancelled: Callable[[], bool] = lambda: False) -> tuple[Path, str, int]:
    """Write ``ckpt``'s tensors (their bytes from ``read(arena offset, nbytes)``, a view
    valid until the next call) to a temporary file, hashing them as they pass; fsync it.
    Returns the file, the content fingerprint, and its size. The caller renames it into
    place (``commit_blob``) or removes it. Every tensor's dtype must be one the loader
    parses (the publish's table was checked against the same list)."""
    assert all(t.dtype in DTYPE_SIZES for t in ckpt.tensors)
    head = blob_header(ckpt)
    path, fd = _temp(root, "blob")
    try:
        _write_all(fd, memoryview(head))
        digests: list[bytes] = []
        for t in ckpt.tensors:
            if cancelled():
                raise StoreProblem("cancelled: the daemon is stopping")
            pieces = []
            for off in range(0, t.nbytes, HASH_BLOCK):
                n = min(HASH_BLOCK, t.nbytes - off)
                view = read(t.arena_offset + off, n)
                try:
                    pieces.append(xxhash.xxh3_128_digest(view))
                    _write_all(fd, view)
                finally:
                    view.release()
            digests.append(tensor_digest(pieces) if pieces else EMPTY_DIGEST)
        os.fsync(fd)
        size = os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    return path, fingerprint(ckpt, digests), size


def commit_blob(root: Path, temp: Path, content: str) -> None:
    """Move a written blob into place, or drop it where the same content is there already."""
    target = blob_path(root, content)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        os.rename(temp, target)
        _fsync_dir(target.parent)
        return
    if _trusted_file(target, st) is None and st.st_size == os.stat(temp).st_size:
        os.unlink(temp)  # stored once; the read back checks its bytes as it checks every file's
        return
    os.rename(temp, target)  # not the daemon's, or not whole: replaced by this one
    _fsync_dir(target.parent)


def write_record(root: Path, rec: StoredRecord) -> None:
    path, fd = _temp(root, "record")
    try:
        _write_all(fd, memoryview(rec.to_json()))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)
    os.rename(path, root / "records" / record_key(rec.name))
    _fsync_dir(root / "records")


def remove_record(root: Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / "records" / record_key(name))
        _fsync_dir(root / "records")


def remove_blob(root: Path, content: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(blob_path(root, content))


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
