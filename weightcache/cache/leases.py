"""The lease book: every live lease by id and by the connection that holds it, so that a
connection's count and its drop at close cost what it holds, not what all hold. The core
(core.py) decides when a lease may begin and what its end changes; this keeps the books."""

from __future__ import annotations

import itertools

from ..errors import BadRequest
from .entries import Entry, Lease, State


class LeaseBook:
    def __init__(self) -> None:
        self.leases: dict[int, Lease] = {}
        self._by_conn: dict[int, set[int]] = {}  # connection -> its lease ids (O(1) counts and drops)
        # entry -> connection -> its lease ids there, oldest first (ids rise): who holds a model
        # costs the connections holding it, not the leases. A peer pipelining attaches held
        # 4096 leases on one model, and every `models` and `status` that sorted them and
        # described each holder stalled the loop 15-46 ms (python -m benchmarks abuse).
        self._holding: dict[str, dict[int, dict[int, None]]] = {}
        self._ids = itertools.count(1)

    def begin(self, e: Entry, conn: int, since: float) -> Lease:
        lease = Lease(id=next(self._ids), model=e.name, conn=conn, since=since)
        self.leases[lease.id] = lease
        self._by_conn.setdefault(conn, set()).add(lease.id)
        e.leases.add(lease.id)
        self._holding.setdefault(e.name, {}).setdefault(conn, {})[lease.id] = None
        return lease

    def held_by(self, lease_id: int, conn: int) -> Lease:
        """Lease ``lease_id``, if ``conn`` holds it; else BAD_REQUEST."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.conn != conn:
            raise BadRequest(f"no lease {lease_id} held by this connection", lease=lease_id)
        return lease

    def of_conn(self, conn: int) -> list[Lease]:
        """The leases ``conn`` holds, oldest first."""
        return [self.leases[i] for i in sorted(self._by_conn.get(conn, ()))]

    def count(self, conn: int) -> int:
        return len(self._by_conn.get(conn, ()))

    def holders(self, e: Entry) -> list[tuple[int, int, Lease]]:
        """Each connection holding leases on ``e``: (connection, how many, its oldest),
        by their oldest lease."""
        rows = [(conn, len(ids), self.leases[next(iter(ids))]) for conn, ids in self._holding.get(e.name, {}).items()]
        return sorted(rows, key=lambda row: row[2].id)

    def end(self, lease: Lease, e: Entry) -> None:
        del self.leases[lease.id]
        held = self._by_conn[lease.conn]
        held.discard(lease.id)
        if not held:
            del self._by_conn[lease.conn]
        e.leases.discard(lease.id)
        holding = self._holding[e.name]
        ids = holding[lease.conn]
        del ids[lease.id]
        if not ids:
            del holding[lease.conn]
            if not holding:
                del self._holding[e.name]

    def check_invariants(self, entries: dict[str, Entry]) -> None:
        """Note [invariants] 2 (core.py): the attach counts are the live leases, each on a
        RESIDENT entry, each listed under the connection that holds it."""
        for e in entries.values():
            assert all(self.leases[i].model == e.name for i in e.leases)
            assert not e.leases or e.state is State.RESIDENT, e.name
        assert sum(e.attach_count for e in entries.values()) == len(self.leases)
        assert {i for held in self._by_conn.values() for i in held} == set(self.leases)
        assert all(self.leases[i].conn == conn and held for conn, held in self._by_conn.items() for i in held)
        assert {(name, conn, i) for name, h in self._holding.items() for conn, ids in h.items() for i in ids} == \
            {(lease.model, lease.conn, lease.id) for lease in self.leases.values()}
        assert all(list(ids) == sorted(ids) and ids for h in self._holding.values() for ids in h.values())
