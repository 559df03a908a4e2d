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
