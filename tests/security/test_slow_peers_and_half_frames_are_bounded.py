"""Slow or silent connections, many connections of one uid, and many half-sent frames."""

from __future__ import annotations

import select
import threading
import time

import pytest
from helpers import NOBODY, as_uid, connect_until_admitted, root_only

from weightcache.protocol import encode_frame
from weightcache.protocol.framing import HEADER

from ._util import MIB, Conn, code, held_as_uid, hello, multi_tenant, rss, wait_closed


def test_frame_read_timeout_is_one_deadline_per_frame(start_daemon):
    d = start_daemon(extra_daemon={"frame_read_timeout_s": 1})
    c = Conn(d.socket)
    try:
        c.sock.send(HEADER.pack(100))
        t0 = time.monotonic()
        closed_after = None
        while time.monotonic() - t0 < 6:
            try:
                c.sock.send(b"\0")  # one byte every 0.2 s: each read "makes progress"
            except OSError:
                closed_after = time.monotonic() - t0
                break
            if select.select([c.sock], [], [], 0.2)[0]:
                r = c.recv()
                assert r is None or code(r) == "TIMEOUT", r
                closed_after = time.monotonic() - t0
                break
        assert closed_after is not None, "a frame trickled one byte at a time was never timed out"
        assert closed_after < 3.0, closed_after
    finally:
        c.close()


def test_connection_without_hello_is_closed(start_daemon):
    d = start_daemon(extra_daemon={"hello_timeout_s": 1})
    idle = Conn(d.socket)  # greeted, then idle: never timed out
    silent = Conn(d.socket, greet=False)
    chatty = Conn(d.socket, greet=False)  # sends requests, never hello
    try:
        silent.sock.setblocking(False)
        t0 = time.monotonic()
        closed = {}
        while time.monotonic() - t0 < 5 and len(closed) < 2:
            try:
                chatty.sock.send(encode_frame({"id": 1, "op": "status"}))
            except OSError:
                closed.setdefault("chatty", time.monotonic() - t0)
            for name, conn in (("silent", silent), ("chatty", chatty)):
                if name not in closed and wait_closed(conn.sock, 0.1) is not None:
                    closed[name] = time.monotonic() - t0
        assert set(closed) == {"silent", "chatty"}, f"still open after 5 s: {closed}"
        assert max(closed.values()) < 3.5, closed
        assert idle.call({"id": 2, "op": "status"})["ok"]
    finally:
        for c in (idle, silent, chatty):
            c.close()


@root_only
def test_max_connections_per_uid(start_daemon):
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY], "max_connections_per_uid": 3})

    def tenant(keep):
        replies = []
        for i in range(4):
            c = Conn(d.socket, greet=False)
            keep.append(c)
            try:
                if i == 3:  # a refusal comes unsolicited (id null); or after hello, if the daemon waits for it
                    c.sock.settimeout(2)
                    try:
                        r = c.recv()
                    except TimeoutError:
                        c.sock.settimeout(10)
                        c.send(hello())
                        r = c.recv()
                else:
                    c.send(hello())
                    r = c.recv()
            except OSError as exc:
                r = {"ok": False, "error": {"code": f"OSError {exc}"}}
            replies.append(r)
        fourth_closed = wait_closed(keep[3].sock, 3) is not None
        return {"codes": [code(r) for r in replies], "fourth_closed": fourth_closed}

    with held_as_uid(NOBODY, tenant) as got:
        assert got.get("codes") == [None, None, None, "LIMIT_EXCEEDED"], got
        assert got["fourth_closed"], got
        # while nobody holds its 3, root still gets in (twice: root's own count is separate)
        a, b = Conn(d.socket), Conn(d.socket)
        assert a.call({"id": 1, "op": "status"})["ok"] and b.call({"id": 1, "op": "status"})["ok"]
        a.close()
        b.close()
    # and once nobody's connections are gone, it may connect again (retried until the daemon
    # has seen them close: a fixed sleep could outrun it on a loaded machine)
    got = as_uid(NOBODY, lambda: {"attempts": connect_until_admitted(d.socket)})
    assert "attempts" in got, got


def test_partial_frames_share_one_budget(start_daemon):
    d = start_daemon(extra_daemon={"max_partial_frame_bytes": 4 * MIB, "max_frame_bytes": 2 * MIB, "frame_read_timeout_s": 30,
                                   "hello_timeout_s": 30})
    pid = d.proc.pid
    base = rss(pid)
    chunk = b"\0" * (2 * MIB - 100)
    conns = []
    try:
        for _i in range(3):
            c = Conn(d.socket)
            c.sock.setblocking(False)
            c.sock.send(HEADER.pack(2 * MIB - 16))
            view = memoryview(chunk)
            t0 = time.monotonic()
            while view and time.monotonic() - t0 < 2:
                try:
                    view = view[c.sock.send(view):]
                except BlockingIOError:
                    time.sleep(0.01)
                except OSError:
                    break
            conns.append(c)
            time.sleep(0.2)  # the daemon takes this half frame in before the next comes (nothing shows it but the close)
        third_closed = wait_closed(conns[2].sock, 3)
        assert third_closed is not None, "a third 2 MiB partial frame was held beyond max_partial_frame_bytes (4 MiB)"
        # more of them, while a well-behaved client keeps asking for status: the daemon's
        # memory stays bounded, and the client is never the one refused or closed
        ok = Conn(d.socket)
        conns.append(ok)
        for i in range(16):
            c = Conn(d.socket, greet=False)
            c.sock.setblocking(False)
            try:
                c.sock.send(HEADER.pack(2 * MIB - 16))
                c.sock.send(chunk)
            except OSError:
                pass
            conns.append(c)
            r = ok.call({"id": 10 + i, "op": "status"})
            assert r is not None and r["ok"], f"a well-behaved connection was dropped for others' partial frames: {r}"
        time.sleep(1.0)  # time for the daemon to read whatever it would hold: RSS shows only what it kept
        growth = rss(pid) - base
        assert growth < 16 * MIB, f"daemon RSS grew {growth / MIB:.0f} MiB holding partial frames"
        fresh = Conn(d.socket)
        conns.append(fresh)
        assert fresh.call({"id": 1, "op": "status"})["ok"]
    finally:
        for c in conns:
            c.close()


def test_partial_frame_budget_is_not_charged_to_innocent_connections(start_daemon, ckpts):
    """The connection that pushes the sum of half-received frames over the budget is the
    one refused, and its half frame leaves the sum before its refusal is sent (up to a
    second to a peer that does not read): no other connection is closed for it meanwhile."""
    d = start_daemon(models={f"m{i:02d}": ckpts["tiny"] for i in range(24)},
                     extra_daemon={"max_partial_frame_bytes": 4 * MIB, "max_frame_bytes": 2 * MIB, "hello_timeout_s": 30})
    well = Conn(d.socket)
    holders = []
    try:
        for _ in range(2):  # two partial frames of ~1.9 MiB: 3.8 of the 4 MiB
            h = Conn(d.socket)
            h.sock.setblocking(False)
            h.sock.send(HEADER.pack(2 * MIB - 16))
            view = memoryview(b"\0" * (2 * MIB - 64 * 1024))
            while view:
                try:
                    view = view[h.sock.send(view):]
                except BlockingIOError:
                    time.sleep(0.01)
            holders.append(h)
        time.sleep(0.3)  # the daemon holds both half frames before the well-behaved call (nothing reports them)
        assert well.call({"id": 1, "op": "status"})["ok"]
        # the offender: replies it never reads fill its socket, so its refusal cannot be sent at once
        off = Conn(d.socket)
        holders.append(off)
        off.sock.sendall(b"".join(encode_frame({"id": 100 + i, "op": "models"}) for i in range(30)))
        time.sleep(0.5)  # its replies fill its socket: the refusal below then cannot be sent at once
        off.sock.setblocking(False)
        try:
            off.sock.send(HEADER.pack(2 * MIB - 16) + b"\0" * (512 * 1024))
        except BlockingIOError:
            pass
        time.sleep(0.05)  # the over-limit half frame is read; the calls below come while its refusal is pending
        for i in range(5):
            r = well.call({"id": 2 + i, "op": "status"})
            assert r is not None and r["ok"], f"a well-behaved connection was closed for another's partial frame: {r}"
            time.sleep(0.05)  # spread over the refusal's second, not all before it
    finally:
        well.close()
        for h in holders:
            h.close()


@pytest.mark.parametrize("case", ["frame too large", "half frames over the uid's share"])
async def test_a_refused_connections_half_frame_goes_before_its_goodbye(tmp_path, ckpts, monkeypatch, case):
    """The goodbye to a peer that does not read may take a second: the half frame it sent
    is dropped, and leaves the count of half frames, before it, not kept in memory that
    no count sees (nor in a count that refuses bystanders) meanwhile."""
    import asyncio
    import socket

    from conftest import daemon_in_process

    from weightcache.protocol import FrameDecoder
    from weightcache.server.connections import Connections

    events: list[tuple[object, ...]] = []
    discard, send_final = FrameDecoder.discard, Connections._send_final

    def recorded_discard(self: FrameDecoder) -> None:
        events.append(("discard", self.pending))
        discard(self)

    async def recorded_send_final(self: Connections, conn, exc) -> None:
        events.append(("goodbye", exc.code, self.bounds.partial_bytes))  # what is still counted as it goes
        await send_final(self, conn, exc)

    monkeypatch.setattr(FrameDecoder, "discard", recorded_discard)
    monkeypatch.setattr(Connections, "_send_final", recorded_send_final)
    if case == "frame too large":  # a header past max_frame_bytes, and bytes after it in the same write
        extra, sent, expected = None, HEADER.pack(2**31) + b"\0" * 4096, [("discard", 4 + 4096), ("goodbye", "FRAME_TOO_LARGE", 0)]
    else:  # a frame within max_frame_bytes, half of it sent: over this uid's share of half frames
        extra, sent = {"max_partial_frame_bytes_per_uid": 4096}, HEADER.pack(2**20) + b"\0" * 8192
        expected = [("discard", 4 + 8192), ("goodbye", "LIMIT_EXCEEDED", 0)]
    async with daemon_in_process(tmp_path, {"tiny": ckpts["tiny"]}, extra_daemon=extra) as daemon:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await asyncio.to_thread(s.connect, daemon.socket_path)
            await asyncio.to_thread(s.sendall, sent)
            deadline = time.monotonic() + 30
            while not any(e[0] == "goodbye" for e in events) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            s.close()
    assert events[:2] == expected, events


@root_only
def test_a_uid_that_floods_the_socket_is_read_at_its_rate_and_no_other_uid_waits(start_daemon):
    """A tenant writing big frames as fast as it could (~200 MB/s of refused 3.5 MB frames
    on the 2-core VM) kept a core of its own busy and much of the daemon's: now each uid's
    connections are read at most at max_read_bytes_per_s_per_uid once they have sent
    max_frame_bytes (connections.py, Note [untrusted peers]), so its writes wait in the kernel.
    Another uid's requests are read meanwhile: its answers come before the flood's last."""
    rate, frame, n = 256 * 1024, 60_000, 16
    d = multi_tenant(start_daemon, extra={"max_frame_bytes": 65536, "max_read_bytes_per_s_per_uid": rate})
    flood = Conn(d.socket, timeout=60)
    done: dict[str, float] = {}

    def send_and_read() -> None:
        for i in range(n):  # each answered (an unknown argument is refused): the daemon read it whole
            flood.send({"id": 100 + i, "op": "status", "pad": "x" * frame})
        for i in range(n):
            assert flood.reply(100 + i) is not None
        done["flood"] = time.monotonic()

    def statuses() -> list[bool]:
        c = Conn(d.socket)
        return [c.call({"id": i, "op": "status"})["ok"] for i in range(1, 11)]

    t0 = time.monotonic()
    sender = threading.Thread(target=send_and_read)
    sender.start()
    try:
        time.sleep(0.3)  # the flood is past its burst and waiting
        r = as_uid(NOBODY, statuses)
        done["other"] = time.monotonic()
    finally:
        sender.join(60)
        flood.close()
    assert r == [True] * 10, r
    # At the rate, the bytes past the burst take (n * frame - 65536) / rate = 3.4 s.
    assert done["flood"] - t0 >= 0.8 * (n * frame - 65536) / rate, done["flood"] - t0
    assert done["other"] < done["flood"], (done["other"] - t0, done["flood"] - t0)
    assert Conn(d.socket).call({"id": 1, "op": "status"})["ok"]
