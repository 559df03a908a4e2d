"""Async send/receive on a raw non-blocking Unix socket, file descriptors included.

Why not asyncio streams: a stream transport cannot carry ancillary data (uvloop's exposes
only a pseudo-socket without sendmsg), and a plain recv silently drops the SCM_RIGHTS
fds that ride on attach replies. So each end owns its socket and waits for readiness with
add_reader/add_writer around recvmsg/sendmsg.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
from collections.abc import Sequence

MAX_FDS_PER_MSG = 253  # SCM_MAX_FD in Linux
_ANC_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MSG * array.array("i").itemsize)


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


async def recv_with_fds(sock: socket.socket, bufsize: int = 1 << 16) -> tuple[bytes, list[int]]:
    """Receive bytes and any fds that arrived with them. ``b""`` means the peer closed."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data, ancdata, flags, _ = sock.recvmsg(bufsize, _ANC_SPACE, socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            await _wait(loop, sock, writable=False)
            continue
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


async def send_with_fds(sock: socket.socket, data: bytes | Sequence[bytes], fds: list[int]) -> None:
    """Send ``data`` (bytes, or parts sent back to back without joining them: an attach
    reply's shared tensor table is never copied per reply); the fds ride on the first
    byte. The caller keeps ownership of the fds."""
    loop = asyncio.get_running_loop()
    views = [memoryview(p) for p in ([data] if isinstance(data, bytes) else data) if len(p)]
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    while views:
        try:
            n = sock.sendmsg(views, anc)
        except (BlockingIOError, InterruptedError):
            await _wait(loop, sock, writable=True)
            continue
        anc = []  # the kernel attached them to the bytes already sent
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
