"""An attach reply read and checked, with no I/O and no torch: the core's other half
(core.py), kept apart so that it and the wire's arena records (protocol/arena.py) are
imported with the attach half, by the first attach or while connecting
(connection.py's ``prefetch_attach``), and not by every control client: importing them
with the client made a fresh engine's import find and load two more modules (this one's
arena records and units.py) and make ~180 more GC-tracked objects (1,607 against 1,424,
counted with the cyclic GC off after ``import torch``; the 2-core VM, issue 23)."""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest
from ..protocol.arena import ArenaDesc, parse_arena
from .core import close_fds


class AttachReply:
    """An attach reply read and checked: the arena as its typed record, its fds (as many
    as the arena needs), the lease, and the tensor table (TensorRow order) to view."""

    __slots__ = ("arena", "device", "fds", "fingerprint", "lease", "source", "tensors", "waited_s")

    def __init__(self, lease: int, fingerprint: str, device: str, arena: ArenaDesc, tensors: list[list[Any]],
                 fds: list[int], source: str, waited_s: float) -> None:
        self.lease = lease
        self.fingerprint = fingerprint
        self.device = device
        self.arena = arena
        self.tensors = tensors
        self.fds = fds  # the caller's to close, or to hand to the mapper that closes them
        # Where the daemon got the bytes: "resident" (a hit), "host", "files" or "peer".
        self.source = source
        self.waited_s = waited_s  # seconds the daemon waited for room that others held


def parse_attach(reply: dict[str, Any], fds: list[int]) -> AttachReply:
    """An attach reply and its fds -> :class:`AttachReply`. Raises BadRequest for a reply
    that does not hold together, closing the fds first: nothing is mapped from it."""
    try:
        arena = parse_arena(reply.get("arena"))
        if len(fds) != arena.fd_count:
            raise BadRequest(f"{arena.kind} arena needs {arena.fd_count} fds, {len(fds)} arrived")
        tensors, lease, fingerprint, device = reply.get("tensors"), reply.get("lease"), reply.get("fingerprint"), reply.get("device")
        if not isinstance(tensors, list) or type(lease) is not int or not isinstance(fingerprint, str) or not isinstance(device, str):
            raise BadRequest("an attach reply needs 'tensors' (a list), 'lease' (an int), 'fingerprint' and 'device' (strings)")
        return AttachReply(lease, fingerprint, device, arena, tensors, fds, str(reply.get("source", "resident")),
                           float(reply.get("waited_s", 0.0)))
    except BaseException:
        close_fds(fds)
        raise
