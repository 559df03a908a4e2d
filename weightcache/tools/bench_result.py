"""What ``weightcache bench`` measured, as typed records, one per group of figures.

:meth:`BenchResult.as_dict` gives the flat JSON object that docs/bench-cpu.json and
docs/bench-h200.json hold: tooling and the docs read those files, so the keys, their
order and their meaning stay exactly as they were when the bench returned a plain dict.
Optional figures keep their old rule: a key is absent when the step did not run (``gpu``
and the host tier on CPU, the disk ceiling without cold runs) and ``null`` when it ran
but had nothing to report (``load_file_cold_s`` with ``--cold-reps 0``).

No torch and no rich here: the records are plain data.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Environment:
    """What ran: the device, the checkpoint and the host."""

    device: str
    checkpoint_bytes: int
    tensors: int
    python: str
    torch: str
    cpus: int | None
    host: str
    gpu: str | None = None  # the device's name, on CUDA only

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.gpu is None:
            del out["gpu"]
        return out


@dataclass(frozen=True)
class LoadFileFigures:
    """``safetensors.torch.load_file`` to the device, the baseline of every ratio."""

    warm_s: float  # median, page cache warm
    touch_warm_s: float  # load, then read every byte once (median, warm)
    cold_s: float | None  # median after dropping the file's pages; None without cold runs

    def as_dict(self) -> dict[str, Any]:
        return {"load_file_warm_s": self.warm_s, "load_file_touch_warm_s": self.touch_warm_s, "load_file_cold_s": self.cold_s}


@dataclass(frozen=True)
class DiskCeiling:
    """The cold read rate of parallel O_DIRECT reads alone: what any loader can reach."""

    gbps: float | None = None  # None: not measured (no cold runs) or failed
    error: str | None = None  # the OSError of a file system without O_DIRECT

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.gbps is not None:
            out["disk_ceiling_GBps"] = self.gbps
        if self.error is not None:
            out["disk_ceiling_error"] = self.error
        return out


@dataclass(frozen=True)
class PeerLoaderFigures:
    """fastsafetensors, where it can be installed: medians warm and cold, or why not."""

    warm_s: float | None = None
    cold_s: float | None = None  # None with a warm figure: no cold runs
    error: str | None = None  # "ExceptionType: message", cut to 300 characters

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.warm_s is not None:
            out["fastsafetensors_warm_s"] = self.warm_s
            if self.error is None:  # the cold step ran to its end
                out["fastsafetensors_cold_s"] = self.cold_s
        if self.error is not None:
            out["fastsafetensors_error"] = self.error
        return out


@dataclass(frozen=True)
class LoaderFigures:
    """The daemon's own loader (a ``load`` request, the model evicted first)."""

    warm_s: float
    cold_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"loader_warm_s": self.warm_s, "loader_cold_s": self.cold_s}


@dataclass(frozen=True)
class AttachFigures:
    """Attach through the real client API, and attach + read every byte once."""

    n: int
    p50_ms: float
    p99_ms: float
    touch_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"attach_n": self.n, "attach_p50_ms": self.p50_ms, "attach_p99_ms": self.p99_ms, "attach_touch_s": self.touch_s}


@dataclass(frozen=True)
class HostTierFigures:
    """CUDA only: evict into pinned host memory, and promote back (medians)."""

    demote_s: float
    promote_s: float

    def as_dict(self) -> dict[str, Any]:
        return {"host_demote_s": self.demote_s, "host_promote_s": self.promote_s}


@dataclass(frozen=True)
class RestartTimes:
    """One way of restarting an engine (medians over the restarts)."""

    ready_s: float  # spawn -> all weights usable, as the parent saw it
    weights_s: float  # the weights step alone, inside the engine


@dataclass(frozen=True)
class RestartFigures:
    """A fresh engine process to ready: the floor, with load_file, with attach."""

    floor: RestartTimes
    disk: RestartTimes
    cache: RestartTimes
    checksums_equal: bool  # disk and cache restarts saw the same weights
    attached_client_extra_device_bytes: int | None  # None on CPU

    @property
    def cache_minus_floor_ms(self) -> float:
        return (self.cache.ready_s - self.floor.ready_s) * 1e3

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for mode, times in (("floor", self.floor), ("disk", self.disk), ("cache", self.cache)):
            out[f"restart_{mode}_s"] = times.ready_s
            out[f"restart_{mode}_weights_s"] = times.weights_s
        out["restart_cache_minus_floor_ms"] = self.cache_minus_floor_ms
        out["restart_checksums_equal"] = self.checksums_equal
        out["attached_client_extra_device_bytes"] = self.attached_client_extra_device_bytes
        return out


@dataclass(frozen=True)
class StatusLatency:
    """``status`` answered while a bigger model loads cold (the control plane)."""

    n: int  # status requests made
    n_during_load: int  # of them, answered while the load was still in progress
    p50_ms: float
    p99_ms: float
    max_ms: float
    load_tail_s: float  # how long the load ran on after the last status


@dataclass(frozen=True)
class ControlPlaneFigures:
    status_during_load: StatusLatency
    big_bytes: int  # the size of the model loaded meanwhile

    def as_dict(self) -> dict[str, Any]:
        return {"status_during_load": asdict(self.status_during_load), "big_bytes": self.big_bytes}


@dataclass(frozen=True)
class BenchResult:
    env: Environment
    load_file: LoadFileFigures
    disk_ceiling: DiskCeiling
    fastsafetensors: PeerLoaderFigures
    loader: LoaderFigures
    attach: AttachFigures
    host_tier: HostTierFigures | None  # None on CPU
    restart: RestartFigures
    control_plane: ControlPlaneFigures

    def as_dict(self) -> dict[str, Any]:
        """The flat object of docs/bench-*.json, keys in the order they always had."""
        out: dict[str, Any] = {}
        for part in (self.env, self.load_file, self.disk_ceiling, self.fastsafetensors, self.loader, self.attach,
                     self.host_tier, self.restart, self.control_plane):
            if part is not None:
                out.update(part.as_dict())
        return out

    def to_json(self) -> str:
        """The text ``--out`` writes."""
        return json.dumps(self.as_dict(), indent=1, default=str) + "\n"
