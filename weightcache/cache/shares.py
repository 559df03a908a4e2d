"""Names that hold one arena between them.

Note [shared arenas]
--------------------
Entries registered with one ``share`` key (the server gives it to names whose checkpoint
is the same files, on the same device and rank, for the same owner) hold one arena
between them. Each keeps its own leases, pin, keep_alive, last use and counters; the
arena is counted once (core.py's Note [invariants], 1) and loaded once: an entry whose
sibling is RESIDENT ``join``s it instead of loading, and ``begin_load`` refuses while a
sibling loads or is resident.
Evicting one name (``evict``, keep_alive) makes that name EVICTED and frees nothing while
a sibling is still RESIDENT; the arena's bytes go with its last resident name. The
policy sees a shared arena as one candidate, only when none of its names is attached or
pinned, ranked as its highest-priority name, and evicts every name on it. A shared
arena is never demoted to the host tier (its names would have to return together).
"""

from __future__ import annotations

from .entries import Entry, State


class Shares:
    """The entries registered with each arena key (``Entry.share``), for the core."""

    def __init__(self, entries: dict[str, Entry]) -> None:
        self._entries = entries  # the core's, by name
        self._names: dict[str, set[str]] = {}  # share key -> the entries registered with it

    def add(self, e: Entry) -> None:
        if e.share is not None:
            self._names.setdefault(e.share, set()).add(e.name)

    def discard(self, e: Entry) -> None:
        if e.share is not None:
            self._names[e.share].discard(e.name)
            if not self._names[e.share]:
                del self._names[e.share]

    def names(self, share: str) -> list[str]:
        """The entries registered with the arena key ``share``."""
        return sorted(self._names.get(share, ()))

    def siblings(self, e: Entry) -> list[Entry]:
        """The other entries that share ``e``'s arena key."""
        if e.share is None:
            return []
        return [self._entries[n] for n in sorted(self._names[e.share]) if n != e.name]

    def sibling_in(self, e: Entry, state: State) -> Entry | None:
        return next((x for x in self.siblings(e) if x.state is state), None)

    def shared(self, e: Entry) -> bool:
        """Whether another name is registered on ``e``'s arena."""
        return e.share is not None and len(self._names[e.share]) > 1

    def keys(self) -> set[str]:
        return set(self._names)
