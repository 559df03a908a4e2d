"""Who can change a checkpoint's bytes: the one trust rule of the daemon.

Two things depend on it, and they must agree (they did not while each wrote its own
copy): whether a CPU model may be served from its files' own page cache
(backends/cpu.py, Note [page-cache arenas]), and whether a file's tensor digests may be
kept by file identity and reused at its next load (loader/content.py). Both are safe only
when nobody but the operator can change the bytes behind the daemon's back.

A checkpoint's files are **trusted** (:func:`why_untrusted` returns None) when:

- the daemon opened them itself: files a peer sent as open fds are the peer's choice, and
  it may keep a writable fd or mapping of them;
- each is owned by root or the daemon's uid and not writable by its group or others (a
  POSIX ACL's named entries are capped by the group bits), or it is immutable
  (``chattr +i``, which only root can undo) or fs-verity (never writable again);
- each is on a local file system: on NFS, CIFS, FUSE or virtiofs another machine or a
  user-space daemon can change the bytes behind the page cache, whatever the mode says.

On such files every change is the operator's and moves st_ctime and st_mtime, which is
what the digests' identity and the page-cache arena's in-place check look at.

Read bits are not part of the rule: they say who may read a file, not who may change it.
What an engine may learn from the fd of a trusted file it could not open itself is the
page-cache arena's question (backends/cpu.py, docs/reliability.md).

No torch, no server imports.
"""

from __future__ import annotations

import fcntl
import os
import stat

from .sources import OpenedSource

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
