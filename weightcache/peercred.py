"""Who is at the other end of a Unix socket, as the kernel saw it (``SO_PEERCRED``).

Both ends use it: the daemon decides whom to serve (server/access.py), and a client
checks who serves the socket before trusting weights from it (client/connection.py). It
lives apart from both so that neither imports the other, and so that the client, which
must stay cheap to import, pulls in nothing but ``socket`` and ``struct``.
"""

from __future__ import annotations

import socket
import struct

# struct ucred (linux/socket.h): pid_t pid; uid_t uid; gid_t gid. uid_t and gid_t are
# unsigned: a uid above 2**31 (user namespaces hand out large ranges) stays positive.
_UCRED = struct.Struct("iII")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer of a connected Unix socket, taken at connect time:
    the peer cannot forge them, and they do not change if it later drops privileges.

    >>> import os
    >>> a, b = socket.socketpair()
    >>> peer_credentials(a) == (os.getpid(), os.geteuid(), os.getegid())
    True
    >>> a.close(); b.close()
    """
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid
