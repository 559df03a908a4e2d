"""The cache core's records: an entry's states, the moves between them (``MOVES``) and its
fields, a device's account, a lease, and the plans the core hands the server
(``StepDown``, ``LoadPlan``). Data only."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ..errors import InternalError
from .names import own_arena


class State(StrEnum):
    REGISTERED = "registered"  # known, never loaded
    LOADING = "loading"  # reservation held, bytes being read into an arena
    RESIDENT = "resident"  # arena filled and sealed; attachable
    HOST = "host"  # demoted: its bytes wait in pinned host memory; a load promotes them
    EVICTED = "evicted"  # was resident, arena freed; a load brings it back


class EntryEvent(StrEnum):
    """What happens to an entry; ``MOVES`` says from which states, and to which."""

    LOAD = "load"  # a load was admitted: bytes reserved, an arena to fill (from its files or host copy)
    LOADED = "loaded"  # the arena is filled and sealed
    JOIN = "join"  # it took a resident sibling's arena (Note [shared arenas] in eviction.py)
    # A load failed; where it leaves the entry depends on what it had (CacheCore.abort_load).
    PROMOTION_FAILED = "promotion_failed"  # its host copy is still there
    RELOAD_FAILED = "reload_failed"  # loaded before: evicted again
    FIRST_LOAD_FAILED = "first_load_failed"  # never filled an arena of its own
    EVICT = "evict"  # its arena is freed, no copy kept (or a sibling keeps the bytes)
    DEMOTE = "demote"  # its arena is freed, its bytes in the host tier (copied, or kept)
    DROP_COPY = "drop_copy"  # the host tier forgot its copy


# Every legal move: state -> event -> new state. ``Entry.move`` is the one way an entry's
# state changes, and anything not listed here is a bug in the core (``IllegalMove``).
# docs/architecture.md ("An entry's states") shows the same table.
MOVES: dict[State, dict[EntryEvent, State]] = {
    State.REGISTERED: {EntryEvent.LOAD: State.LOADING, EntryEvent.JOIN: State.RESIDENT},
    State.LOADING: {EntryEvent.LOADED: State.RESIDENT, EntryEvent.PROMOTION_FAILED: State.HOST,
                    EntryEvent.RELOAD_FAILED: State.EVICTED, EntryEvent.FIRST_LOAD_FAILED: State.REGISTERED},
    State.RESIDENT: {EntryEvent.EVICT: State.EVICTED, EntryEvent.DEMOTE: State.HOST},
    State.HOST: {EntryEvent.LOAD: State.LOADING, EntryEvent.DROP_COPY: State.EVICTED},
    State.EVICTED: {EntryEvent.LOAD: State.LOADING, EntryEvent.JOIN: State.RESIDENT},
}


class IllegalMove(InternalError):
    """An entry was asked to make a move ``MOVES`` does not list: the core's bookkeeping
    is wrong. Raised before anything about the entry changes."""


@dataclass
class Entry:
    name: str
    device: str
    pinned: bool = False
    keep_alive: float | None = None  # seconds unused and unattached before eviction (None: never)
    # The model's configured keep_alive. ``keep_alive`` is what applies now: a load or
    # attach that passes keep_alive replaces it until the next one does (set_keep_alive).
    configured_keep_alive: float | None = None
    state: State = State.REGISTERED
    nbytes: int = 0  # arena size; set when a load is admitted
    last_used: float = 0.0
    # GDSF's frequency: attaches since registration, halved on the whole device as its
    # attaches pass AGING_USES_PER_MODEL per model (CacheCore._count_use).
    refs: int = 0
    clock_base: float = 0.0  # the device's GDSF clock L when it was last used (0 under LRU)
    leases: set[int] = field(default_factory=set)
    # bytes held in the host tier: HOST, LOADING while promoting, or RESIDENT having kept the
    # copy it was promoted from (Note [kept host copies])
    host_copy: bool = False
    loads: int = 0  # fills of a device arena, from files or from the host tier
    evictions: int = 0  # times it left its device (demoted or not)
    demotions: int = 0  # of those, into the host tier
    promotions: int = 0  # loads served from the host tier
    # Entries of one share key hold one arena between them (Note [shared arenas]); None: its own.
    share: str | None = None
    # The tenants whose quotas it counts against ("uid:N", "gid:N": quotas.py); () for the
    # operator's configured models, which count against none (Note [quotas]).
    tenants: tuple[str, ...] = ()
    # Requests on their way to use it (CacheCore.hold): its keep_alive waits for them, so a
    # model loaded for an attach is not expired before the attach takes its lease.
    wanted: int = 0

    def move(self, event: EntryEvent) -> State:
        """Apply ``event`` to the entry's state by ``MOVES``; IllegalMove if it lists none."""
        new = MOVES[self.state].get(event)
        if new is None:
            raise IllegalMove(f"model {self.name!r}: no move on {event} from state {self.state}",
                              model=self.name, state=str(self.state), event=str(event))
        self.state = new
        return new

    @property
    def attach_count(self) -> int:
        return len(self.leases)

    @property
    def evictable(self) -> bool:
        return self.state is State.RESIDENT and not self.leases and not self.pinned

    @property
    def expires_at(self) -> float | None:
        """When its keep_alive runs out, by the core's clock; None while it cannot expire
        (not evictable, wanted, or keep_alive never)."""
        if not self.evictable or self.keep_alive is None or self.wanted:
            return None
        return self.last_used + self.keep_alive


@dataclass
class DeviceAccount:
    budget: int
    used: int = 0  # bytes of RESIDENT arenas
    reserved: int = 0  # bytes promised to loads in flight

    @property
    def free(self) -> int:
        return self.budget - self.used - self.reserved


@dataclass(frozen=True)
class Lease:
    id: int
    model: str
    conn: int  # the connection that holds it; closing the connection ends the lease
    since: float = 0.0  # when it began, by the core's clock (`weightcache ps` shows its age)


@dataclass(frozen=True)
class StepDown:
    """Arenas leaving a device, in the order the server must handle them: first free the
    host copies in ``drop_host`` (room in the host tier), then copy each ``demote``
    arena to the host tier and free it, free each ``evict`` arena outright, and free each
    ``release`` arena, whose bytes the host tier holds already (Note [kept host copies])."""

    demote: tuple[str, ...] = ()
    evict: tuple[str, ...] = ()
    drop_host: tuple[str, ...] = ()
    release: tuple[str, ...] = ()

    @property
    def leaving(self) -> tuple[str, ...]:
        """Every model whose device arena this frees (demoted or not)."""
        return self.demote + self.evict + self.release


@dataclass(frozen=True)
class LoadPlan:
    """What the server must do to admit a load: the step down that makes room, then fill
    a new arena, from the host tier if ``promote`` else from the files."""

    name: str
    nbytes: int
    step_down: StepDown
    promote: bool

    @property
    def evict(self) -> tuple[str, ...]:
        """Every model whose device arena this plan frees (demoted or not)."""
        return self.step_down.leaving


def arena_key(e: Entry) -> str:
    """What counts once: the share key (Note [shared arenas] in eviction.py), or the entry itself."""
    return e.share if e.share is not None else own_arena(e.name)
