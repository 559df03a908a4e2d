"""Engine start to first token with vLLM's default loader and with the weightcache plugin,
side by side in one run, each start a fresh process (docs/vllm.md has the figures).

    make bench-vllm            # = LD_PRELOAD=<libiomp5> .venv-vllm/bin/python -m benchmarks vllm-start --out ...

Rows, in the order they run (the checkpoint is read once before, so every row finds it in
the page cache): ``auto`` (vLLM's default loader), ``weightcache copy`` twice (the first
start registers the checkpoint and the daemon loads it; the second finds it resident),
and, with vLLM's CPU GEMM packing off (see below), ``auto`` again and ``weightcache
processed`` twice (the first start loads and publishes the processed weights; the
second attaches them and skips the load).

vLLM's CPU backend packs linear weights for oneDNN after loading and leaves the
parameters empty, so processed weights cannot be published there; the ``nopack`` rows
make the CPU backend use torch's linear on the parameters instead (tests_vllm/drive.py,
``keep_linear_weights``), which is what post-processing leaves on a GPU. They are a
different engine configuration, so they are compared with their own ``auto`` row.

Phases, timed inside the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni``
executor keep the engine core and its worker in this process): ``import`` (import vllm), ``init`` (the model's modules),
``weights`` (load_weights, or putting attached processed weights in place), ``post``
(process_weights_after_loading), ``publish``, ``load_model`` (all of the loader), then
``engine`` (until LLM() returns: the loader, profiling, KV cache) and ``first_token``
(one greedy token); ``plugins`` is loading vLLM's plugins (weightcache's loader among
them) before the engine, ``total`` the process from its first import to the token.
"""

from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(ROOT / "tests_vllm"))

SIZES = {  # hidden, intermediate, layers, vocab
    "tiny": (256, 512, 2, 768),
    "medium": (1024, 4096, 8, 32000),
}


def child(args: argparse.Namespace) -> None:
    """One engine start in this process; prints one JSON line."""
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams  # the package is lazy: this is the real import

    phases["import"] = time.perf_counter() - t0
    from vllm.model_executor.model_loader import base_loader, default_loader

    running: set[str] = set()

    def timed(owner: Any, attr: str, phase: str) -> None:
        """Time ``owner.attr`` into ``phase``; calls inside a call of the same phase (the
        plugin's load_weights runs DefaultModelLoader's) count once."""
        fn = getattr(owner, attr)

        def wrapper(*a: Any, **k: Any) -> Any:
            if phase in running:
                return fn(*a, **k)
            running.add(phase)
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                running.discard(phase)
                phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - started

        setattr(owner, attr, wrapper)

    from vllm.plugins import load_general_plugins

    started = time.perf_counter()
    load_general_plugins()
    from weightcache.integrations.vllm import loader as wc

    phases["plugins"] = time.perf_counter() - started

    timed(base_loader.BaseModelLoader, "create_model", "init")
    timed(default_loader.DefaultModelLoader, "load_weights", "weights")
    timed(wc.WeightcacheModelLoader, "load_weights", "weights")
    timed(wc, "put_in_place", "weights")
    timed(base_loader, "process_weights_after_loading", "post")
    timed(wc, "process_weights_after_loading", "post")
    timed(wc.WeightcacheModelLoader, "_publish", "publish")
    timed(wc.WeightcacheModelLoader, "load_model", "load_model")
    timed(default_loader.DefaultModelLoader, "load_model", "load_model")
    from drive import keep_linear_weights

    with keep_linear_weights() if args.nopack else contextlib.nullcontext():
        started = time.perf_counter()
        extra = {} if args.mode is None else {"model_loader_extra_config": {"mode": args.mode}}
        # The engine core and its worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0
        # and the "uni" executor), where the timers above are.
        llm = LLM(model=args.model, load_format=args.load_format, dtype="float32", max_model_len=128, max_num_seqs=1,
                  enforce_eager=True, seed=0, distributed_executor_backend="uni", **extra)
        phases["engine"] = time.perf_counter() - started
        started = time.perf_counter()
        llm.generate(["w1 w2 w3"], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        phases["first_token"] = time.perf_counter() - started
    phases["total"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(phases), flush=True)


def run_row(model: Path, load_format: str, mode: str | None, nopack: bool, env: dict[str, str], log: Path) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--load-format", load_format]
    cmd += ["--mode", mode] if mode else []
    cmd += ["--nopack"] if nopack else []
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200, check=False)
    wall = time.perf_counter() - started
    log.write_text(out.stdout + out.stderr)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{cmd} failed ({out.returncode}); see {log}")
    return {**json.loads(lines[-1][7:]), "process_wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="a checkpoint directory (default: one of --size, written with save_pretrained)")
    ap.add_argument("--load-format", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nopack", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", choices=sorted(SIZES), default="medium")
    ap.add_argument("--out", help="JSON file for the rows")
    args = ap.parse_args()
    if args.child:
        return child(args)

    from models import save_model

    from weightcache.tools.spawn import DaemonProcess, config_text

    work = Path(tempfile.mkdtemp(prefix="wc-bench-vllm-"))
    model = Path(args.model) if args.model else save_model(work / f"llama-{args.size}", "llama", seed=1, dims=SIZES[args.size])
    nbytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    for f in model.glob("*.safetensors"):  # into the page cache: every row reads warm
        f.read_bytes()
    sock = os.path.join(tempfile.mkdtemp(prefix="wcb-", dir="/tmp"), "d.sock")
    cfg = work / "daemon.toml"
    cfg.write_text(config_text(sock, {"cpu": "16GiB"}, [], {"log_level": "info"}))
    env = {**os.environ, "WEIGHTCACHE_SOCKET": sock, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    rows = []
    plan = [("auto", "auto", None, False), ("weightcache copy, first start", "weightcache", "copy", False),
            ("weightcache copy", "weightcache", "copy", False), ("auto, nopack", "auto", None, True),
            ("weightcache processed, nopack, first start", "weightcache", "processed", True),
            ("weightcache processed, nopack", "weightcache", "processed", True)]
    with DaemonProcess(cfg, sock, work / "daemon.log"):
        for i, (label, fmt, mode, nopack) in enumerate(plan):
            row = run_row(model, fmt, mode, nopack, env, work / f"row{i}.log")
            rows.append({"row": label, **{k: round(v, 3) for k, v in row.items()}})
            print(json.dumps(rows[-1]), flush=True)
    report = {"machine": f"{platform.node()} {os.cpu_count()} cpus, no GPU", "model": str(model), "checkpoint_bytes": nbytes,
              "size": args.size, "vllm": _version("vllm-cpu"), "torch": _version("torch"), "rows": rows, "logs": str(work)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    cols = ["import", "plugins", "init", "weights", "post", "publish", "load_model", "engine", "first_token", "total"]
    print("| row | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['row']} | " + " | ".join(f"{r[c]:.2f}" if c in r else "" for c in cols) + " |")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
