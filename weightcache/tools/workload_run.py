"""One policy's run of ``weightcache workload``: a fresh daemon, the isolated rates, the
engines replaying the trace (some killed and replaced), a status sampler, and the checks
after (leases, counters, the device's memory). Returns plain data; workload_report.py
makes figures of it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bench_measure import drop_page_cache, warm_page_cache
from .daemon_log import load_lines
from .spawn import DaemonProcess, config_text
from .workload_pool import EnginePool, Replay, read_records
from .workload_probes import Sampler, evict_all, measure_isolated

if TYPE_CHECKING:
    from ..client import SyncClient
    from .workload_setup import Prepared, WorkloadConfig

COUNTERS = ("loads", "promotions", "evictions", "demotions", "kept_copy_demotions", "failed_demotions", "wasted_loads",
            "cancelled_loads")


@dataclass
class PolicyRun:
    """What one policy's run produced, before any statistics."""

    policy: str
    isolated: dict[str, dict[str, Any]] = field(default_factory=dict)  # size key -> rates
    records: list[dict[str, Any]] = field(default_factory=list)  # every engine's result lines, with "slot"
    counters: dict[str, int] = field(default_factory=dict)  # the daemon's totals over the workload only
    peak: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> max used+reserved, budget
    over_budget: list[str] = field(default_factory=list)
    samples: int = 0
    leases_after: int = -1
    memory: dict[str, int] = field(default_factory=dict)  # CUDA free bytes at the checkpoints
    kills: int = 0
    wall_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)  # where the bench's own time went
    daemon_exit: int | None = None
    failures: list[str] = field(default_factory=list)
    daemon_loads: list[dict[str, Any]] = field(default_factory=list)  # the workload's loads, from the daemon's log


def _wait_no_leases(c: SyncClient, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while True:
        leases = int(c.status()["leases"])
        if leases == 0 or time.monotonic() > deadline:
            return leases
        time.sleep(0.05)


def _cuda_free(device: str) -> int:
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def _free_settled(device: str, floor: int, timeout: float = 5) -> int:
    """Free device memory, polled until it reaches ``floor`` or ``timeout`` passes (the
    daemon frees arenas off its event loop, and a dead process's context goes a bit later)."""
    deadline = time.monotonic() + timeout
    while (free := _cuda_free(device)) < floor and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def daemon_config(cfg: WorkloadConfig, prep: Prepared, policy: str, socket: str) -> str:
    daemon: dict[str, Any] = {"log_level": "info"}
    if cfg.host_budget:
        daemon["host_budget"] = cfg.host_budget
    if policy != "lru":  # the key is new: a daemon without it must still run the LRU baseline
        daemon["eviction_policy"] = policy
    models = [{"name": name, "path": str(path), "device": cfg.device} for name, path in prep.files.items()]
    return config_text(socket, {cfg.device: str(cfg.budget_bytes)}, models, daemon)


def run_policy(cfg: WorkloadConfig, prep: Prepared, pool: EnginePool, policy: str) -> PolicyRun:
    from ..client import SyncClient

    run = PolicyRun(policy)
    run_dir = prep.work / f"run-{policy}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("engine-*"):
        old.unlink()
    socket = str(run_dir / "d.sock")
    (run_dir / "daemon.toml").write_text(daemon_config(cfg, prep, policy, socket))
    log = run_dir / "daemon.log"
    log.unlink(missing_ok=True)
    # Every engine started, its CUDA context made, before the first free-memory reading: an
    # engine replaced at the end of the last run must not make its context mid-run.
    pool.start()
    if cfg.cuda:
        run.memory["free_before_daemon"] = _cuda_free(cfg.device)
    clock = time.monotonic()
    daemon = DaemonProcess(run_dir / "daemon.toml", socket, log).start()
    run.phases_s["daemon_start"] = time.monotonic() - clock
    try:
        with SyncClient(socket, name="workload-bench") as c:
            if cfg.cuda:
                run.memory["free_daemon_idle"] = _cuda_free(cfg.device)
            clock = time.monotonic()
            run.isolated = measure_isolated(c, cfg, prep)
            run.phases_s["isolated"] = time.monotonic() - clock
            log_from = log.stat().st_size  # the workload's loads are logged after this
            _workload(cfg, prep, pool, run, c, socket, run_dir)
            run.daemon_loads = load_lines(log.read_bytes()[log_from:].decode(errors="replace"))
            clock = time.monotonic()
            evict_all(c, list(prep.files))
            if cfg.cuda:
                run.memory["free_after_evict_all"] = _free_settled(cfg.device, run.memory["free_daemon_idle"] - cfg.mem_slack)
    finally:
        run.daemon_exit = daemon.stop()
    if cfg.cuda:
        run.memory["free_after_daemon_exit"] = _free_settled(cfg.device, run.memory["free_before_daemon"] - cfg.mem_slack)
    run.phases_s["after"] = time.monotonic() - clock
    _check(cfg, run, log)
    return run


def _workload(cfg: WorkloadConfig, prep: Prepared, pool: EnginePool, run: PolicyRun, c: SyncClient, socket: str,
              run_dir: Path) -> None:
    """The engines replay the trace from a cold device (nothing resident) while the
    sampler watches the budget; then the leases, counters and the engines' records."""
    for path in prep.files.values():
        (drop_page_cache if cfg.cold else warm_page_cache)(path)
    before = c.status()["counters"]
    sampler = Sampler(socket, prep.files if cfg.cold else None)
    sampler.start()
    replay = Replay(pool, socket, run_dir)
    try:
        clock = time.monotonic()
        t0 = replay.start()
        run.phases_s["engines_start"] = time.monotonic() - clock
        replay.drive(cfg)
        run.wall_s = time.monotonic() - t0
        clock = time.monotonic()
        run.leases_after = _wait_no_leases(c)
        run.phases_s["leases"] = time.monotonic() - clock
    except BaseException:
        pool.kill_all()  # engines in the middle of a run cannot be given the next one
        raise
    finally:
        sampler.stop.set()
        sampler.join()
    after = c.status()["counters"]
    run.counters = {k: int(after[k]) - int(before[k]) for k in COUNTERS}
    run.peak, run.over_budget, run.samples, run.kills = sampler.peak, sampler.over, sampler.samples, replay.kills
    run.failures += replay.failures
    if sampler.error is not None:
        run.failures.append(f"the status sampler failed: {sampler.error!r}")
    for slot in range(prep.trace.engines):
        run.records += [{**r, "slot": slot} for r in read_records(replay.results(slot))]


def _check(cfg: WorkloadConfig, run: PolicyRun, log: Path) -> None:
    """Everything that makes the run fail, each in words."""
    if run.leases_after:
        run.failures.append(f"{run.leases_after} lease(s) left after every engine exited")
    run.failures += [f"over budget: {x}" for x in run.over_budget]
    if run.samples == 0:
        run.failures.append("no status sample was taken: the budget was not watched")
    if run.daemon_exit != 0:
        run.failures.append(f"the daemon exited with status {run.daemon_exit} (log: {log})")
    if "Traceback" in log.read_text(errors="replace"):
        run.failures.append(f"the daemon logged a traceback (log: {log})")
    m = run.memory
    if cfg.cuda and m["free_after_evict_all"] < m["free_daemon_idle"] - cfg.mem_slack:
        run.failures.append(f"device memory did not come back after evicting everything: {m['free_after_evict_all']} free, "
                            f"{m['free_daemon_idle']} with the daemon idle before the workload")
    if cfg.cuda and m["free_after_daemon_exit"] < m["free_before_daemon"] - cfg.mem_slack:
        run.failures.append(f"device memory did not come back after the daemon exited: {m['free_after_daemon_exit']} free, "
                            f"{m['free_before_daemon']} before it started")
    bad = [r for r in run.records if "mismatch" in r]
    if bad:
        run.failures.append(f"{len(bad)} attach(es) had wrong bytes, e.g. engine {bad[0]['slot']} {bad[0]['model']}: {bad[0]['mismatch'][:2]}")
    attaches = [r for r in run.records if "source" in r]
    misses = [r for r in attaches if r["source"] != "resident"]
    brought = run.counters["loads"] + run.counters["promotions"]
    if brought and not misses and attaches:
        run.failures.append(f"the daemon made {brought} loads/promotions during the workload but no attach reported a "
                            "miss: its attach replies do not say their source")
    if not attaches:
        run.failures.append("no attach succeeded")
