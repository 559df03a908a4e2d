"""The CLI's commands: each talks to the daemon (or runs a local tool) and decides the exit
status; render.py prints what they got. Heavy things (the daemon and its config loading,
the attach/verify path, rich, the bench and the demo) are imported inside the commands
that use them: every command pays for what this module imports, and the probes run
``weightcache health`` often.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.file import daemon_socket
from ..errors import ConfigError, WeightcacheError
from ..units import parse_duration
from .render import print_json, show_models, show_ps, show_reload, show_status, size


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ..client import Client

    # An operator's command and a health probe answer about now: no waiting for a
    # daemon that is not running (engines wait; see Client's wait_for_daemon).
    return Client(args.socket or daemon_socket(args.config), name="weightcache-cli", wait_for_daemon=0)


def _result(args: argparse.Namespace, result: Any, show: Callable[[Any], None]) -> int:
    """Print a reply: as JSON with --json, else for people."""
    if args.json:
        print_json(result)
    else:
        show(result)
    return 0


async def cmd_status(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        st = await c.status()
    return _result(args, st, show_status)


async def cmd_models(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        models = await c.models()
    return _result(args, models, show_models)


async def cmd_ps(args: argparse.Namespace) -> int:
    """Like `ollama ps`: what holds memory now, who holds it, and until when."""
    async with _client(args) as c:
        resident = (await c.status())["resident"]
    return _result(args, resident, show_ps)


async def cmd_load(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    async with _client(args) as c:
        before = {m["name"]: m for m in await c.models()}
        # The whole reply: a sharded model's every rank is under "shards" (Client.load returns rank 0's).
        job = asyncio.ensure_future(c.request("load", name=args.name, device=args.device, rank=args.rank, wait_s=args.wait,
                                              keep_alive=args.keep_alive))
        console = Console(stderr=True)  # stdout keeps only the result, for scripts
        quiet = args.quiet or args.json or not console.is_terminal
        with Progress("[bold]{task.description}", BarColumn(), TextColumn("{task.fields[sizes]}"),
                      TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), console=console, transient=True,
                      disable=quiet) as bar:
            # Shown only once the daemon knows the size: a small load is often done before
            # the first poll, and a bar without a total would read "0/? bytes".
            task = bar.add_task(f"load {args.name}", total=None, visible=False, sizes="", rate="")
            while not job.done():
                await asyncio.wait([job], timeout=0.2)
                loading = (await c.status())["loading"]
                # an auto model loads as one of its replicas: the entry is the model's
                p = loading.get(args.name) or next((v for v in loading.values() if v.get("model") == args.name), None)
                if p and p["bytes_total"]:
                    bar.update(task, visible=True, completed=p["bytes_done"], total=p["bytes_total"],
                               sizes=f"{size(p['bytes_done'])} / {size(p['bytes_total'])}",
                               rate=f"{size(p['bytes_per_s'])}/s")
        reply = await job
        model, shards = reply["model"], reply.get("shards") or [reply["model"]]
        after = await c.models()
    # What left its device while this load ran: the room it made (or, rarely, what a
    # concurrent eviction took); the daemon counts every model's evictions. Not the model
    # itself: its own stale copy, dropped because its files changed, made no room for it.
    loaded = {s["name"] for s in shards}
    evicted = [{"name": m["name"], "nbytes": before[m["name"]]["nbytes"], "state": m["state"]} for m in after
               if m["name"] in before and m["name"] not in loaded and m["evictions"] > before[m["name"]]["evictions"]]
    if args.json:
        print_json({"model": model, "shards": shards, "evicted": evicted})
        return 0
    for s in shards:  # every rank of a sharded model, each on its own device
        rank = f" (rank {s['rank']})" if s.get("rank") is not None else ""
        print(f"{s['name']}{rank}: {s['state']} on {s['device']}, {size(s['nbytes'])}, {s['tensors']} tensors")
        if s.get("placement"):
            print(f"placed on {s['placement']['detail']}")
    if evicted:
        print("evicted to make room: " + ", ".join(
            f"{e['name']} ({size(e['nbytes'])}{', to the host tier' if e['state'] == 'host' else ''})" for e in evicted))
    return 0


async def cmd_evict(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        result = await c.evict(args.name)
    if args.json:
        print_json(result)
    elif not result["evicted"]:
        print(f"{args.name}: nothing to evict ({result['state']})")
    else:
        where = "moved to the host tier" if result["state"] == "host" else "evicted"
        print(f"{args.name}: {where}, {size(result['freed'])} freed")
    return 0


async def cmd_pin(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        model = await (c.pin(args.name) if args.command == "pin" else c.unpin(args.name))
    if args.json:
        print_json(model)
    else:
        print(f"{args.name}: {'pinned' if model['pinned'] else 'not pinned'} ({model['state']} on {model['device']}"
              f"{', ' + size(model['nbytes']) if model['nbytes'] else ''})")
    return 0


async def cmd_register(args: argparse.Namespace) -> int:
    if (args.path is None) == (not args.shard):
        print("weightcache register: give PATH, or one --shard DEVICE=PATH per rank", file=sys.stderr)
        return 2
    negative = (args.keep_alive or "").strip().startswith("-")
    try:
        keep_alive = None if args.keep_alive is None or negative else parse_duration(args.keep_alive)
    except ValueError as exc:
        print(f"weightcache register: --keep-alive: {exc}", file=sys.stderr)
        return 2
    if negative or (keep_alive is not None and keep_alive <= 0):
        # load/attach take 0 and -1; a registered model's keep_alive is a time, as in the config
        print(f"weightcache register: --keep-alive {args.keep_alive}: give a time > 0 such as 30m, or leave it out to "
              "keep the model until its memory is needed (0 and -1 are for `weightcache load --keep-alive`)",
              file=sys.stderr)
        return 2
    shards = None
    if args.shard:
        shards = []
        for spec in args.shard:
            device, eq, path = spec.partition("=")
            if not eq or not device or not path:
                print(f"weightcache register: --shard {spec!r}: expected DEVICE=PATH, e.g. cuda:0=/models/m/rank0",
                      file=sys.stderr)
                return 2
            # Absolute: with --by-path the daemon opens it, from its own working directory.
            shards.append({"device": device, "path": str(Path(path).absolute())})
    path = None if args.path is None else str(Path(args.path).absolute())
    from ..loader.sources import unindexed_note

    for part in [path] if path else [s["path"] for s in shards or []]:
        note = unindexed_note(part)
        if note is not None:  # merged into one model; said before, in case that is not what was meant
            print(f"weightcache: note: {note}", file=sys.stderr)
    async with _client(args) as c:
        model = await c.register(args.name, path, device=args.device, shards=shards, pin=args.pin, preload=args.preload,
                                 keep_alive=keep_alive, send_files=not args.by_path, allowed_uids=args.allow_uid,
                                 allowed_gids=[int(g) if g.isdigit() else g for g in args.allow_group] if args.allow_group else None)
    if args.json:
        print_json(model)
    else:
        sent = "the daemon opened the paths" if args.by_path else "sent as open files"
        print(f"registered {model['name']}: {model['state']} on {model['device']}"
              f"{f' and {len(shards) - 1} more rank(s)' if shards and len(shards) > 1 else ''} ({sent}); "
              "kept across reloads until `weightcache unregister`, unless the config file comes to name it")
    # Loud, on stderr, with --json too: a runtime registration lives in the daemon's memory
    # only (a peer's open files cannot be kept across a restart at all; docs/deployment.md).
    print(f"weightcache: note: {model['name']} is not kept when the daemon restarts; to keep it, add it to the "
          "config file as a [[models]] entry and run `weightcache reload`", file=sys.stderr)
    return 0


async def cmd_unregister(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        await c.unregister(args.name)
    if args.json:
        print_json({"unregistered": args.name})
    else:
        print(f"unregistered {args.name}")
    return 0


async def cmd_reload(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        report = await c.reload()
    # One rule: a change that did not take effect (failed), or not yet (pending), is a
    # non-zero exit, so that scripts and `systemctl reload` see it.
    status = 1 if report.get("failed") or report.get("pending") else 0
    if args.json:
        print_json(report)
        return status
    show_reload(report)
    return status


async def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the daemon serves (with --ready: and its preloads are done), else 1:
    what a liveness or readiness probe runs."""
    async with _client(args) as c:
        h = await c.health()
    if args.json:
        print_json(h)
    ok = h["ready"] if args.ready else h["serving"]
    if not ok:
        reasons = [] if h["serving"] else ["shutting down"]
        if h["preloading"]:
            reasons.append(f"preloading {', '.join(h['preloading'])}")
        reasons += [f"preload of {name} failed: {err}" for name, err in h["failed_preloads"].items()]
        print(f"weightcache: not {'ready' if args.ready else 'serving'}: {'; '.join(reasons)}", file=sys.stderr)
        return 1
    if not args.json:
        print("ready" if h["ready"] else f"serving; not ready: {len(h['preloading'])} preloading, "
              f"{len(h['failed_preloads'])} failed")
    return 0


async def cmd_attach(args: argparse.Namespace) -> int:
    # The first attach of a process imports torch (the mapping's tensors): 1.3-2.0 s on the
    # dev VM, which "attached in ... ms" reported as the attach's own time. Import it first.
    import weightcache.client.mapping  # noqa: F401

    async with _client(args) as c:
        t0 = time.perf_counter()
        async with c.attach(args.name, rank=args.rank, keep_alive=args.keep_alive) as m:
            dt = time.perf_counter() - t0
            # The size the budget counts, as `models` and `ps` show it (the tensors' own sum
            # is less: the arena's padding and what the daemon holds for the checkpoint).
            nbytes = m.budget_bytes if m.budget_bytes is not None else m.nbytes
            result: dict[str, Any] = {"name": m.name, "rank": args.rank, "lease": m.lease, "tensors": len(m),
                                      "nbytes": nbytes, "tensor_bytes": m.nbytes, "device": m.device,
                                      "attach_ms": dt * 1e3, "fingerprint": m.fingerprint}
            if not args.json:
                rank = f" rank {args.rank}" if args.rank is not None else ""
                print(f"attached {m.name}{rank}: lease {m.lease}, {len(m)} tensors, {size(nbytes)} on {m.device} "
                      f"in {dt * 1e3:.2f} ms; fingerprint {m.fingerprint[:16]}")
            if args.verify:
                entry = next(x for x in await c.models() if (x["name"] == args.name if args.rank is None else
                                                             x["shard_of"] == args.name and x["rank"] == args.rank))
                path = entry["path"]
                if entry["origin"] == "publish" or path is None:
                    # Was the loader's "published:NAME: checkpoint path does not exist".
                    why = ("it was published by an engine and has no files" if entry["origin"] == "publish" else
                           "the daemon shows its files only to its owner and admins")
                    print(f"weightcache attach: --verify {args.name}: nothing to compare with: {why}", file=sys.stderr)
                    return 2
                from ..client.verify import verify_against_files

                bad = await asyncio.to_thread(verify_against_files, m, path)
                result["differ"] = bad
                if not args.json:
                    print(f"VERIFY FAILED: {len(bad)} tensor(s) differ from {path}: {bad[:10]}" if bad
                          else f"verified: all {len(m)} tensors equal the bytes in {path}")
            if args.json:
                print_json(result)
            if args.verify and result["differ"]:
                return 1
            if args.hold:
                if not args.json:
                    print(f"holding the lease for {args.hold}s")
                await asyncio.sleep(args.hold)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ..config import load_settings
    from ..server import run_daemon

    if args.config_file:  # `weightcache serve FILE`, as an operator writes it first
        if args.config and args.config != args.config_file:
            raise ConfigError(f"two config files: --config {args.config} and {args.config_file}; give one")
        args.config = args.config_file
    if args.socket:
        # Through the environment, as $WEIGHTCACHE_SOCKET would: a reload re-reads the file
        # with it, so the socket the daemon serves on is not taken for a changed key.
        os.environ["WEIGHTCACHE_SOCKET"] = str(args.socket)
    settings = load_settings(args.config)
    if args.socket:
        settings = settings.model_copy(update={"daemon": settings.daemon.model_copy(update={"socket": args.socket})})
    return run_daemon(settings, args.config)  # 2 when it could not start: the reason is logged


def cmd_demo(args: argparse.Namespace) -> int:
    from ..tools.demo import run_demo

    return run_demo(workdir=args.workdir, restarts=args.restarts, model_mib=args.model_mib)


def _no_such_device(device: str) -> str | None:
    """Why the benchmarks cannot use ``device`` here, or None: on a host without a GPU
    `bench --device cuda:0` (the README's command) ended in torch's traceback."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return "this host has no CUDA device torch can use (a CPU-only torch, or no GPU); use --device cpu"
    ident = device.partition(":")[2]
    if ident.isdigit() and int(ident) >= torch.cuda.device_count():
        return f"this host has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _redraw(chart: str, write_chart: Callable[[Any, Path], bool]) -> int:
    """Draw the chart of an earlier run's JSON (``--chart``), as a PNG beside it."""
    png = Path(chart).with_suffix(".png")
    if not write_chart(json.loads(Path(chart).read_text()), png):
        print("weightcache: the chart needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 1
    print(f"wrote {png}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.chart:
        from ..tools.bench_report import write_chart

        return _redraw(args.chart, write_chart)
    problem = _no_such_device(args.device)
    if problem:
        print(f"weightcache bench: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    from ..tools.bench import BenchConfig, run_bench, user_checkpoint

    tensors = args.tensors
    if args.checkpoint:
        try:
            _, tensors = user_checkpoint(args.checkpoint)
        except WeightcacheError as exc:
            print(f"weightcache bench: {exc.message}", file=sys.stderr)
            return 2
    return run_bench(BenchConfig(size_gib=args.size_gib, tensors=tensors, device=args.device, attaches=args.attaches,
                                 reps=args.reps, cold_reps=args.cold_reps, restarts=args.restarts, big_gib=args.big_gib,
                                 workdir=args.workdir, out=args.out, fresh=args.fresh, checkpoint=args.checkpoint))


def cmd_workload(args: argparse.Namespace) -> int:
    if args.chart:
        from ..tools.workload_report import write_chart as write_workload_chart

        return _redraw(args.chart, write_workload_chart)
    problem = None if args.write_trace else _no_such_device(args.device)
    if problem:
        print(f"weightcache workload: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    from ..tools.workload import run_workload, workload_config, write_trace_only

    try:
        cfg = workload_config(
            engines=args.engines, models=args.models, model_sizes=args.model_sizes, device=args.device, budget_models=args.budget_models,
            budget=args.budget, host_budget=args.host_budget, duration=args.duration, zipf=args.zipf, seed=args.seed, hold=args.hold,
            gap=args.gap, trace=args.trace, policies=args.policies, tensors=args.tensors, kill_every=args.kill_every, cold=args.cold,
            wait_s=args.wait_s, reps=args.reps, drain_s=args.drain_s, mem_slack=args.mem_slack, workdir=args.workdir, out=args.out)
        return write_trace_only(cfg, args.write_trace) if args.write_trace else run_workload(cfg)
    except ValueError as exc:
        print(f"weightcache workload: {exc}", file=sys.stderr)
        return 2


def cmd_supervise(args: argparse.Namespace) -> int:
    from ..supervise import SupervisorOptions, supervise

    preload = tuple(m.strip() for arg in args.preload for m in arg.split(",") if m.strip())
    exclude = tuple(m.strip() for arg in args.exclude for m in arg.split(",") if m.strip())
    return supervise(args.engine, SupervisorOptions(preload=preload, record=args.record, exclude=exclude, status=args.status,
                                                    stop_timeout_s=args.stop_timeout, backoff_max_s=args.backoff_max))
