"""The frame decoder, fed byte by byte, in random chunks, and with garbage."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightcache.errors import BadRequest, FrameTooLarge
from weightcache.protocol import FrameDecoder, decode_payload, encode_frame

messages = st.dictionaries(
    st.text(max_size=8),
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=50), st.booleans(), st.none(),
              st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5)),
    max_size=6,
)


def test_roundtrip_byte_by_byte():
    msgs = [{"id": 1, "op": "hello"}, {"id": 2, "op": "status", "x": b"\x00" * 300}]
    data = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    frames = []
    for i in range(len(data)):
        frames += dec.feed(data[i : i + 1])
    assert [decode_payload(f) for f in frames] == msgs
    assert dec.pending == 0


@given(st.lists(messages, min_size=1, max_size=5), st.lists(st.integers(1, 64), min_size=1, max_size=30))
def test_any_chunking_yields_the_same_frames(msgs, cuts):
    data = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    frames, pos, i = [], 0, 0
    while pos < len(data):
        n = cuts[i % len(cuts)]
        frames += dec.feed(data[pos : pos + n])
        pos, i = pos + n, i + 1
    assert [decode_payload(f) for f in frames] == msgs


def test_half_frame_is_pending_not_yielded():
    data = encode_frame({"id": 1, "op": "status"})
    dec = FrameDecoder()
    assert dec.feed(data[:-1]) == []
    assert dec.pending == len(data) - 1
    assert len(dec.feed(data[-1:])) == 1


def test_oversized_header_is_refused_before_the_payload_arrives():
    dec = FrameDecoder(max_frame=1024)
    with pytest.raises(FrameTooLarge) as info:
        dec.feed((1025).to_bytes(4, "big"))
    assert info.value.details["limit"] == 1024


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"\x92\x01\x02", msgpack.packb([1, 2]), msgpack.packb("op"), msgpack.packb({1: "int key"}),
     msgpack.packb({"a": 1}) + b"trailing", b""],
    ids=["reserved-byte", "array", "list", "str", "int-key", "trailing", "empty"],
)
def test_garbage_payloads_are_bad_requests(payload):
    with pytest.raises(BadRequest):
        decode_payload(payload)


@given(st.binary(max_size=200))
def test_decode_payload_never_raises_anything_but_bad_request(data):
    try:
        assert isinstance(decode_payload(data), dict)
    except BadRequest:
        pass
