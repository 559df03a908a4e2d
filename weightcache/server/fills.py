"""How a new arena gets its bytes: the four ways a model becomes resident.

``Fill.fill_new_arena`` (server/residency/fill.py) admits, allocates, calls one of these in a
thread, seals and rolls back on failure; what differs between a load from the files, a
promotion from the host tier, a copy from another GPU and a copy of an engine's published
memory is only this step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..backends import Arena, Backend
from ..config import DaemonConfig
from ..loader import Checkpoint, OpenedSource, Progress, read_checkpoint

log = logging.getLogger("weightcache.daemon")


class FillStrategy(Protocol):
    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        """Fill ``arena`` (allocated, unsealed) with ``ckpt``'s bytes; blocking. Returns
        the content fingerprint of what it read, or None where ``ckpt``'s stands (a
        promotion's bytes were hashed when first loaded; a publish names its own)."""


@dataclass(frozen=True)
class ReadFiles:
    """Parallel reads from the files the checkpoint was parsed from (the same fds)."""

    backend: Backend
    settings: DaemonConfig
    files: OpenedSource
    cancelled: Callable[[], bool]
    label: str

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        d = self.settings
        self.backend.bind_files(arena, ckpt, self.files)  # CPU: the page cache itself, where it can be trusted
        return read_checkpoint(
            ckpt, self.files, self.backend.writer(arena, d.load_chunk_bytes), threads=d.load_threads,
            chunk=d.load_chunk_bytes, nice=d.load_nice, progress=progress, cancelled=self.cancelled,
            direct_io=d.load_direct_io, log=lambda msg: log.info("load %s: %s", self.label, msg),
        )


@dataclass(frozen=True)
class Promote:
    """One host-to-device copy from the pinned host tier."""

    backend: Backend
    host: Any  # the backend's host copy

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        self.backend.promote(self.host, arena)
        progress.add(ckpt.data_bytes)
        return None


@dataclass(frozen=True)
class CopyPublished:
    """A copy of the memory an engine published (opened read-only by the backend)."""

    backend: Backend
    source: Any  # what Backend.open_published returned
    nbytes: int

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        self.backend.copy_published(self.source, arena, self.nbytes)
        progress.add(ckpt.data_bytes)
        return None


@dataclass(frozen=True)
class PeerCopy:
    """A device-to-device copy from the same rank's replica resident on another GPU
    (device = "auto" models; NVLink or PCIe P2P), instead of the host tier or the files.
    The bytes are the source's, already fingerprinted: its checkpoint stands."""

    backend: Backend  # the target's
    source_backend: Backend
    source: Arena

    def __call__(self, ckpt: Checkpoint, arena: Arena, progress: Progress) -> str | None:
        self.backend.copy_from_peer(self.source_backend, self.source, arena, min(self.source.nbytes, arena.nbytes))
        progress.add(ckpt.data_bytes)
        return None
