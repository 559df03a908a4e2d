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
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import __version__
from .errors import ConfigError, WeightcacheError
from .units import format_size, parse_duration


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .client import Client
    from .config.file import daemon_socket

    # An operator's command and a health probe answer about now: no waiting for a
    # daemon that is not running (engines wait; see Client's wait_for_daemon).
    return Client(args.socket or daemon_socket(args.config), name="weightcache-cli", wait_for_daemon=0)


def _seconds(text: str) -> float:
    """An argparse type: seconds, or "30s" / "5m" as the config takes them."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN and infinity as None: json.dumps writes them as NaN and
    Infinity, which strict JSON parsers (jq, JSON.parse, Go) refuse."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _print_json(obj: Any) -> None:
    if isinstance(obj, dict):  # a reply's protocol fields are not the command's result
        obj = {k: v for k, v in obj.items() if k not in ("id", "ok")}
    print(json.dumps(_finite(obj), indent=2, default=str, allow_nan=False))


def _size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _duration(s: float | None) -> str:
    """``42s``, ``5m 03s``, ``2h 04m``, ``3d 02h``: seconds as people read them."""
    if s is None:
        return "-"
    n = round(s)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if n >= size:
            return f"{n // size}{unit} {(n % size) // sub_size:02d}{sub}"
    return f"{n}s"


def _print(*renderables: Any) -> None:
    """Print rich renderables (tables) to stdout, never cut. On a terminal rich fits a
    table to its width, folding long cells (columns use overflow="fold"). Piped or
    redirected, rich would assume 80 columns and cut cells to "small-fp…": a script or
    a log wants whole names, so each table gets the width it needs."""
    from rich.console import Console

    console = Console()
    for r in renderables:
        if not console.is_terminal and not isinstance(r, str):
            width = Console(width=1 << 16).measure(r).maximum
            Console(width=max(width, 1)).print(r)
        else:
            console.print(r, highlight=False)


def _table(*columns: str, right: tuple[str, ...] = ()) -> Any:
    from rich.table import Table

    t = Table()
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left", overflow="fold")
    return t


async def cmd_status(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        st = await c.status()
    if args.json:
        _print_json(st)
        return 0
    t = _table("device", "backend", "budget", "used", "reserved", "free", "content hash",
               right=("budget", "used", "reserved", "free"))
    for dev, d in st["devices"].items():
        t.add_row(dev, d["backend"], _size(d["budget"]), _size(d["used"]), _size(d["reserved"]), _size(d["free"]),
                  d.get("content_hash", ""))
    lines: list[Any] = [f"weightcache {st['version']} (pid {st['pid']}, up {_duration(st['uptime_s'])}) on {st['socket']}", t,
                        f"connections: {st['connections']}  leases: {st['leases']}  resident: {len(st.get('resident', []))} "
                        "(weightcache ps)"]
    for name, p in st["loading"].items():
        lines.append(f"loading {name}: {_size(p['bytes_done'])} / {_size(p['bytes_total'])} at {_size(p['bytes_per_s'])}/s")
    if st.get("tenants"):
        lines.append(_tenants_table(st["tenants"]))
    _print(*lines)
    for o in st.get("other_daemons", []):
        print(f"warning: another weightcache daemon runs on this host (pid {o['pid']}): each takes its own budget of the "
              "same memory; run one per host")
    for m in st.get("outlived", []):  # whole lines (rich would fold them at 80 columns when piped)
        print(f"warning: pid {m['pid']} ({m['comm']}, uid {m['uid']}) still maps {_size(m['nbytes'])} of an earlier "
              f"daemon's memory ({', '.join(m['models'])}): no lease here, outside every budget until it exits")
    return 0


def _tenants_table(tenants: dict[str, Any]) -> Any:
    """Per tenant and device: what its models hold, of what quota; and its pins."""
    t = _table("tenant", "device", "used", "quota", "pins", right=("used", "quota", "pins"))
    for name, u in tenants.items():
        pins = f"{u['pins']}" + (f" / {u['pins_quota']}" if u["pins_quota"] is not None else "")
        rows = [(dev, d) for dev, d in u["devices"].items() if d["used"] or d["quota"] is not None]
        for i, (dev, d) in enumerate(rows or [("-", {"used": 0, "quota": None})]):
            t.add_row(name if i == 0 else "", dev, _size(d["used"]), "-" if d["quota"] is None else _size(d["quota"]),
                      pins if i == 0 else "")
    return t


async def cmd_models(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        models = await c.models()
    if args.json:
        _print_json(models)
        return 0
    t = _table("name", "state", "device", "size", "attached", "pinned", "arena", "loads", "evictions", "last error",
               right=("size", "attached", "loads", "evictions"))
    for m in models:
        # A bad path or format is found at start and at reload, before any load: say so here,
        # not only in --json (the daemon shows the reason to owners and admins only).
        err = m.get("last_error") or {}
        placed = m.get("placement") or {}
        # device = "auto": which replica the last placement chose, and why (--json has the detail)
        device = (f"{m['device']} (auto: {placed['reason']})" if placed.get("device") == m["device"]
                  else f"{m['device']} (auto)" if m.get("replica_of") else m["device"])
        t.add_row(m["name"], m["state"], device, _size(m["nbytes"] or None), str(m["attach_count"]),
                  "yes" if m["pinned"] else "", _arena(m), str(m["loads"]), str(m["evictions"]),
                  f"{err.get('code', '')}: {err.get('message', '')}" if err else "")
    _print(t)
    return 0


def _arena(m: dict[str, Any]) -> str:
    """Where the resident copy lives, and why not in the faster arena where it was refused
    (a CPU model copied into a memfd rather than served from its files' page cache)."""
    kind = m.get("arena") or "-"
    return f"{kind}: {m['arena_note']}" if m.get("arena_note") else kind


def _until(m: dict[str, Any]) -> str:
    """When keep_alive will evict a model, as `weightcache ps` shows it."""
    if m["pinned"]:
        return "never (pinned)"
    if m["state"] != "resident":
        return "-"
    if m["keep_alive"] is None:
        return "when room is needed"
    if m["attach_count"]:
        return f"{_duration(m['keep_alive'])} after the last detach"
    return f"in {_duration(m['expires_in_s'])}" if m.get("expires_in_s") is not None else "-"


def _lease_lines(m: dict[str, Any]) -> str:
    lines = [f"pid {h['pid']} {h['client']} (uid {h['uid']}), {_duration(h['since_s'])}" for h in m["leases"]]
    hidden = m["attach_count"] - len(m["leases"])
    if hidden > 0:  # the daemon shows other users' holders to admins only
        lines.append(f"{hidden} of other users")
    return "\n".join(lines) or "-"


def _owner(m: dict[str, Any]) -> str:
    """Whose model it is: the operator's config, or the uid that registered or published it."""
    return "config" if m.get("owner") is None else f"uid {m['owner']}"


async def cmd_ps(args: argparse.Namespace) -> int:
    """Like `ollama ps`: what holds memory now, who holds it, and until when."""
    async with _client(args) as c:
        resident = (await c.status())["resident"]
    if args.json:
        _print_json(resident)
        return 0
    if not resident:
        print("no model is resident")
        return 0
    t = _table("name", "owner", "state", "device", "size", "arena", "leases (pid, client, uid, held for)", "idle", "until",
               right=("size", "idle"))
    for m in resident:
        t.add_row(m["name"], _owner(m), m["state"], m["device"], _size(m["nbytes"]), _arena(m), _lease_lines(m),
                  "-" if m["attach_count"] else _duration(m["idle_s"]), _until(m))
    _print(t)
    return 0


async def cmd_load(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    async with _client(args) as c:
        before = {m["name"]: m for m in await c.models()}
        job = asyncio.ensure_future(c.load(args.name, device=args.device, rank=args.rank, wait_s=args.wait,
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
                # an auto model loads as one of its replicas, "<name>@<device>"
                p = loading.get(args.name) or next((v for k, v in loading.items() if k.startswith(f"{args.name}@")), None)
                if p and p["bytes_total"]:
                    bar.update(task, visible=True, completed=p["bytes_done"], total=p["bytes_total"],
                               sizes=f"{_size(p['bytes_done'])} / {_size(p['bytes_total'])}",
                               rate=f"{_size(p['bytes_per_s'])}/s")
        model = await job
        after = await c.models()
    # What left its device while this load ran: the room it made (or, rarely, what a
    # concurrent eviction took); the daemon counts every model's evictions. Not the model
    # itself: its own stale copy, dropped because its files changed, made no room for it.
    evicted = [{"name": m["name"], "nbytes": before[m["name"]]["nbytes"], "state": m["state"]} for m in after
               if m["name"] in before and m["name"] != model["name"] and m["evictions"] > before[m["name"]]["evictions"]]
    if args.json:
        _print_json({"model": model, "evicted": evicted})
        return 0
    print(f"{model['name']}: {model['state']} on {model['device']}, {_size(model['nbytes'])}, {model['tensors']} tensors")
    if model.get("placement"):
        print(f"placed on {model['placement']['detail']}")
    if evicted:
        print("evicted to make room: " + ", ".join(
            f"{e['name']} ({_size(e['nbytes'])}{', to the host tier' if e['state'] == 'host' else ''})" for e in evicted))
    return 0


async def cmd_evict(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        result = await c.evict(args.name)
    if args.json:
        _print_json(result)
    elif not result["evicted"]:
        print(f"{args.name}: nothing to evict ({result['state']})")
    else:
        where = "moved to the host tier" if result["state"] == "host" else "evicted"
        print(f"{args.name}: {where}, {_size(result['freed'])} freed")
    return 0


async def cmd_pin(args: argparse.Namespace) -> int:
    async with _client(args) as c:
        model = await (c.pin(args.name) if args.command == "pin" else c.unpin(args.name))
    if args.json:
        _print_json(model)
    else:
        print(f"{args.name}: {'pinned' if model['pinned'] else 'not pinned'} ({model['state']} on {model['device']}"
              f"{', ' + _size(model['nbytes']) if model['nbytes'] else ''})")
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
    from .loader.sources import unindexed_note

    for part in [path] if path else [s["path"] for s in shards or []]:
        note = unindexed_note(part)
        if note is not None:  # merged into one model; said before, in case that is not what was meant
            print(f"weightcache: note: {note}", file=sys.stderr)
    async with _client(args) as c:
        model = await c.register(args.name, path, device=args.device, shards=shards, pin=args.pin, preload=args.preload,
                                 keep_alive=keep_alive, send_files=not args.by_path, allowed_uids=args.allow_uid,
                                 allowed_gids=[int(g) if g.isdigit() else g for g in args.allow_group] if args.allow_group else None)
    if args.json:
        _print_json(model)
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
        _print_json({"unregistered": args.name})
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
        _print_json(report)
        return status
    done = [f"{what}: {', '.join(report[what])}" for what in ("added", "removed", "changed", "updated", "displaced")
            if report.get(what)]
    done += [f"budgets.{b['device']}: {_size(b['budget'])} (was {_size(b['previous'])})" for b in report.get("budgets", [])]
    done += [f"max_loaded_models.{m['device']}: {_count(m['limit'])} (was {_count(m['previous'])})"
             for m in report.get("max_loaded_models", [])]
    if report.get("quotas") is not None:
        done.append(f"quotas: {', '.join(report['quotas']) or 'none'}")
    print("reloaded: " + ("; ".join(done) if done else "no changes"))
    for e in report.get("evicted", []):
        print(f"evicted: {e['name']} ({_size(e['nbytes'])}{', to the host tier' if e['to'] == 'host' else ''}): {e['reason']}")
    for line in report.get("pending", []):
        print(f"pending: {line}")
    for line in report.get("failed", []):
        print(f"failed: {line}")
    return status


def _count(n: int | None) -> str:
    return "no limit" if n is None else str(n)


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
    # The first attach of a process imports torch (the mapping's tensors): 1.3-2.0 s on the
    # dev VM, which "attached in ... ms" reported as the attach's own time. Import it first.
    import weightcache.client.mapping  # noqa: F401

    async with _client(args) as c:
        t0 = time.perf_counter()
        async with c.attach(args.name, keep_alive=args.keep_alive) as m:
            dt = time.perf_counter() - t0
            result: dict[str, Any] = {"name": m.name, "lease": m.lease, "tensors": len(m), "nbytes": m.nbytes,
                                      "device": m.device, "attach_ms": dt * 1e3, "fingerprint": m.fingerprint}
            if not args.json:
                print(f"attached {m.name}: lease {m.lease}, {len(m)} tensors, {_size(m.nbytes)} on {m.device} "
                      f"in {dt * 1e3:.2f} ms; fingerprint {m.fingerprint[:16]}")
            if args.verify:
                entry = next(x for x in await c.models() if x["name"] == args.name)
                path = entry["path"]
                if entry["origin"] == "publish" or path is None:
                    # Was the loader's "published:NAME: checkpoint path does not exist".
                    why = ("it was published by an engine and has no files" if entry["origin"] == "publish" else
                           "the daemon shows its files only to its owner and admins")
                    print(f"weightcache attach: --verify {args.name}: nothing to compare with: {why}", file=sys.stderr)
                    return 2
                from .client.verify import verify_against_files

                bad = await asyncio.to_thread(verify_against_files, m, path)
                result["differ"] = bad
                if not args.json:
                    print(f"VERIFY FAILED: {len(bad)} tensor(s) differ from {path}: {bad[:10]}" if bad
                          else f"verified: all {len(m)} tensors equal the bytes in {path}")
            if args.json:
                _print_json(result)
            if args.verify and result["differ"]:
                return 1
            if args.hold:
                if not args.json:
                    print(f"holding the lease for {args.hold}s")
                await asyncio.sleep(args.hold)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import load_settings
    from .server import run_daemon

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
    from .tools.demo import run_demo

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


def cmd_bench(args: argparse.Namespace) -> int:
    if args.chart:  # render the chart of an earlier run's JSON
        from .tools.bench_report import write_chart

        png = Path(args.chart).with_suffix(".png")
        if not write_chart(json.loads(Path(args.chart).read_text()), png):
            print("weightcache: the chart needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        print(f"wrote {png}")
        return 0
    problem = _no_such_device(args.device)
    if problem:
        print(f"weightcache bench: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    from .tools.bench import BenchConfig, run_bench, user_checkpoint

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
    if args.chart:  # render the chart of an earlier run's JSON
        from .tools.workload_report import write_chart as write_workload_chart

        png = Path(args.chart).with_suffix(".png")
        if not write_workload_chart(json.loads(Path(args.chart).read_text()), png):
            print("weightcache: the chart needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        print(f"wrote {png}")
        return 0
    problem = None if args.write_trace else _no_such_device(args.device)
    if problem:
        print(f"weightcache workload: --device {args.device}: {problem}", file=sys.stderr)
        return 2
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


def cmd_supervise(args: argparse.Namespace) -> int:
    from .supervise import SupervisorOptions, supervise

    preload = tuple(m.strip() for arg in args.preload for m in arg.split(",") if m.strip())
    exclude = tuple(m.strip() for arg in args.exclude for m in arg.split(",") if m.strip())
    return supervise(args.engine, SupervisorOptions(preload=preload, record=args.record, exclude=exclude, status=args.status,
                                                    stop_timeout_s=args.stop_timeout, backoff_max_s=args.backoff_max))


def build_parser() -> argparse.ArgumentParser:
    socket_help = ("daemon socket (default: $WEIGHTCACHE_SOCKET, else the [daemon] socket of the file $WEIGHTCACHE_CONFIG "
                   "names, else /run/weightcache/weightcache.sock)")
    p = argparse.ArgumentParser(prog="weightcache", description="Keep model weights resident; engines attach them zero-copy.")
    config_help = ("the daemon's TOML config (default: $WEIGHTCACHE_CONFIG); client commands read only its "
                   "[daemon] socket")
    p.add_argument("--version", action="version", version=f"weightcache {__version__}")
    p.add_argument("--socket", help=socket_help)
    p.add_argument("--config", help=config_help)
    # --json too before the command (`weightcache --json status`), as --socket.
    p.add_argument("--json", action="store_true", help="print the result as JSON, for scripts (client commands)")
    # --socket also after the subcommand; SUPPRESS keeps one given before it when absent after.
    sock = argparse.ArgumentParser(add_help=False)
    sock.add_argument("--socket", default=argparse.SUPPRESS, help=socket_help)
    # --config too, before or after: `weightcache --config F serve` read F as the command.
    sock.add_argument("--config", default=argparse.SUPPRESS, help=config_help)
    client = argparse.ArgumentParser(add_help=False, parents=[sock])
    client.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print the result as JSON, for scripts")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon", parents=[sock])
    s.add_argument("config_file", nargs="?", metavar="CONFIG", help="the same as --config")
    s.set_defaults(func=cmd_serve)

    for name, fn, text in (("status", cmd_status, "devices, budgets, loads in progress"),
                           ("models", cmd_models, "every registered model"),
                           ("ps", cmd_ps, "resident models: size, device, who holds them, idle time, keep_alive expiry")):
        s = sub.add_parser(name, help=text, parents=[client])
        s.set_defaults(func=fn)

    s = sub.add_parser("health", help="exit 0 if the daemon serves (--ready: and its preloads are resident); for probes",
                       parents=[client])
    s.add_argument("--ready", action="store_true", help="also require every configured preload to be resident")
    s.set_defaults(func=cmd_health)

    s = sub.add_parser("load", help="make a model resident, with a progress bar; says what it evicted", parents=[client])
    s.add_argument("name")
    s.add_argument("--wait", type=_seconds, default=None, metavar="DURATION",
                   help="how long to wait for attached models to detach if memory is short: seconds or 30s/5m")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--device", default=None,
                   help='for a model with device = "auto": load it on this device (cuda:N in the daemon\'s numbering, '
                        "or cuda:GPU-<uuid>); without it the daemon places it")
    s.add_argument("--rank", type=int, default=None, help="one rank of a sharded model")
    s.add_argument("--keep-alive", default=None, metavar="DURATION",
                   help="keep it this long once unattached: seconds or 30s/5m/1h, 0 = evict when unattached, "
                        "-1 = never (capped at the configured value for non-admins)")
    s.set_defaults(func=cmd_load)

    s = sub.add_parser("evict", help="move a model one tier down (to the host tier, or out)", parents=[client])
    s.add_argument("name")
    s.set_defaults(func=cmd_evict)
    for name, text in (("pin", "never evict a model while pinned"), ("unpin", "make a pinned model evictable again")):
        s = sub.add_parser(name, help=text, parents=[client])
        s.add_argument("name")
        s.set_defaults(func=cmd_pin)

    s = sub.add_parser("register", help="add a model at run time (kept across reloads unless the config file comes to name it)",
                       parents=[client])
    s.add_argument("name")
    s.add_argument("path", nargs="?", help="a .safetensors file, a directory, or a model.safetensors.index.json")
    s.add_argument("--device", default="cpu", help="cpu, cuda:N or cuda:GPU-<uuid> (default cpu)")
    s.add_argument("--shard", action="append", metavar="DEVICE=PATH",
                   help="one per rank, in rank order, instead of PATH: a tensor-parallel model")
    s.add_argument("--pin", action="store_true", help="never evict it (administrators only)")
    s.add_argument("--preload", action="store_true", help="load it now, in the background")
    s.add_argument("--keep-alive", default=None, help="evict after this long unused and unattached: '30s', '5m', '1h' or seconds")
    s.add_argument("--allow-uid", action="append", type=int, metavar="UID",
                   help="a uid that may use it (repeat for more); without this or --allow-group a non-admin's model is its own")
    s.add_argument("--allow-group", action="append", metavar="GROUP", help="a group (name or gid) whose members may use it")
    s.add_argument("--by-path", action="store_true",
                   help="send only the paths: the daemon opens them with its own rights (administrators only); "
                        "by default this command opens the files and passes them")
    s.set_defaults(func=cmd_register)

    s = sub.add_parser("unregister", help="forget a model and free its memory (refused while attached or loading)",
                       parents=[client])
    s.add_argument("name")
    s.set_defaults(func=cmd_unregister)

    s = sub.add_parser("reload", help="make the daemon re-read its config file", parents=[client])
    s.set_defaults(func=cmd_reload)

    s = sub.add_parser("attach", help="attach a model and report; --verify compares every byte with the files",
                       parents=[client])
    s.add_argument("name")
    s.add_argument("--verify", action="store_true")
    s.add_argument("--hold", type=_seconds, default=0, metavar="DURATION", help="keep the lease this long: seconds or 30s/5m")
    s.add_argument("--keep-alive", default=None, metavar="DURATION",
                   help="keep it this long once unattached: seconds or 30s/5m/1h, 0 = evict when unattached, "
                        "-1 = never (capped at the configured value for non-admins)")
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
    s.add_argument("--fresh", type=int, default=7, help="fresh engine processes per way for the fresh-process rows")
    s.add_argument("--checkpoint", default=None, metavar="FILE",
                   help="measure the operator's own .safetensors file instead of a generated one (--size-gib/--tensors ignored)")
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

    s = sub.add_parser("supervise", help="fork an engine from a process that has its imports done; restart it at once when it exits",
                       usage="weightcache supervise [--preload MODULES] [--record FILE] [--status FILE] -- python engine.py ARGS")
    s.add_argument("--preload", action="append", default=[], metavar="MODULES", help="modules to import before forking, comma-separated")
    s.add_argument("--record", default=None, metavar="FILE",
                   help="engines write their imported modules here at weightcache.engine.ready(); the next start preloads them")
    s.add_argument("--exclude", action="append", default=[], metavar="MODULES",
                   help="never preload these (and their submodules) from the --record file, comma-separated")
    s.add_argument("--status", default=None, metavar="FILE", help="write the supervisor's state, restart counts and last exits here (JSON)")
    s.add_argument("--stop-timeout", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL of the engine (default 30)")
    s.add_argument("--backoff-max", type=float, default=30.0, help="longest wait before restarting a crashing engine (default 30 s)")
    s.add_argument("engine", nargs=argparse.REMAINDER, help="-- python engine.py ARGS, or -- python -m module ARGS")
    s.set_defaults(func=cmd_supervise)
    for name, sp in sub.choices.items():
        sp.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the examples' lines
        sp.epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name])
    return p


# Shown under each subcommand's --help: what an operator types first.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "serve": ("weightcache serve /etc/weightcache/weightcache.toml",
              "WEIGHTCACHE_DAEMON__LOG_LEVEL=debug weightcache serve --config ./wc.toml --socket /tmp/wc.sock"),
    "status": ("weightcache status", "weightcache status --json | jq '.devices.cpu.free'"),
    "models": ("weightcache models", "weightcache models --json | jq -r '.[] | select(.state == \"error\") | .name'"),
    "ps": ("weightcache ps", "weightcache --socket /run/weightcache/weightcache.sock ps --json | head"),
    "health": ("weightcache health            # liveness: exit 0 while serving",
               "weightcache health --ready    # readiness: every preload resident"),
    "load": ("weightcache load qwen-7b", "weightcache load qwen-7b --keep-alive 1h --wait 30s",
             "weightcache load llama-8b-tp2 --rank 1 --device cuda:1"),
    "evict": ("weightcache evict qwen-7b", "weightcache evict mistral-7b@cuda:1   # one replica of an auto model"),
    "pin": ("weightcache pin qwen-7b",),
    "unpin": ("weightcache unpin qwen-7b",),
    "register": ("weightcache register qwen-7b /models/qwen-7b --device cuda:0 --keep-alive 1h",
                 "weightcache register tp2 --shard cuda:0=/models/m/rank0 --shard cuda:1=/models/m/rank1",
                 "weightcache register shared /models/m.safetensors --allow-group team-a --by-path"),
    "unregister": ("weightcache unregister qwen-7b",),
    "reload": ("weightcache reload            # exit 1 when a change did not take effect",
               "weightcache reload --json | jq '.failed'",
               "systemctl reload weightcache  # the same, from the unit (Type=notify-reload)"),
    "attach": ("weightcache attach qwen-7b --verify", "weightcache attach qwen-7b --hold 5m   # keep it resident meanwhile"),
    "demo": ("weightcache demo", "weightcache demo --restarts 5 --model-mib 256"),
    "bench": ("weightcache bench --device cpu --size-gib 1",
              "weightcache bench --device cuda:0 --size-gib 9.15 --tensors 183 --out run.json"),
    "workload": ("weightcache workload --engines 4 --models 1,2,4,8 --device cuda:0 --budget 12GiB",
                 "weightcache workload --chart run.json"),
    "supervise": ("weightcache supervise --preload torch,transformers -- python engine.py --model qwen-7b",
                  "weightcache supervise --record /var/lib/engine/modules.txt --status /run/engine.json -- python -m myengine"),
}


# What an operator can do next, after the daemon's sentence (which says what is wrong).
_HINTS = {
    "UNKNOWN_MODEL": "; `weightcache models` lists the names it has (add one with `weightcache register NAME PATH` "
                     "or in the config file, then `weightcache reload`)",
}


def _stdout_gone() -> bool:
    """Whether our stdout is a pipe whose reader has gone (``| head`` has exited): poll
    says POLLERR. A BrokenPipeError can also come from the daemon's socket, which is a
    real failure and must not be hidden."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # `weightcache ps --json | head`: the reader took what it wanted. Quiet, as a C
        # tool killed by SIGPIPE is, and with the status a shell gives one (128 + 13).
        # stdout goes to /dev/null so that the interpreter's final flush is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


def _run(args: argparse.Namespace) -> int:
    try:
        if asyncio.iscoroutinefunction(args.func):
            return asyncio.run(args.func(args))
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"weightcache: {exc.message}", file=sys.stderr)
        return 2
    except WeightcacheError as exc:
        if getattr(args, "json", False):  # a script reads the code and details, not the sentence
            _print_json({"error": exc.to_wire()})
        print(f"weightcache: {exc}{_HINTS.get(exc.code, '')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
