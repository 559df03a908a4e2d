"""What ``weightcache workload`` measures around the engines: the isolated rate of each
model size (alone on the device, in the daemon the workload then runs in), and a status
sampler that watches the budgets (and, for cold runs, keeps the page cache dropped)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bench_measure import drop_page_cache, warm_page_cache

if TYPE_CHECKING:
    from ..client import SyncClient
    from .workload_setup import Prepared, WorkloadConfig

GONE = ("registered", "evicted")  # states that hold no memory on any tier


def evict_all(c: SyncClient, names: list[str]) -> None:
    """Every model out of every tier (one evict only demotes to the host tier)."""
    for name in names:
        for _ in range(3):
            if c.evict(name)["state"] in GONE:
                break


def _timed_load(c: SyncClient, name: str) -> float:
    t = time.perf_counter()
    c.load(name)
    return time.perf_counter() - t


def _gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


def measure_isolated(c: SyncClient, cfg: WorkloadConfig, prep: Prepared) -> dict[str, dict[str, Any]]:
    """Per distinct model size, alone on the device: a load from files with the page
    cache warm (and dropped, with ``--cold``), and on a GPU with a host tier a promotion.
    Medians of ``cfg.reps``, as GB/s of the model's bytes."""
    names = list(prep.files)
    out: dict[str, dict[str, Any]] = {}
    for key, name in prep.by_size.items():
        nbytes = prep.refs[name]["nbytes"]
        path = prep.files[name]
        fig: dict[str, Any] = {"model": name, "nbytes": nbytes}

        # One load first, not counted: the loader hashes a file's bytes only at its first
        # load (later ones find its digests kept, loader/reader.py), and under the trace
        # every load but each model's first is such a later one; the isolated rate is
        # held to the same.
        evict_all(c, names)
        warm_page_cache(path)
        _timed_load(c, name)
        warm = []
        for _ in range(cfg.reps):
            evict_all(c, names)
            warm_page_cache(path)
            warm.append(_timed_load(c, name))
        fig["files_warm_s"], fig["page_cache_GBps"] = warm, _gbps(nbytes, warm)
        if cfg.cold:
            cold = []
            for _ in range(cfg.reps):
                evict_all(c, names)
                drop_page_cache(path)
                cold.append(_timed_load(c, name))
            fig["files_cold_s"], fig["disk_cold_GBps"] = cold, _gbps(nbytes, cold)
        if cfg.cuda and cfg.host_budget >= nbytes:
            promote = []
            for _ in range(cfg.reps):
                evict_all(c, names)
                c.load(name)
                state = c.evict(name)["state"]
                if state != "host":
                    fig["promote_error"] = f"evicting {name} left it {state!r}, not in the host tier"
                    break
                promote.append(_timed_load(c, name))
            if promote:
                fig["promote_s"], fig["host_tier_GBps"] = promote, _gbps(nbytes, promote)
        out[key] = fig
    evict_all(c, names)
    return out


def _drop_pages(path: Path) -> None:
    """drop_page_cache without its sync: that is system-wide, and the files were synced
    once before the workload."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Sampler(threading.Thread):
    """``status`` every ``interval``: the peak of used+reserved per device against its
    budget. With ``cold`` files, also drops the page cache of every model that is not
    resident (or loading) every ~100 ms, so that its next load reads the disk."""

    def __init__(self, socket: str, cold_files: dict[str, Path] | None, interval: float = 0.05) -> None:
        super().__init__(name="workload-sampler", daemon=True)
        self.socket, self.cold_files, self.interval = socket, cold_files, interval
        self.stop = threading.Event()
        self.peak: dict[str, dict[str, int]] = {}
        self.over: list[str] = []
        self.samples = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        from ..client import SyncClient

        try:
            with SyncClient(self.socket, name="workload-sampler") as c:
                last_drop = 0.0
                while not self.stop.wait(self.interval):
                    self._sample(c.status())
                    if self.cold_files and time.monotonic() - last_drop >= 0.1:
                        last_drop = time.monotonic()
                        for m in c.models():
                            if m["state"] not in ("resident", "loading") and m["name"] in self.cold_files:
                                _drop_pages(self.cold_files[m["name"]])
        except BaseException as exc:  # reported as a failure: a blind sampler must not pass the budget check
            self.error = exc

    def _sample(self, st: dict[str, Any]) -> None:
        self.samples += 1
        for dev, d in st["devices"].items():
            held = d["used"] + d["reserved"]
            p = self.peak.setdefault(dev, {"used_reserved": 0, "budget": d["budget"]})
            p["used_reserved"] = max(p["used_reserved"], held)
            if held > d["budget"] and len(self.over) < 20:
                self.over.append(f"{dev}: used {d['used']} + reserved {d['reserved']} > budget {d['budget']}")
