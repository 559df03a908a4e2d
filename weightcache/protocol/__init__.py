"""Wire protocol v1: length-prefixed msgpack frames (docs/protocol.md).

A frame is a 4-byte big-endian payload length followed by one msgpack map. The frame
decoder here has no I/O: feed bytes in, get frames out. It never blocks and never reads a
socket, so it is tested byte by byte and with garbage (tests/test_framing.py); the server
and the client drive it from their own sockets. What a payload holds is framing.py's (the
daemon's, msgpack) and pymsgpack.py's (the client's) to encode and decode. The decoder
lives in the package itself, not a module of its own: every user of the protocol imports
the package first, and each module a fresh engine imports costs ~60-75 µs (issue 23).

``encode_frame`` and ``decode_payload`` (the daemon's msgpack codec, framing.py) are
imported when first asked for: the client and ``import weightcache`` import this package,
and a fresh engine should not pay for msgpack (pymsgpack.py says why).
"""

from __future__ import annotations

import struct
from typing import Any

from ..errors import FrameTooLarge
from .messages import ADMIN_OPS, OPS, PROTOCOL_VERSION

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 2**20


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
            end = HEADER.size + n
            # One copy into the payload (a slice of the bytearray, then bytes of it, was two).
            frames.append(bytes(memoryview(self._buf)[HEADER.size : end]))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes held that do not yet make a whole frame (a half-sent frame)."""
        return len(self._buf)

    def discard(self) -> None:
        """Drop the half frame held: the stream is being abandoned."""
        self._buf = bytearray()


def __getattr__(name: str) -> Any:
    if name in ("encode_frame", "decode_payload"):
        from . import framing

        return getattr(framing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADMIN_OPS", "DEFAULT_MAX_FRAME", "HEADER", "OPS", "PROTOCOL_VERSION", "FrameDecoder", "decode_payload",
           "encode_frame"]
