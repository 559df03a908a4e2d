"""Time a fresh engine's attach, phase by phase: connect -> usable tensors.

Each measured process is new. It imports torch and initialises CUDA first (the engine's
own start, reported but not counted), then times what the client adds, with one of the
two clients (``--client``; both by default, their processes alternating so that drift
in the machine weighs on both alike):

  sync    ``SyncClient``: what an engine that is not asyncio code uses; the I/O happens
          in the calling thread (sync.py's Note [blocking transport])
  async   ``Client`` on the engine's own event loop, created before timing (an asyncio
          engine has one already)

  import_ms             ``from weightcache import SyncClient`` (or ``Client``: the one measured)
  connect_ms            ``SyncClient(socket)`` / ``await Client(socket).connect()``:
                        connect, check who serves it, hello
  import_mapping_ms     the client's torch half (mapping.py, cuda_mapping.py, libcuda.py),
                        which connecting imports while the daemon answers the hello
                        (connection.py's import_attach_half); timed on its own here
  attach_ms             ``c.attach(model, device=...)`` until it returns: tensors usable
    driver_load_ms        of which: loading libcuda and cuInit (first GPU attach only)
    request_ms            the attach request until its reply and fds are in
    map_ms                fds -> one tensor over the arena (GPU: driver_map_ms of it is
                          import + reserve + map; CPU: the mmap)
    set_access_ms         GPU: cuMemSetAccess, on a thread of its own while the views are
                          made (cuda_mapping.py's Note [views while access is set])
    views_ms              the tensor views (on a GPU made while the access is set)
  connect_to_usable_ms  connect_ms + import_mapping_ms + attach_ms: the target
                        (<= 5 ms p50 on the H200 for a ~10 GB model in 10 chunks)
  first_touch_ms        reading one element of the first and last tensor back (on a GPU
                        a kernel launch and a sync: torch's cost, not the client's)
  second_attach_ms      detach, then attach again in the same process
  gc_ms, gc_gens        time in the cyclic GC's collections from the import to usable
                        tensors, and their generations: a fresh engine's first
                        collections go through what ``import torch`` left (a gen-1 one
                        cost ~2 ms on the 2-core VM), so how many objects the
                        client keeps alive at once shows here

With ``--anchors`` it then times, side by side and alternating, what a
fresh engine pays: import -> usable tensors with weightcache (bytecode cached, as a wheel
install leaves it, and compiled from source, as an editable checkout with
PYTHONDONTWRITEBYTECODE=1 has it), with a fresh process's ``load_file`` of the same file,
and on a GPU with the same tensors as torch CUDA IPC handles from a holder process
(``import_to_usable_ms`` in the JSON; targets: <= 8 ms and <= 0.5x CUDA IPC on the H200,
<= 10 ms and no slower than load_file on the CPU VM). Each way also reports the engine
process's CPU time for the same span (``cpu_p50``; ``time.process_time``, every thread,
so the client's prefetch thread counts, and no waiting): on a machine others keep busy
the wall times move with their load, the CPU times much less. The checkpoint is written by
``safetensors.torch.save_file`` (mode 0600), as users' files are. ``--base DIR`` adds
engines that import weightcache from DIR (the directory holding another version's
``weightcache/``, e.g. from ``git archive``; each engine's ``package`` says which copy it
imported), alternating with the rest: two versions compared in one run, against
the same daemon (this version's) and the same anchors.

Prints one JSON object: the setup, every process's phases, and median / min / max / p90
of each phase over the processes, per client (``summary.sync``, ``summary.async``). Without ``--socket`` it writes a synthetic checkpoint
(kept in ``--dir`` for the next run), starts a daemon, loads the model and stops the
daemon at the end. A warm-up process (not counted) runs first, so every measured one
finds Python's bytecode cache written.

    python -m benchmarks fresh-attach --device cuda:0 --size-gib 9.15 --tensors 183 --procs 7 --anchors
    python -m benchmarks fresh-attach --device cpu --size-gib 0.5 --tensors 100 --procs 5
    python -m benchmarks fresh-attach --device cpu --size-gib 0.25 --tensors 200 --procs 20 --no-breakdown
    python -m benchmarks fresh-attach --socket /run/weightcache/weightcache.sock --model qwen-7b --device cuda:0
"""

# ruff: noqa: E402  (a measured engine imports torch before the rest of this script's imports)
from __future__ import annotations

import sys
import time

_STARTED = time.perf_counter()
if "--child" in sys.argv:
    # A measured engine imports torch first, before anything of this script: what a
    # process imported before torch changes the state torch leaves the cyclic GC in
    # ((41, 9, 9) with this script's imports first, (494, 8, 9) with torch alone; issue
    # 23), and with it whether a gen-1 collection of torch's objects falls between the
    # import of the client and usable tensors.
    import torch  # noqa: F401

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

RESULT = "RESULT "
PHASES = ["import_ms", "import_cpu_ms", "connect_ms", "connect_cpu_ms", "attach_cpu_ms",
          "import_mapping_ms", "attach_ms", "driver_load_ms", "request_ms", "map_ms", "driver_map_ms", "set_access_ms",
          "views_ms", "connect_to_usable_ms", "first_touch_ms", "second_attach_ms", "gc_ms"]
TARGET_MS = 5.0
CLIENTS = ("sync", "async")
RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default


# ------------------------------------------------------------------------------ the engine
def child(sock: str, model: str, device: str, breakdown: bool, client: str) -> dict[str, Any]:
    t0 = _STARTED  # the floor counts from the process's first line: torch was imported there
    import torch

    cuda = device.startswith("cuda")
    if cuda:
        torch.empty(1, device=device)  # the engine's CUDA context: part of every engine's start
        torch.cuda.synchronize(device)
    loop = asyncio.new_event_loop() if client == "async" else None  # an asyncio engine's own loop
    floor_ms = (time.perf_counter() - t0) * 1e3
    before = set(sys.modules)
    out: dict[str, Any] = {"client": client, "floor_ms": floor_ms}
    import gc

    out["gc_count_at_import"] = gc.get_count()  # the state the span starts from: (494, 8, 9) after torch alone
    gc_log = _log_collections()

    t, cpu = time.perf_counter(), time.process_time()
    # Only the client this engine uses: a SyncClient engine imports no asyncio client.
    if client == "sync":
        from weightcache import SyncClient
    else:
        from weightcache import Client

    out["import_ms"] = (time.perf_counter() - t) * 1e3
    out["import_cpu_ms"] = (time.process_time() - cpu) * 1e3
    out["package"] = os.path.dirname(sys.modules["weightcache"].__file__ or "")  # which copy was timed (--base)
    times: dict[str, float] = {}
    if breakdown:
        t = time.perf_counter()
        from weightcache.client import mapping, sync

        if cuda:
            from weightcache.client import cuda_mapping, libcuda
        out["import_mapping_ms"] = (time.perf_counter() - t) * 1e3
        _timed(mapping, "tensor_views", "views_ms", times)
        _timed(mapping, "file_tensor_views", "views_ms", times)
        if cuda:
            _timed(cuda_mapping, "map_vmm", "map_ms", times)
            _timed(libcuda.Driver, "import_and_map", "driver_map_ms", times)
            _timed(libcuda.Driver, "set_access", "set_access_ms", times)
            _timed(libcuda, "load", "driver_load_ms", times)
        else:
            _timed(mapping, "map_memfd", "map_ms", times)
        transport: Any = sync.BlockingConnection
        if client == "async":
            from weightcache.client import aio

            transport = aio.Connection
        request = transport._request

        async def timed_request(self: Any, op: str, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await request(self, op, *args, **kwargs)
            finally:
                if op == "attach":
                    times["request_ms"] = times.get("request_ms", 0.0) + (time.perf_counter() - t) * 1e3

        transport._request = timed_request
    else:
        out["import_mapping_ms"] = 0.0  # inside attach_ms then

    where = device if cuda else None
    if loop is None:
        out.update(_sync_engine(SyncClient, sock, model, where, times))
    else:
        out.update(loop.run_until_complete(_async_engine(Client, sock, model, where, times)))
        loop.close()
    out["connect_to_usable_ms"] = out["connect_ms"] + out["import_mapping_ms"] + out["attach_ms"]
    out["gc_gens"] = [gen for gen, _ in gc_log[: out.pop("gc_until")]]
    out["gc_ms"] = sum(ms for _, ms in gc_log[: len(out["gc_gens"])])
    new = set(sys.modules) - before
    out["cuda_bindings_imported"] = any(m == "cuda.bindings" or m.startswith("cuda.bindings.") for m in new)
    out["new_top_level_modules"] = sorted({m.split(".")[0] for m in new})
    if cuda:
        from weightcache.client import libcuda

        out["driver_version"] = libcuda.driver().version()
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    import importlib.util

    import weightcache

    pyc = importlib.util.cache_from_source(str(Path(weightcache.__file__)))
    out["bytecode_cached"] = os.path.exists(pyc)
    out["torch"] = torch.__version__
    out["python"] = sys.version.split()[0]
    return out


_GC_LOG: list[tuple[int, float]] = []


def _log_collections() -> list[tuple[int, float]]:
    """From now on, record each cyclic-GC collection as (generation, ms) in the list returned."""
    import gc

    started = [0.0]

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            _GC_LOG.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    gc.callbacks.append(note)
    return _GC_LOG


def _collections_so_far() -> int:
    return len(_GC_LOG)


def _free_device_bytes(device: str | None) -> int:
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0]) if device else 0


def _touch(weights: Any, out: dict[str, Any], free0: int, device: str | None) -> None:
    """Record the tensors; read one element of the first and last back (timed)."""
    if device:  # before any kernel runs: torch loads kernels lazily, into device memory
        out["extra_device_bytes"] = free0 - _free_device_bytes(device)
    t = time.perf_counter()
    tensors = list(weights.values())
    for x in (tensors[0], tensors[-1]):
        float(x.reshape(-1)[0].float())
    out["first_touch_ms"] = (time.perf_counter() - t) * 1e3
    out["tensors"] = len(tensors)
    out["nbytes"] = weights.nbytes


def _sync_engine(sync_client: Any, sock: str, model: str, device: str | None, times: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    free0 = _free_device_bytes(device)
    t, cpu = time.perf_counter(), time.process_time()
    c = sync_client(sock, name="fresh-attach")
    out["connect_ms"], out["connect_cpu_ms"] = (time.perf_counter() - t) * 1e3, (time.process_time() - cpu) * 1e3
    with c:
        t, cpu = time.perf_counter(), time.process_time()
        cm = c.attach(model, device=device)
        weights = cm.__enter__()
        out["attach_ms"], out["attach_cpu_ms"] = (time.perf_counter() - t) * 1e3, (time.process_time() - cpu) * 1e3
        out["gc_until"] = _collections_so_far()
        out.update({k: round(v, 4) for k, v in times.items()})
        times.clear()
        _touch(weights, out, free0, device)
        del weights
        cm.__exit__(None, None, None)
        t = time.perf_counter()
        with c.attach(model, device=device) as again:
            out["second_attach_ms"] = (time.perf_counter() - t) * 1e3
            assert len(again) == out["tensors"]
    return out


async def _async_engine(client: Any, sock: str, model: str, device: str | None, times: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    free0 = _free_device_bytes(device)
    t, cpu = time.perf_counter(), time.process_time()
    c = await client(sock, name="fresh-attach").connect()
    out["connect_ms"], out["connect_cpu_ms"] = (time.perf_counter() - t) * 1e3, (time.process_time() - cpu) * 1e3
    try:
        t, cpu = time.perf_counter(), time.process_time()
        cm = c.attach(model, device=device)
        weights = await cm.__aenter__()
        out["attach_ms"], out["attach_cpu_ms"] = (time.perf_counter() - t) * 1e3, (time.process_time() - cpu) * 1e3
        out["gc_until"] = _collections_so_far()
        out.update({k: round(v, 4) for k, v in times.items()})
        times.clear()
        _touch(weights, out, free0, device)
        del weights
        await cm.__aexit__(None, None, None)
        t = time.perf_counter()
        async with c.attach(model, device=device) as again:
            out["second_attach_ms"] = (time.perf_counter() - t) * 1e3
            assert len(again) == out["tensors"]
    finally:
        await c.close()
    return out


def _timed(owner: Any, name: str, key: str, times: dict[str, float]) -> None:
    """Replace ``owner.name`` with a wrapper adding its wall time to ``times[key]``. A name
    the client does not have (an older one, measured beside this one) is left out."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key] = times.get(key, 0.0) + (time.perf_counter() - t) * 1e3

    setattr(owner, name, wrapper)


# ------------------------------------------------------------------------------ the parent
def run_child(sock: str, model: str, device: str, breakdown: bool, client: str, src: str | None = None,
              base: str | None = None) -> dict[str, Any]:
    """One fresh engine process. ``src``: a source-only copy of the package (restart.py's
    source_only_package), imported with PYTHONDONTWRITEBYTECODE=1: no bytecode. ``base``:
    a directory holding another version of the package (``--base``), bytecode cached."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # engines have their bytecode cached
    if src is not None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if src is not None or base is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src or base, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--child", "--socket", sock, "--model", model, "--device", device, "--client", client]
    if not breakdown:
        cmd.append("--no-breakdown")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith(RESULT)]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"engine process failed ({r.returncode}): {r.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT):])
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for phase in PHASES:
        xs = sorted(r[phase] for r in results if phase in r)
        if xs:
            out[phase] = {"p50": round(statistics.median(xs), 3), "min": round(xs[0], 3), "max": round(xs[-1], 3),
                          "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 3)}
    return out


def start_daemon(args: argparse.Namespace, work: Path) -> tuple[Any, str, str, float]:
    """Write (or reuse) the checkpoint, start a daemon with it, load it. Returns the daemon,
    its socket, the model's name and the load's seconds."""
    from weightcache import Client
    from weightcache.tools.spawn import DaemonProcess, config_text
    from weightcache.tools.synth import write_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"fresh-{args.size_gib:g}gib-{args.tensors}t.safetensors"
    if not ckpt.exists():
        print(f"writing {ckpt} ...", file=sys.stderr, flush=True)
        tmp = ckpt.with_suffix(".tmp.safetensors")
        write_checkpoint(tmp, int(args.size_gib * 2**30), args.tensors)
        tmp.rename(ckpt)
    sockdir = tempfile.mkdtemp(prefix="wc-fa-", dir="/tmp")  # Unix socket paths are short
    sock = os.path.join(sockdir, "d.sock")
    budget = f"{int(args.size_gib * 1.25) + 1}GiB"
    budgets = {"cpu": budget} if args.device == "cpu" else {"cpu": "1GiB", args.device: budget}
    cfg = work / "fresh-attach.toml"
    cfg.write_text(config_text(sock, budgets, [{"name": "fresh", "path": str(ckpt), "device": args.device}],
                               {"log_level": "warning"}))
    daemon = DaemonProcess(cfg, sock, work / "fresh-attach-daemon.log").start()

    async def load() -> float:
        async with Client(sock) as c:
            t = time.perf_counter()
            await c.load("fresh")
            return time.perf_counter() - t

    return daemon, sock, "fresh", asyncio.run(load())


def time_restarts(args: argparse.Namespace, sock: str, model: str) -> dict[str, Any]:
    """The bench's restart rows (weightcache/tools/restart.py): a fresh engine process to
    ready, ``floor`` (import torch + CUDA init), ``disk`` (+ load_file) and ``cache`` (+
    import the client, connect, attach), interleaved, page cache warm. ``weights_s`` is
    the in-process weights step, timed after torch and CUDA are ready: the target
    for ``cache`` is within 20 ms of the floor, i.e. a weights step <= 20 ms."""
    from weightcache.tools.bench_measure import warm_page_cache
    from weightcache.tools.restart import time_restart

    ckpt = str(Path(args.dir) / f"fresh-{args.size_gib:g}gib-{args.tensors}t.safetensors")
    warm_page_cache(ckpt)
    runs: dict[str, list[Any]] = {"floor": [], "disk": [], "cache": []}
    for _ in range(args.restarts):
        for mode in runs:
            runs[mode].append(time_restart(mode, files=[ckpt], model=model, socket=sock, device=args.device))

    def spread(xs: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}

    out: dict[str, Any] = {mode: {"ready_s": spread([r.ready_s for r in rs]), "weights_ms": spread([r.weights_s * 1e3 for r in rs]),
                                  "runs": [dataclasses.asdict(r) for r in rs]} for mode, rs in runs.items()}
    out["checksums_equal"] = len({r.checksum for r in runs["disk"] + runs["cache"]}) == 1
    print(f"restarts ({args.restarts} each, medians): floor {out['floor']['ready_s']['median']:.3f} s, "
          f"disk {out['disk']['ready_s']['median']:.3f} s (weights step {out['disk']['weights_ms']['median']:.1f} ms), "
          f"cache {out['cache']['ready_s']['median']:.3f} s (weights step {out['cache']['weights_ms']['median']:.1f} ms); "
          f"identical weights: {out['checksums_equal']}", file=sys.stderr, flush=True)
    return out


def time_anchors(args: argparse.Namespace, sock: str, model: str, clients: tuple[str, ...]) -> dict[str, Any]:
    """The comparison: import -> usable tensors in fresh processes, side by side,
    alternating: weightcache (bytecode cached, and compiled from source), a fresh
    process's load_file of the same file, and on a GPU the same tensors as torch CUDA IPC
    handles from a process that holds them (weightcache/tools/restart.py)."""
    from weightcache.tools.bench_measure import warm_page_cache
    from weightcache.tools.restart import ipc_holder, source_only_package, time_restart

    ckpt = str(Path(args.dir) / f"fresh-{args.size_gib:g}gib-{args.tensors}t.safetensors")
    warm_page_cache(ckpt)
    ways: dict[str, list[tuple[float, float]]] = {f"weightcache_{c}": [] for c in clients}
    ways.update({f"weightcache_{c}_no_bytecode": [] for c in clients})
    if args.base:
        ways.update({f"weightcache_{c}_base": [] for c in clients})
    ways["load_file"] = []
    cuda = args.device.startswith("cuda")
    with source_only_package() as src, contextlib.ExitStack() as stack:
        held = stack.enter_context(ipc_holder([ckpt], args.device, sock + ".ipc")) if cuda else None
        if held is not None:
            ways["cuda_ipc"] = []
        for c in clients:  # warm-ups, not counted: the bytecode, the page cache, the daemon
            run_child(sock, model, args.device, False, c)
            if args.base:
                run_child(sock, model, args.device, False, c, base=args.base)
        runs: list[tuple[str, Any]] = []
        for c in clients:
            runs.append((f"weightcache_{c}", functools.partial(_import_to_usable_of, sock, model, args.device, c, None)))
            runs.append((f"weightcache_{c}_no_bytecode", functools.partial(_import_to_usable_of, sock, model, args.device, c, src)))
            if args.base:
                runs.append((f"weightcache_{c}_base",
                             functools.partial(_import_to_usable_of, sock, model, args.device, c, None, args.base)))
        runs.append(("load_file", lambda: _weights_ms(time_restart("disk", files=[ckpt], model=model, socket=sock,
                                                                   device=args.device))))
        if held is not None:
            runs.append(("cuda_ipc", lambda: _weights_ms(time_restart("ipc", files=[ckpt], model=model, socket=sock, device=args.device,
                                                                      ipc_socket=held))))
        for i in range(args.procs):
            # Each round starts one way later, so that every way follows every other alike.
            for way, measure in runs[i % len(runs):] + runs[:i % len(runs)]:
                ways[way].append(measure())
                if cuda:
                    # A process's device memory and context are freed by the driver after it
                    # exits: without a pause that may fall on the next process's time (in
                    # runs without it weightcache's processes were ~12 ms p50 beside the
                    # others against ~9 ms for the same phases back to back).
                    time.sleep(args.settle_s)
    out: dict[str, Any] = {}
    for way, pairs in ways.items():
        wall, cpu = [w for w, _ in pairs], [c for _, c in pairs]
        out[way] = {"p50": round(statistics.median(wall), 3), "min": round(min(wall), 3), "max": round(max(wall), 3),
                    "runs": [round(x, 3) for x in wall],
                    # the engine process's CPU time for the same span (every thread, no waits)
                    "cpu_p50": round(statistics.median(cpu), 3), "cpu_min": round(min(cpu), 3), "cpu_max": round(max(cpu), 3)}
        if way in _ANCHOR_GC:  # the weightcache ways: how much of the span was the cyclic GC's (load_file's is not known)
            out[way]["gc_p50"] = round(statistics.median(_ANCHOR_GC[way]), 3)
            out[way]["gc_runs"] = [round(x, 3) for x in _ANCHOR_GC[way]]
    for way in ("load_file", "cuda_ipc", f"weightcache_{clients[0]}_base"):
        if way in out:
            mine, theirs = out[f"weightcache_{clients[0]}"], out[way]
            out[f"weightcache_{clients[0]}_over_{way}"] = round(mine["p50"] / theirs["p50"], 3)
            out[f"weightcache_{clients[0]}_over_{way}_cpu"] = round(mine["cpu_p50"] / theirs["cpu_p50"], 3)
    if "cuda_ipc" in out and args.base:
        mine, theirs = out[f"weightcache_{clients[0]}_base"], out["cuda_ipc"]
        out[f"weightcache_{clients[0]}_base_over_cuda_ipc"] = round(mine["p50"] / theirs["p50"], 3)
    line = ", ".join(f"{way} {v['p50']:.2f} ms (cpu {v['cpu_p50']:.2f})" for way, v in out.items() if isinstance(v, dict))
    print(f"import -> usable tensors, p50 of {args.procs}: {line}", file=sys.stderr, flush=True)
    return out


def _import_to_usable(r: dict[str, Any]) -> tuple[float, float]:
    """Wall and CPU milliseconds from the import to usable tensors."""
    return (float(r["import_ms"] + r["connect_ms"] + r["attach_ms"]),
            float(r["import_cpu_ms"] + r["connect_cpu_ms"] + r["attach_cpu_ms"]))


_ANCHOR_GC: dict[str, list[float]] = {}  # way -> each process's ms in GC collections within the span


def _import_to_usable_of(sock: str, model: str, device: str, client: str, src: str | None,
                         base: str | None = None) -> tuple[float, float]:
    r = run_child(sock, model, device, False, client, src, base)
    if base is not None and not Path(r["package"]).resolve().is_relative_to(Path(base).resolve()):
        raise RuntimeError(f"--base {base}: the engine imported weightcache from {r['package']}")
    way = f"weightcache_{client}" + ("_no_bytecode" if src is not None else "_base" if base is not None else "")
    _ANCHOR_GC.setdefault(way, []).append(r["gc_ms"])
    return _import_to_usable(r)


def _weights_ms(r: Any) -> tuple[float, float]:
    return r.weights_s * 1e3, (r.weights_cpu_s or 0.0) * 1e3


def _child_main(argv: list[str]) -> None:
    """A measured engine's arguments, read without argparse: building the parser made
    hundreds of GC-tracked objects between torch's import and the timed span."""
    pairs = [a for a in argv if a != "--no-breakdown"]
    opts = dict(zip(pairs[::2], pairs[1::2], strict=True))
    result = child(opts["--socket"], opts["--model"], opts["--device"], "--no-breakdown" not in argv, opts["--client"])
    print(RESULT + json.dumps(result), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child_main(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default cuda:0)")
    ap.add_argument("--size-gib", type=float, default=9.15, help="synthetic checkpoint size (default 9.15: 10 x 1 GiB chunks)")
    ap.add_argument("--tensors", type=int, default=183)
    ap.add_argument("--procs", type=int, default=7, help="fresh processes to measure (default 7)")
    ap.add_argument("--socket", help="a running daemon's socket (then --model names a model it has)")
    ap.add_argument("--model", default="fresh")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "wc-fresh-attach"), help="where the checkpoint is kept")
    ap.add_argument("--no-breakdown", action="store_true", help="time only the whole phases (no wrappers)")
    ap.add_argument("--client", choices=[*CLIENTS, "both"], default="both",
                    help="SyncClient, the async Client, or both alternating (default)")
    ap.add_argument("--restarts", type=int, default=0,
                    help="also time N engine restarts each way (floor, disk, cache), interleaved: "
                         "`weightcache bench`'s restart rows, without the rest of the bench")
    ap.add_argument("--anchors", action="store_true",
                    help="also time import -> usable tensors side by side: weightcache with and without bytecode, a fresh "
                         "load_file of the same file and, on a GPU, torch CUDA IPC handles of the same tensors")
    ap.add_argument("--settle-s", type=float, default=1.0, help="with --anchors on a GPU: pause after every process")
    ap.add_argument("--base", help="with --anchors: also time engines that import weightcache from this directory, the one "
                                   "holding another version's weightcache/ (e.g. from `git archive`), alternating with the rest")
    ap.add_argument("--out", type=Path, default=RESULTS / "fresh-attach.json", help="also write the JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(RESULT + json.dumps(child(args.socket, args.model, args.device, not args.no_breakdown, args.client)), flush=True)
        return

    daemon, load_s = None, None
    sock, model = args.socket, args.model
    if args.anchors and sock is not None:
        ap.error("--anchors needs the checkpoint this script writes: leave out --socket")
    if args.restarts and sock is not None:
        ap.error("--restarts needs the checkpoint this script writes: leave out --socket")
    if args.base and not args.anchors:
        ap.error("--base adds a way to --anchors' comparison: give --anchors too")
    if args.base and not (Path(args.base) / "weightcache" / "__init__.py").is_file():
        ap.error(f"--base {args.base}: no weightcache/__init__.py there (give the directory that holds the package)")
    if sock is None:
        daemon, sock, model, load_s = start_daemon(args, Path(args.dir))
    restarts: dict[str, Any] | None = None
    anchors: dict[str, Any] | None = None
    clients = CLIENTS if args.client == "both" else (args.client,)
    try:
        warmup = [run_child(sock, model, args.device, not args.no_breakdown, c) for c in clients]  # bytecode cache; not counted
        results: dict[str, list[dict[str, Any]]] = {c: [] for c in clients}
        for _ in range(args.procs):
            for c in clients:  # alternating, so that drift weighs on both alike
                results[c].append(run_child(sock, model, args.device, not args.no_breakdown, c))
        if args.restarts:
            restarts = time_restarts(args, sock, model)
        if args.anchors:
            anchors = time_anchors(args, sock, model, clients)
    finally:
        if daemon is not None:
            daemon.stop()
    s = {c: summary(rs) for c, rs in results.items()}
    first = results[clients[0]][0]
    report = {
        "what": "fresh engine process: torch + CUDA ready, then import weightcache, connect, first attach -> usable tensors",
        "device": args.device, "model": model, "procs": args.procs, "daemon_load_s": load_s,
        "tensors": first.get("tensors"), "nbytes": first.get("nbytes"), "breakdown": not args.no_breakdown,
        "target_connect_to_usable_p50_ms": TARGET_MS,
        "met": {c: s[c]["connect_to_usable_ms"]["p50"] <= TARGET_MS for c in clients},
        "connect_to_usable_p50_ms": {c: s[c]["connect_to_usable_ms"]["p50"] for c in clients},
        "summary": s,
        "restarts": restarts,
        "import_to_usable_ms": anchors,
        "warmup": warmup,
        "runs": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
