"""The client's msgpack codec, in Python: what a fresh engine uses instead of the msgpack
package, whose import was 1.3-1.8 ms of a fresh engine's ~7.8 ms from ``from weightcache
import SyncClient`` to usable tensors (2-core VM, torch imported first). The
daemon keeps the msgpack package, whose C decoder bounds hostile frames (framing.py).

A client's frames are small: hello, attach and detach requests; their replies, whose
one long part, an attach's tensor table, comes as a few binary columns when the client
asks for them (``"table": "columns"``, arena.py's ``column_rows``). Decoding a 200-row
table as rows here took ~1 ms against 0.07 for the C decoder, which is why the columns
exist. What this codec does not do, it refuses: msgpack ext types (the protocol has
none), non-string map keys, values the wire cannot carry.

``packb(obj)`` gives the bytes ``msgpack.packb(obj, use_bin_type=True)`` gives for the
types the protocol uses (tests/test_pymsgpack.py checks both ways on random values),
and ``unpackb(data)`` what ``msgpack.unpackb(data, raw=False, strict_map_key=True)``
does, with the same length limits as framing.decode_payload, checked before building, and
nesting bounded by MAX_DEPTH (msgpack's C decoder allows 1024).
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import BadRequest

_B = struct.Struct(">B")
_H = struct.Struct(">H")
_I = struct.Struct(">I")
_Q = struct.Struct(">Q")
_b = struct.Struct(">b")
_h = struct.Struct(">h")
_i = struct.Struct(">i")
_q = struct.Struct(">q")
_f = struct.Struct(">f")
_d = struct.Struct(">d")
# Containers nested deeper are refused (replies nest ~5 deep). Each level is two Python
# frames: at 256 a caller 500 frames deep met a RecursionError.
MAX_DEPTH = 32


class Packed(bytes):
    """Bytes that already are one complete msgpack object, spliced into a frame as they
    are: the daemon's attach tables (framing.encode_reply), a publish request's table (publish.py
    packs it with the msgpack package: 600,000 rows took 5.8 s here, 0.32 s there)."""


# -- encoding -------------------------------------------------------------------------------
def packb(obj: Any) -> bytes:
    out: list[bytes] = []
    _pack(obj, out.append, 0)
    return b"".join(out)


def _pack_len(n: int, fix: int, fix_max: int, c8: int | None, c16: int, c32: int, put: Any) -> None:
    if n <= fix_max:
        put(bytes((fix | n,)))
    elif c8 is not None and n < 0x100:
        put(bytes((c8, n)))
    elif n < 0x10000:
        put(bytes((c16,)) + _H.pack(n))
    elif n < 0x100000000:
        put(bytes((c32,)) + _I.pack(n))
    else:
        raise ValueError(f"a msgpack container or string holds at most 2**32-1 items, not {n}")


def _pack(obj: Any, put: Any, depth: int) -> None:
    if obj is None:
        put(b"\xc0")
    elif type(obj) is Packed:
        put(obj)
    elif obj is True:
        put(b"\xc3")
    elif obj is False:
        put(b"\xc2")
    elif isinstance(obj, int):
        if 0 <= obj < 0x80:
            put(bytes((obj,)))
        elif -32 <= obj < 0:
            put(bytes((obj & 0xFF,)))
        elif obj >= 0:
            if obj < 0x100:
                put(b"\xcc" + _B.pack(obj))
            elif obj < 0x10000:
                put(b"\xcd" + _H.pack(obj))
            elif obj < 0x100000000:
                put(b"\xce" + _I.pack(obj))
            elif obj < 0x10000000000000000:
                put(b"\xcf" + _Q.pack(obj))
            else:
                raise OverflowError(f"integer {obj} does not fit msgpack's 64 bits")
        elif obj >= -0x80:
            put(b"\xd0" + _b.pack(obj))
        elif obj >= -0x8000:
            put(b"\xd1" + _h.pack(obj))
        elif obj >= -0x80000000:
            put(b"\xd2" + _i.pack(obj))
        elif obj >= -0x8000000000000000:
            put(b"\xd3" + _q.pack(obj))
        else:
            raise OverflowError(f"integer {obj} does not fit msgpack's 64 bits")
    elif isinstance(obj, str):
        data = obj.encode()
        _pack_len(len(data), 0xA0, 31, 0xD9, 0xDA, 0xDB, put)
        put(data)
    elif isinstance(obj, float):
        put(b"\xcb" + _d.pack(obj))
    elif isinstance(obj, bytes | bytearray | memoryview):
        data = bytes(obj)
        _pack_len(len(data), 0, -1, 0xC4, 0xC5, 0xC6, put)
        put(data)
    elif depth >= MAX_DEPTH and isinstance(obj, list | tuple | dict):
        raise ValueError("value nested too deep to pack")
    elif isinstance(obj, list | tuple):
        _pack_len(len(obj), 0x90, 15, None, 0xDC, 0xDD, put)
        for item in obj:
            _pack(item, put, depth + 1)
    elif isinstance(obj, dict):
        _pack_len(len(obj), 0x80, 15, None, 0xDE, 0xDF, put)
        for key, value in obj.items():
            if not isinstance(key, str):  # the protocol's maps are keyed by strings (docs/protocol.md)
                raise TypeError(f"a map key must be a str, not {type(key).__name__}")
            _pack(key, put, depth + 1)
            _pack(value, put, depth + 1)
    else:
        raise TypeError(f"cannot pack {type(obj).__name__} into a weightcache frame")


# -- decoding -------------------------------------------------------------------------------
class _Limits:
    __slots__ = ("array", "bin", "map", "str")

    def __init__(self, max_map_len: int, max_array_len: int, max_str_len: int, max_bin_len: int) -> None:
        self.map, self.array, self.str, self.bin = max_map_len, max_array_len, max_str_len, max_bin_len


def unpackb(data: bytes, *, max_map_len: int, max_array_len: int, max_str_len: int, max_bin_len: int) -> Any:
    """One msgpack object that is the whole of ``data``. Raises ValueError for anything
    else: truncated or trailing bytes, ext types, reserved bytes, a container or string
    longer than its limit (checked before it is built), non-string map keys, nesting
    deeper than MAX_DEPTH."""
    limits = _Limits(max_map_len, max_array_len, max_str_len, max_bin_len)
    try:
        obj, end = _unpack(data, 0, limits, 0)
    except (IndexError, struct.error):
        raise ValueError("truncated msgpack data") from None
    except RecursionError:  # only a caller already near Python's recursion limit meets it
        raise ValueError("msgpack data nested too deep for this caller's stack") from None
    except UnicodeDecodeError:
        raise ValueError("a msgpack string is not valid UTF-8") from None
    if end != len(data):
        raise ValueError(f"{len(data) - end} bytes after the msgpack object")
    return obj


def _checked_len(n: int, limit: int, what: str, data: bytes, i: int, item_bytes: int) -> int:
    if n > limit:
        raise ValueError(f"{what} of {n} exceeds the limit of {limit}")
    if n * item_bytes > len(data) - i:  # announced more than the frame holds: refuse before building
        raise ValueError("truncated msgpack data")
    return n


def _str(data: bytes, i: int, n: int, limits: _Limits) -> tuple[str, int]:
    end = i + _checked_len(n, limits.str, "a str", data, i, 1)
    return data[i:end].decode(), end


def _bin(data: bytes, i: int, n: int, limits: _Limits) -> tuple[bytes, int]:
    end = i + _checked_len(n, limits.bin, "a bin", data, i, 1)
    return data[i:end], end


def _unpack(data: bytes, i: int, limits: _Limits, depth: int) -> tuple[Any, int]:
    t = data[i]
    i += 1
    if t < 0x80:
        return t, i
    if t >= 0xE0:
        return t - 0x100, i
    if t >= 0xA0 and t < 0xC0:
        return _str(data, i, t & 0x1F, limits)
    if t < 0x90:
        return _map(data, i, t & 0x0F, limits, depth)
    if t < 0xA0:
        return _array(data, i, t & 0x0F, limits, depth)
    if t == 0xC0:
        return None, i
    if t == 0xC2:
        return False, i
    if t == 0xC3:
        return True, i
    if t == 0xCC:
        return data[i], i + 1
    if t == 0xCD:
        return _H.unpack_from(data, i)[0], i + 2
    if t == 0xCE:
        return _I.unpack_from(data, i)[0], i + 4
    if t == 0xCF:
        return _Q.unpack_from(data, i)[0], i + 8
    if t == 0xD0:
        return _b.unpack_from(data, i)[0], i + 1
    if t == 0xD1:
        return _h.unpack_from(data, i)[0], i + 2
    if t == 0xD2:
        return _i.unpack_from(data, i)[0], i + 4
    if t == 0xD3:
        return _q.unpack_from(data, i)[0], i + 8
    if t == 0xCA:
        return _f.unpack_from(data, i)[0], i + 4
    if t == 0xCB:
        return _d.unpack_from(data, i)[0], i + 8
    if t == 0xD9:
        return _str(data, i + 1, data[i], limits)
    if t == 0xDA:
        return _str(data, i + 2, _H.unpack_from(data, i)[0], limits)
    if t == 0xDB:
        return _str(data, i + 4, _I.unpack_from(data, i)[0], limits)
    if t == 0xC4:
        return _bin(data, i + 1, data[i], limits)
    if t == 0xC5:
        return _bin(data, i + 2, _H.unpack_from(data, i)[0], limits)
    if t == 0xC6:
        return _bin(data, i + 4, _I.unpack_from(data, i)[0], limits)
    if t == 0xDC:
        return _array(data, i + 2, _H.unpack_from(data, i)[0], limits, depth)
    if t == 0xDD:
        return _array(data, i + 4, _I.unpack_from(data, i)[0], limits, depth)
    if t == 0xDE:
        return _map(data, i + 2, _H.unpack_from(data, i)[0], limits, depth)
    if t == 0xDF:
        return _map(data, i + 4, _I.unpack_from(data, i)[0], limits, depth)
    raise ValueError(f"msgpack type byte 0x{t:02x} is not used by the weightcache protocol")


def _array(data: bytes, i: int, n: int, limits: _Limits, depth: int) -> tuple[list[Any], int]:
    _checked_len(n, limits.array, "an array", data, i, 1)
    if depth >= MAX_DEPTH:
        raise ValueError("msgpack data nested too deep")
    out: list[Any] = []
    append = out.append
    for _ in range(n):
        value, i = _unpack(data, i, limits, depth + 1)
        append(value)
    return out, i


def _map(data: bytes, i: int, n: int, limits: _Limits, depth: int) -> tuple[dict[str | bytes, Any], int]:
    _checked_len(n, limits.map, "a map", data, i, 2)
    if depth >= MAX_DEPTH:
        raise ValueError("msgpack data nested too deep")
    out: dict[str | bytes, Any] = {}
    for _ in range(n):
        key, i = _unpack(data, i, limits, depth + 1)
        if type(key) is not str and type(key) is not bytes:
            raise ValueError(f"a map key must be a str, not {type(key).__name__}")
        out[key], i = _unpack(data, i, limits, depth + 1)
    return out, i


def decode_reply(payload: bytes, max_len: int) -> dict[str, Any]:
    """One reply frame's payload -> its map; BadRequest for anything else, as
    framing.decode_payload says for the daemon's side."""
    try:
        obj = unpackb(payload, max_map_len=max_len, max_array_len=max_len, max_str_len=max_len, max_bin_len=max_len)
    except ValueError as exc:
        raise BadRequest(f"frame payload is not valid msgpack or exceeds a limit: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"frame payload must be a msgpack map, got {type(obj).__name__}")
    return obj
