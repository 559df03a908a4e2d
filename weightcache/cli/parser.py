"""The CLI's arguments: every subcommand, its options and its --help examples."""

from __future__ import annotations

import argparse

from .. import __version__
from ..units import parse_duration
from .commands import (
    cmd_attach,
    cmd_bench,
    cmd_demo,
    cmd_evict,
    cmd_health,
    cmd_load,
    cmd_models,
    cmd_pin,
    cmd_ps,
    cmd_register,
    cmd_reload,
    cmd_serve,
    cmd_status,
    cmd_supervise,
    cmd_unregister,
    cmd_workload,
)


def _seconds(text: str) -> float:
    """An argparse type: seconds, or "30s" / "5m" as the config takes them."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    s.add_argument("--rank", type=int, default=None, help="the rank to attach, of a sharded model (0, 1, ...)")
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
    s.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="measure the operator's own checkpoint instead of a generated one: a .safetensors file, or a "
                        "save_pretrained directory (model.safetensors, or shards and their index json) or its index "
                        "(--size-gib/--tensors ignored)")
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
    "attach": ("weightcache attach qwen-7b --verify", "weightcache attach qwen-7b --hold 5m   # keep it resident meanwhile",
               "weightcache attach llama-8b-tp2 --rank 1   # one rank of a sharded model"),
    "demo": ("weightcache demo", "weightcache demo --restarts 5 --model-mib 256"),
    "bench": ("weightcache bench --device cpu --size-gib 1",
              "weightcache bench --device cuda:0 --size-gib 9.15 --tensors 183 --out run.json",
              "weightcache bench --checkpoint /models/qwen-7b --big-gib 0.5 --out qwen.json   # a save_pretrained directory"),
    "workload": ("weightcache workload --engines 4 --models 1,2,4,8 --device cuda:0 --budget 12GiB",
                 "weightcache workload --chart run.json"),
    "supervise": ("weightcache supervise --preload torch,transformers -- python engine.py --model qwen-7b",
                  "weightcache supervise --record /var/lib/engine/modules.txt --status /run/engine.json -- python -m myengine"),
}
