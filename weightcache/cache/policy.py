"""Eviction policies: which evictable models leave a device when a load needs room. Pure,
like the core: no I/O, no await; the core asks, the policy answers.

- ``LRU`` (the default): least recently used first, until there is room.
- ``GDSF`` (GreedyDual-Size-Frequency, Cherkasova 1998): lowest priority first, where

      H = L + frequency x cost / size

  ``cost`` is the time it would take to bring the model back from where it would go if
  evicted now (the host tier or its files; ``LoadRates``), ``size`` its arena's bytes,
  ``frequency`` its attaches, aged (``Entry.refs``; at least 1), and ``L`` the device's
  clock: the priority of the last victim, taken by a model each time it is used
  (``Entry.clock_base``). A model not used while others are evicted falls behind the
  rising clock, so what was popular once and no longer is goes in the end.

A policy chooses only what leaves a device. Which host copy the host tier drops to take a
demotion stays least recently used under both (tiers.py, ``HostTier.step_down``), as it always was;
a cost-aware choice there (a dropped copy comes back from its files) is not made yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, get_args

PolicyName = Literal["lru", "gdsf"]
POLICIES: tuple[str, ...] = get_args(PolicyName)
Source = Literal["files", "host"]
SOURCES: tuple[str, ...] = get_args(Source)


class Candidate(Protocol):
    """What a policy reads of an entry (core.Entry; a Protocol so this module need not import the core)."""

    @property
    def name(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def last_used(self) -> float: ...
    @property
    def refs(self) -> int: ...
    @property
    def clock_base(self) -> float: ...


C = TypeVar("C", bound=Candidate)


@dataclass(frozen=True)
class DeviceRates:
    files: float  # bytes/s from the checkpoint's files
    host: float  # bytes/s promoted from the pinned host tier
    overhead_s: float  # fixed cost of one load, whatever its size


# What a load costs before anything was measured on this machine.
# GPU: docs/benchmarks.md, H200 run 7 (9.15 GiB): the loader from the page cache at 31.5 GB/s
# (34.6 GB/s for 3 GiB isolated, 28.8 in issue 12: ~30) and promotion from the host tier at
# 46.7 GB/s (50 for 3 GiB). The fixed cost is the phases of a load that do not grow with its
# size, as the daemon logged them ("where a miss's time goes under churn"): open 1 ms,
# allocate 0.7-1.3, seal 1-2, the attach table 0.3, waiting for freed arenas 2-4: ~5 ms.
# (Issue 12's 60-100 ms per load was the victim's demotion, now overlapped with the fill.)
# Files not in the page cache are read at the disk's rate (1.9 GB/s there): a model whose
# files are cold shows it in its own measurement (``LoadRates.cost``), not in this guess.
GPU_DEFAULTS = DeviceRates(files=30e9, host=47e9, overhead_s=0.005)
# CPU: the memfd loader warm, 2.15 GB/s (weightcache bench on the 2-core VM); fixed
# cost 2-3 ms (allocate + read + seal of 1-256 MiB checkpoints, warm, fitted as a + n/r on
# the 2-core CI-class VM). CPU models have no tier below, so their host rate is never used.
CPU_DEFAULTS = DeviceRates(files=2.15e9, host=2.15e9, overhead_s=0.003)


def defaults_for(device: str) -> DeviceRates:
    return CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS


class LoadRates:
    """How fast each device brings models back, learned from the server's measurements.

    Two things are kept. Per model and source, its last rate: the best predictor of its
    next load from there (same size, same files, which may be cold or on a slow disk), so
    that model's cost is its last measured time, fixed overhead included. Per device and
    source, a smoothed rate for models never measured from there, whose cost is the fixed
    overhead plus their bytes at that rate; only loads taking over twice the overhead teach
    it (with the overhead taken out), so that a small load, whose time is mostly overhead,
    cannot teach an absurd rate.
    """

    # Weight of a new measurement in the smoothed rate: the last few loads dominate, since
    # the page cache and the loads running beside it change within minutes.
    SMOOTHING = 0.25

    def __init__(self) -> None:
        self._smoothed: dict[tuple[str, str], float] = {}  # (device, source) -> bytes/s
        self._last: dict[tuple[str, str], float] = {}  # (model, source) -> bytes/s of its last load

    def observe(self, device: str, name: str, source: str, nbytes: int, seconds: float) -> None:
        if source not in SOURCES:
            raise ValueError(f"load source must be one of {SOURCES}, not {source!r}")
        if nbytes <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return  # no bytes or no time measured: nothing to learn
        self._last[(name, source)] = nbytes / seconds
        overhead = defaults_for(device).overhead_s
        if seconds > 2 * overhead:
            rate = nbytes / (seconds - overhead)
            old = self._smoothed.get((device, source))
            self._smoothed[(device, source)] = rate if old is None else old + self.SMOOTHING * (rate - old)

    def rate(self, device: str, source: str) -> float:
        """Bytes/s for a model never measured from ``source``: smoothed, else the default."""
        default = defaults_for(device)
        return self._smoothed.get((device, source), default.host if source == "host" else default.files)

    def last_rate(self, name: str, source: str) -> float | None:
        return self._last.get((name, source))

    def cost(self, device: str, name: str, source: str, nbytes: int) -> float:
        """Seconds to bring ``nbytes`` of model ``name`` back from ``source``."""
        own = self._last.get((name, source))
        if own is not None:
            return nbytes / own
        return defaults_for(device).overhead_s + nbytes / self.rate(device, source)

    def forget(self, name: str) -> None:
        for source in SOURCES:
            self._last.pop((name, source), None)

    def rename(self, name: str, new: str) -> None:
        self.forget(new)
        for source in SOURCES:
            if (name, source) in self._last:
                self._last[(new, source)] = self._last.pop((name, source))


class EvictionPolicy(Protocol):
    name: str

    def clock(self, device: str) -> float:
        """The value a model takes as ``clock_base`` when used (GDSF's L; 0 for LRU)."""

    def priority(self, e: Candidate) -> float:
        """Lowest is evicted first."""

    def rank(self, e: Candidate) -> tuple[float, ...]:
        """Total order of eviction: priority, then ties broken."""

    def choose(self, candidates: Iterable[C], need: int, count: int = 0) -> list[C] | None:
        """Victims among ``candidates`` (all evictable, one device) freeing at least
        ``need`` bytes, and at least ``count`` of them (the device's max_loaded_models),
        in eviction order; None if all of them would not."""

    def evicted(self, device: str, victims: list[C]) -> None:
        """``victims`` (chosen by ``choose``) are about to leave ``device``."""


class LRU:
    """Least recently used first; exactly the policy weightcache has always had."""

    name = "lru"

    def clock(self, device: str) -> float:
        return 0.0

    def priority(self, e: Candidate) -> float:
        return e.last_used

    def rank(self, e: Candidate) -> tuple[float, ...]:
        return (e.last_used,)

    def choose(self, candidates: Iterable[C], need: int, count: int = 0) -> list[C] | None:
        victims: list[C] = []
        for v in sorted(candidates, key=lambda x: x.last_used):
            if need <= 0 and len(victims) >= count:
                break
            victims.append(v)
            need -= v.nbytes
        return victims if need <= 0 and len(victims) >= count else None

    def evicted(self, device: str, victims: list[C]) -> None:
        pass


class GDSF:
    """GreedyDual-Size-Frequency: H = L + frequency x cost / size (module docstring)."""

    name = "gdsf"

    def __init__(self, rates: LoadRates, comes_back_from: Callable[[Candidate], str]) -> None:
        self.rates = rates
        self._comes_back_from = comes_back_from  # the core's step-down rule: "host" or "files"
        self._clock: dict[str, float] = {}  # device -> L

    def clock(self, device: str) -> float:
        return self._clock.get(device, 0.0)

    def cost(self, e: Candidate) -> float:
        return self.rates.cost(e.device, e.name, self._comes_back_from(e), e.nbytes)

    def priority(self, e: Candidate) -> float:
        # A model loaded but not attached yet (a preload), or whose count aged to 0, counts once.
        return e.clock_base + max(1, e.refs) * self.cost(e) / max(1, e.nbytes)

    def rank(self, e: Candidate) -> tuple[float, ...]:
        # Equal priorities go least recently used first, as GreedyDual's ties are usually broken.
        return (self.priority(e), e.last_used)

    def choose(self, candidates: Iterable[C], need: int, count: int = 0) -> list[C] | None:
        if need <= 0 and count <= 0:
            return []
        victims: list[C] = []
        freed = 0
        for v in sorted(candidates, key=self.rank):
            if freed >= need and len(victims) >= count:
                break
            victims.append(v)
            freed += v.nbytes
        if freed < need or len(victims) < count:
            return None
        # The lowest priorities until there is room may take more than needed (a small model
        # first, then a large one that alone was enough). Spare every victim the others make
        # room without, the most valuable first; the last one taken is always needed.
        # Sparing one must leave enough victims for ``count`` too.
        spared: set[int] = set()
        for v in sorted(victims[:-1], key=self.rank, reverse=True):
            if freed - v.nbytes >= need and len(victims) - len(spared) - 1 >= count:
                spared.add(id(v))
                freed -= v.nbytes
        return [v for v in victims if id(v) not in spared]

    def evicted(self, device: str, victims: list[C]) -> None:
        # L becomes the priority of the last victim; max() keeps the clock from going back
        # when priorities were computed from older rates or before a pin or lease ended.
        if victims:
            self._clock[device] = max(self.clock(device), *(self.priority(v) for v in victims))


def make_policy(name: str, rates: LoadRates, comes_back_from: Callable[[Candidate], str]) -> EvictionPolicy:
    if name == "lru":
        return LRU()
    if name == "gdsf":
        return GDSF(rates, comes_back_from)
    raise ValueError(f"eviction policy must be one of {POLICIES}, not {name!r}")
