"""The inputs of ``weightcache workload``: its configuration from the command line, the
trace (read or generated), the synthetic checkpoints, their reference byte sums, and the
device budget in bytes. Everything here is made before the first daemon starts."""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from ..units import parse_size
from .workload_trace import GIB, Trace, model_names, parse_range, read_trace, write_trace, zipf_trace


@dataclass(frozen=True)
class WorkloadConfig:
    """What to run; ``weightcache workload`` builds it with :func:`workload_config`."""

    engines: int
    model_sizes: dict[str, int]  # name -> bytes; empty: the trace header's
    device: str
    budget_models: float | None  # the device budget as this many mean-sized models ...
    budget: int | None  # ... or in bytes
    host_budget: int
    duration_s: float
    zipf: float
    seed: int
    hold: tuple[float, float]
    gap: tuple[float, float]
    trace: str | None
    policies: tuple[str, ...]
    tensors: int
    kill_every: tuple[float, float] | None
    cold: bool
    wait_s: float  # how long an attach may wait for room
    reps: int  # repetitions of each isolated measurement
    # Events not started this long after the trace's end are skipped (and counted). None:
    # every event runs however late, so that each policy does the same work.
    drain_s: float | None
    mem_slack: int  # bytes of device memory that may stay missing after evicting everything
    workdir: str | None = None
    out: str | None = None
    budget_bytes: int = field(default=0)  # resolved by prepare()

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def workload_config(*, engines: int, models: str | None, model_sizes: str | None, device: str, budget_models: float | None,
                    budget: str | None, host_budget: str | None, duration: float, zipf: float, seed: int, hold: str, gap: str,
                    trace: str | None, policies: str, tensors: int, kill_every: str | None, cold: bool, wait_s: float,
                    reps: int, drain_s: float | None, mem_slack: str, workdir: str | None, out: str | None) -> WorkloadConfig:
    """The command line's strings -> a config; ValueError says what is wrong."""
    if models and model_sizes:
        raise ValueError("give --models (GiB) or --model-sizes (with units), not both")
    sizes: list[int] = []
    if models:
        sizes = [int(float(x) * GIB) for x in models.split(",")]
    elif model_sizes:
        sizes = [parse_size(x.strip()) for x in model_sizes.split(",")]
    elif not trace:
        sizes = [parse_size(x) for x in ("32MiB", "64MiB", "128MiB", "256MiB")]
    if any(s <= 0 for s in sizes):
        raise ValueError("model sizes must be positive")
    if budget is not None and budget_models is not None:
        raise ValueError("give --budget or --budget-models, not both")
    pols = tuple(p.strip() for p in policies.split(",") if p.strip())
    if not pols or len(set(pols)) != len(pols):
        raise ValueError(f"--policies needs distinct names: {policies!r}")
    if device != "cpu" and not device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda:N, not {device!r}")
    host = parse_size(host_budget) if host_budget else 0
    if host and device == "cpu":
        raise ValueError("--host-budget needs a GPU device: the host tier holds demoted GPU models")
    if engines < 1 or duration <= 0 or reps < 1 or tensors < 1:
        raise ValueError("--engines, --duration, --reps and --tensors must be positive")
    return WorkloadConfig(
        engines=engines, model_sizes=dict(zip(model_names(len(sizes)), sizes, strict=True)), device=device,
        budget_models=budget_models, budget=parse_size(budget) if budget else None, host_budget=host, duration_s=duration, zipf=zipf, seed=seed,
        hold=parse_range(hold), gap=parse_range(gap), trace=trace, policies=pols, tensors=tensors,
        kill_every=parse_range(kill_every) if kill_every else None, cold=cold, wait_s=wait_s, reps=reps,
        drain_s=drain_s, mem_slack=parse_size(mem_slack), workdir=workdir, out=out)


def make_trace(cfg: WorkloadConfig) -> Trace:
    """The trace file's (sizes from the command line win over its header), or a Zipf one."""
    if cfg.trace:
        trace = read_trace(cfg.trace)
        if cfg.model_sizes:
            trace.models = dict(cfg.model_sizes)
        missing = sorted({e.model for e in trace.events} - set(trace.models))
        if missing:
            raise ValueError(f"{cfg.trace} names models with no size: {missing} (give --models/--model-sizes or a header)")
        return trace
    return zipf_trace(cfg.model_sizes, cfg.engines, cfg.duration_s, cfg.zipf, cfg.seed, cfg.hold, cfg.gap)


@dataclass
class Prepared:
    """The run's inputs on disk: checkpoints, the reference sums and the trace the engines read."""

    work: Path
    trace: Trace
    trace_path: Path
    files: dict[str, Path]  # model -> checkpoint
    refs: dict[str, dict[str, Any]]  # model -> {"nbytes", "tensors": name -> [dtype, shape, sum]}
    refs_path: Path
    by_size: dict[str, str]  # size key (bytes, as a string) -> the model whose isolated rate stands for it


def _checkpoint(work: Path, name: str, nbytes: int, tensors: int) -> Path:
    from .synth import kept_checkpoint

    # Kept in the workdir between runs; a seed from the name gives each model other bytes.
    return kept_checkpoint(work / "models" / f"{name}-{nbytes}b-{tensors}t.safetensors", nbytes, tensors,
                           seed=zlib.crc32(name.encode()))


def _references(work: Path, files: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Byte sums of every tensor, made once from the files (cached by path, size and mtime)."""
    from .workload_engine import file_sums

    cache_path = work / "models" / "sums.json"
    cache: dict[str, Any] = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    out = {}
    for name, path in files.items():
        st = path.stat()
        key = f"{path.name}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            sums = file_sums(str(path))
            cache[key] = {"nbytes": sum(_nbytes(v) for v in sums.values()), "tensors": sums}
        out[name] = cache[key]
    cache_path.write_text(json.dumps(cache))
    return out


def _nbytes(desc: list[Any]) -> int:
    import torch

    numel = 1
    for d in desc[1]:
        numel *= d
    return numel * getattr(torch, desc[0]).itemsize


def prepare(cfg: WorkloadConfig, console: Console) -> tuple[WorkloadConfig, Prepared]:
    """Checkpoints, sums and trace on disk, and the budget in bytes (checked to fit the
    largest model: otherwise every miss of it would fail)."""
    trace = make_trace(cfg)
    work = Path(cfg.workdir or "/tmp/wc-workload")
    (work / "models").mkdir(parents=True, exist_ok=True)
    with console.status("generating checkpoints and their reference sums"):
        files = {name: _checkpoint(work, name, n, cfg.tensors) for name, n in trace.models.items()}
        refs = _references(work, files)
    trace_path = work / "trace.jsonl"
    write_trace(trace, trace_path)
    refs_path = work / "refs.json"
    refs_path.write_text(json.dumps(refs))
    by_size: dict[str, str] = {}
    for name, n in trace.models.items():
        by_size.setdefault(str(n), name)
    mean = sum(r["nbytes"] for r in refs.values()) / len(refs)
    budget = cfg.budget if cfg.budget is not None else int((cfg.budget_models or 2.0) * mean)
    largest = max(r["nbytes"] for r in refs.values())
    if budget < largest:
        raise ValueError(f"a device budget of {budget} bytes cannot hold the largest model ({largest} bytes)")
    cfg = WorkloadConfig(**{**asdict(cfg), "budget_bytes": budget})
    return cfg, Prepared(work, trace, trace_path, files, refs, refs_path, by_size)


def check_policies(policies: tuple[str, ...]) -> None:
    from ..config import DaemonConfig

    if any(p != "lru" for p in policies) and "eviction_policy" not in DaemonConfig.model_fields:
        raise ValueError(f"this daemon has no eviction_policy setting yet: only lru can run (asked for {', '.join(policies)})")
