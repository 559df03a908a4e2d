"""Wire protocol v1, both ends' part of it (docs/protocol.md): the names both ends
share, length-prefixed frames, and the Unix socket that carries them with their fds.

A frame is a 4-byte big-endian payload length followed by one msgpack map. The frame
decoder here has no I/O: feed bytes in, get frames out. It never blocks and never reads a
socket, so it is tested byte by byte and with garbage (tests/test_framing.py); the server
and the client drive it from their own sockets. What a payload holds is framing.py's (the
daemon's, msgpack) and pymsgpack.py's (the client's) to encode and decode.

The socket's default path and the environment variables that name it are here too, not
in the config package: the client needs them, and must not import pydantic (~150 ms,
``python -X importtime``).

Sockets: a stream transport cannot carry ancillary data (uvloop's exposes only a
pseudo-socket without sendmsg), and a plain recv silently drops the SCM_RIGHTS fds that
ride on attach replies. So each end owns its socket and waits for readiness with
add_reader/add_writer around recvmsg/sendmsg. The socket work itself is written once
(``_recv_now``, and ``_send_steps``, a generator that yields while the socket is full);
the async functions wait for readiness on the event loop, the blocking ones (the
SyncClient's, in the caller's thread) with poll(2) up to a deadline. Both ends also take
from here who is at the other end (``peer_credentials``: the daemon decides whom to
serve, a client checks who serves the socket) and how the fds that came with frames are
closed (``close_fds``).

Why one module: the names, the frames and the sockets lived in modules of their own, and
each module a fresh engine imports costs ~50-110 µs whatever it holds (2-core VM, H100
host). Every user of the protocol imports the package first; ``import
weightcache`` (for ``tenant_fingerprint``) therefore loads socket, select and array too,
which an engine's torch has loaded already.

``encode_frame`` and ``decode_payload`` (the daemon's msgpack codec, framing.py) are
imported when first asked for: the client and ``import weightcache`` import this package,
and a fresh engine should not pay for msgpack (pymsgpack.py says why).
"""

from __future__ import annotations

import array
import hashlib
import math
import os
import select
import socket
import struct
import time
from collections.abc import Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import FrameTooLarge

if TYPE_CHECKING:
    import asyncio

# -- names both ends share ------------------------------------------------------------

PROTOCOL_VERSION = 1

DEFAULT_SOCKET = "/run/weightcache/weightcache.sock"
SOCKET_ENV = "WEIGHTCACHE_SOCKET"
CONFIG_ENV = "WEIGHTCACHE_CONFIG"
DAEMON_UID_ENV = "WEIGHTCACHE_DAEMON_UID"  # a daemon uid or user name clients trust besides root and themselves


def client_socket_path(explicit: str | os.PathLike[str] | None = None) -> str:
    """The socket a client connects to: explicit, else ``$WEIGHTCACHE_SOCKET``, else the default."""
    return os.fspath(explicit or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)

# Ops the daemon answers. Admin ops change what is cached for everyone.
OPS = frozenset(
    {"hello", "status", "models", "load", "attach", "detach", "evict", "pin", "unpin",
     "register", "unregister", "reload", "publish", "health"}
)

# register, unregister and publish check their own rights (an owner may act on its own models).
ADMIN_OPS = frozenset({"evict", "pin", "unpin", "reload"})


def tenant_fingerprint(fingerprint: str, uid: int) -> str:
    """The fingerprint the daemon gives a model that uid ``uid`` published (with
    ``fingerprint`` as it sent it) or registered with its own files (``fingerprint`` being
    the checkpoint's). Binding the owner's uid in means no tenant can offer weights that
    carry another's fingerprint, or a configured model's: an engine that checks
    ``m.fingerprint == tenant_fingerprint(expected, uid_it_trusts)`` gets only that uid's
    weights.

    >>> tenant_fingerprint("82a6b0f1+int8-v1", 1000)[:12]
    'uid1000:dfc2'
    """
    return f"uid{uid}:" + hashlib.sha256(f"{uid}\0{fingerprint}".encode()).hexdigest()


# -- frames -------------------------------------------------------------------------

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 2**20


class FrameDecoder:
    """Accumulates bytes and yields complete frame payloads.

    ``feed`` raises :class:`FrameTooLarge` as soon as a header announces a payload above
    ``max_frame``; the stream is then out of step and the caller must close it.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames: list[bytes] = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > self.max_frame:
                raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {self.max_frame}", limit=self.max_frame)
            if len(self._buf) < HEADER.size + n:
                break
            end = HEADER.size + n
            # One copy into the payload (a slice of the bytearray, then bytes of it, was two).
            frames.append(bytes(memoryview(self._buf)[HEADER.size : end]))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes held that do not yet make a whole frame (a half-sent frame)."""
        return len(self._buf)

    def discard(self) -> None:
        """Drop the half frame held: the stream is being abandoned."""
        self._buf = bytearray()


# -- the socket, fds included ---------------------------------------------------------

MAX_FDS_PER_MSG = 253  # SCM_MAX_FD in Linux
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MSG * array.array("i").itemsize)
# struct ucred (linux/socket.h): pid_t pid; uid_t uid; gid_t gid. uid_t and gid_t are
# unsigned: a uid above 2**31 (user namespaces hand out large ranges) stays positive.
_UCRED = struct.Struct("iII")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer of a connected Unix socket, taken at connect time
    (``SO_PEERCRED``): the peer cannot forge them, and they do not change if it later
    drops privileges.

    >>> a, b = socket.socketpair()
    >>> peer_credentials(a) == (os.getpid(), os.geteuid(), os.getegid())
    True
    >>> a.close(); b.close()
    """
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid, gid


def close_fds(fds: Iterable[int]) -> None:
    """Close ``fds``, a run of consecutive numbers with one ``os.closerange``.

    Why not an os.close each: every call lets go of the GIL, and while another thread
    computes the caller waits up to a switch interval (5 ms), or to the end of that
    thread's C call, to take it back. The 253 fds of one refused frame, closed one by
    one on the event loop beside a fill's hashing, were 50-60 ms stalls with the loop
    thread blocked, not on a CPU (the loop watch's report). Fds that arrive
    together are numbered in a run: the kernel gives out the lowest free numbers.
    """
    ordered = sorted(fds)
    if not ordered:
        return
    start = prev = ordered[0]
    for fd in ordered[1:]:
        if fd != prev + 1:
            os.closerange(start, prev + 1)
            start = fd
        prev = fd
    os.closerange(start, prev + 1)


async def _wait(loop: asyncio.AbstractEventLoop, sock: socket.socket, writable: bool) -> None:
    fut = loop.create_future()
    fd = sock.fileno()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    add(fd, ready)
    try:
        await fut
    finally:
        remove(fd)


def _recv_now(sock: socket.socket, bufsize: int) -> tuple[bytes, list[int]] | None:
    """One recvmsg: bytes and the fds that came with them, or None if nothing is there yet."""
    try:
        data, ancdata, flags, _ = sock.recvmsg(bufsize, _ANC_SPACE, socket.MSG_CMSG_CLOEXEC)
    except (BlockingIOError, InterruptedError):
        return None
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            fds.extend(arr)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            _close_quietly(fd)
        raise ConnectionError("file descriptors were truncated in transit (MSG_CTRUNC)")
    return data, fds


def _send_steps(sock: socket.socket, data: bytes | Sequence[bytes], fds: list[int]) -> Generator[None, None, None]:
    """Send all of ``data``, the fds on its first byte: yields while the socket is full."""
    views = [memoryview(p) for p in ([data] if isinstance(data, bytes) else data) if len(p)]
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while views:
        try:
            n = sock.sendmsg(views, anc)
        except (BlockingIOError, InterruptedError):
            yield
            continue
        anc = []  # the kernel attached them to the bytes already sent
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


async def recv_with_fds(sock: socket.socket, bufsize: int = 1 << 16) -> tuple[bytes, list[int]]:
    """Receive bytes and any fds that arrived with them. ``b""`` means the peer closed."""
    import asyncio  # here, not at the top: a SyncClient engine that never runs a loop skips its ~20 ms import

    loop = asyncio.get_running_loop()
    while (got := _recv_now(sock, bufsize)) is None:
        await _wait(loop, sock, writable=False)
    return got


async def send_with_fds(sock: socket.socket, data: bytes | Sequence[bytes], fds: list[int]) -> None:
    """Send ``data`` (bytes, or parts sent back to back without joining them: an attach
    reply's shared tensor table is never copied per reply); the fds ride on the first
    byte. The caller keeps ownership of the fds."""
    import asyncio

    loop = asyncio.get_running_loop()
    for _ in _send_steps(sock, data, fds):
        await _wait(loop, sock, writable=True)


def wait_ready(sock: socket.socket, writable: bool, deadline: float | None) -> None:
    """Block until ``sock`` is readable (writable), or raise TimeoutError at ``deadline``
    (``time.monotonic()``; None waits without a bound). An error or hang-up on the
    socket counts as ready: the next recvmsg or sendmsg reports it."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT if writable else select.POLLIN)
    while True:
        if deadline is None:
            ms = None
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            ms = max(1, math.ceil(left * 1e3))
        if poller.poll(ms):
            return


def recv_with_fds_blocking(sock: socket.socket, deadline: float | None, bufsize: int = 1 << 16) -> tuple[bytes, list[int]]:
    """:func:`recv_with_fds` for a non-blocking socket driven from a plain thread:
    waits with poll(2) up to ``deadline`` (TimeoutError past it)."""
    while (got := _recv_now(sock, bufsize)) is None:
        wait_ready(sock, False, deadline)
    return got


def send_with_fds_blocking(sock: socket.socket, data: bytes | Sequence[bytes], fds: list[int], deadline: float | None) -> None:
    """:func:`send_with_fds` from a plain thread, up to ``deadline`` (TimeoutError past it,
    possibly with part of ``data`` sent)."""
    for _ in _send_steps(sock, data, fds):
        wait_ready(sock, True, deadline)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def __getattr__(name: str) -> Any:
    if name in ("encode_frame", "decode_payload"):
        from . import framing

        return getattr(framing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADMIN_OPS", "CONFIG_ENV", "DAEMON_UID_ENV", "DEFAULT_MAX_FRAME", "DEFAULT_SOCKET", "HEADER", "MAX_FDS_PER_MSG", "OPS",
           "PROTOCOL_VERSION", "SOCKET_ENV", "FrameDecoder", "client_socket_path", "close_fds", "decode_payload", "encode_frame",
           "peer_credentials", "recv_with_fds", "recv_with_fds_blocking", "send_with_fds", "send_with_fds_blocking",
           "tenant_fingerprint", "wait_ready"]
