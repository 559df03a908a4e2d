"""One arena's record in the registry: what the daemon holds for the bytes the core counts
under one arena key.

Note [one record per arena]
---------------------------
What the daemon holds for an arena's bytes is one ``Resident`` record, keyed as the core
keys the arena (cache/eviction.py's ``arena_key``: the entry's own name, or the share key
of the names that read the same files, Note [shared arenas]); every name's ``Model``
points at its key's record. So two names on one arena see one arena, one checkpoint,
one table and one source, and nothing copies them from name to name. Which names
hold the arena now is the record's ``holders``: a name takes it when its fill ends or
when it joins a sibling, and lets go when it steps down or is unregistered; the arena is
freed by the last one to let go. A host copy is one entry's (the core's host tier counts
a copy per entry: ``host_of``). Names of one arena never keep one (the core never
demotes an arena two names share), except a name demoted before a second name of its
files was registered: when that second name then fills the arena from the files, the
host copy is dropped (residency/fill.py), so that a record never holds two versions
of its bytes (the host copy's checkpoint would be overwritten by the new fill's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends import Arena, HostCopy
from ..loader import Checkpoint


@dataclass(eq=False)
class Resident:
    """One arena's bytes, wherever they are (Note [one record per arena])."""

    key: str  # the core's key of the arena (cache/entries.arena_key)
    arena: Arena | None = None  # while some name holds it on its device
    checkpoint: Checkpoint | None = None  # parsed at load time; identity of what is resident (or on the host tier)
    table: bytes = b""  # the attach reply's tensor table, msgpack-encoded once per load: rows
    columns: bytes = b""  # the same table as columns (tensor_table.wire_columns), for clients that ask
    # Bytes its load was charged beyond the arena for the checkpoint and table (Note [held
    # bytes] in loader/checkpoint.py; a promotion is admitted for the same).
    held: int = 0
    # Where the resident bytes came from (LoadJob.source: "files", "host", "peer" for
    # another GPU, "neighbour" for another daemon; "publish"); shown in ``models``.
    source: str | None = None
    host: HostCopy | None = None  # the backend's host-tier copy (the model HOST, or one kept since its promotion)
    host_of: str | None = None  # the entry whose host copy it is
    holders: set[str] = field(default_factory=set)  # the names that hold ``arena`` now
    # Its bytes were found not to be what its files hold (a neighbour's fill under a pinned
    # fingerprint the files no longer have: residency/pins.py): served only to those
    # attached meanwhile, as a changed file's, then reloaded.
    refuted: bool = False

    def fill(self, name: str, arena: Arena, checkpoint: Checkpoint, tables: tuple[bytes, bytes], held: int,
             source: str) -> None:
        """``name`` filled the arena with ``checkpoint``'s bytes (no other name holds one:
        the core admits no load while a sibling loads or is resident)."""
        self.arena, self.checkpoint, self.held, self.source = arena, checkpoint, held, source
        self.refuted = False
        self.table, self.columns = tables
        self.holders = {name}

    def held_by(self, name: str) -> Arena | None:
        """The arena, if ``name`` holds it (a sibling may hold it while ``name`` is evicted)."""
        return self.arena if name in self.holders else None

    def let_go(self, name: str) -> Arena | None:
        """``name`` no longer holds the arena (it steps down, or is unregistered). Returns
        the arena if it was the last name holding it: the caller frees it."""
        if name not in self.holders:
            return None
        self.holders.discard(name)
        if self.holders:
            return None
        arena, self.arena = self.arena, None
        return arena

    def take_host(self, name: str) -> HostCopy | None:
        """``name``'s host copy, forgotten here (the caller frees it); None if it has none."""
        if self.host is None or self.host_of != name:
            return None
        host, self.host, self.host_of = self.host, None, None
        return host

    def drop_parsed(self) -> None:
        """Forget the parsed checkpoint and table once the arena is gone (evicted, not on
        the host tier): kept, a 100k-tensor header cost ~50 MiB of RSS per model after
        eviction that no budget counted. The next load parses the files again."""
        self.checkpoint, self.table, self.columns, self.held = None, b"", b"", 0

    def rename(self, name: str, new: str, key: str) -> None:
        """A publish's staging entry became the model ``new``: its own arena's key is ``key`` now."""
        self.key = key
        if name in self.holders:
            self.holders = (self.holders - {name}) | {new}
        if self.host_of == name:
            self.host_of = new
