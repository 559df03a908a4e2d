"""Who may connect, who may administer, and where the socket may live.

Unix sockets authenticate for free: SO_PEERCRED gives the peer's pid, uid and gid as the
kernel saw them at connect time, unforgeable by the peer. The daemon checks them against
the configured allow lists on accept (a refused peer gets PERMISSION_DENIED and the
connection is closed) and again for admin ops. The socket's directory is checked before
binding so that nobody else can swap the socket or the directory under us.
"""

from __future__ import annotations

import ctypes
import errno
import grp
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ..config import DaemonConfig
from ..protocol import peer_credentials


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # primary gid and supplementary groups (from /proc, best effort)

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        pid, uid, gid = peer_credentials(sock)
        groups = _peer_groups(sock)
        return cls(pid, uid, gid, frozenset({gid, *(groups if groups is not None else _supplementary_groups(pid))}))


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # linux/socket.h; Python does not export it
_NGROUPS_MAX = 65536


def _peer_groups(sock: socket.socket) -> list[int] | None:
    """The peer's supplementary groups as the kernel took them at connect(), with its
    uid (Linux >= 4.13): what ``/proc/<pid>`` cannot give, since the pid may have exited
    (its groups lost: a "gid:N" quota would no longer cover its models) or been reused
    by another process (whose groups it would borrow). None where the kernel has no
    SO_PEERGROUPS."""
    try:  # socket.getsockopt takes at most 1024 bytes: 256 groups
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError as exc:
        if exc.errno != errno.ERANGE:
            return None
        more = _peer_groups_libc(sock.fileno())  # more: libc's, with room for NGROUPS_MAX
        if more is None:
            return None
        raw = more
    return list(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


def _peer_groups_libc(fd: int) -> bytes | None:
    buf = ctypes.create_string_buffer(4 * _NGROUPS_MAX)
    size = ctypes.c_uint32(len(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        return None
    return buf.raw[: size.value]


def _supplementary_groups(pid: int) -> list[int]:
    # Kernels without SO_PEERGROUPS: the groups come from /proc. A peer that exits first
    # loses them (fails closed for access, open for a group's quota).
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return [int(g) for g in line.split()[1:]]
    except OSError:
        pass
    return []


def resolve_gid(group: str | int) -> int:
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r}") from None


class AccessPolicy:
    def __init__(self, cfg: DaemonConfig) -> None:
        me = os.geteuid()
        self.allowed_uids = frozenset(cfg.allowed_uids if cfg.allowed_uids is not None else (me, 0))
        self.allowed_gids = frozenset(resolve_gid(g) for g in cfg.allowed_gids)
        if cfg.socket_group is not None:
            # Whoever the socket's group lets connect is meant to be let in.
            self.allowed_gids |= {resolve_gid(cfg.socket_group)}
        # Admins may make the daemon read any file under model_roots as its own uid, and
        # change what is cached for everyone: by default only the daemon's uid and root.
        self.admin_uids = frozenset(cfg.admin_uids if cfg.admin_uids is not None else (me, 0))
        self.admin_gids = frozenset(resolve_gid(g) for g in cfg.admin_gids)

    def allows(self, peer: Peer) -> bool:
        return peer.uid in self.allowed_uids or bool(peer.groups & self.allowed_gids)

    def is_admin(self, peer: Peer) -> bool:
        return peer.uid == 0 or peer.uid in self.admin_uids or bool(peer.groups & self.admin_gids)


def check_socket_dir(directory: Path) -> None:
    """Refuse a directory someone else could tamper with: a symlink, one owned by another
    non-root user, or one that anyone may write to without the sticky bit."""
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeError(f"socket directory {directory} is a symlink; refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"socket directory {directory} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise RuntimeError(f"socket directory {directory} is owned by uid {st.st_uid}, not this user or root")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise RuntimeError(f"socket directory {directory} is world-writable without the sticky bit")
