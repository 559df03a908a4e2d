"""The interface every memory backend implements, and the arena record they share.

A backend owns the arenas of one device: it allocates them, gives the loader a writer to
fill them, seals them, exports them as file descriptors for attach, and frees them.
The server picks the backend by the model's device (``cpu`` -> the files' page cache or a
memfd, ``cuda:N`` -> VMM).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..loader.reader import ArenaWriter

if TYPE_CHECKING:
    from ..loader.checkpoint import Checkpoint
    from ..loader.sources import OpenedSource
    from ..protocol.arena import ArenaDesc


@dataclass
class Arena:
    device: str
    nbytes: int  # capacity after the backend's rounding (page or VMM granularity)
    label: str  # the model name, for logs and /proc listings
    room_wait_s: float = 0.0  # time its pieces waited for the device's room (victims' chunks leaving)
    # Why the backend's faster arena was refused for this one ("" if it was not): a CPU
    # model copied into a memfd rather than served from its files' page cache. Shown to
    # operators in `models` (arena_note), since the refusal costs a copy and memory.
    fallback: str = ""

    @property
    def kind(self) -> str:
        """The arena's kind as the attach reply names it (docs/protocol.md): "file",
        "memfd" or "cuda_vmm"; shown in `models` as ``arena``."""
        raise TypeError(f"{type(self).__name__} does not say its kind")


class Room:
    """The bytes of a device's budget that no arena chunk holds: the physical side of the
    core's accounting. Every chunk a backend creates takes its bytes from here first
    (waiting if they are not yet free), and every chunk it releases gives them back. The
    core admits a load as soon as its victims are chosen; their bytes come back here
    chunk by chunk as they are copied to the host tier and freed. So a load fills its
    first chunks while its victims' last ones are still copied out (device to host and
    host to device overlap on PCIe's two directions), and the daemon never holds more
    than its budget, even while an earlier load's victims are still leaving (a
    3 GiB miss under churn spent 59 ms demoting its victim before filling anything; a
    per-load room, started at "need less victims", made a load wait for victim bytes it
    did not need whenever its victims were bigger than its need)."""

    def __init__(self, available: int, timeout_s: float = 120.0) -> None:
        self._available = available
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self.waiting = 0  # takers blocked now: a demotion releases its copied chunks at once only for them

    @property
    def available(self) -> int:
        return self._available

    def give(self, nbytes: int) -> None:
        """Return ``nbytes`` (negative: take them away, as a lowered budget does)."""
        with self._cond:
            self._available += nbytes
            self._cond.notify_all()

    def take(self, nbytes: int) -> float:
        """Block until ``nbytes`` are free, then take them; returns the seconds waited."""
        t0 = time.monotonic()
        with self._cond:
            short = self._available < nbytes
            self.waiting += short
            try:
                ok = self._cond.wait_for(lambda: self._available >= nbytes, self._timeout_s)
            finally:
                self.waiting -= short
            if not ok:
                raise TimeoutError(f"{nbytes} bytes of the device's budget were not freed within {self._timeout_s:g}s "
                                   f"({self._available} free): an arena that left the cache was never released")
            self._available -= nbytes
        return time.monotonic() - t0


@dataclass
class HostCopy:
    """An arena's bytes waiting in the host tier (a backend's own subclass)."""

    nbytes: int


class HostPool(ABC):
    """Pinned host memory shared by every backend with a host tier."""

    @abstractmethod
    def close(self) -> None: ...


@dataclass
class PublishedSource:
    """An engine's published memory, mapped read-only by ``open_published``."""

    nbytes: int


@dataclass
class DmaRegion:
    """Bytes of an arena that a transfer engine (NIXL, weightcache/peers/) may read or
    write directly: ``nbytes`` at ``arena_offset`` of the arena are at ``addr``."""

    arena_offset: int
    addr: int  # in this process (host memory) or on the device (VRAM)
    nbytes: int


@dataclass
class DmaView:
    """An arena as a transfer engine sees it: its regions, in arena order, and what memory
    they are (NIXL's names: "DRAM", "VRAM" with the GPU's ordinal). ``release`` undoes
    what making the view took (a read-only mapping of a sealed memfd); the arena itself
    stays the backend's."""

    regions: list[DmaRegion]
    memory: str
    device_id: int = 0
    release: Callable[[], None] = lambda: None
    # A target's bytes [offset, offset + nbytes) made ready to be written before a read
    # lands there (the CPU backend reserves their pages), called in arena order, ahead of
    # the reads, so that it overlaps them.
    prepare: Callable[[int, int], None] = lambda _offset, _nbytes: None
    # Memory a transfer engine cannot read where it is (a CUDA arena's VMM chunks) is
    # lent through a ring it can (backends/cuda_staging.py): no ``regions`` then, and the
    # peer asks for each piece of the arena to be staged into a slot before reading it.
    staged: StagedRing | None = None
    # What a thread needs current to register or read this memory (a GPU's context).
    context: Callable[[], AbstractContextManager[None]] = nullcontext
    # The file the one region maps from its first byte (a CPU arena's memfd): what a
    # transfer engine in another process maps to fill it (peers/lend_worker.py's fill
    # worker). None where the memory is not a file's.
    fd: int | None = None


@dataclass(frozen=True)
class StagedRing:
    """A lender's ring: ``slots`` x ``slot_bytes`` at ``addr``; ``stage(slot, offset,
    nbytes, done)`` queues a copy of arena bytes into a slot and returns at once;
    ``done(None)`` is called once they are there, ``done(why)`` if they cannot be, from
    any thread, in request order (cuda_staging.py's Note [stages pipelined]). The peer's
    request is checked against ``arena_bytes`` and the ring before (peers/server.py)."""

    addr: int
    slots: int
    slot_bytes: int
    arena_bytes: int
    stage: Callable[[int, int, int, Callable[[str | None], None]], None]


class Landing(Protocol):
    """Where a neighbour's bytes land when the arena itself cannot take a transfer
    engine's writes (``Backend.dma_landing``; backends/cuda_staging.py's is the one):
    reads land in a ring's slots, each slot is copied on into the arena, and the pieces
    are hashed where the bytes are."""

    memory: str
    device_id: int
    ring: Any  # .slots, .slot_bytes, .addr(slot), .base

    def context(self) -> AbstractContextManager[None]: ...
    def wait(self, slot: int) -> None: ...
    def land(self, slot: int, offset: int, nbytes: int) -> None: ...
    def hash_landed(self, pieces: Sequence[tuple[Any, int, int]]) -> None: ...
    def zero(self, gaps: Sequence[tuple[int, int]]) -> None: ...
    def digests(self) -> dict[Any, bytes]: ...
    def close(self) -> None: ...


class Backend(ABC):
    kind: str  # the export kind named on the wire ("memfd", "cuda_vmm")
    # Capabilities, asked by the daemon instead of comparing kinds:
    # can an arena wait in pinned host memory and come back at copy speed? (The CPU
    # backend cannot: its arenas already are host memory.)
    supports_host_tier = False
    # may a client map an arena read-write? (Sealed memfds cannot be.)
    supports_writable_attach = False
    # can a neighbour daemon's transfer engine read its arenas and fill new ones
    # (dma_source, dma_target; weightcache/peers/)?
    supports_dma = False
    # do its arenas take a transfer engine's bytes through a ring (dma_landing) rather
    # than directly (dma_target)? Its lends are then staged too (DmaView.staged).
    dma_through_ring = False
    # does each piece of an arena wait for its bytes in the budget's Room (``grow``), so
    # that an arena may be allocated while evicted victims are still being freed?
    allocates_as_room_frees = False

    @property
    def can_land_dma(self) -> bool:
        """Whether ``dma_landing`` can give a ring now (a GPU's hash kernel runs: a peer's
        bytes are checked where they land)."""
        return False

    def __init__(self, device: str) -> None:
        self.device = device
        # The device's stable name clients send ("GPU-…" for a GPU; None for the CPU):
        # a client's CUDA_VISIBLE_DEVICES may number GPUs differently from the daemon's.
        self.uuid: str | None = None

    def names(self, device: str) -> bool:
        """Whether ``device`` (as a client wrote it) is this backend's device."""
        return device == self.device or (self.uuid is not None and device.lower() == f"cuda:{self.uuid}".lower())

    @abstractmethod
    def total_memory(self) -> int:
        """Bytes of memory the device has; fraction budgets resolve against it."""

    def content_hash(self) -> str:
        """Where loads onto this device hash the content fingerprint (``status`` says):
        "host", or "gpu" (files that cannot change unseen on the GPU, others on the host;
        loader/reader.py, Note [content fingerprint])."""
        return "host"

    def free_memory(self) -> int | None:
        """Bytes free on the device now, whoever holds the rest (other processes count);
        None where the backend cannot tell. Automatic placement reads it (cache/placement.py)."""
        return None

    @abstractmethod
    def capacity(self, nbytes: int) -> int:
        """The arena size an allocation of ``nbytes`` really takes."""

    @abstractmethod
    def allocate(self, nbytes: int, label: str) -> Arena: ...

    def allocate_as_room_frees(self, nbytes: int, label: str) -> Arena:
        """Allocate while the load's victims are still being freed. This default is
        ``allocate``; a backend that maps an arena piece by piece (CUDA) creates each
        piece as the writer reaches it, once its budget's room has the bytes, so the
        first pieces fill while the victims' last ones are still copied out."""
        return self.allocate(nbytes, label)

    def limit(self, budget: int) -> None:  # noqa: B027  (a hook)
        """The device's budget in bytes, at start and at each reload. A backend whose
        arenas can outlive the core's decision to free them (CUDA: a victim's chunks
        leave as its demotion copies them out) gates each new piece on it; the others
        rely on the core's accounting alone."""

    def bind_files(self, arena: Arena, ckpt: Checkpoint, files: OpenedSource) -> None:  # noqa: B027  (a hook)
        """Offer a freshly allocated ``arena`` the open files a load will fill it from,
        before ``writer``. A backend that can serve the files' own pages instead of a copy
        (the CPU backend: their page cache, where it can trust them) takes them here; its
        writer then makes those pages resident instead of copying them. By default every
        byte is copied."""

    def configure_loads(self, depth: int, page_cache_dma: str, chunk_loop: str = "auto") -> None:  # noqa: B027  (a hook)
        """The daemon's ``load_depth``, ``load_page_cache_dma`` and ``load_chunk_loop``, once
        at start; a backend whose writer has no use for them ignores them."""

    def prepare_loads(self, threads: int, chunk_bytes: int) -> None:  # noqa: B027  (a hook)
        """At start, after ``configure_loads``: what a load by ``threads`` threads in chunks
        of ``chunk_bytes`` will need may be made ready now, in the background, rather than
        by the first load. By default nothing."""

    @abstractmethod
    def writer(self, arena: Arena, chunk_bytes: int) -> ArenaWriter:
        """A writer for one load; the loader never hands it more than ``chunk_bytes`` at once."""

    @abstractmethod
    def seal(self, arena: Arena) -> None:
        """Make the filled arena immutable; called once, after the writer finished."""

    @abstractmethod
    def export(self, arena: Arena) -> tuple[list[int], dict[str, Any]]:
        """New fds for one attach (the caller closes them once sent) and the arena
        description clients need to map them (docs/protocol.md, ``arena``)."""

    @abstractmethod
    def free(self, arena: Arena) -> None:
        """Release the daemon's hold. Clients that still map the memory keep it alive
        (memfd and VMM memory are reference counted), so this never pulls pages from
        under an engine."""

    # -- the host tier (where supports_host_tier) ------------------------------------
    def start_host_tier(self, nbytes: int) -> HostPool:
        """Begin pinning the shared host-tier pool (in the background) and return it."""
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    def use_host_pool(self, pool: HostPool) -> None:
        """Demote into ``pool`` (one pool serves every GPU's backend)."""
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    def demote(self, arena: Arena) -> HostCopy:
        """Copy the arena into pinned host memory and free it, piece by piece, each
        piece's device memory released as soon as it is copied; return the copy (for
        ``promote``). The arena is freed when this returns, whether it succeeded or not."""
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    def promote(self, host: HostCopy, arena: Arena) -> None:
        """Fill a fresh (unsealed) arena from a host copy."""
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    def free_host(self, host: HostCopy) -> None:
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    # -- GPU to GPU: a replica of an auto model filled from another device's -------------
    def can_copy_from(self, other: Backend) -> bool:
        """Whether ``copy_from_peer`` may fill this device's arenas from ``other``'s
        directly (peer access between two GPUs); else the host tier or the files do."""
        return False

    def copy_from_peer(self, source_backend: Backend, source: Arena, arena: Arena, nbytes: int) -> None:
        """Copy ``nbytes`` of ``source`` (sealed, on ``source_backend``'s device) into this
        device's fresh, unsealed ``arena``."""
        raise RuntimeError(f"{type(self).__name__} cannot copy from another device")  # callers check can_copy_from

    # -- a neighbour daemon's transfer engine (weightcache/peers/) ----------------------
    def dma_source(self, arena: Arena, slots: int, slot_bytes: int) -> DmaView | None:
        """The sealed ``arena``'s bytes, readable by a transfer engine for as long as the
        view is not released (a peer copies them out), or None where this backend cannot
        offer them. Where they are lent through a ring (``dma_through_ring``), it has
        ``slots`` x ``slot_bytes``."""
        return None

    def dma_files(self, arena: Arena) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, int]]] | None:
        """The sealed host ``arena`` as files another process can map read-only: each
        file as (fd, size), owned by the arena (not to be closed), and each region as
        (file index, offset in the file, arena offset, bytes), in arena order; None
        where its bytes are not in files (a GPU arena). A lend worker maps them instead
        of the daemon registering its own memory (peers/lend_worker.py)."""
        return None

    def dma_target(self, arena: Arena) -> DmaView | None:
        """The fresh, unsealed ``arena``'s memory, writable by a transfer engine until
        ``seal``, or None where this backend cannot offer it (the fill then reads the files)."""
        return None

    def dma_landing(self, arena: Arena, slots: int, slot_bytes: int) -> Landing | None:
        """For a backend whose ``dma_target`` is None: a ring of ``slots`` x ``slot_bytes``
        a transfer engine can write, landed into the fresh ``arena`` and hashed there, or
        None where this backend has none (the fill then reads the files)."""
        return None

    # -- publish: an engine hands the daemon weights it processed itself ---------------
    @abstractmethod
    def open_published(self, arena: ArenaDesc, fds: list[int]) -> PublishedSource:
        """Map the engine's memory read-only, as ``arena`` (the request's map parsed by
        protocol/arena.parse_arena, the record an attach reply is built from) describes
        it (of this backend's ``kind``: the caller checked); the fds stay the caller's.
        Refuse memory the engine could still change (BadRequest)."""

    @abstractmethod
    def copy_published(self, source: PublishedSource, arena: Arena, nbytes: int) -> None:
        """Copy ``nbytes`` from the opened source into the daemon's own (unsealed) arena."""

    @abstractmethod
    def close_published(self, source: PublishedSource) -> None: ...

    # -- the published store: a published arena written to disk (server/store.py) ---------
    def reading(self, arena: Arena) -> AbstractContextManager[Callable[[int, int], memoryview]]:
        """For the sealed ``arena`` of a publish: a function ``read(offset, nbytes)`` giving
        a host view of those bytes, valid until the next call (blocking; the caller holds a
        lease so the arena is not freed meanwhile)."""
        raise RuntimeError(f"{type(self).__name__} cannot read its arenas back")

    def close(self) -> None:  # noqa: B027  (a hook: most backends hold nothing backend-wide)
        """Release backend-wide resources at shutdown."""
