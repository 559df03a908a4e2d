"""``weightcache bench``: every contender measured side by side in one run.

For one generated checkpoint (default 1 GiB, 200 bf16 tensors) on one device:

- ``safetensors.torch.load_file`` to the device, page cache warm and cold;
- the peer loaders where installed (fastsafetensors; runai-model-streamer as vLLM's
  ``--load-format runai_streamer`` uses it; InstantTensor's three backends on a GPU),
  warm and cold; a missing one is skipped and the reason printed;
- the weightcache loader (daemon ``load``), warm and cold;
- the same loader in this process with the content hash and without (bench_hash.py);
- attach latency through the real client API (p50/p99 over many attaches);
- ready to compute: attach + read every byte once vs ``load_file`` + read every byte
  once, alternating, medians and range;
- attach in fresh engine processes (torch and CUDA ready first): client import,
  connect, first and second attach, phase by phase, medians and range;
- restart-to-ready of a fresh engine process: the floor (spawn + import torch + CUDA
  init), with load_file, and with attach;
- ``status`` latency while a bigger model loads (the control plane must stay fast).

Cold runs drop the file's pages with ``posix_fadvise(DONTNEED)`` (no root needed);
each figure says which it is. Results print as a table and go to ``--out`` as JSON.

``--checkpoint PATH`` puts the operator's own checkpoint in the generated one's place:
one .safetensors file, or a directory as transformers' ``save_pretrained`` writes it
(``model.safetensors``, or ``model-0000N-of-0000M.safetensors`` shards and their
``model.safetensors.index.json``), or such an index. Every row then times all of its
files (a loader's row loads them one after the other, bench_measure.py); the control
plane's bigger model is still generated (it is loaded only while ``status`` is timed). A
checkpoint whose pages cannot be dropped (on a tmpfs, or mapped by a running process)
gets no cold rows, and the output says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from ..checkpoint_files import discover_files
from ..config import DaemonConfig
from .bench_hash import measure_content_hash
from .bench_measure import (
    INSTANTTENSOR_BACKENDS,
    READ_EVERY_BYTE,
    attach_and_touch,
    attach_latencies,
    checkpoint_bytes,
    daemon_load,
    disk_ceiling,
    drop_page_cache,
    host_tier_round_trip,
    memfd_bytes,
    page_cache_bytes,
    pct,
    status_under_load,
    time_fastsafetensors,
    time_instanttensor_in_child,
    time_load_file,
    time_load_file_and_touch,
    time_runai_streamer,
    warm_page_cache,
)
from .bench_report import print_table, write_chart
from .bench_result import (
    AttachFigures,
    BenchResult,
    ContentHashFigures,
    ControlPlaneFigures,
    DiskCeiling,
    Environment,
    FreshAttachFigures,
    HostTierFigures,
    LoaderFigures,
    LoadFileFigures,
    PeerLoaderFigures,
    ReadyToComputeFigures,
    RestartFigures,
    RestartTimes,
    Spread,
)
from .restart import FreshAttach, Restart, ipc_holder, time_fresh_attach, time_restart
from .spawn import DaemonProcess, config_text
from .synth import write_checkpoint

GIB = 2**30
MODEL = "bench"  # the model every figure is about
BIG = "big"  # the bigger model loaded while the control plane is measured


@dataclass(frozen=True)
class BenchConfig:
    """What to measure; ``weightcache bench`` builds it from its arguments (the defaults
    live there)."""

    size_gib: float  # the checkpoint every figure is about
    tensors: int  # ... in this many tensors
    device: str  # "cpu" or "cuda:N"
    attaches: int  # attaches timed for the latency percentiles
    reps: int  # repetitions of each warm load
    cold_reps: int  # repetitions of each cold load (0: skip cold runs and the disk ceiling)
    restarts: int  # engine restarts per way
    big_gib: float  # the model loaded while status latency is measured
    workdir: str | None = None  # checkpoints, config, socket and daemon log (default /tmp/wc-bench)
    out: str | None = None  # JSON results here, and a PNG chart beside it
    ready_reps: int = 7  # ready-to-compute repetitions of each way (alternating)
    fresh: int = 7  # fresh engine processes timed for the fresh-process attach row
    checkpoint: str | None = None  # the operator's own checkpoint (a file, a directory, an index) instead of a generated one

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class Checkpoints:
    work: Path
    model: Path  # the bench model
    big: Path  # the control-plane model


def run_bench(cfg: BenchConfig) -> int:
    """Measure everything side by side, print the table, write ``cfg.out``. Returns the exit status."""
    console = Console()
    started = time.monotonic()

    def step(what: str) -> None:
        # The whole bench runs for minutes (over 5.5 on the H200): say where it is.
        console.print(f"[dim]{time.monotonic() - started:7.1f} s  {what}...[/dim]")

    notes: list[str] = []  # rows that did not run, and why
    if cfg.checkpoint:
        _, tensors = user_checkpoint(cfg.checkpoint)
        cfg = replace(cfg, tensors=tensors)
    files = _generate(console, cfg)
    env = _environment(cfg, files)
    if cfg.cold_reps:
        cfg = _cold_possible(console, cfg, files.model, notes)
    step("load_file, warm and cold")
    load_file_warm_s, load_file_cold_s = _measure_load_file(cfg, files.model)
    step("the disk's ceiling")
    ceiling = _measure_disk_ceiling(cfg, files.model)
    step("fastsafetensors")
    peer = _measure_peer(cfg, files.model, "fastsafetensors", "fastsafetensors", time_fastsafetensors)
    step("runai-model-streamer")
    runai = _measure_peer(cfg, files.model, "runai_streamer", "runai-model-streamer", time_runai_streamer)
    step("InstantTensor, each backend")
    instant = tuple(_measure_instanttensor(cfg, files.model, backend) for backend in INSTANTTENSOR_BACKENDS)
    step("the loader with and without the content hash")
    content_hash = _measure_content_hash(cfg, files.model)
    if cfg.cuda:
        import torch

        torch.cuda.empty_cache()
    sock = str(files.work / "bench.sock")
    log = files.work / "bench-daemon.log"
    log.unlink(missing_ok=True)
    with DaemonProcess(_write_daemon_config(cfg, files, sock), sock, log) as daemon:
        step("the daemon's loader, warm and cold")
        loader = _measure_loader(cfg, files.model, sock)
        step("attach latency")
        attach_lat = asyncio.run(attach_latencies(sock, MODEL, cfg.attaches))
        step("ready to compute: attach vs load_file")
        ready = _measure_ready(cfg, files.model, sock, daemon)
        if cfg.cuda:
            step("the host tier")
        host_tier = _measure_host_tier(cfg, sock) if cfg.cuda else None
        step("fresh-process attach")
        fresh = _measure_fresh(cfg, files.model, sock)
        step("engine restarts")
        restart = _measure_restarts(cfg, files.model, sock)
        step("status while a bigger model loads cold")
        control_plane = _measure_control_plane(files.big, sock)
    # The older figures "load_file + read" and "attach + read" are the ready-to-compute row's medians.
    load_file = LoadFileFigures(warm_s=load_file_warm_s, touch_warm_s=ready.load_file_s.p50, cold_s=load_file_cold_s)
    attach = AttachFigures(n=len(attach_lat), p50_ms=pct(attach_lat, 50) * 1e3, p99_ms=pct(attach_lat, 99) * 1e3,
                           touch_s=ready.attach_s.p50)
    result = BenchResult(env=env, load_file=load_file, disk_ceiling=ceiling, fastsafetensors=peer, loader=loader, attach=attach,
                         host_tier=host_tier, restart=restart, control_plane=control_plane, runai_streamer=runai, ready=ready,
                         fresh_attach=fresh, content_hash=content_hash, instanttensor=instant, notes=tuple(notes))
    print_table(console, result)
    if cfg.out:
        _write_outputs(console, result, Path(cfg.out))
    return 0


def user_checkpoint(path: str) -> tuple[Path, int]:
    """``--checkpoint``: the checkpoint (a .safetensors file, a directory as
    ``save_pretrained`` writes it, or an index json), opened and parsed as the daemon
    would (a LoadFailed or CorruptCheckpoint says why not), and its tensor count."""
    from ..loader import open_source, parse_checkpoint

    p = Path(path)
    with open_source(p) as opened:
        return p, len(parse_checkpoint(opened).tensors)


def _cold_possible(console: Console, cfg: BenchConfig, model: Path, notes: list[str]) -> BenchConfig:
    """``cfg``, without cold runs where the model's pages cannot be dropped (a tmpfs keeps
    them, a process that maps them keeps them): each cold figure would be a warm one."""
    try:
        drop_page_cache(model)
        return cfg
    except RuntimeError as exc:
        note = f"cold rows (load_file, peers, loader, disk ceiling) skipped: {exc}"
        console.print(f"[yellow]{note}[/yellow]")
        notes.append(note)
        return replace(cfg, cold_reps=0)


def _generate(console: Console, cfg: BenchConfig) -> Checkpoints:
    """The bench model (the operator's checkpoint with ``--checkpoint``, else made once per
    size and kept in the workdir) and the control plane's bigger model."""
    work = Path(cfg.workdir or "/tmp/wc-bench")
    work.mkdir(parents=True, exist_ok=True)
    model = Path(os.path.abspath(cfg.checkpoint)) if cfg.checkpoint else work / f"bench-{cfg.size_gib:g}g-{cfg.tensors}t.safetensors"
    files = Checkpoints(work=work, model=model, big=work / f"big-{cfg.big_gib:g}g.safetensors")
    with console.status("generating checkpoints"):
        if not files.model.exists():
            write_checkpoint(files.model, int(cfg.size_gib * GIB), cfg.tensors, seed=1)
        if not files.big.exists():
            write_checkpoint(files.big, int(cfg.big_gib * GIB), 40, seed=2)
    return files


def _environment(cfg: BenchConfig, files: Checkpoints) -> Environment:
    import torch

    return Environment(device=cfg.device, checkpoint_bytes=checkpoint_bytes(files.model), tensors=cfg.tensors,
                       python=platform.python_version(), torch=torch.__version__, cpus=os.cpu_count(), host=platform.node(),
                       gpu=torch.cuda.get_device_name(torch.device(cfg.device)) if cfg.cuda else None, load_avg_1m=os.getloadavg()[0],
                       checkpoint=str(files.model) if cfg.checkpoint else None,
                       files=len(discover_files(files.model)) if cfg.checkpoint else None)


def _cold_runs(cfg: BenchConfig, path: Path, measure: Callable[[], float]) -> list[float]:
    """``measure()`` once per cold repetition, the file's pages dropped before each."""
    out = []
    for _ in range(cfg.cold_reps):
        drop_page_cache(path)
        out.append(measure())
    return out


def _measure_load_file(cfg: BenchConfig, ckpt: Path) -> tuple[float, float | None]:
    """safetensors.load_file, warm then cold: the medians (cold None without cold runs).
    Its "+ read every byte" figure is the ready-to-compute row's, side by side with attach."""
    warm_page_cache(ckpt)
    time_load_file(ckpt, cfg.device)  # first call pays one-time costs (CUDA context, allocator)
    warm = [time_load_file(ckpt, cfg.device) for _ in range(cfg.reps)]
    cold = _cold_runs(cfg, ckpt, lambda: time_load_file(ckpt, cfg.device))
    return statistics.median(warm), statistics.median(cold) if cold else None


def _measure_disk_ceiling(cfg: BenchConfig, ckpt: Path) -> DiskCeiling:
    if not cfg.cold_reps:
        return DiskCeiling()
    try:
        return DiskCeiling(gbps=max(disk_ceiling(ckpt) for _ in range(cfg.cold_reps)) / 1e9)
    except OSError as exc:  # a file system without O_DIRECT
        return DiskCeiling(error=str(exc))


def _measure_peer(cfg: BenchConfig, ckpt: Path, name: str, dist: str, measure: Callable[[Path, str], float]) -> PeerLoaderFigures:
    """A peer loader (``dist`` the package, ``name`` its keys' prefix), where it can be
    installed; why not, in the results and on the console, where it cannot."""
    warm: float | None = None
    try:
        version: str | None = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        warm_page_cache(ckpt)
        measure(ckpt, cfg.device)  # the first call pays its imports and one-time set-up
        warm = statistics.median(measure(ckpt, cfg.device) for _ in range(cfg.reps))
        cold = _cold_runs(cfg, ckpt, lambda: measure(ckpt, cfg.device))
        return PeerLoaderFigures(warm_s=warm, cold_s=statistics.median(cold) if cold else None, version=version, name=name)
    except Exception as exc:  # not installed, or fails on this host: say so in the results
        error = f"{type(exc).__name__}: {exc}"[:300]
        Console(stderr=True).print(f"{dist}: {'failed' if warm else 'skipped'} ({error})")
        return PeerLoaderFigures(warm_s=warm, error=error, version=version, name=name)


def _measure_instanttensor(cfg: BenchConfig, ckpt: Path, backend: str) -> PeerLoaderFigures:
    """InstantTensor with one of its backends (bench_measure.time_instanttensor). It
    loads to a GPU only: on the CPU its rows say so."""
    name = f"instanttensor_{backend}"
    if not cfg.cuda:
        return PeerLoaderFigures(error="no CPU target: InstantTensor loads into GPU memory only", name=name)
    return _measure_peer(cfg, ckpt, name, "instanttensor", functools.partial(time_instanttensor_in_child, backend=backend))


def _measure_content_hash(cfg: BenchConfig, ckpt: Path) -> ContentHashFigures:
    """The daemon's loader in this process, with the content hash and without (the
    product always hashes; the switch is the bench's), alternating, page cache warm."""
    figs = measure_content_hash(ckpt, cfg.device, reps=max(cfg.reps, 3), threads=DaemonConfig().load_threads,
                                chunk=DaemonConfig().load_chunk_bytes)
    return replace(figs, nbytes=checkpoint_bytes(ckpt))  # its own figure is the path's st_size: a directory's, not its files'


def _write_daemon_config(cfg: BenchConfig, files: Checkpoints, sock: str) -> Path:
    """A daemon with room for both models (and, on CUDA, a host tier for the bench model)."""
    nbytes = checkpoint_bytes(files.model)
    budget = {cfg.device: f"{int((nbytes + files.big.stat().st_size) * 1.1)}"}
    daemon_opts: dict[str, Any] = {"log_level": "info"}
    if cfg.cuda:
        daemon_opts["host_budget"] = int(nbytes * 1.1)  # room to demote the bench model
    path = files.work / "bench.toml"
    path.write_text(config_text(sock, budget, [{"name": MODEL, "path": str(files.model), "device": cfg.device},
                                               {"name": BIG, "path": str(files.big), "device": cfg.device}],
                                daemon=daemon_opts))
    return path


def _measure_loader(cfg: BenchConfig, ckpt: Path, sock: str) -> LoaderFigures:
    """The daemon's loader, warm then cold (the first warm load is not counted)."""
    warm_page_cache(ckpt)
    asyncio.run(daemon_load(sock, MODEL))
    warm = [asyncio.run(daemon_load(sock, MODEL)) for _ in range(cfg.reps)]
    cold = [asyncio.run(daemon_load(sock, MODEL, cold=ckpt)) for _ in range(cfg.cold_reps)]
    return LoaderFigures(warm_s=statistics.median(warm), cold_s=statistics.median(cold) if cold else None)


def _measure_ready(cfg: BenchConfig, ckpt: Path, sock: str, daemon: DaemonProcess) -> ReadyToComputeFigures:
    """Ready to compute, both ways alternating (which goes first alternates too), page
    cache warm, each in a fresh mapping: the same conditions for both, in one run. On the
    CPU, also the host memory that holds the model once the daemon serves it."""
    warm_page_cache(ckpt)
    asyncio.run(attach_and_touch(sock, MODEL))  # one of each first, not counted: lazy imports, kernels, allocator
    time_load_file_and_touch(ckpt, cfg.device)
    attach: list[float] = []
    load_file: list[float] = []
    for i in range(cfg.ready_reps):
        for way in ("attach", "load_file") if i % 2 == 0 else ("load_file", "attach"):
            if way == "attach":
                attach.append(asyncio.run(attach_and_touch(sock, MODEL)))
            else:
                load_file.append(time_load_file_and_touch(ckpt, cfg.device))
    if cfg.cuda:
        import torch

        torch.cuda.empty_cache()  # give load_file's cached blocks back before the engines start
    resident, arena, note = (None, None, None) if cfg.cuda else _resident(ckpt, sock, daemon)
    return ReadyToComputeFigures(attach_s=Spread(tuple(attach)), load_file_s=Spread(tuple(load_file)), read=READ_EVERY_BYTE,
                                 resident_ratio=resident, arena=arena, arena_note=note)


def _resident(ckpt: Path, sock: str, daemon: DaemonProcess) -> tuple[float, str | None, str | None]:
    """The daemon's copies of the model (its memfds) plus the files' page cache, over the
    files' size, with the model resident and nobody attached; the arena it got, and why
    not the page cache where that was refused. A
    file served from its page cache is 1.0x; a copy into a memfd is one too once the
    file's pages are dropped (backends/cpu.py), but only after the load."""
    from ..client import SyncClient

    with SyncClient(sock) as c:
        c.load(MODEL)
        entry = next(m for m in c.models() if m["name"] == MODEL)
    assert daemon.proc is not None
    return ((memfd_bytes(daemon.proc.pid) + page_cache_bytes(ckpt)) / checkpoint_bytes(ckpt), entry["arena"],
            entry.get("arena_note"))


def _measure_fresh(cfg: BenchConfig, ckpt: Path, sock: str) -> FreshAttachFigures:
    """``cfg.fresh`` rounds of fresh engine processes, one after the other: one attaching
    twice (phase by phase), one loading the same files with load_file and, on a GPU, one
    opening the same tensors as torch CUDA IPC handles from a process holding them."""
    files = discover_files(ckpt)
    time_fresh_attach(model=MODEL, socket=sock, device=cfg.device)  # not counted: writes the bytecode the others read
    runs: list[FreshAttach] = []
    load_file: list[float] = []
    ipc: list[float] = []
    with contextlib.ExitStack() as stack:
        held = stack.enter_context(ipc_holder(files, cfg.device, sock + ".ipc")) if cfg.cuda else None
        # On a GPU each process's context and memory are freed by the driver after it exits:
        # a pause after each, so that this does not fall on the next one's time.
        settle = 1.0 if cfg.cuda else 0.0
        for _ in range(cfg.fresh):
            runs.append(time_fresh_attach(model=MODEL, socket=sock, device=cfg.device))
            time.sleep(settle)
            load_file.append(time_restart("disk", files=files, model=MODEL, socket=sock, device=cfg.device).weights_s * 1e3)
            time.sleep(settle)
            if held is not None:
                ipc.append(time_restart("ipc", files=files, model=MODEL, socket=sock, device=cfg.device, ipc_socket=held).weights_s * 1e3)
                time.sleep(settle)

    def spread(attr: str) -> Spread:
        return Spread(tuple(getattr(x, attr) for x in runs))

    return FreshAttachFigures(import_client_ms=spread("import_client_ms"), connect_ms=spread("connect_ms"),
                              first_attach_ms=spread("first_attach_ms"), second_attach_ms=spread("second_attach_ms"),
                              lazy_imports=tuple(sorted({m for x in runs for m in x.lazy_imports})),
                              load_file_ms=Spread(tuple(load_file)), cuda_ipc_ms=Spread(tuple(ipc)) if ipc else None)


def _measure_host_tier(cfg: BenchConfig, sock: str) -> HostTierFigures:
    trips = [asyncio.run(host_tier_round_trip(sock, MODEL)) for _ in range(cfg.reps)]
    return HostTierFigures(demote_s=statistics.median(t[0] for t in trips), promote_s=statistics.median(t[1] for t in trips))


def _measure_restarts(cfg: BenchConfig, ckpt: Path, sock: str) -> RestartFigures:
    """A fresh engine process to ready, the three ways interleaved, page cache warm."""
    runs: dict[str, list[Restart]] = {"floor": [], "disk": [], "cache": []}
    files = discover_files(ckpt)
    for f in files:
        warm_page_cache(f)
    for _ in range(cfg.restarts):
        for mode in ("floor", "disk", "cache"):
            runs[mode].append(time_restart(mode, files=files, model=MODEL, socket=sock, device=cfg.device))

    def medians(mode: str) -> RestartTimes:
        return RestartTimes(ready_s=statistics.median(x.ready_s for x in runs[mode]),
                            weights_s=statistics.median(x.weights_s for x in runs[mode]))

    extra = [x.extra_device_bytes for x in runs["cache"] if x.extra_device_bytes is not None]
    return RestartFigures(floor=medians("floor"), disk=medians("disk"), cache=medians("cache"),
                          checksums_equal=len({x.checksum for x in runs["disk"] + runs["cache"]}) == 1,
                          attached_client_extra_device_bytes=max(extra) if extra else None)


def _measure_control_plane(big: Path, sock: str) -> ControlPlaneFigures:
    drop_page_cache(big)
    return ControlPlaneFigures(status_during_load=asyncio.run(status_under_load(sock, BIG)), big_bytes=big.stat().st_size)


def _write_outputs(console: Console, result: BenchResult, out: Path) -> None:
    out.write_text(result.to_json())
    console.print(f"wrote {out}")
    png = out.with_suffix(".png")
    if write_chart(result.as_dict(), png):
        console.print(f"wrote {png}")
    else:
        console.print("matplotlib is not installed: no chart (pip install matplotlib; weightcache bench --chart FILE.json)")
