"""Restart to first logits, supervised vs fresh, with the example's 8B engine.

Builds examples/transformers_engine.py's model (``--preset llama-8b``: Llama-3-8B's
shapes, 16 GB bf16, random weights, built locally), starts a daemon with it resident,
then times engine restarts that take their weights from the cache, three ways, in one run:

  fresh                  a new ``python examples/transformers_engine.py --engine cache``
                         process per start (imports torch and transformers every time)
  supervised_preload     ``weightcache supervise --preload torch,transformers``: engines
                         forked from a template with those two imported (the lazily
                         imported transformers modules, e.g. the Llama model's, are not)
  supervised_recorded    a second supervisor start that also preloads the modules the
                         first one's engine recorded at ``weightcache.engine.ready()``

``restart_to_logits_s``: from the previous engine's first logits (its ``t_done``) to
this engine's, on ``time.monotonic()``: the old engine's exit (lease detach, CUDA
teardown), the new start (fork or exec), imports, CUDA init, attach, forward. Each
series runs ``--restarts + 1`` engines; the first (a cold start) is reported apart.
One engine also loads the weights from disk (``from_pretrained``): every engine's
logits must be bit-identical to it. Exit status 1 if they are not; the target (supervised
with a record below 1 s, median) is reported, not enforced.

    python -m benchmarks supervised-restart --preset llama-8b --device cuda:0 --restarts 3 --out results/supervised.json
    python -m benchmarks supervised-restart --preset tiny --device cpu --restarts 2 --out /tmp/supervised-cpu.json   # smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "transformers_engine.py"
TARGET_S = 1.0


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("transformers_engine", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    restarts = rows[1:]
    out: dict[str, Any] = {"first_start_s": rows[0]["restart_to_logits_s"]}
    for key in ("restart_to_logits_s", "import_s", "cuda_init_s", "weights_s", "attach_s"):
        vals = [r[key] for r in restarts if key in r]
        if vals:
            out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def preload_line(log: str) -> str | None:
    m = re.search(r"preloaded \d+ modules in [0-9.]+ s[^\n]*", log)
    return m.group(0) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-8b", help="the example's preset: tiny or llama-8b")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for a smoke test")
    ap.add_argument("--restarts", type=int, default=3, help="restarts timed per series (each series runs one more engine)")
    ap.add_argument("--workdir", default=None, help="model, socket, logs (default: a temp dir; the built model is reused)")
    ap.add_argument("--out", type=Path, default=RESULTS / "supervised.json", help="write the results here as JSON")
    ap.add_argument("--exclude", default=None, metavar="MODULES",
                    help="passed to the recorded series' supervisor: recorded modules not to preload (if it refused one)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # For every engine, fresh or forked: torch.cuda.is_available() asks NVML instead of
    # initialising the driver, so that a recorded module that asks it at import cannot put
    # the driver into the template (the supervisor would refuse to fork). Export it as 0 to
    # see whether the template stays clean without it.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"supervised_restart: --device {args.device} needs CUDA, and torch finds none here; "
              "run it on the GPU host, or use --preset tiny --device cpu for a smoke test", file=sys.stderr)
        return 2
    example = load_example()
    if args.preset not in example.PRESETS:
        print(f"supervised_restart: --preset must be one of {sorted(example.PRESETS)}", file=sys.stderr)
        return 2

    from weightcache import SyncClient
    from weightcache.tools.spawn import DaemonProcess, config_text

    work = Path(args.workdir or tempfile.mkdtemp(prefix="wc-supervised-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / f"{example.MODEL}-{args.preset}"
    if not (model_dir / "config.json").exists():
        t = time.perf_counter()
        example.build(model_dir, args.preset, args.device)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the built model's 16 GB, kept by torch's allocator otherwise
        print(f"built {args.preset} in {model_dir} ({time.perf_counter() - t:.1f} s)", flush=True)
    nbytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    sock = str(work / "wc.sock")
    (work / "wc.toml").write_text(config_text(sock, {args.device: f"{nbytes // 2**30 + 1}GiB"},
                                              [{"name": example.MODEL, "path": str(model_dir), "device": args.device,
                                                "preload": True}]))
    record = work / "modules.txt"
    record.unlink(missing_ok=True)  # the recorded series must use this run's record
    n = args.restarts + 1
    series: dict[str, list[dict[str, Any]]] = {}
    logs: dict[str, str | None] = {}
    errors: dict[str, str] = {}
    with DaemonProcess(work / "wc.toml", sock, work / "daemon.log"):
        with SyncClient(sock) as c:
            c.load(example.MODEL)
        p = subprocess.run([sys.executable, str(EXAMPLE), "--engine", "disk", str(model_dir), sock, args.device],
                           capture_output=True, text=True, timeout=1200)
        lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            print(f"the disk engine failed:\n{p.stderr[-3000:]}", file=sys.stderr)
            return 1
        disk = json.loads(lines[0][7:])
        print(f"disk engine (from_pretrained): weights {disk['weights_s']:.3f} s, logits {disk['logits_sha256'][:16]}", flush=True)
        for name, sup in (("fresh", None),
                          ("supervised_preload", ["--preload", "torch,transformers", "--record", str(record)]),
                          ("supervised_recorded", ["--preload", "torch,transformers", "--record", str(record),
                                                   *(["--exclude", args.exclude] if args.exclude else [])])):
            try:
                series[name] = example.restart_series(model_dir, sock, args.device, n, supervise=sup, work=work)
            except RuntimeError as exc:  # kept in the JSON; the other series still run
                print(f"{name}: {exc}", file=sys.stderr)
                errors[name] = str(exc)
                continue
            logs[name] = preload_line((work / "supervisor.log").read_text()) if sup else None
            s = summary(series[name])
            print(f"{name:>20}: restart to first logits median {s['restart_to_logits_s']['median']:.3f} s "
                  f"(min {s['restart_to_logits_s']['min']:.3f}, max {s['restart_to_logits_s']['max']:.3f}); "
                  f"first start {s['first_start_s']:.3f} s{'; ' + logs[name] if logs[name] else ''}", flush=True)

    shas = {disk["logits_sha256"]} | {r["logits_sha256"] for rows in series.values() for r in rows}
    identical = len(shas) == 1
    recorded = summary(series["supervised_recorded"])["restart_to_logits_s"]["median"] if "supervised_recorded" in series else None
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "device": args.device, "preset": args.preset, "model_bytes": nbytes,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "torch": torch.__version__, "python": platform.python_version(), "restarts_per_series": args.restarts,
        "env": {k: os.environ[k] for k in ("PYTORCH_NVML_BASED_CUDA_CHECK", "HF_HUB_OFFLINE")}, "exclude": args.exclude,
        "definition": "restart_to_logits_s: previous engine's t_done (after its first logits) to this engine's first logits, "
                      "time.monotonic(); each series' first engine is its first_start_s (from the driver's spawn)",
        "disk": disk,
        "series": {k: {"summary": summary(v), "template": logs.get(k), "rows": v} for k, v in series.items()},
        "logits_identical": identical, "logits_sha256": sorted(shas),
        "target_s": TARGET_S, "supervised_recorded_median_s": recorded,
        "meets_target": recorded is not None and recorded < TARGET_S, "errors": errors,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if errors:
        print(f"series that failed: {', '.join(errors)} (reasons above and in {args.out})", file=sys.stderr)
        return 1
    fresh = summary(series["fresh"])["restart_to_logits_s"]["median"]
    print(f"restart to first logits, medians: fresh {fresh:.3f} s, supervised (preload) "
          f"{summary(series['supervised_preload'])['restart_to_logits_s']['median']:.3f} s, supervised (recorded) {recorded:.3f} s "
          f"(target < {TARGET_S:.0f} s: {'met' if recorded < TARGET_S else 'NOT met'}); logits "
          f"{'bit-identical across all ' + str(1 + sum(map(len, series.values()))) + ' engines' if identical else 'DIFFER'}; wrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
