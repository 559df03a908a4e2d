"""The daemon's side of framing: msgpack maps in and out of frames (the package's FrameDecoder cuts the
stream into frames), with the msgpack package, whose C decoder checks each container's
length before building it. The client encodes and decodes its frames with pymsgpack.py
instead, so that a fresh engine does not import msgpack. Replies may carry values
encoded once and spliced into each frame (``encode_reply``, Note [replies with
pre-encoded values]).
"""

from __future__ import annotations

import gc
import struct
from typing import Any

import msgpack

from ..errors import BadRequest
from . import DEFAULT_MAX_FRAME, HEADER, FrameDecoder
from .pymsgpack import Packed

__all__ = ["DEFAULT_MAX_FRAME", "DEFERRED_KEYS", "HEADER", "MAX_ARRAY_LEN", "MAX_DECODED_BYTES", "MAX_MAP_LEN", "MAX_TABLE_LEN",
           "Deferred", "FrameDecoder", "Packed", "PayloadRefused", "decode_payload", "encode_frame", "encode_reply"]


def encode_frame(message: dict[str, Any]) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


# Structural limits for decode_payload. msgpack checks each container's and string's
# announced length against them before building it, so a frame that announces a huge
# map is refused at once (0.1 ms) instead of being built: a 16 MiB frame holding one
# map of 1.4M keys took ~1.1 s to decode, stalling the daemon's event loop. No request
# map needs more than a handful of keys, nor any list but a publish's tensor table more
# than a few hundred entries (access lists are bounded at 256, shards at 256, a VMM
# arena's chunks by the fds a frame may carry).
#
# What the limits do not bound (measured with msgpack 1.2.4, CPython 3.11, on a 2-core
# VM, 3 runs each): they cap each container, not the number of objects, so a 16 MiB
# frame can still nest ~16M one-byte objects in arrays of 1M. The worst allowed shape
# found, 16 arrays of 1M empty arrays, decodes in 2.5-4.1 s (0.8 s with the cyclic GC
# off) plus 0.3 s to free; 1M-long arrays of [nil] 1.8-2.7 s; of {"": nil} 1.5-1.9 s;
# of empty maps 0.8-1.4 s; 64-key maps 0.3-0.4 s; scalars and short strings 0.08-0.17 s.
# A legitimate frame at the limit (a publish table of ~340k rows) takes 0.3-0.4 s.
# Hence Note [deferred values]: the one list allowed to be long is not built on the
# loop at all, and every other list is held to MAX_ARRAY_LEN.
MAX_MAP_LEN = 64
MAX_ARRAY_LEN = 4096
MAX_TABLE_LEN = 1 << 20  # rows of a deferred table (a publish's tensors)
# Bytes of a request decoded on the loop, all values but the deferred ones: ~1M objects
# at most, ~90 ms in the worst shape (1.4 s for 16 MiB of it: 16 arrays of 1M empty
# arrays, GC paused, 2-core VM). A register of 256 shards with long paths is ~100 KB.
MAX_DECODED_BYTES = 1 << 20
DEFERRED_KEYS = frozenset({"tensors"})  # the request values decode_payload leaves as bytes
SMALL_FRAME = 4096  # payloads this short are decoded in one call: < 4096 objects, however shaped
DECODE_BATCH_BYTES = 256 << 10  # of a deferred list, built per C call: <= 256K objects, ~20 ms at worst
_STR_TYPES = frozenset([*range(0xA0, 0xC0), 0xD9, 0xDA, 0xDB])  # fixstr, str 8/16/32: the first byte of a key


class Deferred:
    """Note [deferred values]
    ----------------------
    A request value left as its msgpack bytes, to be decoded where it is used: in the
    io pool, never on the event loop. A publish's tensor table is the one list a request
    may make long (a row per tensor, up to MAX_TABLE_LEN), and building it is the cost:
    ~0.3 s of held GIL for a 17.6 MiB table of 340k rows, in one C call that lets no
    other connection in (the same stall as ``abuse``'s ``biglist``, a publish listing
    700,000 groups, which set another tenant's attach p99 with every abuser at once:
    4.7x on the 2-core VM; such lists are now refused from their size). Skipping it to find where it ends costs 18.5 ms
    for that frame, and 41 ms for the worst shape of 16 MiB (16M empty arrays), whose
    building took 1.4 s. Every other value is decoded on the loop only within
    MAX_DECODED_BYTES. ``decode_list`` builds the list DECODE_BATCH_BYTES of rows per C
    call (skipping row by row to find the batch's end: 56 ms for 340k rows), so the io
    pool's thread gives the loop its turns in between, whatever the rows hold."""

    __slots__ = ("data", "key")

    def __init__(self, key: str, data: bytes | memoryview) -> None:
        self.key, self.data = key, data

    def __repr__(self) -> str:
        return f"Deferred({self.key!r}, {len(self.data)} bytes)"

    def decode_list(self, *, max_len: int = MAX_TABLE_LEN, max_str_len: int = DEFAULT_MAX_FRAME) -> list[Any]:
        """The value as a list, or BadRequest naming the key if it is not one (or not
        valid msgpack, or over the limits: ``max_len`` for it and every list inside)."""
        data = self.data
        limits = {"max_map_len": MAX_MAP_LEN, "max_array_len": max_len, "max_str_len": max_str_len, "max_bin_len": max_str_len}
        up = _unpacker(data, **limits)
        try:
            n = up.read_array_header()
            if n > max_len:
                raise ValueError(f"{n} exceeds max_array_len({max_len})")
            rows: list[Any] = []
            while len(rows) < n:
                start = end = up.tell()
                k = 0
                while len(rows) + k < n and end - start < DECODE_BATCH_BYTES:
                    up.skip()
                    k += 1
                    at, end = end, up.tell()
                    if end - at > DECODE_BATCH_BYTES:  # no real row comes near (a name is <= 1024 characters)
                        raise ValueError(f"row {len(rows) + k - 1} takes {end - at} bytes (at most {DECODE_BATCH_BYTES})")
                # the batch's rows as one array: an array 32 header, then their bytes
                rows.extend(_build(b"\xdd" + k.to_bytes(4, "big") + data[start:end], limits))
            if up.tell() != len(data):
                raise ValueError("bytes after the list")
        except (msgpack.UnpackException, ValueError, TypeError) as exc:
            raise BadRequest(f"argument {self.key!r} is not a msgpack list within the limits: {type(exc).__name__}: {exc}",
                             argument=self.key) from None
        return rows


class PayloadRefused(BadRequest):
    """decode_payload's refusal; ``request_id`` is the request's id where the map gave it
    before the fault, so that the reply reaches the request that caused it."""

    def __init__(self, message: str, request_id: int | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.request_id = request_id


# str as str, keys strings (or bytes, which decode_payload refuses): the protocol's maps
_OPTIONS: dict[str, Any] = {"raw": False, "strict_map_key": True}


def _unpacker(data: bytes | memoryview, **limits: int) -> msgpack.Unpacker:
    """A streaming decoder over ``data``, to skip values and find where they end."""
    up = msgpack.Unpacker(max_buffer_size=max(len(data), 1), **_OPTIONS, **limits)
    up.feed(data)
    return up


def _build(data: bytes, limits: dict[str, int]) -> Any:
    """``data``, one msgpack object, built in one C call."""
    return msgpack.unpackb(data, **_OPTIONS, **limits)


def decode_payload(payload: bytes, *, max_map_len: int = MAX_MAP_LEN, max_array_len: int = MAX_ARRAY_LEN,
                   max_str_len: int = DEFAULT_MAX_FRAME, max_bin_len: int = DEFAULT_MAX_FRAME,
                   max_decoded_bytes: int = MAX_DECODED_BYTES, deferred: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One frame's payload -> a map. Raises PayloadRefused (a BadRequest) for anything
    that is not a msgpack map with string keys, that has a map, array, str or bin longer
    than its limit, or whose values but the deferred ones take more than
    ``max_decoded_bytes``. Each value is skipped before it is built, so an over-long
    value costs a scan, not its objects. The values of the keys in ``deferred`` are not
    decoded: each becomes a :class:`Deferred` of its bytes (Note [deferred values]; the
    daemon passes DEFERRED_KEYS).

    The defaults suit requests (what the daemon decodes). Replies can be larger (status's
    ``loading`` and health's ``failed_preloads`` have one key per model, an attach's
    tensor table one row per tensor): a client passes limits as large as its frame limit.
    """
    if not payload or not (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF)):  # fixmap, map 16, map 32
        raise PayloadRefused("frame payload must be a msgpack map")
    limits = {"max_map_len": max_map_len, "max_array_len": max_array_len, "max_str_len": max_str_len, "max_bin_len": max_bin_len}
    obj: dict[str, Any] = {}
    key: str | None = None
    decoded = 0
    gc_was_on = gc.isenabled()
    gc.disable()  # a frame's objects are all new and acyclic: collecting them mid-build only costs time
    try:
        if len(payload) <= SMALL_FRAME:  # most requests: one C call (1.7 us for an attach; key by key took 15)
            obj = _build(payload, limits)
            if not all(type(k) is str for k in obj):
                raise ValueError("a key that is not a string")
            for k in deferred & obj.keys():
                obj[k] = Deferred(k, msgpack.packb(obj[k], use_bin_type=True))
            return obj
        up = _unpacker(payload, **limits)
        n = up.read_map_header()
        if n > max_map_len:
            raise ValueError(f"{n} exceeds max_map_len({max_map_len})")
        for _ in range(n):
            key = None
            at = up.tell()
            if at < len(payload) and payload[at] not in _STR_TYPES:  # never build a key that is not a string
                raise ValueError("a key that is not a string")
            key = up.unpack()
            start = up.tell()
            up.skip()
            end = up.tell()
            if key in deferred:
                obj[key] = Deferred(key, memoryview(payload)[start:end])  # a view: 17.6 MB not copied
                continue
            decoded += end - start
            if decoded > max_decoded_bytes:
                raise ValueError(f"the request's values take more than {max_decoded_bytes} bytes "
                                 f"(only {', '.join(sorted(deferred)) or 'no argument'} may be longer)")
            obj[key] = _build(payload[start:end], limits)
        key = None
        if up.tell() != len(payload):
            raise ValueError("bytes after the map")
    except (msgpack.UnpackException, ValueError, TypeError) as exc:  # TypeError: unhashable keys
        rid = obj.get("id")
        where = f"argument {key!r}" if key is not None else "frame payload"
        raise PayloadRefused(f"{where} is not valid msgpack or exceeds a limit: {type(exc).__name__}: {exc}",
                             request_id=rid if type(rid) is int else None,
                             **({"argument": key} if key is not None else {})) from None
    finally:
        if gc_was_on:
            gc.enable()
    return obj


# Note [replies with pre-encoded values]
# Frames with pre-encoded values spliced in.
#
# An attach reply carries the model's tensor table: a list of [name, dtype, shape, offset,
# nbytes] rows, the same for every attach of a load. Encoding it per reply cost ~2 s of
# event-loop time for a 600,000-row published table, and every reply waiting for a peer
# that does not read held its own copy. The daemon encodes it once per load (``Packed``)
# and ``encode_reply`` splices those bytes into each frame: a msgpack map is its header
# followed by key, value, key, value..., so a value may be any complete msgpack object.


def _map_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x80 | n])
    if n < 1 << 16:
        return b"\xde" + struct.pack(">H", n)
    return b"\xdf" + struct.pack(">I", n)


def encode_reply(message: dict[str, Any]) -> list[bytes]:
    """One frame for ``message``, whose top-level values may be ``Packed``, as parts to
    send back to back (``protocol.send_with_fds``): the packed values are not copied."""
    parts: list[bytes] = []
    run = [_map_header(len(message))]
    for key, value in message.items():
        run.append(msgpack.packb(key, use_bin_type=True))
        if isinstance(value, Packed):
            parts += [b"".join(run), value]
            run = []
        else:
            run.append(msgpack.packb(value, use_bin_type=True))
    parts.append(b"".join(run))
    return [HEADER.pack(sum(len(p) for p in parts)), *parts]
