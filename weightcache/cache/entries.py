"""The cache core's records: an entry's states and fields, a device's account, a lease,
and the plans the core hands the server (``StepDown``, ``LoadPlan``). Data only."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .names import own_arena


class State(StrEnum):
    REGISTERED = "registered"  # known, never loaded
    LOADING = "loading"  # reservation held, bytes being read into an arena
    RESIDENT = "resident"  # arena filled and sealed; attachable
    HOST = "host"  # demoted: its bytes wait in pinned host memory; a load promotes them
    EVICTED = "evicted"  # was resident, arena freed; a load brings it back


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

    @property
    def attach_count(self) -> int:
        return len(self.leases)

    @property
    def evictable(self) -> bool:
        return self.state is State.RESIDENT and not self.leases and not self.pinned


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
