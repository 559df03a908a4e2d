"""The client's no-I/O core (weightcache/client/core.py) and the wire's arena records
(weightcache/protocol/arena.py), driven with bytes and fds by hand: no socket, no daemon."""

from __future__ import annotations

import errno
import os

import msgpack
import pytest
from helpers import is_open

from weightcache.client.core import RETRY_MAX_S, ClientCore, Retry
from weightcache.errors import BadRequest, DaemonUnavailable, FrameTooLarge, UnknownModel
from weightcache.protocol import encode_frame
from weightcache.protocol.arena import SEGMENT, FileArenaDesc, MemfdArenaDesc, TensorRow, VmmArenaDesc, parse_arena, parse_attach


def memfds(n: int) -> list[int]:
    return [os.memfd_create("t", os.MFD_CLOEXEC) for _ in range(n)]


@pytest.fixture
def core() -> ClientCore:
    c = ClientCore("/tmp/nowhere.sock", name="t", wait_for_daemon=0)
    c.start()
    return c


def test_a_reply_fed_byte_by_byte_completes_once_with_the_fds_that_came_first(core):
    fds = memfds(2)
    frame = encode_frame({"id": 1, "ok": True, "fds": 2}) + encode_frame({"event": "shutting_down", "grace_s": 5})
    got = core.receive(frame[:1], fds)  # the fds ride on the first byte
    for i in range(1, len(frame)):
        got += core.receive(frame[i : i + 1], [])
    assert got == [({"id": 1, "ok": True, "fds": 2}, fds)]
    assert list(core.events) == [{"event": "shutting_down", "grace_s": 5}]
    os.close(fds[0]), os.close(fds[1])


def test_the_stream_ending_or_lying_about_fds_is_the_end_of_the_connection(core):
    with pytest.raises(DaemonUnavailable, match="closed the connection"):
        core.receive(b"", [])
    with pytest.raises(DaemonUnavailable, match="naming 1 fds, but 0 arrived"):
        core.receive(encode_frame({"id": 1, "ok": True, "fds": 1}), [])
    small = ClientCore("/tmp/nowhere.sock", max_frame_bytes=16, wait_for_daemon=0)
    small.start()
    with pytest.raises(FrameTooLarge):
        small.receive(encode_frame({"id": 1, "ok": True, "pad": "x" * 32}), [])


def test_fds_of_frames_not_yet_whole_are_closed_when_the_connection_stops(core):
    fds = memfds(1)
    frame = encode_frame({"id": 1, "ok": True, "fds": 1})
    assert core.receive(frame[:3], fds) == []
    err = core.stop(DaemonUnavailable("gone"))
    assert not is_open(fds[0])
    assert core.stop(DaemonUnavailable("client closed")) is err  # the first reason stands
    with pytest.raises(DaemonUnavailable, match="gone"):
        core.request("status", {})


def test_requests_need_a_connection_and_leave_out_none_arguments():
    c = ClientCore("/tmp/nowhere.sock", wait_for_daemon=0)
    with pytest.raises(DaemonUnavailable, match="not connected"):
        c.request("status", {})
    c.start()
    rid, frame = c.request("load", {"name": "m", "device": None}, nfds=2)
    assert msgpack.unpackb(frame[4:]) == {"id": rid, "op": "load", "name": "m", "fds": 2}
    assert c.request("status", {})[0] == rid + 1


def test_unclaimed_replies_give_back_their_lease_or_fail_everyone(core):
    fds = memfds(1)
    assert core.unclaimed({"id": 3, "ok": True, "lease": 9, "tensors": []}, fds) == 9
    assert not is_open(fds[0])
    err = core.unclaimed({"id": None, "ok": False, "error": {"code": "FRAME_TOO_LARGE", "message": "big"}}, [])
    assert isinstance(err, FrameTooLarge)
    assert core.unclaimed({"id": 4, "ok": True, "devices": {}}, []) is None
    with pytest.raises(UnknownModel):
        core.checked({"id": 5, "ok": False, "error": {"code": "UNKNOWN_MODEL", "message": "no"}}, [])


def test_load_timeout_follows_the_daemons_hello(core):
    assert core.load_timeout == 930.0 and core.limit("attach", None) == 930.0 and core.limit("status", None) == 60.0
    core.accept_hello({"id": 1, "ok": True, "request_timeout_s": 5})
    assert core.load_timeout == 35.0 and core.limit("status", float("inf")) is None


def test_the_retry_schedule_backs_off_and_stops_at_the_deadline():
    retry = Retry(1.0, now=0.0)
    refused = OSError(errno.ECONNREFUSED, "refused")
    waits = [retry.after(refused, now=t) for t in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)]
    assert waits == [0.01, 0.02, 0.04, 0.08, 0.16, RETRY_MAX_S]
    assert retry.after(refused, now=0.95) == pytest.approx(0.05)  # cut to the deadline
    # The attempt after the cut wait is the last, even when that wait ended early: a timer
    # that rounds to whole ms ended each sub-ms wait at once, and the client spun, trying
    # 25 times in 1 s (seen beside two busy loops).
    assert retry.after(refused, now=0.9995) is None
    assert retry.after(refused, now=1.0) is None
    assert Retry(10.0, now=0.0).after(OSError(errno.EACCES, "denied"), now=0.0) is None  # never retried


def test_an_attach_reply_is_parsed_into_its_arena_record_and_a_bad_one_closes_its_fds():
    fds = memfds(2)
    reply = {"id": 1, "ok": True, "lease": 4, "fingerprint": "f", "device": "cuda:GPU-1", "source": "files",
             "arena": {"kind": "cuda_vmm", "nbytes": 8, "chunks": [4, 4], "device_uuid": "GPU-1", "writable": True},
             "tensors": [["w", "U8", [8], 0, 8]], "fds": 2}
    got = parse_attach(reply, fds)
    assert isinstance(got.arena, VmmArenaDesc) and got.arena.writable and got.arena.chunks == [4, 4]
    assert (got.lease, got.source, got.waited_s, got.fds) == (4, "files", 0.0, fds)
    with pytest.raises(BadRequest, match="cuda_vmm arena needs 2 fds, 1 arrived"):
        parse_attach(reply, fds[:1])
    assert not is_open(fds[0])
    with pytest.raises(BadRequest, match="unknown arena kind 'ipc'"):
        parse_attach({**reply, "arena": {"kind": "ipc", "nbytes": 8}}, fds[1:])
    assert not is_open(fds[1])


@pytest.mark.parametrize("wire", [
    {"kind": "memfd", "nbytes": 4096},
    {"kind": "file", "nbytes": 8192, "files": [5000, 9000], "segments": SEGMENT.pack(0, 0, 0, 5000) + SEGMENT.pack(1, 0, 5120, 3000)},
    {"kind": "cuda_vmm", "nbytes": 3 << 30, "chunks": [1 << 30, 1 << 30, 1 << 30], "device_uuid": "GPU-6b1d"},
], ids=["memfd", "file", "cuda_vmm"])
def test_each_arena_record_builds_the_bytes_the_protocol_doc_names(wire):
    desc = parse_arena({**wire, "writable": False})
    assert desc.kind == wire["kind"]
    assert encode_frame(desc.to_wire()) == encode_frame(wire)  # same keys, same order: the wire bytes did not change
    assert desc.fd_count == {"memfd": 1, "file": 2, "cuda_vmm": 3}[desc.kind]
    if isinstance(desc, FileArenaDesc):
        assert desc.segment_list() == [(0, 0, 0, 5000), (1, 0, 5120, 3000)]


@pytest.mark.parametrize("bad", [
    {"kind": "memfd", "nbytes": 0}, {"kind": "memfd", "nbytes": 4096, "writable": 1},
    {"kind": "file", "nbytes": 8, "files": [], "segments": b""}, {"kind": "file", "nbytes": 8, "files": [8], "segments": b"x"},
    {"kind": "cuda_vmm", "nbytes": 8, "chunks": ["8"], "device_uuid": "GPU-1"}, {"kind": "cuda_vmm", "nbytes": 8, "chunks": [8]},
    ["memfd", 8],
])
def test_an_arena_that_does_not_hold_together_is_refused(bad):
    with pytest.raises(BadRequest):
        parse_arena(bad)


def test_a_tensor_row_goes_on_the_wire_as_the_array_it_is():
    row = TensorRow("w", "BF16", [2, 3], 256, 12)
    assert msgpack.packb(row) == msgpack.packb(["w", "BF16", [2, 3], 256, 12])
    assert MemfdArenaDesc(4096).to_wire() == {"kind": "memfd", "nbytes": 4096}
