"""``weightcache`` command line: parses arguments and calls into the package; no logic.

Kept light at import: the probes run ``weightcache health`` often, and every command pays
for what this module imports. Heavy things (the daemon and its config loading, the
attach/verify path, rich's tables, the bench and the demo) are imported inside the
commands that use them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from .errors import ConfigError, WeightcacheError
from .units import format_size


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .client import Client

    # An operator's command and a health probe answer about now: no waiting for a
    # daemon that is not running (engines wait; see Client's wait_for_daemon).
    return Client(args.socket, name="weightcache-cli", wait_for_daemon=0)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def _size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


async def cmd_status(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        st = await c.status()
    if args.json:
        _print_json(st)
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"weightcache {st['version']} (pid {st['pid']}, up {st['uptime_s']:.0f}s) on {st['socket']}")
    for col in ("device", "backend", "budget", "used", "reserved", "free"):
        t.add_column(col, justify="left" if col in ("device", "backend") else "right")
    for dev, d in st["devices"].items():
        t.add_row(dev, d["backend"], _size(d["budget"]), _size(d["used"]), _size(d["reserved"]), _size(d["free"]))
    console = Console()
    console.print(t)
    console.print(f"connections: {st['connections']}  leases: {st['leases']}")
    for name, p in st["loading"].items():
        console.print(f"loading {name}: {_size(p['bytes_done'])} / {_size(p['bytes_total'])} at {p['bytes_per_s'] / 1e9:.2f} GB/s")
    return 0


async def cmd_models(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        models = await c.models()
    if args.json:
        _print_json(models)
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table()
    for col in ("name", "state", "device", "size", "attached", "pinned", "loads", "evictions"):
        t.add_column(col, no_wrap=True)
    for m in models:
        t.add_row(m["name"], m["state"], m["device"], _size(m["nbytes"] or None), str(m["attach_count"]),
                  "yes" if m["pinned"] else "", str(m["loads"]), str(m["evictions"]))
    Console().print(t)
    return 0


async def cmd_load(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    async with _client(args) as c:
        job = asyncio.ensure_future(c.load(args.name, wait_s=args.wait))
        with Progress("[bold]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), transient=True, disable=args.quiet) as bar:
            task = bar.add_task(f"load {args.name}", total=None)
            while not job.done():
                await asyncio.wait([job], timeout=0.2)
                p = (await c.status())["loading"].get(args.name)
                if p:
                    bar.update(task, completed=p["bytes_done"], total=p["bytes_total"])
        model = await job
    print(f"{model['name']}: {model['state']} on {model['device']}, {_size(model['nbytes'])}, {model['tensors']} tensors")
    return 0


async def cmd_simple(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        result = await getattr(c, args.command)(args.name)
    _print_json(result)
    return 0


async def cmd_reload(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        _print_json(await c.reload())
    return 0


async def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the daemon serves (with --ready: and its preloads are done), else 1:
    what a liveness or readiness probe runs."""
    async with _client(args) as c:
        h = await c.health()
    if args.json:
        _print_json(h)
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
    async with _client(args) as c:
        t0 = time.perf_counter()
        async with c.attach(args.name) as m:
            dt = time.perf_counter() - t0
            print(f"attached {m.name}: lease {m.lease}, {len(m)} tensors, {_size(m.nbytes)} on {m.device} "
                  f"in {dt * 1e3:.2f} ms; fingerprint {m.fingerprint[:16]}")
            if args.verify:
                path = next(x["path"] for x in await c.models() if x["name"] == args.name)
                from .client.verify import verify_against_files

                bad = await asyncio.to_thread(verify_against_files, m, path)
                if bad:
                    print(f"VERIFY FAILED: {len(bad)} tensor(s) differ from {path}: {bad[:10]}")
                    return 1
                print(f"verified: all {len(m)} tensors equal the bytes in {path}")
            if args.hold:
                print(f"holding the lease for {args.hold}s")
                await asyncio.sleep(args.hold)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import load_settings
    from .server import run_daemon

    settings = load_settings(args.config)
    if args.socket:
        settings = settings.model_copy(update={"daemon": settings.daemon.model_copy(update={"socket": args.socket})})
    return run_daemon(settings, args.config)  # 2 when it could not start: the reason is logged


def cmd_demo(args: argparse.Namespace) -> int:
    from .tools.demo import run_demo

    return run_demo(workdir=args.workdir, restarts=args.restarts, model_mib=args.model_mib)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.chart:  # render the chart of an earlier run's JSON
        from .tools.bench_report import write_chart

        png = Path(args.chart).with_suffix(".png")
        if not write_chart(json.loads(Path(args.chart).read_text()), png):
            print("weightcache: the chart needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        print(f"wrote {png}")
        return 0
    from .tools.bench import BenchConfig, run_bench

    return run_bench(BenchConfig(size_gib=args.size_gib, tensors=args.tensors, device=args.device, attaches=args.attaches,
                                 reps=args.reps, cold_reps=args.cold_reps, restarts=args.restarts, big_gib=args.big_gib,
                                 workdir=args.workdir, out=args.out))


def cmd_workload(args: argparse.Namespace) -> int:
    if args.chart:  # render the chart of an earlier run's JSON
        from .tools.workload_report import write_chart as write_workload_chart

        png = Path(args.chart).with_suffix(".png")
        if not write_workload_chart(json.loads(Path(args.chart).read_text()), png):
            print("weightcache: the chart needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        print(f"wrote {png}")
        return 0
    from .tools.workload import run_workload, workload_config, write_trace_only

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightcache", description="Keep model weights resident; engines attach them zero-copy.")
    p.add_argument("--socket", help="daemon socket (default: $WEIGHTCACHE_SOCKET, else the config's, else /run/weightcache/weightcache.sock)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument("--config", help="TOML config (default: $WEIGHTCACHE_CONFIG)")
    s.set_defaults(func=cmd_serve)

    for name, fn, text in (("status", cmd_status, "devices, budgets, loads in progress"), ("models", cmd_models, "registered models")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--json", action="store_true")
        s.set_defaults(func=fn)

    s = sub.add_parser("health", help="exit 0 if the daemon serves (--ready: and its preloads are resident); for probes")
    s.add_argument("--ready", action="store_true", help="also require every configured preload to be resident")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_health)

    s = sub.add_parser("load", help="make a model resident, with a progress bar")
    s.add_argument("name")
    s.add_argument("--wait", type=float, default=None, help="seconds to wait for attached models to detach if memory is short")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=cmd_load)

    for name in ("evict", "pin", "unpin"):
        s = sub.add_parser(name, help=f"{name} a model")
        s.add_argument("name")
        s.set_defaults(func=cmd_simple)

    s = sub.add_parser("reload", help="make the daemon re-read its config file")
    s.set_defaults(func=cmd_reload)

    s = sub.add_parser("attach", help="attach a model and report; --verify compares every byte with the files")
    s.add_argument("name")
    s.add_argument("--verify", action="store_true")
    s.add_argument("--hold", type=float, default=0, help="keep the lease this many seconds")
    s.set_defaults(func=cmd_attach)

    s = sub.add_parser("demo", help="generate small models, run a daemon, restart an engine with and without the cache")
    s.add_argument("--workdir", default=None, help="where to put models and the socket (default: a temp dir)")
    s.add_argument("--restarts", type=int, default=3)
    s.add_argument("--model-mib", type=int, default=96)
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("bench", help="attach latency and control-plane latency vs safetensors.load_file")
    s.add_argument("--size-gib", type=float, default=1.0)
    s.add_argument("--tensors", type=int, default=200)
    s.add_argument("--device", default="cpu")
    s.add_argument("--attaches", type=int, default=200)
    s.add_argument("--reps", type=int, default=3, help="repetitions of each warm load")
    s.add_argument("--cold-reps", type=int, default=2, help="repetitions of each cold load (0: skip)")
    s.add_argument("--restarts", type=int, default=3, help="engine restarts per way")
    s.add_argument("--big-gib", type=float, default=3.0, help="size of the model loaded while status latency is measured")
    s.add_argument("--workdir", default=None)
    s.add_argument("--out", default=None, help="write results as JSON here (and a PNG chart beside it)")
    s.add_argument("--chart", default=None, metavar="JSON", help="only draw the chart of an earlier run's JSON")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("workload", help="N engines attaching M models under a budget, per eviction policy: hit ratio, miss speed vs isolated")
    s.add_argument("--engines", type=int, default=4, help="engine processes (a trace file may name more slots)")
    s.add_argument("--models", default=None, help="model sizes in GiB, comma-separated (models m0, m1, ...), e.g. 1,2,4,8")
    s.add_argument("--model-sizes", default=None, help="model sizes with units, e.g. 4MiB,4MiB,8MiB (default: 32,64,128,256 MiB)")
    s.add_argument("--tensors", type=int, default=64, help="tensors per generated model")
    s.add_argument("--device", default="cpu", help="cpu or cuda:N")
    s.add_argument("--budget-models", type=float, default=None, help="device budget as this many mean-sized models (default 2)")
    s.add_argument("--budget", default=None, help="device budget as a size instead, e.g. 6GiB")
    s.add_argument("--host-budget", default=None, help="host tier size for demoted GPU models, e.g. 8GiB")
    s.add_argument("--duration", type=float, default=20.0, help="seconds of generated trace")
    s.add_argument("--zipf", type=float, default=1.1, help="popularity: Zipf exponent")
    s.add_argument("--seed", type=int, default=0, help="seed of the trace and of the kills")
    s.add_argument("--hold", default="0-0.4", help="seconds an engine holds each attach, LO-HI")
    s.add_argument("--gap", default="0-0.05", help="seconds between an engine's detach and its next attach, LO-HI")
    s.add_argument("--trace", default=None, help="replay this trace file (JSON lines, docs/workload.md) instead of Zipf")
    s.add_argument("--write-trace", default=None, metavar="FILE", help="only write the generated trace here, and exit")
    s.add_argument("--policies", default="lru,gdsf", help="eviction policies to run the same trace under, each with a fresh daemon")
    s.add_argument("--kill-every", default=None, metavar="LO-HI", help="SIGKILL a random engine every LO-HI seconds and replace it")
    s.add_argument("--cold", action="store_true", help="keep dropping the page cache of models not resident: misses read the disk")
    s.add_argument("--wait-s", type=float, default=30.0, help="how long an attach may wait for room before NO_SPACE")
    s.add_argument("--reps", type=int, default=2, help="repetitions of each isolated measurement")
    s.add_argument("--drain-s", type=float, default=None, help="skip events not started this long after the trace's end (default: run every event)")
    s.add_argument("--mem-slack", default="512MiB", help="device memory that may stay missing after evicting everything (CUDA)")
    s.add_argument("--workdir", default=None, help="models, trace and logs (default /tmp/wc-workload)")
    s.add_argument("--out", default=None, help="write results as JSON here (and a PNG chart beside it)")
    s.add_argument("--chart", default=None, metavar="JSON", help="only draw the chart of an earlier run's JSON")
    s.set_defaults(func=cmd_workload)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if asyncio.iscoroutinefunction(args.func):
            return asyncio.run(args.func(args))
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"weightcache: {exc.message}", file=sys.stderr)
        return 2
    except WeightcacheError as exc:
        print(f"weightcache: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
