"""What a conversion that builds tensors costs a fresh engine the first time, and what
attaching the derived model the daemon keeps costs every engine after.

Writes a Mixtral checkpoint (``save_pretrained``: per-expert ``w1``/``w2``/``w3``, which
transformers 5 fuses into ``experts.gate_up_proj`` / ``experts.down_proj`` as it loads),
starts a daemon serving it, and runs fresh engine processes one after another, each:

  from_pretrained_ms  ``MixtralForCausalLM.from_pretrained`` from the files (the page cache)
  in_process_ms       attach + ``load_into_module(skeleton, attached)``: the experts fused
                      in this process, every start
  converted_ms        ``attach_converted`` + ``load_into_module``: the first engine fuses
                      the experts and publishes them (``built_here``); later ones attach
                      the derived model

Each is timed, wall and the process's CPU time (every thread; less moved by other load
on the machine), from before the attach (or the ``from_pretrained`` call) to a module
ready to run, after ``import torch, transformers``, one attach of the checkpoint that is
not counted (the process's first attach imports the client's mapping half) and the
skeleton under ``empty_parameters``. The order within an engine is converted,
in-process, from_pretrained. Prints one JSON object and writes it to ``--out``
(results/derived-cost.json unless told).

    python -m benchmarks derived-cost --engines 4 --hidden 512 --intermediate 1024 --experts 8 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default


def engine(sock: str, path: str) -> dict[str, object]:
    import torch
    import transformers

    from weightcache import SyncClient, empty_parameters, load_into_module
    from weightcache.client.conversions import attach_converted

    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.from_pretrained(path)

    def skeleton() -> torch.nn.Module:
        with empty_parameters():
            return transformers.MixtralForCausalLM._from_config(cfg, dtype=cfg.dtype)

    out: dict[str, object] = {}
    clock = [0.0, 0.0]

    def start() -> None:
        clock[:] = [time.perf_counter(), time.process_time()]

    def stop(what: str) -> None:
        out[f"{what}_ms"] = (time.perf_counter() - clock[0]) * 1e3
        out[f"{what}_cpu_ms"] = (time.process_time() - clock[1]) * 1e3

    with SyncClient(sock) as c:
        with c.attach("mixtral"):  # the process's first attach (imports, first mapping): not the conversion's
            pass
        s = skeleton()
        start()
        with attach_converted(c, "mixtral", s) as w:
            load_into_module(s, w)
            stop("converted")
            out["built_here"], out["derived"] = w.built_here, w.derived_name
        s = skeleton()
        start()
        with c.attach("mixtral") as w:
            load_into_module(s, w)
            stop("in_process")
    start()
    transformers.MixtralForCausalLM.from_pretrained(path)
    stop("from_pretrained")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, default=RESULTS / "derived-cost.json", help="write the JSON here too")
    ap.add_argument("--engine", nargs=2, metavar=("SOCKET", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(engine(*args.engine)))
        return
    import torch
    import transformers

    from weightcache.tools.spawn import DaemonProcess, config_text

    work = Path(tempfile.mkdtemp(prefix="wc-derived-", dir="/tmp"))
    cfg = transformers.MixtralConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.intermediate,
                                     num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                     num_local_experts=args.experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM._from_config(cfg, dtype=getattr(torch, args.dtype)).save_pretrained(work / "mixtral")
    ckpt_bytes = sum(f.stat().st_size for f in (work / "mixtral").glob("*.safetensors"))
    sock = str(work / "d.sock")
    (work / "d.toml").write_text(config_text(sock, {"cpu": f"{4 * ckpt_bytes // 2**20 + 64}MiB"},
                                             [{"name": "mixtral", "path": str(work / "mixtral")}]))
    runs = []
    with DaemonProcess(work / "d.toml", sock, work / "d.log"):
        for _ in range(args.engines):
            r = subprocess.run([sys.executable, __file__, "--engine", sock, str(work / "mixtral")], capture_output=True, text=True,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=600)
            if r.returncode:
                sys.exit(r.stderr[-3000:])
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    later = runs[1:]
    text = json.dumps({
        "checkpoint_bytes": ckpt_bytes, "config": vars(args) | {"engine": None, "out": str(args.out)},
        "first_built_here": runs[0]["built_here"], "later_built_here": [r["built_here"] for r in later],
        **{f"first_converted_{k}": runs[0][f"converted_{k}"] for k in ("ms", "cpu_ms")},
        **{f"later_converted_{k}_median": statistics.median(r[f"converted_{k}"] for r in later) if later else None
           for k in ("ms", "cpu_ms")},
        **{f"{w}_{k}_median": statistics.median(r[f"{w}_{k}"] for r in runs)
           for w in ("in_process", "from_pretrained") for k in ("ms", "cpu_ms")},
        "engines": runs}, indent=1)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
