"""One load in flight (flight.py starts and joins it; fill.py checks whether it is still wanted)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...loader import Checkpoint, OpenedSource


@dataclass
class ParsedFiles:
    """The files a load opened and parsed, once, for the sources that read them (a neighbour
    daemon's copy, verified against them; the files themselves)."""

    opened: OpenedSource
    ckpt: Checkpoint
    opening_s: float  # opening (and the parse, unless a kept one served)


@dataclass
class LoadJob:
    """One load in flight: the requests waiting on it, and whether it was given up."""

    name: str
    # where its bytes come from: "files", "host" (a promotion), "peer" (another GPU) or
    # "neighbour" (another daemon, weightcache/peers/), "disk" (a published model read back
    # from the published store, server/store.py)
    source: str = "files"
    waiters: int = 0
    # Set when every waiter went and the load was not worth finishing: the filling
    # threads check it between chunks, the load task between phases.
    abandoned: threading.Event = field(default_factory=threading.Event)
    task: asyncio.Task[str] | None = None
    files: ParsedFiles | None = None  # once a source needed them (flight.py's _parsed_files)
