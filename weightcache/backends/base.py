"""The interface every memory backend implements, and the arena record they share.

A backend owns the arenas of one device: it allocates them, gives the loader a writer to
fill them, seals them, exports them as file descriptors for attach, and frees them.
The server picks the backend by the model's device (``cpu`` -> the files' page cache or a
memfd, ``cuda:N`` -> VMM).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..loader.reader import ArenaWriter

if TYPE_CHECKING:
    from ..loader.checkpoint import Checkpoint
    from ..loader.sources import OpenedSource


@dataclass
class Arena:
    device: str
    nbytes: int  # capacity after the backend's rounding (page or VMM granularity)
    label: str  # the model name, for logs and /proc listings


class Room:
    """The bytes a new arena may take on its device while its load's victims are still
    being demoted: it starts at what is free within the budget and grows as each victim
    chunk is copied to the host tier and freed. So a demotion (device to host) and the
    load that needed its room (host to device) overlap on PCIe's two directions, and the
    daemon never holds more than its budget (issue 12: a 3 GiB miss under churn spent
    59 ms demoting its victim before filling anything)."""

    def __init__(self, available: int, timeout_s: float = 120.0) -> None:
        self._available = available
        self._timeout_s = timeout_s
        self._cond = threading.Condition()

    def give(self, nbytes: int) -> None:
        with self._cond:
            self._available += nbytes
            self._cond.notify_all()

    def take(self, nbytes: int) -> None:
        """Block until ``nbytes`` are free, then take them."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._available >= nbytes, self._timeout_s):
                raise TimeoutError(f"the victims' demotions freed too little room for {nbytes} bytes "
                                   f"within {self._timeout_s:g}s")
            self._available -= nbytes


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


class Backend(ABC):
    kind: str  # the export kind named on the wire ("memfd", "cuda_vmm")
    # Capabilities, asked by the daemon instead of comparing kinds:
    # can an arena wait in pinned host memory and come back at copy speed? (The CPU
    # backend cannot: its arenas already are host memory.)
    supports_host_tier = False
    # may a client map an arena read-write? (Sealed memfds cannot be.)
    supports_writable_attach = False

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

    @abstractmethod
    def capacity(self, nbytes: int) -> int:
        """The arena size an allocation of ``nbytes`` really takes."""

    @abstractmethod
    def allocate(self, nbytes: int, label: str) -> Arena: ...

    def allocate_as_room_frees(self, nbytes: int, label: str, room: Room) -> Arena:
        """Allocate while the load's victims are still being freed, taking ``room`` as
        it comes. This default waits for all of it; a backend that can map an arena
        piece by piece (CUDA) starts filling the first pieces meanwhile."""
        room.take(nbytes)
        return self.allocate(nbytes, label)

    def bind_files(self, arena: Arena, ckpt: Checkpoint, files: OpenedSource) -> None:  # noqa: B027  (a hook)
        """Offer a freshly allocated ``arena`` the open files a load will fill it from,
        before ``writer``. A backend that can serve the files' own pages instead of a copy
        (the CPU backend: their page cache, where it can trust them) takes them here; its
        writer then makes those pages resident instead of copying them. By default every
        byte is copied."""

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

    def demote(self, arena: Arena, freed: Callable[[int], None] | None = None) -> HostCopy:
        """Copy the arena into pinned host memory and free it, piece by piece, calling
        ``freed(nbytes)`` as each piece's device memory is released; return the copy (for
        ``promote``). The arena is freed when this returns, whether it succeeded or not."""
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    def promote(self, host: HostCopy, arena: Arena) -> None:
        """Fill a fresh (unsealed) arena from a host copy."""
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    def free_host(self, host: HostCopy) -> None:
        raise RuntimeError(f"{type(self).__name__} has no host tier")  # callers check supports_host_tier

    # -- publish: an engine hands the daemon weights it processed itself ---------------
    @abstractmethod
    def open_published(self, arena: dict[str, Any], fds: list[int]) -> PublishedSource:
        """Map the engine's memory (described as in an attach reply) read-only; the fds
        stay the caller's. Refuse memory the engine could still change (BadRequest)."""

    @abstractmethod
    def copy_published(self, source: PublishedSource, arena: Arena, nbytes: int) -> None:
        """Copy ``nbytes`` from the opened source into the daemon's own (unsealed) arena."""

    @abstractmethod
    def close_published(self, source: PublishedSource) -> None: ...

    def close(self) -> None:  # noqa: B027  (a hook: most backends hold nothing backend-wide)
        """Release backend-wide resources at shutdown."""
