"""Framing with no I/O: feed bytes in, get frames out.

A frame is a 4-byte big-endian payload length followed by one msgpack map. The decoder
never blocks and never reads a socket, so it is tested byte by byte and with garbage
(tests/test_framing.py); the server and the client drive it from their own sockets.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from ..errors import BadRequest, FrameTooLarge

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 2**20


def encode_frame(message: dict[str, Any]) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> dict[str, Any]:
    """One frame's payload -> a map. Raises BadRequest for anything that is not a msgpack map."""
    try:
        # strict_map_key rejects non-str/bytes keys: v1 maps are keyed by strings only.
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:  # TypeError: unhashable keys
        raise BadRequest(f"frame payload is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"frame payload must be a msgpack map, got {type(obj).__name__}")
    return obj


class FrameDecoder:
    """Accumulates bytes and yields complete frame payloads.

    ``feed`` raises :class:`FrameTooLarge` as soon as a header announces a payload above
    ``max_frame``; the stream is then out of step and the caller must close it.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames: list[bytes] = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > self.max_frame:
                raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {self.max_frame}", limit=self.max_frame)
            if len(self._buf) < HEADER.size + n:
                break
            frames.append(bytes(self._buf[HEADER.size : HEADER.size + n]))
            del self._buf[: HEADER.size + n]
        return frames

    @property
    def pending(self) -> int:
        """Bytes held that do not yet make a whole frame (a half-sent frame)."""
        return len(self._buf)
