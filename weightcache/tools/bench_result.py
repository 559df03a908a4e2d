"""What ``weightcache bench`` measured, as typed records, one per group of figures.

:meth:`BenchResult.as_dict` gives the flat JSON object that results/bench-cpu-*.json and
results/bench-h200-*.json hold: tooling and the docs read those files, so the keys, their
order and their meaning stay exactly as they were when the bench returned a plain dict.
Optional figures keep their old rule: a key is absent when the step did not run (``gpu``
and the host tier on CPU, the disk ceiling without cold runs) and ``null`` when it ran
but had nothing to report (``load_file_cold_s`` with ``--cold-reps 0``).

No torch and no rich here: the records are plain data.
"""

from __future__ import annotations

import json
import statistics
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
    load_avg_1m: float | None = None  # the host's 1-minute load average when the bench started (absent in older runs)
    # --checkpoint: the operator's checkpoint path and its .safetensors files' count (absent for a generated one)
    checkpoint: str | None = None
    files: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("gpu", "load_avg_1m", "checkpoint", "files"):
            if out[key] is None:
                del out[key]
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
    """Another loader (fastsafetensors, runai-model-streamer, InstantTensor), where it can be installed:
    medians warm and cold, or why not. Its keys are ``<name>_warm_s`` and so on."""

    warm_s: float | None = None
    cold_s: float | None = None  # None with a warm figure: no cold runs
    error: str | None = None  # "ExceptionType: message", cut to 300 characters
    version: str | None = None  # the installed package's version, where it is installed
    name: str = "fastsafetensors"  # the prefix of its keys

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.version is not None:
            out[f"{self.name}_version"] = self.version
        if self.warm_s is not None:
            out[f"{self.name}_warm_s"] = self.warm_s
            if self.error is None:  # the cold step ran to its end
                out[f"{self.name}_cold_s"] = self.cold_s
        if self.error is not None:
            out[f"{self.name}_error"] = self.error
        return out


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one figure: the median and the range, and every run."""

    runs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError("a spread needs at least one run")

    @property
    def p50(self) -> float:
        return statistics.median(self.runs)

    def as_dict(self) -> dict[str, Any]:
        return {"p50": self.p50, "min": min(self.runs), "max": max(self.runs), "runs": list(self.runs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Spread:
        return cls(tuple(d["runs"]))


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
class ReadyToComputeFigures:
    """Ready to compute, side by side: attach + read every byte once, and ``load_file`` +
    read every byte once, the two alternating in one run (page cache warm; each in a fresh
    mapping, so first-touch costs count for both). ``ratio`` > 1: attach is ready sooner."""

    attach_s: Spread
    load_file_s: Spread
    read: str  # how every byte is read
    # CPU only: host memory holding the model once the daemon serves it (its memfds plus the
    # file's page cache), over the file's size; absent from older runs' JSON
    resident_ratio: float | None = None
    arena: str | None = None  # which arena it got ("file", "memfd"; models' "arena")
    arena_note: str | None = None  # why not the page cache, where it was refused (models' "arena_note"; key absent if none)

    @property
    def ratio(self) -> float:
        return self.load_file_s.p50 / self.attach_s.p50

    def as_dict(self) -> dict[str, Any]:
        out = {"read": self.read, "reps": len(self.attach_s.runs), "attach_s": self.attach_s.as_dict(),
               "load_file_s": self.load_file_s.as_dict(), "ratio_load_file_over_attach": self.ratio}
        if self.resident_ratio is not None:
            out |= {"resident_over_file": self.resident_ratio, "arena": self.arena}
            if self.arena_note:
                out["arena_note"] = self.arena_note
        return {"ready_to_compute": out}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReadyToComputeFigures:
        return cls(attach_s=Spread.from_dict(d["attach_s"]), load_file_s=Spread.from_dict(d["load_file_s"]), read=d["read"],
                   resident_ratio=d.get("resident_over_file"), arena=d.get("arena"), arena_note=d.get("arena_note"))


@dataclass(frozen=True)
class FreshAttachFigures:
    """Attach in fresh engine processes (torch imported and, on a GPU, CUDA initialised
    first), phase by phase, one run per process, in milliseconds; and, in processes
    alternating with those, the anchors: a fresh process's ``load_file`` of the same
    files and (GPU) the same tensors as torch CUDA IPC handles, each from its own imports
    to usable tensors (tools/restart.py, Note [as the engine meets it])."""

    import_client_ms: Spread  # the client's import on top of torch
    connect_ms: Spread
    first_attach_ms: Spread  # attach entered -> tensors usable, lazy imports included
    second_attach_ms: Spread  # the same process's next attach
    lazy_imports: tuple[str, ...] = ()  # modules connect or the first attach imported (union over the processes)
    load_file_ms: Spread | None = None  # import safetensors + load_file -> usable (absent from older runs' JSON)
    cuda_ipc_ms: Spread | None = None  # receive handles + open each -> usable (GPU only)

    @property
    def connect_to_tensors_ms(self) -> Spread:
        """connect -> first usable tensors, per process (not the sum of two medians)."""
        return Spread(tuple(c + a for c, a in zip(self.connect_ms.runs, self.first_attach_ms.runs, strict=True)))

    @property
    def import_to_tensors_ms(self) -> Spread:
        """import the client -> first usable tensors, per process: what the engine pays."""
        return Spread(tuple(i + c + a for i, c, a in zip(self.import_client_ms.runs, self.connect_ms.runs, self.first_attach_ms.runs,
                                                        strict=True)))

    def as_dict(self) -> dict[str, Any]:
        out = {"n": len(self.connect_ms.runs), "connect_to_tensors_ms": self.connect_to_tensors_ms.as_dict(),
               "import_client_ms": self.import_client_ms.as_dict(), "connect_ms": self.connect_ms.as_dict(),
               "first_attach_ms": self.first_attach_ms.as_dict(), "second_attach_ms": self.second_attach_ms.as_dict(),
               "lazy_imports": list(self.lazy_imports)}
        if self.load_file_ms is not None:  # runs with anchors: the headline beside its anchors
            out["import_to_tensors_ms"] = self.import_to_tensors_ms.as_dict()
        for key in ("load_file_ms", "cuda_ipc_ms"):
            sp = getattr(self, key)
            if sp is not None:
                out[key] = sp.as_dict()
        return {"fresh_attach": out}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FreshAttachFigures:
        return cls(**{k: Spread.from_dict(d[k]) for k in ("import_client_ms", "connect_ms", "first_attach_ms", "second_attach_ms")},
                   lazy_imports=tuple(d["lazy_imports"]),
                   **{k: Spread.from_dict(d[k]) for k in ("load_file_ms", "cuda_ipc_ms") if k in d})


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
class ContentHashFigures:
    """Loader seconds per (arena, hash) variant, warm, and the GIL check."""

    device: str
    nbytes: int
    threads: int
    chunk: int
    runs: dict[str, Spread]  # "arena, hash" -> seconds
    kinds: dict[str, str]  # "arena, hash" -> the arena kind the backend really made (a file arena may fall back to memfd)
    gil_pace: float  # a Python loop's pace while another thread hashes, over its pace alone (1.0: GIL released)
    gil_pace_copy: float  # the same while another thread copies with bytes() (holds the GIL): the control
    xxh3_GBps: float  # one thread, 64 MiB in memory

    def ratio(self, arena: str) -> float | None:
        """Loader time with the hash over without, for ``arena`` (first load)."""
        on, off = self.runs.get(f"{arena}, on"), self.runs.get(f"{arena}, off")
        return on.p50 / off.p50 if on and off else None

    def as_dict(self) -> dict[str, Any]:
        return {"content_hash": {
            "device": self.device, "nbytes": self.nbytes, "threads": self.threads, "chunk": self.chunk,
            "runs": {k: v.as_dict() for k, v in self.runs.items()}, "kinds": self.kinds,
            "ratio_on_over_off": {a: self.ratio(a) for a in sorted({k.split(",")[0] for k in self.runs})},
            "gil_pace_while_hashing": self.gil_pace, "gil_pace_while_copying": self.gil_pace_copy, "xxh3_GBps": self.xxh3_GBps,
        }}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ContentHashFigures:
        return cls(device=d["device"], nbytes=d["nbytes"], threads=d["threads"], chunk=d["chunk"],
                   runs={k: Spread.from_dict(v) for k, v in d["runs"].items()}, kinds=d["kinds"],
                   gil_pace=d["gil_pace_while_hashing"], gil_pace_copy=d["gil_pace_while_copying"], xxh3_GBps=d["xxh3_GBps"])


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
    # Optional: absent from the JSON of older runs.
    runai_streamer: PeerLoaderFigures | None = None
    ready: ReadyToComputeFigures | None = None
    fresh_attach: FreshAttachFigures | None = None
    content_hash: ContentHashFigures | None = None  # the loader with and without the content hash
    # InstantTensor, one per backend ("instanttensor_default", _buffered, _mmap)
    instanttensor: tuple[PeerLoaderFigures, ...] = ()
    notes: tuple[str, ...] = ()  # rows that did not run on this checkpoint, and why (key absent when none)

    def as_dict(self) -> dict[str, Any]:
        """The flat object of results/bench-*.json, keys in the order they always had (the
        later rows' keys beside their kin)."""
        out: dict[str, Any] = {}
        for part in (self.env, self.load_file, self.disk_ceiling, self.fastsafetensors, self.runai_streamer, *self.instanttensor,
                     self.loader, self.content_hash, self.attach,
                     self.ready, self.host_tier, self.fresh_attach, self.restart, self.control_plane):
            if part is not None:
                out.update(part.as_dict())
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def to_json(self) -> str:
        """The text ``--out`` writes."""
        return json.dumps(self.as_dict(), indent=1, default=str) + "\n"
