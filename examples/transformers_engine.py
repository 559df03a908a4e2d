"""An example engine: a small Llama built locally with transformers (no downloads), served
by a weightcache daemon, restarted with and without the cache. The forward outputs must
be bit-identical every time.

    python examples/transformers_engine.py [--restarts 2] [--workdir DIR] [--device cpu]

Each restart is a fresh process: `import torch, transformers`, build the model skeleton
from its config, then either `from_pretrained` (weights from disk) or attach +
`load_into_module` (weights from the cache, zero-copy), then one forward pass.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "tiny-llama"


def build(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)


def engine(mode: str, model_dir: str, socket: str, device: str) -> None:
    t0 = time.perf_counter()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    t1 = time.perf_counter()
    if mode == "disk":
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
        lease = None
    else:
        from weightcache import SyncClient, load_into_module

        # The skeleton is built for real (not on "meta"): its non-persistent buffers
        # (rotary frequencies) are computed at init and are not in the checkpoint. Built
        # the way from_pretrained builds it: `.to(bfloat16)` would also cast the float32
        # rotary buffer, and the logits would differ from the disk path's.
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16).to(device)
        client = SyncClient(socket, name="example-engine")
        lease = client.attach(MODEL, device=None if device == "cpu" else device)
        model = load_into_module(skeleton, lease.__enter__())
    model.eval()
    t2 = time.perf_counter()
    ids = torch.arange(64, device=device).remainder(2048).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    digest = hashlib.sha256(logits.numpy().tobytes()).hexdigest()
    print("RESULT " + json.dumps({"import_s": t1 - t0, "weights_s": t2 - t1, "logits_sha256": digest}), flush=True)
    if lease is not None:
        lease.__exit__(None, None, None)
        client.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:0 on a GPU host")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

    from weightcache.spawn import DaemonProcess, config_text

    work = Path(args.workdir or tempfile.mkdtemp(prefix="wc-example-", dir="/tmp"))
    model_dir = work / MODEL
    if not (model_dir / "model.safetensors").exists():
        build(model_dir)
    sock = str(work / "wc.sock")
    (work / "wc.toml").write_text(config_text(sock, {args.device: "1GiB"},
                                              [{"name": MODEL, "path": str(model_dir / "model.safetensors"),
                                                "device": args.device, "preload": True}]))
    rows = []
    with DaemonProcess(work / "wc.toml", sock, work / "daemon.log"):
        for i in range(args.restarts):
            for mode in ("disk", "cache"):
                t = time.perf_counter()
                p = subprocess.run([sys.executable, __file__, "--engine", mode, str(model_dir), sock, args.device],
                                   capture_output=True, text=True, timeout=600)
                wall = time.perf_counter() - t
                line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
                if p.returncode != 0 or line is None:
                    print(f"engine ({mode}) failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                    return 1
                rows.append({"restart": i + 1, "mode": mode, "wall_s": wall, **json.loads(line[7:])})
    print(f"{'restart':>7} {'weights from':>13} {'process (s)':>12} {'import (s)':>11} {'weights (ms)':>13}  logits sha256")
    for r in rows:
        print(f"{r['restart']:>7} {r['mode']:>13} {r['wall_s']:>12.3f} {r['import_s']:>11.3f} "
              f"{r['weights_s'] * 1e3:>13.1f}  {r['logits_sha256'][:16]}")
    if len({r["logits_sha256"] for r in rows}) != 1:
        print("MISMATCH: the forward outputs differ between disk and cache")
        return 1
    print(f"forward outputs identical across all {len(rows)} engine starts (disk and cache)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(*sys.argv[2:6])
    else:
        sys.exit(main())
