"""The open files of a checkpoint: each opened once, and only ever read through its fd.

Parsing a header from a path and later re-opening the path for the data lets anyone who
can swap the path in between (a symlink, a rename) make the daemon serve a different file
than the one it validated; a FIFO given as a path blocks the opening thread forever. So a
load opens every file once, here, with ``O_NONBLOCK`` (a FIFO open returns at once and is
then refused by ``fstat``), checks that each fd is a regular file and, with ``roots``, that
the file it actually refers to (``/proc/self/fd/N``) lies under an allowed directory; the
header parser and the reader then use those fds and nothing else. Files of a directory or
an index are opened relative to one fd of that directory, so a directory swapped after
it was checked cannot redirect them either.

:func:`adopt_fds` wraps fds that a client passed instead of a path. Under TRUST, at the
end: whether anyone but the operator can change the bytes behind those fds
(:func:`why_untrusted`).

No torch, no server imports.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import logging
import os
import re
import stat
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ..checkpoint_files import INDEX_SUFFIX, MAX_INDEX_BYTES, corrupt, index_names, no_safetensors, read_capped
from ..errors import BadRequest, LoadFailed, PermissionDenied, WeightcacheError

log = logging.getLogger("weightcache.loader")

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class SourceFile:
    path: str  # the name shown in messages; for files the daemon opened, also the path re-stat'ed for staleness
    fd: int  # O_RDONLY regular file, owned by the OpenedSource


class OpenedSource:
    """The open files of one checkpoint, in checkpoint order. Context manager; close()
    closes every fd (idempotent)."""

    def __init__(self, source: str, files: list[SourceFile]) -> None:
        self.source = source  # label: the path given, or e.g. 'fds:<name>'
        self.files = files
        self.closed = False
        self.adopted = False  # fds a peer sent (adopt_fds): the peer chose the files
        self._lock = threading.Lock()
        self._readers = 0  # threads inside reading() now

    def close(self) -> None:
        """Closed at once for its users; the fds themselves once no thread reads them
        (``reading``): an fd closed under a running pread is a number the next file the
        daemon opens (or a peer sends) may take, and the read goes on in that file."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._readers:
                return  # the last reader closes them
        self._close_fds()

    def _close_fds(self) -> None:
        for f in self.files:
            with contextlib.suppress(OSError):
                os.close(f.fd)

    @contextlib.contextmanager
    def reading(self) -> Iterator[OpenedSource]:
        """Hold the fds open while a thread reads them, even past a ``close`` meanwhile (a
        register whose client went, or an io timeout, gives up on a parse still running)."""
        with self._lock:
            if self.closed:
                raise ValueError(f"{self!r} is closed")
            self._readers += 1
        try:
            yield self
        finally:
            with self._lock:
                self._readers -= 1
                last = self.closed and not self._readers
            if last:
                self._close_fds()

    def __enter__(self) -> OpenedSource:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fds {[f.fd for f in self.files]}"
        return f"OpenedSource({self.source!r}, {len(self.files)} files, {state})"


def _fd_path(fd: int) -> str:
    """Where ``fd`` really points: symlinks, bind mounts and renames all resolved by the kernel."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _under(path: str, root: str) -> bool:
    """Component-wise: /models2/x is not under /models."""
    parts, rparts = Path(path).parts, Path(root).parts
    return parts[: len(rparts)] == rparts


def untrusted_directory(path: str) -> tuple[str, int] | None:
    """The first directory on the way to ``path`` (as written, then symlinks resolved)
    that someone other than root or the daemon's uid can change, with its owner; None
    when there is none. As OpenSSH's StrictModes: a directory is trusted if root or the
    daemon's uid owns it and neither group nor others may write it, or, sticky (/tmp), if
    the entry in it on the way is owned by root or the daemon's uid (others cannot
    rename or remove that one). A directory that cannot be examined is untrusted."""
    trusted = (0, os.geteuid())
    ways = [os.path.normpath(os.path.abspath(path))]
    real = os.path.realpath(path)
    if real != ways[0]:
        ways.append(real)
    for way in ways:
        parts = Path(way).parts
        for i in range(1, len(parts)):
            d = os.path.join(*parts[:i])
            try:
                st = os.lstat(d)
                if stat.S_ISLNK(st.st_mode):
                    continue  # its own directory was checked; where it leads is the second way
                if st.st_uid not in trusted:
                    return d, st.st_uid
                if st.st_mode & 0o022:
                    nxt = os.lstat(os.path.join(d, parts[i]))
                    if not (st.st_mode & stat.S_ISVTX) or nxt.st_uid not in trusted:
                        return d, (nxt.st_uid if st.st_mode & stat.S_ISVTX else st.st_uid)
            except OSError:
                return d, -1
    return None


# Paths already said to lie in a directory others can change (logged once each, bounded).
_warned: set[str] = set()


def _warn_untrusted(path: str, where: tuple[str, int]) -> None:
    if path in _warned or len(_warned) >= 1024:
        return
    _warned.add(path)
    who = "its owner cannot be told" if where[1] < 0 else f"uid {where[1]} can change it"
    log.warning("checkpoint path %s: directory %s is not the operator's alone (%s): symbolic links on the way are not "
                "followed, so nobody can point the daemon at a file of their choosing (make the directories root's, "
                "or use daemon.model_roots)", path, where[0], who, extra={"path": path})


class _Opener:
    """Opens the files of one checkpoint, remembering every fd so that a failure closes them all.

    Symbolic links are followed (with ``follow_symlinks``) only on a way every directory
    of which root or the daemon's uid alone can change (untrusted_directory): else one
    who can write a directory there could swap a file for a link to another tenant's
    file, which the daemon, reading as root, would then serve (the stale-file reload did,
    with the default config, without this check)."""

    def __init__(self, source: str, roots: Sequence[str | os.PathLike[str]] | None, follow_symlinks: bool) -> None:
        self.source = source
        self.roots = None if roots is None else [os.path.realpath(r) for r in roots]
        self.follow = follow_symlinks
        self.flags = _OPEN_FLAGS | (0 if follow_symlinks else os.O_NOFOLLOW)
        self.fds: list[int] = []
        self.untrusted: tuple[str, int] | None = None  # the directory that stopped a symlink being followed

    def close_all(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def release(self, fd: int) -> None:
        """Close one fd that is not part of the result (a directory, an index)."""
        self.fds.remove(fd)
        os.close(fd)

    def deny(self, path: str) -> PermissionDenied:
        return PermissionDenied(f"{path}: outside the allowed checkpoint roots {self.roots}", file=path,
                                roots=self.roots, reason="outside roots")

    def check_roots(self, path: str, real: str) -> None:
        if self.roots is not None and not any(_under(real, r) for r in self.roots):
            raise self.deny(path)

    def open(self, path: str, name: str | None = None, dir_fd: int | None = None, *, want_dir: bool = False) -> tuple[int, os.stat_result]:
        """Open ``name`` (relative to ``dir_fd``; ``path`` when None) once and check it. ``path``
        is what messages say. Returns the fd and its fstat. A directory is accepted only
        with ``want_dir`` (``None`` for the top-level source, which may be either)."""
        target = path if name is None else name
        try:
            asked = os.path.abspath(target) if dir_fd is None else os.path.join(_fd_path(dir_fd), target)
        except (OSError, ValueError):
            asked = target
        follow = self.follow
        if follow and (where := untrusted_directory(asked)) is not None:
            follow = False
            self.untrusted = where
            _warn_untrusted(asked, where)
        try:
            # O_PATH first: it opens nothing (no device or FIFO open with side effects), and
            # what it names is then checked and reopened by inode, never by path again.
            pfd = os.open(target, os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), dir_fd=dir_fd)
        except OSError as exc:
            raise self._refuse(path, target, dir_fd, self._open_error(path, exc, follow)) from None
        except ValueError:  # an embedded NUL
            raise LoadFailed(f"{path}: invalid path", file=path, reason="invalid path") from None
        try:
            pre = os.fstat(pfd)
            if stat.S_ISLNK(pre.st_mode):  # only when not following symlinks
                raise self._symlink(path)
            if not (stat.S_ISREG(pre.st_mode) or (want_dir and stat.S_ISDIR(pre.st_mode))):
                raise self._refuse(path, target, dir_fd, self._not_regular(path, pre.st_mode, want_dir))
            try:
                fd = os.open(f"/proc/self/fd/{pfd}", self.flags & ~os.O_NOFOLLOW)
            except OSError as exc:
                raise self._refuse(path, target, dir_fd, self._open_error(path, exc, follow)) from None
        finally:
            os.close(pfd)
        self.fds.append(fd)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (pre.st_dev, pre.st_ino):  # cannot happen through /proc; say so if it does
            raise LoadFailed(f"{path}: changed while being opened", file=path, reason="changed while opening")
        # O_NOFOLLOW covers the last component only: a symlinked directory on the way
        # shows as a real path that differs from the one asked for.
        if not follow and os.path.normpath(asked) != _fd_path(fd):
            raise self._symlink(path)
        if self.roots is not None:
            self.check_roots(path, _fd_path(fd))
        if not (stat.S_ISREG(st.st_mode) or (want_dir and stat.S_ISDIR(st.st_mode))):
            raise self._not_regular(path, st.st_mode, want_dir)
        return fd, st

    def _refuse(self, path: str, target: str, dir_fd: int | None, err: WeightcacheError) -> WeightcacheError:
        """``err``, unless the path leads outside the roots: then PermissionDenied, so that
        nothing is said about what lies out there (missing, a device, ...)."""
        if self.roots is not None:
            self.check_roots(path, os.path.realpath(target if dir_fd is None else f"/proc/self/fd/{dir_fd}/{target}"))
        return err

    def _not_regular(self, path: str, mode: int, want_dir: bool) -> LoadFailed:
        what = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device", stat.S_IFLNK: "a symbolic link"}.get(stat.S_IFMT(mode), "not a regular file")
        expected = "a regular file or directory" if want_dir else "a regular file"
        return LoadFailed(f"{path}: is {what}, not {expected}", file=path, reason="not a regular file")

    def _symlink(self, path: str) -> PermissionDenied:
        if self.follow and self.untrusted is not None:
            d, uid = self.untrusted
            who = "someone other than root or the daemon's user" if uid < 0 else f"uid {uid}"
            return PermissionDenied(f"{path}: is or passes through a symbolic link in {d}, which {who} can change; "
                                    "symbolic links are followed only through directories root or the daemon's user "
                                    "alone can change", file=path, reason="symlink in untrusted directory")
        return PermissionDenied(f"{path}: is or passes through a symbolic link, and symbolic links are not followed here",
                                file=path, reason="symlink")

    def _open_error(self, path: str, exc: OSError, follow: bool) -> LoadFailed | PermissionDenied:
        if exc.errno == errno.ENOENT:
            return LoadFailed(f"{path}: file not found", file=path, reason="not found")
        if exc.errno == errno.ELOOP and not follow:
            return self._symlink(path)
        if exc.errno in (errno.EACCES, errno.EPERM):
            return LoadFailed(f"{path}: permission denied", file=path, reason="permission denied")
        return LoadFailed(f"{path}: cannot open: {exc.strerror}", file=path, reason=exc.strerror)


_SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>[0-9]+)-of-(?P<n>[0-9]+)\.safetensors$")


def unindexed_note(directory: str | os.PathLike[str]) -> str | None:
    """What to tell the operator about a directory without an index that is loaded as one
    model, or None: a directory is one checkpoint when it holds one .safetensors file, an
    index, or the complete set ``<stem>-00001-of-0000N`` .. ``-0000N-of-0000N`` of one stem,
    as ``save_pretrained`` names shards. Anything else (two unrelated models, a stray copy
    beside the shards, a set with one missing) is still merged into one model, as it
    always was (tensor names that clash are refused), but no longer silently:
    start, reload and register log this line and the CLI's register prints it. A pure
    look at the names (no file is opened); None for anything that is not a directory."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    if any(fnmatch.fnmatchcase(n, f"*{INDEX_SUFFIX}") for n in names):
        return None
    files = [n for n in names if fnmatch.fnmatchcase(n, "*.safetensors")]
    if len(files) <= 1:
        return None
    found = [_SHARD_NAME.match(n) for n in files]
    sets = {(m.group("stem"), int(m.group("n"))) for m in found if m}
    if all(found) and len(sets) == 1:
        ((_stem, count),) = sets
        if sorted(int(m.group("i")) for m in found if m) == list(range(1, count + 1)):
            return None
    shown = files if len(files) <= 8 else [*files[:8], f"... {len(files) - 8} more"]
    return (f"{os.fspath(directory)} has no *{INDEX_SUFFIX} and its {len(files)} .safetensors files are not one "
            f"shard set (<name>-00001-of-0000N.safetensors ...), yet they are loaded as ONE model: {shown}; if they "
            "are not one checkpoint, name one file as the path, or give the directory an index")


def open_source(source: str | os.PathLike[str], *, roots: Sequence[str | os.PathLike[str]] | None = None,
                follow_symlinks: bool = True) -> OpenedSource:
    """Discover the .safetensors files of a file, a directory or a ``*.safetensors.index.json``
    (the rules of :func:`weightcache.checkpoint_files.discover_files`) and open each once
    with ``O_RDONLY|O_NONBLOCK|O_CLOEXEC`` (``|O_NOFOLLOW`` unless ``follow_symlinks``).
    Each fd must be a regular file (else LoadFailed, reason 'not a regular file'); with
    ``roots``, the file each fd really is, and the directory and index json it was found
    through, must lie under one of the roots (else PermissionDenied). On any failure
    everything opened so far is closed."""
    label = os.fspath(source)
    op = _Opener(label, roots, follow_symlinks)
    try:
        if op.roots is not None:
            # Refuse early (before touching the path at all) what is plainly outside the
            # roots; the authoritative check is on each opened fd.
            op.check_roots(label, os.path.realpath(label))
        try:
            top, st = op.open(label, want_dir=True)
        except LoadFailed as exc:
            if exc.details.get("reason") == "not found":
                raise LoadFailed(f"{label}: checkpoint path does not exist", file=label, reason="not found") from None
            raise
        if stat.S_ISDIR(st.st_mode):
            names = sorted(os.listdir(top))
            indexes = [n for n in names if fnmatch.fnmatchcase(n, f"*{INDEX_SUFFIX}")]
            if len(indexes) > 1:
                raise LoadFailed(f"{label}: several index files {indexes}; name one as the path", file=label)
            if indexes:
                index_path = str(Path(label) / indexes[0])
                ifd, _ = op.open(index_path, indexes[0], top)
                return _open_indexed(op, top, index_path, ifd)
            shards = [n for n in names if fnmatch.fnmatchcase(n, "*.safetensors")]
            if not shards:
                raise no_safetensors(label, names)
            return _open_files(op, top, [(str(Path(label) / n), n) for n in shards])
        if label.endswith(".json"):
            # An index: its files are opened relative to one fd of its directory (checked
            # against the roots like the index itself).
            dfd, _ = op.open(os.path.dirname(label) or ".", want_dir=True)
            return _open_indexed(op, dfd, label, top)
        return OpenedSource(label, [SourceFile(label, top)])
    except BaseException:
        op.close_all()
        raise


def _open_indexed(op: _Opener, dfd: int, index_path: str, ifd: int) -> OpenedSource:
    """Read the index from ``ifd`` (then close it) and open the files it names relative to ``dfd``."""
    raw = read_capped(ifd, MAX_INDEX_BYTES)
    if raw is None:
        raise corrupt(index_path, f"invalid index: larger than {MAX_INDEX_BYTES >> 20} MiB")
    op.release(ifd)
    parent = Path(index_path).parent
    names = index_names(raw, index_path)
    return _open_files(op, dfd, [(str(parent / n), n) for n in names])


def _open_files(op: _Opener, dfd: int, files: list[tuple[str, str]]) -> OpenedSource:
    """Open each (path, name relative to ``dfd``); then close ``dfd``."""
    out = []
    for path, name in files:
        fd, _ = op.open(path, name, dfd)
        out.append(SourceFile(path, fd))
    op.release(dfd)
    return OpenedSource(op.source, out)


def adopt_fds(label: str, names: Sequence[str], fds: Sequence[int]) -> OpenedSource:
    """Wrap fds a client passed, one per .safetensors file in checkpoint order (``names``
    are for messages only). Takes ownership of the fds: they are all closed on failure
    too. Each must be a regular file opened for reading, else BadRequest naming the file."""
    owned: list[int] = []
    seen: set[int] = set()
    for fd in fds:
        # Only fds that are really open (and each once) are ours to close: closing a number
        # twice, or one that was not open, could close a file another thread just opened.
        if isinstance(fd, int) and not isinstance(fd, bool) and fd >= 0 and fd not in seen:
            try:
                os.fstat(fd)
            except OSError:
                continue
            seen.add(fd)
            owned.append(fd)

    def bad(name: str, what: str) -> BadRequest:
        for fd in owned:
            with contextlib.suppress(OSError):
                os.close(fd)
        return BadRequest(f"{label}: {name}: {what}", file=name, reason=what)

    if len(names) != len(fds):
        raise bad(label, f"{len(fds)} fds for {len(names)} file names")
    if not fds:
        raise bad(label, "no files")
    files = []
    used: set[int] = set()
    for name, fd in zip(names, fds, strict=True):
        shown = str(name)[:200]
        if not (isinstance(fd, int) and not isinstance(fd, bool)) or fd < 0:
            raise bad(shown, "not a file descriptor")
        if fd in used:
            raise bad(shown, "the same fd is given for two files")
        used.add(fd)
        try:
            st = os.fstat(fd)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError as exc:
            raise bad(shown, f"unusable fd ({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            kind = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO or pipe", stat.S_IFSOCK: "a socket",
                    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise bad(shown, f"is {kind}, not a regular file")
        # An O_PATH fd reads as access mode O_RDONLY but cannot be read; reopening it
        # through /proc (as O_DIRECT reads do) would grant a read the client never had.
        if flags & os.O_PATH:
            raise bad(shown, "was opened with O_PATH, not for reading")
        if flags & os.O_ACCMODE not in (os.O_RDONLY, os.O_RDWR):
            raise bad(shown, "is not opened for reading (O_WRONLY)")
        files.append(SourceFile(str(name), fd))
    opened = OpenedSource(label, files)
    opened.adopted = True
    return opened


# ===============================================================================================
# TRUST: who can change a checkpoint's bytes
# ===============================================================================================
# Who can change a checkpoint's bytes: the one trust rule of the daemon.
#
# Two things depend on it, and they must agree (they did not while each wrote its own
# copy): whether a CPU model may be served from its files' own page cache
# (backends/cpu.py, Note [page-cache arenas]), and whether a file's tensor digests may be
# kept by file identity and reused at its next load (loader/reader.py). Both are safe only
# when nobody but the operator can change the bytes behind the daemon's back.
#
# A checkpoint's files are **trusted** (:func:`why_untrusted` returns None) when:
#
# - the daemon opened them itself: files a peer sent as open fds are the peer's choice, and
#   it may keep a writable fd or mapping of them;
# - each is owned by root or the daemon's uid and not writable by its group or others (a
#   POSIX ACL's named entries are capped by the group bits), or it is immutable
#   (``chattr +i``, which only root can undo) or fs-verity (never writable again);
# - each is on a local file system: on NFS, CIFS, FUSE or virtiofs another machine or a
#   user-space daemon can change the bytes behind the page cache, whatever the mode says.
#
# On such files every change is the operator's and moves st_ctime and st_mtime, which is
# what the digests' identity and the page-cache arena's in-place check look at.
#
# Read bits are not part of the rule: they say who may read a file, not who may change it.
# What an engine may learn from the fd of a trusted file it could not open itself is the
# page-cache arena's question (backends/cpu.py, docs/reliability.md).


# File systems on which only this kernel changes a file, through its page cache: the
# owner and mode rules then say who can. (On NFS, CIFS, FUSE or virtiofs another machine
# or a user-space daemon can change the bytes whatever the mode says.)
LOCAL_FILE_SYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "bcachefs", "jfs", "reiserfs", "zfs", "tmpfs", "ramfs", "overlay",
    "squashfs", "erofs", "iso9660",
})

FS_IOC_GETFLAGS = 0x80086601
FS_IMMUTABLE_FL = 0x00000010
FS_VERITY_FL = 0x00100000


def inode_flags(fd: int) -> int:
    try:
        return int.from_bytes(fcntl.ioctl(fd, FS_IOC_GETFLAGS, bytes(8))[:4], "little")
    except OSError:  # a file system without inode flags
        return 0


def file_system(fd: int) -> str:
    """The type of the file system ``fd`` is on, from its mount id (/proc/self/fdinfo)."""
    mnt = ""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                mnt = line.split()[1]
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] == mnt and "-" in fields:
                return fields[fields.index("-") + 1]
    return "unknown"


def why_untrusted(opened: OpenedSource) -> str | None:
    """Why someone other than the operator could change these files' bytes, and what the
    operator can do about it (one line, naming the file), or None when only root or the
    daemon's uid can."""
    if opened.adopted:
        return ("its files were sent by a peer as open files; to have the daemon open them itself, name the model in the "
                "config or register it with --by-path (admins)")
    me = os.geteuid()
    owners = "root" if me == 0 else f"root or uid {me} (the daemon's)"
    for sf in opened.files:
        st = os.fstat(sf.fd)
        immutable = inode_flags(sf.fd) & (FS_IMMUTABLE_FL | FS_VERITY_FL)
        if not immutable and st.st_uid not in (0, me):
            return f"{sf.path} is owned by uid {st.st_uid}, who could rewrite it; chown it to {owners}, or chattr +i it"
        if not immutable and st.st_mode & 0o022:
            return (f"{sf.path} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}), who could rewrite it; "
                    f"chmod go-w {sf.path}")
        fs = file_system(sf.fd)
        if fs not in LOCAL_FILE_SYSTEMS:
            return f"{sf.path} is on {fs}, where the bytes can change behind the page cache; copy it to a local file system"
    return None
