"""A daemon that refuses a connection (a uid it does not allow, too many connections)
sends why and closes. A SyncClient whose hello was sent after that close meets EPIPE; it
must report the refusal it was sent, not the broken pipe, and not connect again."""

from __future__ import annotations

import os
import socket
import struct
import threading
from pathlib import Path

import msgpack
import pytest

from weightcache import SyncClient
from weightcache.client import sync
from weightcache.errors import PermissionDenied


def test_a_refusal_sent_before_the_close_is_what_the_hello_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "d.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    closed = threading.Event()
    accepted = 0

    def refuse_every_connection() -> None:
        nonlocal accepted
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted += 1
            refusal = {"id": None, "ok": False,
                       "error": {"code": "PERMISSION_DENIED", "message": f"uid {os.geteuid()} may not use this weightcache daemon"}}
            body = msgpack.packb(refusal)
            conn.sendall(struct.pack(">I", len(body)) + body)
            conn.close()
            closed.set()

    server = threading.Thread(target=refuse_every_connection, daemon=True)
    server.start()
    send = sync.send_with_fds_blocking

    def send_after_the_close(sock: socket.socket, frame: bytes, fds: list[int], deadline: float | None) -> None:
        assert closed.wait(10), "the fake daemon never closed"
        send(sock, frame, fds, deadline)  # the daemon's end is closed: EPIPE

    monkeypatch.setattr(sync, "send_with_fds_blocking", send_after_the_close)
    try:
        with pytest.raises(PermissionDenied, match="may not use this weightcache daemon"):
            SyncClient(path, wait_for_daemon=0).status()
        assert accepted == 1  # a refusal is no reason to connect again
    finally:
        listener.close()


async def test_the_async_client_reports_the_refusal_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same race for :class:`~weightcache.Client`: its reader task has the refusal (or
    not yet) when the hello meets EPIPE; it must wait for it, not report the broken pipe."""
    import asyncio

    from weightcache import Client
    from weightcache.client import aio

    path = str(tmp_path / "d.sock")
    accepted = 0
    closed = asyncio.Event()

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        refusal = {"id": None, "ok": False,
                   "error": {"code": "PERMISSION_DENIED", "message": f"uid {os.geteuid()} may not use this weightcache daemon"}}
        body = msgpack.packb(refusal)
        writer.write(struct.pack(">I", len(body)) + body)
        await writer.drain()
        writer.close()
        closed.set()

    server = await asyncio.start_unix_server(refuse, path)
    send = aio.send_with_fds

    async def send_after_the_close(sock: socket.socket, frame: bytes, fds: list[int]) -> None:
        await asyncio.wait_for(closed.wait(), 10)
        await asyncio.sleep(0.05)  # the daemon's end is closed: EPIPE
        await send(sock, frame, fds)

    monkeypatch.setattr(aio, "send_with_fds", send_after_the_close)
    try:
        with pytest.raises(PermissionDenied, match="may not use this weightcache daemon"):
            async with Client(path, wait_for_daemon=0) as c:
                await c.status()
        assert accepted == 1  # a refusal is no reason to connect again
    finally:
        server.close()
