"""Checkpoint opening, parsing and parallel reading."""

from ..protocol.arena import ARENA_ALIGN
from .checkpoint import Checkpoint, open_checkpoint, parse_checkpoint
from .reader import ArenaWriter, Progress, fingerprint_files, read_checkpoint
from .sources import OpenedSource, SourceFile, adopt_fds, open_source
from .tensor_table import TensorInfo

__all__ = [
    "ARENA_ALIGN", "ArenaWriter", "Checkpoint", "OpenedSource", "Progress", "SourceFile", "TensorInfo", "adopt_fds",
    "fingerprint_files", "open_checkpoint", "open_source", "parse_checkpoint", "read_checkpoint",
]
