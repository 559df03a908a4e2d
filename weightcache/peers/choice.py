"""Which source fills a load that a peer could serve: the one expected to be faster, from
rates this daemon measured (a fill chosen by measured cost).

A peer is not faster by nature. On the 2-core VM a fill from a neighbour over loopback ran
at 0.83 GB/s (median), the same daemon's cold load from its files at 0.90 and a load from
a warm page cache at ~2 GB/s (docs/benchmarks.md, "Peers"): always asking the peer first
made most loads slower. Across nodes it is the other way round when the files are cold
(storage at 1-2 GB/s, RDMA at tens). So the choice compares:

- the peer's rate: what this daemon measured for its own fills from that peer (the
  fill's own phases, as the loader's rate: allocate, fill, seal, table), smoothed;
- the files' rate for files in the state they are in now: warm (at least half of their
  pages in the page cache, the rule the loader picks O_DIRECT by) or cold, each smoothed
  from this daemon's own loads from files in that state.

A peer never measured is tried (one fill teaches its rate); a peer whose fills fail is
not asked again for a while, doubling with each failure in a row (``backoff_s``): a
failed fill costs its load up to ``stall_s`` (5 s) before the files are read, and a peer
that keeps failing would otherwise charge that to every load. Files never measured in
their state are taken at a default for the device: warm, the cache policy's
(policy.DeviceRates); cold, ``COLD_FILES`` below. The rates drift as the page cache and
the network load change: the smoothing weighs the last few fills most (as
cache/eviction.LoadRates does), and a peer's rate older than ``REMEASURE_S`` counts as
unmeasured, so a peer that lost once is tried again now and then rather than never (a
source that always loses is never measured otherwise).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..cache.eviction import defaults_for
from ..loader import OpenedSource
from ..loader.preads import resident_fraction

WARM_FRACTION = 0.5  # loader/reader.open_for_reading: buffered reads above it, O_DIRECT below
SMOOTHING = 0.25  # a new measurement's weight (cache/eviction.LoadRates.SMOOTHING)
REMEASURE_S = 600.0  # a peer's rate this old is measured again (one fill from it)
# Files not in the page cache, before this daemon has read any cold: the disk's rate. GPU
# hosts: the H200's, 1.9 GB/s (cache/eviction.py's note; O_DIRECT reads there reached 2.26
# in the loader's probe). CPU: the 2-core VM's cold load of 1 GiB, 0.90 GB/s median
# (docs/benchmarks.md, "Peers").
COLD_FILES = {"gpu": 1.9e9, "cpu": 0.9e9}


def files_default(device: str, warm: bool) -> float:
    """Bytes/s assumed for files in that state on ``device`` until measured there."""
    if warm:
        return defaults_for(device).files
    return COLD_FILES["cpu" if device == "cpu" else "gpu"]


def smoothed(old: float | None, rate: float) -> float:
    """``old`` (bytes/s; None: nothing yet) moved towards a new measurement ``rate``."""
    return rate if old is None else old + SMOOTHING * (rate - old)


@dataclass(frozen=True)
class Choice:
    peer: bool  # fill from the peer (else from the files)
    why: str  # one line for the log


BACKOFF_S = 10.0  # after one failed fill; doubled for each further failure in a row
BACKOFF_MAX_S = 600.0


def backoff_s(failed_in_a_row: int) -> float:
    """How long a peer whose last ``failed_in_a_row`` fills failed is left out."""
    return 0.0 if failed_in_a_row <= 0 else min(BACKOFF_MAX_S, BACKOFF_S * 2.0 ** (failed_in_a_row - 1))


def gbps(rate: float) -> str:
    return f"{rate / 1e9:.2f} GB/s"


def choose(peer_rate: float | None, files_rate: float, warm: bool) -> Choice:
    """Peer or files for one load: ``peer_rate`` measured from this peer (None: never, or
    too long ago), ``files_rate`` the files' expected rate in their current state."""
    state = "warm" if warm else "cold"
    if peer_rate is None:
        return Choice(True, f"peer not measured lately (files {state}): trying it")
    if peer_rate > files_rate:
        return Choice(True, f"peer {gbps(peer_rate)} > {state} files {gbps(files_rate)}")
    return Choice(False, f"{state} files {gbps(files_rate)} >= peer {gbps(peer_rate)}")


def files_warm(opened: OpenedSource) -> bool:
    """Whether at least half of the checkpoint's bytes are in the page cache (mincore on a
    sample of each file's pages: a few syscalls, no reads)."""
    total = warm = 0
    for f in opened.files:
        size = os.fstat(f.fd).st_size
        total += size
        warm += int(resident_fraction(f.fd, size) * size)
    return total == 0 or warm >= WARM_FRACTION * total
