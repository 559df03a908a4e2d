"""The client's own msgpack codec (protocol/pymsgpack.py) against the msgpack package: the
same bytes out, the same values in, and the same refusals of what the wire never holds."""

import math
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.errors import BadRequest
from weightcache.protocol.pymsgpack import MAX_DEPTH, Packed, decode_reply, packb, unpackb

BIG = 1 << 30
LIMITS = {"max_map_len": BIG, "max_array_len": BIG, "max_str_len": BIG, "max_bin_len": BIG}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=40), st.binary(max_size=80))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=8),
                                                        st.dictionaries(st.text(max_size=10), inner, max_size=8)),
                      max_leaves=60)


@settings(deadline=None)  # a loaded CI machine stretches an example past the 200 ms default
@given(values)
def test_packs_the_bytes_msgpack_packs_and_reads_them_back(value):
    theirs = msgpack.packb(value, use_bin_type=True)
    assert packb(value) == theirs
    assert unpackb(theirs, **LIMITS) == msgpack.unpackb(theirs, raw=False, strict_map_key=True)


@pytest.mark.parametrize("n", [0, 15, 16, 31, 32, 255, 256, 65535, 65536])
def test_every_length_form_of_str_bin_array_and_map(n):
    # The boundaries where msgpack moves from the fix form to 8, 16 and 32-bit lengths.
    for value in ("x" * n, b"\x01" * n, [1] * n, {f"k{i}": i for i in range(n)}):
        theirs = msgpack.packb(value, use_bin_type=True)
        assert packb(value) == theirs
        assert unpackb(theirs, **LIMITS) == value


@pytest.mark.parametrize("n", [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
                               -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)])
def test_every_integer_form(n):
    theirs = msgpack.packb(n)
    assert packb(n) == theirs and unpackb(theirs, **LIMITS) == n


def test_float32_and_tuples_and_packed_values():
    assert unpackb(b"\xca" + struct.pack(">f", 1.5), **LIMITS) == 1.5
    assert packb((1, "a")) == msgpack.packb([1, "a"])
    table = msgpack.packb([["w", "F32", [4], 0, 16]], use_bin_type=True)
    assert packb({"op": "publish", "tensors": Packed(table)}) == msgpack.packb(
        {"op": "publish", "tensors": [["w", "F32", [4], 0, 16]]}, use_bin_type=True)


@pytest.mark.parametrize("value, error", [(2**64, OverflowError), (-(2**63) - 1, OverflowError), (object(), TypeError),
                                          ({1.5: 1}, TypeError), (math.nan, None)])
def test_what_the_wire_cannot_carry_is_refused(value, error):
    if error is None:  # nan is a float64 like any other: packed as msgpack packs it
        assert packb(value) == msgpack.packb(value)
        return
    with pytest.raises(error):
        packb(value)


@pytest.mark.parametrize("data, reason", [
    (b"", "truncated"),
    (b"\x92\x01", "truncated"),  # an array of 2 holding 1
    (b"\xdd\x00\xff\xff\xff", "truncated"),  # announces 16M items: refused before any is built
    (b"\xa3ab", "truncated"),
    (b"\x01\x02", "1 bytes after"),
    (b"\xd4\x01\x00", "0xd4 is not used"),  # fixext 1
    (b"\xc1", "0xc1 is not used"),  # never used by msgpack
    (b"\x81\x01\x02", "must be a str"),  # {1: 2}
    (b"\xa2\xff\xfe", "not valid UTF-8"),
])
def test_malformed_data_is_a_value_error_naming_what(data, reason):
    with pytest.raises(ValueError, match=reason):
        unpackb(data, **LIMITS)


def test_the_limits_are_checked_before_building():
    data = msgpack.packb({"a": [0] * 100, "b": "x" * 100, "c": b"y" * 100})
    unpackb(data, max_map_len=3, max_array_len=100, max_str_len=100, max_bin_len=100)
    for limit in ("max_map_len", "max_array_len", "max_str_len", "max_bin_len"):
        with pytest.raises(ValueError, match="exceeds the limit"):
            unpackb(data, **{**LIMITS, limit: 2})


def test_nesting_past_the_bound_is_refused_not_a_recursion_error():
    unpackb(b"\x91" * (MAX_DEPTH - 1) + b"\x90", **LIMITS)  # MAX_DEPTH arrays, one in the other
    with pytest.raises(ValueError, match="nested too deep"):
        unpackb(b"\x91" * MAX_DEPTH + b"\x90", **LIMITS)
    deep: list = []
    for _ in range(MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ValueError, match="nested too deep"):
        packb(deep)


def test_a_reply_must_be_a_map_and_garbage_is_a_bad_request():
    assert decode_reply(msgpack.packb({"id": 1, "ok": True}), 1 << 20) == {"id": 1, "ok": True}
    with pytest.raises(BadRequest, match="must be a msgpack map, got list"):
        decode_reply(msgpack.packb([1]), 1 << 20)
    with pytest.raises(BadRequest, match="not valid msgpack"):
        decode_reply(b"\x81\xa1a", 1 << 20)
    with pytest.raises(BadRequest, match="exceeds the limit"):
        decode_reply(msgpack.packb({"t": [0] * 10}), 5)


def test_a_caller_deep_in_its_stack_gets_a_value_error_not_a_recursion_error():
    import sys

    data = b"\x91" * (MAX_DEPTH - 1) + b"\x90"
    limit = sys.getrecursionlimit()

    def at_depth(n):
        return at_depth(n - 1) if n else unpackb(data, **LIMITS)

    sys.setrecursionlimit(200)
    try:
        with pytest.raises(ValueError, match="too deep for this caller's stack"):
            at_depth(150)
    finally:
        sys.setrecursionlimit(limit)


def test_str_subclass_keys_pack_as_strings():
    import enum

    class Key(enum.StrEnum):
        A = "a"

    assert packb({Key.A: 1}) == msgpack.packb({"a": 1})
