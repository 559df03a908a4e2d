"""Wire protocol v1: length-prefixed msgpack frames (docs/protocol.md)."""

from .framing import FrameDecoder, decode_payload, encode_frame
from .messages import ADMIN_OPS, OPS, PROTOCOL_VERSION

__all__ = ["ADMIN_OPS", "OPS", "PROTOCOL_VERSION", "FrameDecoder", "decode_payload", "encode_frame"]
