"""Wire protocol v1: length-prefixed msgpack frames (docs/protocol.md).

``encode_frame`` and ``decode_payload`` (the daemon's msgpack codec, framing.py) are
imported when first asked for: the client and ``import weightcache`` import this package,
and a fresh engine should not pay for msgpack (pymsgpack.py says why).
"""

from typing import Any

from .frames import FrameDecoder
from .messages import ADMIN_OPS, OPS, PROTOCOL_VERSION


def __getattr__(name: str) -> Any:
    if name in ("encode_frame", "decode_payload"):
        from . import framing

        return getattr(framing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADMIN_OPS", "OPS", "PROTOCOL_VERSION", "FrameDecoder", "decode_payload", "encode_frame"]
