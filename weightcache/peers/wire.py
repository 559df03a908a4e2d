"""The peers' control channel: the daemon's own frames (4-byte big-endian length, one
msgpack map; protocol/framing.py) over TCP, between daemons.

Why a TCP side port and not NIXL's own channel: NIXL's metadata listener exchanges agent
metadata only, and its notifications flow only once both agents hold each other's
metadata, arrive by polling, and have no request/reply pairing nor size limits. A lend
needs a request and its reply, and a lease that ends when the borrower goes: here the
lease lives at most as long as the borrower's TCP connection (as an engine's lease lives
as long as its Unix socket connection; ``done`` and ``timeout_s`` end it sooner), so a
borrower that dies releases what it held, and a lender that dies is seen by the borrower
as EOF within the transfer.

Ops, each a request map with "op" and a reply map with "ok" (and "error": {"code",
"message"} when not ok; codes: PROTOCOL_VERSION, UNKNOWN_OP, BAD_REQUEST, UNKNOWN_MODEL,
BUSY, UNSUPPORTED):

- ``hello`` {"protocol": 2, "daemon": id} -> {"protocol": 2, "daemon": id} (2: GPU lends are
  staged; a daemon of protocol 1 would take their empty regions for a layout that does not fit)
- ``inventory`` -> {"models": [{"fingerprint", "layout", "nbytes", "tier", "device"}]}:
  what the lender would lend now (its operator's models open to every user, resident,
  files unchanged). ``tier``: "gpu" (VMM memory) or "host" (host memory).
- ``lend`` {"fingerprint", "layout"} -> {"metadata": bin, "memory": "DRAM"|"VRAM",
  "device_id": int, "regions": [[arena_offset, addr, nbytes], ...]}: the lender holds a
  lease on the model and keeps the regions registered with NIXL until ``done`` or the
  connection closes. A GPU model's reply has no regions but ``"staged": {"addr",
  "slots", "slot_bytes"}``: a ring of device memory NIXL can read, which the arena is
  copied into piece by piece (backends/cuda_staging.py says why).
- ``stage`` {"seq", "slot", "offset", "nbytes"} -> {"seq"}, on a staged lend: arena bytes
  [offset, offset + nbytes) are in the ring's slot ``slot`` when the reply comes. A
  borrower may send the next ones before the replies: each copy is queued as its request
  arrives, and the replies come in the order asked. A request outside the arena or the
  slot, or a copy that failed, is answered BAD_REQUEST (after the replies before it),
  and ends the lend.
- ``done`` -> {}: the borrower has what it needs; the lease ends.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

__all__ = ["PROTOCOL", "PeerError", "check_reply", "encode_frame", "lend_reply_limit", "recv", "reply_error", "send",
           "split_host_port"]

from ..errors import BadRequest, FrameTooLarge
from ..protocol.framing import HEADER, MAX_ARRAY_LEN, decode_payload, encode_frame

PROTOCOL = 2
# Frame limits, by what a frame may hold (Note [peer frame bounds]).
MAX_REQUEST_FRAME = 4096  # hello, inventory, lend, stage, done, and the replies but inventory's and lend's
MAX_INVENTORY_FRAME = 64 * 2**10  # the lender lists what fits (server.py, Lender.inventory)
MAX_FRAME = 16 * 2**20  # the most a lend's reply may be, whatever it describes
LEND_REPLY_BASE = 64 * 2**10  # NIXL metadata of a lend with few regions (a few KiB) and the reply's own keys
LEND_REPLY_PER_TENSOR = 1024  # a region (~40 bytes) and its part of NIXL's metadata (a descriptor and a remote key)
DECODE_ON_LOOP = 4096  # a payload this short is decoded on the loop: fewer than 4096 objects, however shaped


def lend_reply_limit(tensors: int) -> int:
    """The biggest lend reply a checkpoint of ``tensors`` tensors needs: a file arena is
    lent as one region per contiguous run of tensors, a memfd arena as one, a GPU arena
    as a ring (no regions)."""
    return min(MAX_FRAME, LEND_REPLY_BASE + LEND_REPLY_PER_TENSOR * tensors)


class PeerError(Exception):
    """A peer answered an error, broke the protocol, or went away."""

    def __init__(self, message: str, code: str = "PEER") -> None:
        super().__init__(message)
        self.code = code


async def send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(encode_frame(message))
    await writer.drain()


async def recv(reader: asyncio.StreamReader, max_frame: int = MAX_REQUEST_FRAME,
               max_array_len: int = MAX_ARRAY_LEN) -> dict[str, Any] | None:
    """The next frame's map; None at a clean end of stream (between frames).

    Note [peer frame bounds]
    ------------------------
    The Unix socket's bounds (protocol/framing.py): a frame's announced length is checked
    against ``max_frame`` before any of it is read, so a peer's partial frame holds at
    most that many bytes here; the payload is decoded with the same structural limits
    (maps of MAX_MAP_LEN keys, arrays of ``max_array_len``, strings of 4096 bytes) and,
    beyond DECODE_ON_LOOP bytes, in a thread, never on the event loop. Only a lend's
    reply is allowed past the 64 KiB of an inventory, by as much as the checkpoint it is
    asked for needs (``lend_reply_limit``)."""
    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise PeerError("connection closed inside a frame header") from None
    (n,) = HEADER.unpack(head)
    if n > max_frame:
        raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {max_frame}", limit=max_frame)
    try:
        payload = await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise PeerError("connection closed inside a frame") from None
    decode = functools.partial(decode_payload, max_array_len=max_array_len, max_str_len=4096, max_bin_len=max_frame,
                               max_decoded_bytes=max_frame)
    try:
        if n <= DECODE_ON_LOOP:
            return decode(payload)
        return await asyncio.to_thread(decode, payload)
    except BadRequest as exc:
        raise PeerError(f"malformed frame: {exc.message}") from None


def reply_error(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"code": code, "message": message}}


def check_reply(reply: dict[str, Any] | None, what: str) -> dict[str, Any]:
    if reply is None:
        raise PeerError(f"the peer closed the connection before answering {what}")
    if reply.get("ok") is not True:
        err = reply.get("error")
        if isinstance(err, dict):
            raise PeerError(f"{what}: {err.get('message')!s:.300}", code=str(err.get("code", "PEER"))[:64])
        raise PeerError(f"{what}: the peer's reply is malformed")
    return reply


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
