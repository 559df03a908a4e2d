"""Frames with pre-encoded values spliced in.

An attach reply carries the model's tensor table: a list of [name, dtype, shape, offset,
nbytes] rows, the same for every attach of a load. Encoding it per reply cost ~2 s of
event-loop time for a 600,000-row published table, and every reply waiting for a peer
that does not read held its own copy. The daemon encodes it once per load (``Packed``)
and ``encode_reply`` splices those bytes into each frame: a msgpack map is its header
followed by key, value, key, value..., so a value may be any complete msgpack object.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from . import HEADER
from .pymsgpack import Packed


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
