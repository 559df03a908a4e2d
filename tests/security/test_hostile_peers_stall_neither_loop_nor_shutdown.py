"""SIGTERM while a client never reads, and a frame that is costly to decode: neither
holds the shutdown or the event loop."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import msgpack
import pytest

from weightcache.protocol import encode_frame
from weightcache.protocol.framing import DEFERRED_KEYS, HEADER, PayloadRefused, decode_payload

from ._util import Conn, code


def test_sigterm_with_a_client_that_never_reads(start_daemon, ckpts):
    d = start_daemon(models={f"m{i:02d}": ckpts["tiny"] for i in range(16)}, extra_daemon={"shutdown_grace_s": 2})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket)
    s.sendall(encode_frame({"id": 0, "op": "hello", "protocol": 1, "client": "stuck"}))
    s.setblocking(False)
    batch = encode_frame({"id": 1, "op": "models"}) * 512
    t0 = time.monotonic()
    last_progress = t0
    while time.monotonic() - t0 < 4 and time.monotonic() - last_progress < 1:
        try:
            s.send(batch)
            last_progress = time.monotonic()
        except BlockingIOError:
            time.sleep(0.01)
    try:
        d.proc.send_signal(signal.SIGTERM)
        t1 = time.monotonic()
        while d.proc.poll() is None and time.monotonic() - t1 < 12:
            time.sleep(0.05)
        took = time.monotonic() - t1
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
            raise AssertionError("daemon did not exit within 12 s of SIGTERM (grace 2 s) with a client that never reads")
        assert took < 2 + 4, took
        assert d.proc.returncode == 0, d.proc.returncode
    finally:
        s.close()


def _huge_map() -> bytes:
    n_keys = 1_400_000
    payload = bytearray(msgpack.packb({"id": 1, "op": "status"}))
    payload[0] = 0xDF  # map32 header instead of fixmap: 2 + n_keys entries follow
    payload[1:1] = (2 + n_keys).to_bytes(4, "big")
    payload += b"".join(b"\xa6" + f"{i:06x}".encode() + b"\x00" for i in range(n_keys))  # fixstr(6) key, 0 value
    return bytes(payload)


def _nested_arrays(limit: int) -> bytes:
    # {"id": 1, "op": "status", "x": [[[], [], ...], ...]}: one object per byte, every
    # container under the per-container length limit of 1M, the frame just under ``limit``
    arrays, room = [], limit - 64
    while room > 4096:
        n = min((1 << 20) - 64, room - 8)
        arrays.append(b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
        room -= n + 5
    outer = bytes([0x90 | len(arrays)]) + b"".join(arrays)
    return b"\x83" + msgpack.packb("id") + b"\x01" + msgpack.packb("op") + msgpack.packb("status") + msgpack.packb("x") + outer


def _reference_decode_s(payload: bytes) -> float:
    """How long this process takes, now, to decode ``payload`` as the daemon does (same
    function, same limits): the loop's stall is that decode, on the same loaded cores."""
    t = time.monotonic()
    try:
        decode_payload(payload, deferred=DEFERRED_KEYS)
    except PayloadRefused:
        pass
    return time.monotonic() - t


# msgpack's limits bound each container, not a frame's object count, and its C decoder
# holds the GIL: a frame of nested empty arrays stalls the loop ~50-130 ms per MiB on the
# CI-class VM (docs/reliability.md). max_frame_bytes bounds it: at 2 MiB the stall was
# 0.1-0.3 s, and 0.57 s once on a loaded CI run. A fixed bound fails on a loaded machine,
# so the bound scales with a reference decode of the same payload measured here, around
# the test: it is here to catch a stall of another order (the default 16 MiB frame
# stalled 1.5-2.9 s, ~8x the 2 MiB one), not to time the decoder (docs/reliability.md).
@pytest.mark.parametrize("shape", ["map-1.4M-keys", "nested-arrays-16MiB"])
def test_costly_frame_is_refused_without_stalling_the_loop(start_daemon, shape):
    if shape.startswith("map"):
        d = start_daemon()
        payload = _huge_map()
    else:
        # At the default frame limit: built, this frame stalled the loop 1.5-2.9 s; now it
        # is skipped to its end and refused for its size (Note [deferred values]).
        d = start_daemon()
        payload = _nested_arrays(16 * 2**20 - 64)
    assert len(payload) < 16 * 2**20
    frame = HEADER.pack(len(payload)) + payload

    big = Conn(d.socket, timeout=30)
    probe = Conn(d.socket)
    lat: list[float] = []
    done = threading.Event()
    reply: dict = {}

    def send_big():
        big.sock.sendall(frame)
        reply["r"] = big.recv()  # the refusal may carry id null (the frame could not be decoded)
        reply["t"] = time.monotonic()
        done.set()

    ref = _reference_decode_s(payload)
    try:
        t = threading.Thread(target=send_big)
        t0 = time.monotonic()
        t.start()
        while not done.is_set() and time.monotonic() - t0 < 20:
            s = time.monotonic()
            assert probe.call({"id": 2, "op": "status"})["ok"]
            lat.append(time.monotonic() - s)
            time.sleep(0.02)
        t.join(20)
        assert done.is_set(), "no reply to the huge frame"
        ref = max(ref, _reference_decode_s(payload))  # the load may have changed meanwhile
        bound = max(1.0, 4 * ref + 0.2)
        assert max(lat) < bound, f"status took {max(lat):.2f}s while the daemon decoded the huge frame (bound {bound:.2f}s, ref {ref:.2f}s)"
        # refused by the structural limits: 1.4M keys, or 16 MiB of values (at most 1 MiB is built)
        assert reply["r"] is None or not reply["r"]["ok"], f"a {shape} request was accepted"
        assert reply["r"] is None or code(reply["r"]) in ("BAD_REQUEST", "FRAME_TOO_LARGE", "LIMIT_EXCEEDED"), reply["r"]
        assert reply["t"] - t0 < max(5.0, 20 * ref), (reply["t"] - t0, ref)
        assert probe.call({"id": 3, "op": "status"})["ok"]
    finally:
        big.close()
        probe.close()


def test_a_peer_piling_up_leases_makes_no_reply_longer(start_daemon, ckpts):
    """A peer that pipelines attaches holds a lease per reply (up to
    max_leases_per_connection on each of its connections). `models` and `status` listed
    a holder per lease: with 4096 leases on one model every such request sorted them and
    described each, 15-46 ms on the loop (python -m benchmarks abuse). A row per
    holding connection, with its count, keeps the work and the reply to the connections."""
    d = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"max_leases_per_connection": 1024})
    c = Conn(d.socket)
    try:
        for batch in range(0, 1000, 20):  # within max_requests_per_connection in flight
            for i in range(batch, batch + 20):
                c.send({"id": 10 + i, "op": "attach", "name": "tiny"})
            for i in range(batch, batch + 20):
                assert c.reply(10 + i)["ok"]
            for fd in c.take_fds():
                os.close(fd)
        (tiny,) = c.call({"id": 2, "op": "models"})["models"]
        assert tiny["attach_count"] == 1000 and [h["count"] for h in tiny["leases"]] == [1000], tiny["leases"][:3]
        (resident,) = c.call({"id": 3, "op": "status"})["resident"]
        assert [h["count"] for h in resident["leases"]] == [1000]
    finally:
        c.close()
