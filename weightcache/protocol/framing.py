"""The daemon's side of framing: msgpack maps in and out of frames (frames.py cuts the
stream into frames), with the msgpack package, whose C decoder checks each container's
length before building it. The client encodes and decodes its frames with pymsgpack.py
instead, so that a fresh engine does not import msgpack.
"""

from __future__ import annotations

import gc
from typing import Any

import msgpack

from ..errors import BadRequest
from .frames import DEFAULT_MAX_FRAME, HEADER, FrameDecoder

__all__ = ["DEFAULT_MAX_FRAME", "HEADER", "MAX_ARRAY_LEN", "MAX_MAP_LEN", "FrameDecoder", "decode_payload", "encode_frame"]


def encode_frame(message: dict[str, Any]) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


# Structural limits for decode_payload. msgpack checks each container's and string's
# announced length against them before building it, so a frame that announces a huge
# map is refused at once (0.1 ms) instead of being built: a 16 MiB frame holding one
# map of 1.4M keys took ~1.1 s to decode, stalling the daemon's event loop. No request
# map needs more than a handful of keys; long arrays are a publish tensor table's rows.
#
# What the limits do not bound (measured with msgpack 1.2.4, CPython 3.11, on a 2-core
# VM, 3 runs each): they cap each container, not the number of objects, so a 16 MiB
# frame can still nest ~16M one-byte objects in arrays of 1M. The worst allowed shape
# found, 16 arrays of 1M empty arrays, decodes in 2.5-4.1 s (0.8 s with the cyclic GC
# off) plus 0.3 s to free; 1M-long arrays of [nil] 1.8-2.7 s; of {"": nil} 1.5-1.9 s;
# of empty maps 0.8-1.4 s; 64-key maps 0.3-0.4 s; scalars and short strings 0.08-0.17 s.
# A legitimate frame at the limit (a publish table of ~340k rows) takes 0.3-0.4 s.
# Most of the worst cases is the cyclic GC, triggered again and again by millions of new
# containers, so decode_payload pauses it while it builds one frame: then the worst
# shapes measured were 0.82 s (empty arrays), 0.57 s ([nil]), 0.82 s ({"": nil}) and
# 0.29 s (5-int arrays) for 16 MiB, plus up to 0.3 s to free. Past that,
# max_frame_bytes bounds the stall: operators who do not trust their peers can lower it
# (a real publish table is ~100 bytes per tensor).
MAX_MAP_LEN = 64
MAX_ARRAY_LEN = 1 << 20


def decode_payload(payload: bytes, *, max_map_len: int = MAX_MAP_LEN, max_array_len: int = MAX_ARRAY_LEN,
                   max_str_len: int = DEFAULT_MAX_FRAME, max_bin_len: int = DEFAULT_MAX_FRAME) -> dict[str, Any]:
    """One frame's payload -> a map. Raises BadRequest for anything that is not a msgpack
    map with string keys, or that has a map, array, str or bin longer than its limit.

    The defaults suit requests (what the daemon decodes). Replies can be larger (status's
    ``loading`` and health's ``failed_preloads`` have one key per model, an attach's
    tensor table one row per tensor): a client passes limits as large as its frame limit.
    """
    gc_was_on = gc.isenabled()
    gc.disable()  # a frame's objects are all new and acyclic: collecting them mid-build only costs time
    try:
        # strict_map_key rejects non-str/bytes keys: v1 maps are keyed by strings only.
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_map_len=max_map_len,
                              max_array_len=max_array_len, max_str_len=max_str_len, max_bin_len=max_bin_len)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:  # TypeError: unhashable keys
        raise BadRequest(f"frame payload is not valid msgpack or exceeds a limit: {type(exc).__name__}: {exc}") from None
    finally:
        if gc_was_on:
            gc.enable()
    if not isinstance(obj, dict):
        raise BadRequest(f"frame payload must be a msgpack map, got {type(obj).__name__}")
    return obj
