"""The frame decoder, fed byte by byte, in random chunks, and with garbage."""

import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.errors import BadRequest, FrameTooLarge
from weightcache.protocol import FrameDecoder, decode_payload, encode_frame
from weightcache.protocol.framing import (
    DEFAULT_MAX_FRAME,
    DEFERRED_KEYS,
    HEADER,
    MAX_ARRAY_LEN,
    MAX_DECODED_BYTES,
    MAX_MAP_LEN,
    SMALL_FRAME,
    Deferred,
    PayloadRefused,
)

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


@settings(deadline=None)  # a loaded CI machine stretches an example past the 200 ms default
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


def test_a_frame_that_completes_is_copied_once():
    """The read that completes a big frame allocates its payload beside the buffer that
    held it, and nothing more of its size: slicing the buffer and then copying the slice
    made two copies per frame, in the daemon of fresh memory, page by page
    (5.4-5.9 ms a 3.5 MB frame fed in 64 KiB reads with two copies, 3.6-4.4 ms with
    one)."""
    payload = bytes(range(256)) * (4 * 2**20 // 256)
    data = HEADER.pack(len(payload)) + payload
    dec = FrameDecoder()
    assert dec.feed(data[:-1]) == []
    tracemalloc.start()
    try:
        frames = dec.feed(data[-1:])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert frames == [payload] and type(frames[0]) is bytes
    assert peak < 2.5 * len(payload), (peak, len(payload))  # the buffer and the payload; three sizes with two copies


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


@settings(deadline=None)  # a loaded CI machine stretches an example past the 200 ms default
@given(st.binary(max_size=200))
def test_decode_payload_never_raises_anything_but_bad_request(data):
    try:
        assert isinstance(decode_payload(data), dict)
    except BadRequest:
        pass


# -- structural limits: a frame at the size limit must not stall whoever decodes it ------


def frame_sized_map(entries: int) -> bytes:
    """A payload of exactly DEFAULT_MAX_FRAME bytes: one map announcing ``entries`` keys,
    the first of them present, then filler (refused at the header, so never reached)."""
    head = b"\xdf" + entries.to_bytes(4, "big") + msgpack.packb("k0") + msgpack.packb(0)
    return head + b"\xc0" * (DEFAULT_MAX_FRAME - len(head))


def test_a_huge_map_at_the_frame_limit_is_refused_as_bad_request():
    # The frame that stalled the daemon for ~1 s: 1.4M keys in 16 MiB. It is a whole,
    # valid-sized frame (not FRAME_TOO_LARGE); decoding must refuse it, not build it.
    payload = frame_sized_map(1_400_000)
    (frame,) = FrameDecoder().feed(HEADER.pack(len(payload)) + payload)
    assert len(frame) == DEFAULT_MAX_FRAME
    with pytest.raises(BadRequest, match=r"1400000 exceeds max_map_len\(64\)"):
        decode_payload(frame)


def test_a_real_map_of_many_distinct_keys_is_refused():
    with pytest.raises(BadRequest, match="max_map_len"):
        decode_payload(msgpack.packb({f"key{i}": i for i in range(100_000)}))


def test_limits_apply_at_every_depth():
    ok_map = {f"k{i}": i for i in range(MAX_MAP_LEN)}
    assert decode_payload(msgpack.packb({"id": 1, "nested": [ok_map]}))["nested"] == [ok_map]
    with pytest.raises(BadRequest, match="max_map_len"):
        decode_payload(msgpack.packb({"id": 1, "nested": [{**ok_map, "one": "more"}]}))
    rows = [[0]] * MAX_ARRAY_LEN
    assert len(decode_payload(msgpack.packb({"shards": rows}))["shards"]) == MAX_ARRAY_LEN
    with pytest.raises(BadRequest, match="max_array_len"):
        decode_payload(msgpack.packb({"shards": [*rows, [0]]}))


# -- Note [deferred values]: a publish's table is not built where the frame is read ------


def publish_request(rows: int, **more):
    table = [[f"layer.{i}.weight", "BF16", [64, 64], i * 8192, 8192] for i in range(rows)]
    return {"id": 7, "op": "publish", "name": "m", "tensors": table, "arena": {"kind": "memfd", "nbytes": 8192 * rows}, **more}


def test_a_deferred_table_is_kept_as_bytes_and_decodes_to_the_same_rows():
    req = publish_request(MAX_ARRAY_LEN * 3 + 5)  # longer than any other list may be
    got = decode_payload(msgpack.packb(req), deferred=DEFERRED_KEYS)
    assert isinstance(got["tensors"], Deferred) and got["arena"] == req["arena"] and got["id"] == 7
    assert got["tensors"].decode_list() == req["tensors"]
    assert decode_payload(msgpack.packb({"tensors": [1]}))["tensors"] == [1]  # deferred only where asked (the daemon's dispatch)


def test_reading_a_frame_does_not_build_its_deferred_table():
    """What the loop does with a big publish is skip its table: memory of about the
    table's bytes (their copy), not its rows as objects (~100 bytes each and more)."""
    payload = msgpack.packb(publish_request(100_000))
    tracemalloc.start()
    try:
        got = decode_payload(payload, deferred=DEFERRED_KEYS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2.5 * len(payload), (peak, len(payload))
    tracemalloc.start()
    try:
        rows = got["tensors"].decode_list()
        _, built = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rows) == 100_000 and built > 10 * len(payload), built  # what the skip saved the loop


@pytest.mark.parametrize("value, why", [
    (msgpack.packb({"a": 1}), "Unexpected type header"),
    (msgpack.packb([[0]] * 3)[:-1], "OutOfData"),
    (msgpack.packb([1, 2]) + msgpack.packb(3), "bytes after the list"),
    (b"\xdd" + (2**32 - 1).to_bytes(4, "big"), "max_array_len"),
    (msgpack.packb([[[0] * 11]]), "max_array_len"),
], ids=["not-a-list", "truncated", "trailing", "announced-4G", "nested-too-long"])
def test_a_deferred_value_that_is_not_a_list_within_the_limits_is_a_bad_request(value, why):
    with pytest.raises(BadRequest, match=f"argument 'tensors' .*{why}") as info:
        Deferred("tensors", value).decode_list(max_len=10)
    assert info.value.details["argument"] == "tensors"


def test_at_most_a_mebibyte_of_a_request_is_built_but_a_deferred_table_may_be_longer():
    """Each value is skipped to its end before it is built: 16 MiB of empty arrays cost a
    scan, not 16M objects (1.4 s of held GIL when built)."""
    shards = [{"path": "/models/" + "p" * 4000, "device": "cpu"}] * 300  # 1.2 MB: no real register is near
    with pytest.raises(PayloadRefused, match="more than 1048576 bytes") as info:
        decode_payload(msgpack.packb({"id": 4, "op": "register", "shards": shards}), deferred=DEFERRED_KEYS)
    assert info.value.request_id == 4 and info.value.details["argument"] == "shards"
    req = publish_request(40_000)  # ~2 MB of rows
    assert len(msgpack.packb(req["tensors"])) > MAX_DECODED_BYTES
    assert decode_payload(msgpack.packb(req), deferred=DEFERRED_KEYS)["tensors"].decode_list() == req["tensors"]
    with pytest.raises(PayloadRefused, match="more than 1048576 bytes"):
        decode_payload(msgpack.packb(req))  # not deferred: counted like any value


def test_a_deferred_row_that_no_table_could_hold_is_refused_before_it_is_built():
    hostile = [["x", "U8", [1], 0, 1], [[[]] * 4000] * 80]  # one row of 320k objects
    with pytest.raises(BadRequest, match="row 1 takes"):
        Deferred("tensors", msgpack.packb(hostile)).decode_list()


@settings(deadline=None)
@given(messages)
def test_short_and_long_frames_decode_alike(msg):
    """Frames of at most SMALL_FRAME bytes are decoded in one call, longer ones key by key:
    the same map either way."""
    long = {**msg, "pad": "p" * SMALL_FRAME}
    assert decode_payload(msgpack.packb(long, use_bin_type=True)) == long
    assert decode_payload(msgpack.packb(msg, use_bin_type=True)) == msg


def test_a_refusal_names_the_argument_and_keeps_the_request_id():
    """Refused at a list's header, before its entries: the reply must still reach the
    request that caused it (the id is read first), and say which argument."""
    payload = msgpack.packb({"id": 12, "op": "publish", "allowed_gids": ["root"] * (MAX_ARRAY_LEN + 1)})
    with pytest.raises(PayloadRefused, match=r"argument 'allowed_gids' .*exceeds max_array_len\(4096\)") as info:
        decode_payload(payload, deferred=DEFERRED_KEYS)
    assert info.value.request_id == 12 and info.value.details["argument"] == "allowed_gids"
    with pytest.raises(PayloadRefused) as info:
        decode_payload(msgpack.packb({"op": "x", "id": 3})[:-1])  # cut inside the id
    assert info.value.request_id is None


def test_an_array_announced_beyond_the_limit_is_refused_before_it_is_read():
    payload = b"\x81\xa1t" + b"\xdd" + (2**32 - 1).to_bytes(4, "big")  # announces 4G items, holds none
    with pytest.raises(BadRequest, match="max_array_len"):
        decode_payload(payload)


def test_str_and_bin_limits_and_larger_limits_for_replies():
    payload = msgpack.packb({"s": "x" * 100, "b": b"y" * 100}, use_bin_type=True)
    assert decode_payload(payload)["s"] == "x" * 100
    with pytest.raises(BadRequest, match="max_str_len"):
        decode_payload(payload, max_str_len=50)
    with pytest.raises(BadRequest, match="max_bin_len"):
        decode_payload(payload, max_bin_len=50)
    # a client decoding replies passes larger limits (status.loading has one key per model)
    many = {"loading": {f"m{i}": {"eta_s": None} for i in range(500)}}
    with pytest.raises(BadRequest):
        decode_payload(msgpack.packb(many))
    assert decode_payload(msgpack.packb(many), max_map_len=1 << 20) == many


def test_close_fds_closes_the_fds_given_and_no_other():
    """It closes runs with os.closerange: a number between two of the given ones that
    was not given must stay open."""
    import os
    import random

    from weightcache.protocol import close_fds

    fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(10)]
    given = [fds[i] for i in (0, 1, 2, 4, 5, 8)]
    random.Random(1).shuffle(given)
    try:
        close_fds(given)
        for fd in fds:
            try:
                os.fstat(fd)
                is_open = True
            except OSError:
                is_open = False
            assert is_open == (fd not in given), (fd, given)
    finally:
        close_fds([fd for fd in fds if fd not in given])
    close_fds([])
