"""Checkpoint parsing and parallel reading."""

from .checkpoint import ARENA_ALIGN, Checkpoint, TensorInfo, open_checkpoint
from .reader import ArenaWriter, Progress, read_checkpoint

__all__ = ["ARENA_ALIGN", "ArenaWriter", "Checkpoint", "Progress", "TensorInfo", "open_checkpoint", "read_checkpoint"]
