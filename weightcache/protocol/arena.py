"""The arena's layout on the wire, defined once for the daemon that exports arenas and
the client that maps them (docs/protocol.md, "attach"): both ends import it, so the
layout cannot drift between them (issue 26: the segment format was written twice)."""

from __future__ import annotations

import fcntl
import struct

# Every tensor starts ARENA_ALIGN-aligned within its arena: what CUDA kernels and any
# dtype's view need. Checkpoint layouts (loader/checkpoint.py) and published tables
# (client/publish.py, loader/published.py) both follow it.
ARENA_ALIGN = 256

# One segment of a "file" arena: file index, file offset, arena offset, byte count.
SEGMENT = struct.Struct("<4Q")

# A memfd arena (attach replies, publish requests) carries these seals: no writable
# mapping, no resize, no more seal changes.
MEMFD_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
