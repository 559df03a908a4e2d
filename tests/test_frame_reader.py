"""A connection's read side without a daemon (server/connections.py: FrameReader, FlowControl):
bytes and a clock in, frames, deadlines and refusals out. The same rules end to end, with
a daemon and real sockets, are in tests/security/ (half frames, slow peers, fds)."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest

from weightcache.errors import BadRequest, FrameTooLarge, RequestTimeout
from weightcache.server.connections import FlowControl, FrameReader


def frame(msg: dict) -> bytes:
    body = msgpack.packb(msg)
    return struct.pack(">I", len(body)) + body


def reader(now: float = 100.0) -> FrameReader:
    return FrameReader(max_frame_bytes=1 << 16, frame_read_timeout_s=5.0, hello_timeout_s=2.0, now=now)


def test_a_frame_split_over_reads_has_a_deadline_from_its_first_byte() -> None:
    r = reader()
    whole = frame({"id": 1, "op": "status"})
    assert r.feed(whole[:3], 0, now=100.5) == []
    assert r.pending == 3 and r.frame_deadline == 105.5
    assert r.timeout(greeted=True, now=101.0) == pytest.approx(4.5)
    assert r.feed(whole[3:7], 0, now=103.0) == []  # more of the same frame: the deadline stays
    assert r.frame_deadline == 105.5
    (got,) = r.feed(whole[7:], 0, now=104.0)
    assert msgpack.unpackb(got) == {"id": 1, "op": "status"}
    assert r.pending == 0 and r.frame_deadline is None and r.timeout(greeted=True, now=104.0) is None


def test_a_read_that_ends_one_frame_and_begins_the_next_restarts_the_deadline() -> None:
    r = reader()
    a, b = frame({"id": 1}), frame({"id": 2})
    r.feed(a[:2], 0, now=100.0)
    frames = r.feed(a[2:] + b[:2], 0, now=104.0)
    assert len(frames) == 1 and r.pending == 2 and r.frame_deadline == 109.0


def test_before_its_hello_a_connection_has_the_hello_deadline() -> None:
    r = reader(now=100.0)
    assert r.timeout(greeted=False, now=101.5) == pytest.approx(0.5)
    assert r.timeout(greeted=False, now=103.0) == 0.0
    assert r.timeout(greeted=True, now=103.0) is None
    err = r.timed_out(now=103.0)
    assert isinstance(err, RequestTimeout) and "no hello within 2s" in err.message


def test_a_frame_past_its_deadline_is_what_the_timeout_says() -> None:
    r = reader()
    r.feed(frame({"id": 1})[:2], 0, now=100.0)
    assert r.timeout(greeted=False, now=101.0) == pytest.approx(1.0)  # the hello's comes first
    assert "frame incomplete 5s after its first byte" in r.timed_out(now=105.0).message


def test_fds_must_come_with_a_frames_first_byte() -> None:
    whole = frame({"id": 1, "op": "register", "fds": 1})
    assert len(reader().feed(whole, 1, now=100.0)) == 1  # with the first byte: taken
    r = reader()
    r.feed(whole[:3], 1, now=100.0)  # a frame begun here: fine
    r2 = reader()
    r2.feed(whole[:3], 0, now=100.0)
    with pytest.raises(BadRequest, match="must come with a frame's first byte"):
        r2.feed(whole[3:], 1, now=100.1)  # the middle of a frame begun before


def test_a_frame_over_the_limit_is_refused_from_its_length() -> None:
    r = reader()
    with pytest.raises(FrameTooLarge):
        r.feed(struct.pack(">I", (1 << 16) + 1) + b"x", 0, now=100.0)


def test_discard_drops_the_half_frame() -> None:
    r = reader()
    r.feed(frame({"id": 1})[:4], 0, now=100.0)
    r.discard()
    assert r.pending == 0


async def test_flow_control_pauses_on_requests_in_flight_and_unread_replies() -> None:
    flow = FlowControl(max_requests=2, max_unsent=100)
    assert flow.reading
    flow.set_in_flight(2)
    assert not flow.reading
    waiter = asyncio.ensure_future(flow.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    flow.set_in_flight(1)
    await asyncio.wait_for(waiter, 1)
    flow.set_unsent(101)  # a reply the peer does not read
    assert not flow.reading
    flow.set_unsent(100)
    assert flow.reading
