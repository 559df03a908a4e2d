"""Checkpoint opening, parsing and parallel reading."""

from .checkpoint import ARENA_ALIGN, Checkpoint, TensorInfo, open_checkpoint, parse_checkpoint
from .reader import ArenaWriter, Progress, fingerprint_files, read_checkpoint
from .sources import OpenedSource, SourceFile, adopt_fds, open_source

__all__ = [
    "ARENA_ALIGN", "ArenaWriter", "Checkpoint", "OpenedSource", "Progress", "SourceFile", "TensorInfo", "adopt_fds",
    "fingerprint_files", "open_checkpoint", "open_source", "parse_checkpoint", "read_checkpoint",
]
