"""Malformed publishes, headers and arguments get the right error code (never INTERNAL, never no reply)."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from ._util import Conn, code, publish_msg, raw_safetensors, sealed_memfd

GOOD_ROW = [["x", "U8", [16], 0, 16]]


def _fd(kind: str, tmp_path) -> tuple[int, list]:
    extra: list = []
    if kind == "regular":
        p = tmp_path / "plain.bin"
        p.write_bytes(b"\0" * 8192)
        return os.open(p, os.O_RDONLY), extra
    if kind == "fifo":
        p = tmp_path / "pipe"
        os.mkfifo(p)
        return os.open(p, os.O_RDWR | os.O_NONBLOCK), extra
    if kind == "socket":
        a, b = socket.socketpair()
        extra.append(b)
        return a.detach(), extra
    if kind == "devzero":
        return os.open("/dev/zero", os.O_RDONLY), extra
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["regular", "fifo", "socket", "devzero"])
def test_publish_with_fds_that_are_not_memfds(start_daemon, tmp_path, kind):
    d = start_daemon()
    fd, extra = _fd(kind, tmp_path)
    c = Conn(d.socket)
    try:
        r = c.call(publish_msg(1, f"p-{kind}", GOOD_ROW, 4096), fds=[fd])
        assert code(r) == "BAD_REQUEST", r
        assert c.call({"id": 2, "op": "status"})["ok"]
    finally:
        os.close(fd)
        c.close()
        for x in extra:
            x.close()


def test_publish_malformed_arena_and_table(start_daemon):
    d = start_daemon()
    c = Conn(d.socket)
    empty = sealed_memfd(b"")
    page = sealed_memfd(b"\1" * 16, 4096)
    try:
        r0 = c.call(publish_msg(1, "zero", [["e", "U8", [0], 0, 0]], 0), fds=[empty])
        r1 = c.call(publish_msg(2, "dtlist", [["x", ["U8"], [16], 0, 16]], 4096), fds=[page])
        r2 = c.call(publish_msg(3, "dtmap", [["x", {"U8": 1}, [16], 0, 16]], 4096), fds=[page])
        assert [code(r) for r in (r0, r1, r2)] == ["BAD_REQUEST"] * 3, (r0, r1, r2)
    finally:
        os.close(empty)
        os.close(page)
        c.close()


def _header(tensors: str) -> str:
    return "{" + tensors + "}"


ENTRY = '"ok": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}'
BAD_HEADERS = {
    "5000-digit-int": _header(ENTRY + ', "big": {"dtype": "U8", "shape": [' + "9" * 5000 + '], "data_offsets": [16, 32]}'),
    "duplicate-key": _header(ENTRY + ', "dup": {"dtype": "U8", "shape": [16], "data_offsets": [16, 32]}'
                             + ', "dup": {"dtype": "U8", "shape": [16], "data_offsets": [32, 48]}'),
    "dim-2**64": _header(ENTRY + f', "huge": {{"dtype": "U8", "shape": [{2**64}, 0], "data_offsets": [16, 16]}}'),
    "dtype-list": _header(ENTRY + ', "l": {"dtype": ["U8"], "shape": [16], "data_offsets": [16, 32]}'),
}


@pytest.mark.parametrize("kind", list(BAD_HEADERS))
def test_malformed_header_is_corrupt_checkpoint(start_daemon, tmp_path, kind):
    p = raw_safetensors(tmp_path / f"{kind}.safetensors", BAD_HEADERS[kind], b"\7" * 64)
    d = start_daemon(models={"bad": p})
    c = Conn(d.socket, timeout=10)
    try:
        try:
            r = c.call({"id": 1, "op": "attach", "name": "bad"})
        except TimeoutError:
            raise AssertionError("no reply to the attach within 10 s") from None
        for fd in c.take_fds():
            os.close(fd)
        assert code(r) == "CORRUPT_CHECKPOINT", r
        assert c.call({"id": 2, "op": "status"})["ok"]
    finally:
        c.close()


def test_wait_s_must_be_finite_and_is_cut_to_the_request_timeout(start_daemon, ckpts):
    """NaN and infinity are refused; a huge finite wait_s (1e300) is cut to
    request_timeout_s: the request would time out then anyway, and the load it starts
    stops waiting for room with it (tests/test_security.py shows joiners wait only their
    own wait_s)."""
    d = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"request_timeout_s": 60})
    c = Conn(d.socket)
    try:
        nan = c.call({"id": 1, "op": "attach", "name": "tiny", "wait_s": float("nan")})
        inf = c.call({"id": 2, "op": "load", "name": "tiny", "wait_s": float("inf")})
        assert code(nan) == "BAD_REQUEST" and code(inf) == "BAD_REQUEST", (nan, inf)
        assert nan["error"].get("argument") == "wait_s", nan
        huge = c.call({"id": 3, "op": "load", "name": "tiny", "wait_s": 1e300})
        assert huge["ok"], huge
    finally:
        c.close()


assert struct  # keep the import for hand-written headers
