"""An example engine: a Llama built locally with transformers (no downloads), served by a
weightcache daemon, restarted with and without the cache. The forward outputs must be
bit-identical every time.

    python examples/transformers_engine.py [--preset tiny|llama-8b] [--device cpu|cuda:0]
                                           [--restarts 2] [--workdir DIR] [--supervised]

Each restart is a fresh process: `import torch, transformers`, initialize CUDA (timed
apart), then either `from_pretrained` (weights from disk) or an `empty_parameters()`
skeleton + attach + `load_into_module` (weights from the cache, zero-copy), then one
forward pass. `--preset llama-8b` needs a GPU with ~40 GB free (the daemon's copy and a
disk-loaded engine's) and ~16 GB of disk.

``--supervised`` adds restarts under ``weightcache supervise`` (docs/deployment.md,
"Supervisor"): engines forked from a template that imported torch and transformers,
compared with fresh processes on restart-to-first-logits. `python -m benchmarks supervised-restart`
measures the same with a recorded template, and writes JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = "tiny-llama"


# "tiny" runs anywhere in seconds (CI runs it on the CPU). "llama-8b" has Llama-3-8B's
# shapes (8.0B parameters, 16 GB in bfloat16): the size where a restart's weights step is
# what an operator waits for. Both are built locally from random weights, never downloaded.
PRESETS = {
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512),
    "llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rope_theta=500000.0),
}


def build(out: Path, preset: str, device: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # Llama-3-8B's embeddings are not tied. Tied models (Llama-3.2-1B/3B, Qwen2, Gemma,
    # GPT-2) work too: load_into_module ties them as from_pretrained does, and
    # tests/test_tied_weights.py checks their logits bit for bit.
    cfg = LlamaConfig(**PRESETS[preset], tie_word_embeddings=False)
    # Initialized on the target device: random init of 8B parameters on a CPU takes minutes.
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


class CudaInit(threading.Thread):
    """Creates the CUDA context on ``device`` in the background; ``join`` returns the
    seconds it took, or raises what it raised."""

    def __init__(self, device: str) -> None:
        super().__init__(name="cuda-init", daemon=True)
        self.device, self.seconds = device, 0.0
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        import torch

        t = time.perf_counter()
        try:
            torch.zeros(1, device=self.device)
            torch.cuda.synchronize(self.device)
        except BaseException as exc:  # re-raised in the engine's thread by join()
            self.error = exc
        self.seconds = time.perf_counter() - t

    def join(self, timeout: float | None = None) -> float:  # type: ignore[override]
        super().join(timeout)
        if self.error is not None:
            raise self.error
        return self.seconds


def engine(mode: str, model_dir: str, socket: str, device: str, starts_file: str = "", starts: str = "1") -> None:
    """One engine start. ``mode`` is "disk", "cache", or "supervised": the cache path in an
    engine forked by ``weightcache supervise``, which after its logits calls
    ``weightcache.engine.ready()`` and asks for a restart until ``starts`` engines have run
    (counted in ``starts_file``). ``t_start``, ``t_logits`` and ``t_done`` are
    ``time.monotonic()`` (one clock for every process of the host), so a driver can time a
    restart from one engine's ``t_done`` to the next one's ``t_logits``."""
    t_start = time.monotonic()
    phases: dict[str, float] = {}
    t = time.perf_counter()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    phases["import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cuda_init = None
    phases["cuda_init_s"] = 0.0
    if device != "cpu":
        # Both paths pay for the CUDA context. The cache path builds its model skeleton
        # (CPU work) while another thread creates the context, as an engine that knows its
        # start-up would; cuda_init_s is that thread's own time, weights_s runs from here.
        cuda_init = CudaInit(device)
        if mode == "disk":
            phases["cuda_init_s"] = cuda_init.join()
            t = time.perf_counter()
    if mode == "disk":
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 device_map=None if device == "cpu" else device)
        lease = None
    else:
        from weightcache import SyncClient, empty_parameters, load_into_module

        # The skeleton's parameters stay on "meta" (nothing allocated or initialized);
        # its non-persistent buffers (rotary frequencies, in no checkpoint) are computed
        # for real, and load_into_module moves them to the weights' device. Built the way
        # from_pretrained builds it: `.to(bfloat16)` would also cast the float32 rotary
        # buffer, and the logits would differ from the disk path's.
        with empty_parameters():
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.bfloat16)
        phases["skeleton_s"] = time.perf_counter() - t
        if cuda_init is not None:
            phases["cuda_init_s"] = cuda_init.join()
        client = SyncClient(socket, name="example-engine")
        lease = client.attach(MODEL, device=None if device == "cpu" else device)
        weights = lease.__enter__()
        phases["attach_s"] = time.perf_counter() - t - phases["skeleton_s"]
        model = load_into_module(skeleton, weights)
    model.eval()
    if device != "cpu":
        torch.cuda.synchronize()  # from_pretrained's copies are asynchronous
    phases["weights_s"] = time.perf_counter() - t
    ids = torch.arange(64, device=device).remainder(2048).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    t_logits = time.monotonic()
    digest = hashlib.sha256(logits.numpy().tobytes()).hexdigest()
    print("RESULT " + json.dumps({**phases, "logits_sha256": digest, "t_start": t_start, "t_logits": t_logits,
                                  "t_done": time.monotonic()}), flush=True)
    if lease is not None:
        lease.__exit__(None, None, None)
        client.close()
    if mode == "supervised":
        from weightcache import engine as supervised_engine

        supervised_engine.ready()  # with --record, writes the modules the next supervisor start preloads
        with open(starts_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        if len(Path(starts_file).read_text().splitlines()) < int(starts):
            supervised_engine.restart("benchmark: next start")


def restart_series(model_dir: Path, sock: str, device: str, starts: int, supervise: list[str] | None = None,
                   work: Path | None = None) -> list[dict]:
    """``starts`` engine starts from the cache, one after the other: fresh processes, or
    (``supervise`` = the supervisor's options) engines forked by one ``weightcache
    supervise``. Each row has ``restart_to_logits_s``: from the previous engine's
    ``t_done`` to this one's ``t_logits`` (the old engine's exit, the new one's start,
    imports, CUDA init, attach and forward); the first row's is from the driver's spawn."""
    args = [str(model_dir), sock, device]
    t_spawn = time.monotonic()
    if supervise is None:
        rows = []
        for _ in range(starts):
            p = subprocess.run([sys.executable, __file__, "--engine", "cache", *args], capture_output=True, text=True, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"engine (cache) failed:\n{p.stderr[-3000:]}")
            rows += [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        mode = "cache"
    else:
        assert work is not None
        starts_file = work / "supervised-starts"
        starts_file.unlink(missing_ok=True)
        p = subprocess.run([sys.executable, "-m", "weightcache", "supervise", *supervise, "--", sys.executable, __file__,
                            "--engine", "supervised", *args, str(starts_file), str(starts)],
                           capture_output=True, text=True, timeout=1800)
        (work / "supervisor.log").write_text(p.stderr)
        rows = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or len(rows) != starts:
            raise RuntimeError(f"supervised engines failed (status {p.returncode}, {len(rows)} of {starts} results):\n{p.stderr[-3000:]}")
        mode = "supervised"
    prev = t_spawn
    for r in rows:
        r["mode"] = mode
        r["restart_to_logits_s"] = r["t_logits"] - prev
        prev = r["t_done"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:0 on a GPU host")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--supervised", action="store_true",
                    help="also restart the cache engine under `weightcache supervise` (forked from a template with torch "
                         "and transformers imported) and compare restart-to-first-logits with fresh processes")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local
    if args.device.startswith("cuda"):
        import torch

        # On a host without the GPU this ended in torch's traceback from inside the build.
        ordinal = args.device.partition(":")[2]
        if not torch.cuda.is_available() or (ordinal.isdigit() and int(ordinal) >= torch.cuda.device_count()):
            ap.error(f"--device {args.device}: this host has no such CUDA device torch can use; try --device cpu")

    from weightcache import SyncClient
    from weightcache.tools.spawn import DaemonProcess, config_text

    work = Path(args.workdir or tempfile.mkdtemp(prefix="wc-example-", dir="/tmp"))
    model_dir = work / f"{MODEL}-{args.preset}"
    if not (model_dir / "config.json").exists():
        t = time.perf_counter()
        build(model_dir, args.preset, args.device)
        print(f"built {args.preset} in {model_dir} ({time.perf_counter() - t:.1f} s)", flush=True)
    nbytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    sock = str(work / "wc.sock")
    # The directory, not one file: save_pretrained shards large models (with an index).
    (work / "wc.toml").write_text(config_text(sock, {args.device: f"{nbytes // 2**30 + 1}GiB"},
                                              [{"name": MODEL, "path": str(model_dir),
                                                "device": args.device, "preload": True}]))
    rows = []
    series: dict[str, list[dict]] = {}
    with DaemonProcess(work / "wc.toml", sock, work / "daemon.log"):
        # The engine restarts below time attaching a resident model, not the first load.
        t = time.perf_counter()
        with SyncClient(sock) as c:
            c.load(MODEL)
        print(f"daemon: {MODEL} resident on {args.device}, {nbytes / 1e9:.2f} GB "
              f"(preload finished {time.perf_counter() - t:.2f} s after the daemon was ready)", flush=True)
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
        if args.supervised:
            # One supervisor: its first engine is a cold start (template imports included);
            # the next ones are the restarts compared. --record: the first engine writes the
            # modules it imported, which a later supervisor start (another run) preloads.
            sup = restart_series(model_dir, sock, args.device, args.restarts + 1, work=work,
                                 supervise=["--preload", "torch,transformers", "--record", str(work / "modules.txt")])
            fresh = restart_series(model_dir, sock, args.device, args.restarts + 1)
            series = {"fresh": fresh[1:], "supervised": sup[1:]}
    print(f"{'restart':>7} {'weights from':>13} {'process (s)':>12} {'import (s)':>11} {'CUDA init (ms)':>15} "
          f"{'weights (ms)':>13}  logits sha256")
    for r in rows:
        print(f"{r['restart']:>7} {r['mode']:>13} {r['wall_s']:>12.3f} {r['import_s']:>11.3f} {r['cuda_init_s'] * 1e3:>15.1f} "
              f"{r['weights_s'] * 1e3:>13.1f}  {r['logits_sha256'][:16]}")
    cached = [r for r in rows if r["mode"] == "cache"]
    parts = {k: statistics.median(r[k] for r in cached) * 1e3 for k in ("skeleton_s", "attach_s", "weights_s")}
    print(f"cache weights step, medians: skeleton (empty_parameters + from_config) {parts['skeleton_s']:.1f} ms, "
          f"connect + attach {parts['attach_s']:.1f} ms, load_into_module "
          f"{parts['weights_s'] - parts['skeleton_s'] - parts['attach_s']:.1f} ms")
    if series:
        print("restart to first logits, weights from the cache (from the previous engine's logits to this one's: its exit, "
              "the next start, imports, CUDA init, attach, forward)")
        print(f"{'restart':>7} {'fresh (s)':>10} {'supervised (s)':>15} {'supervised import (s)':>22}")
        for i, (a, b) in enumerate(zip(series["fresh"], series["supervised"], strict=True)):
            print(f"{i + 1:>7} {a['restart_to_logits_s']:>10.3f} {b['restart_to_logits_s']:>15.3f} {b['import_s']:>22.4f}")
    every = rows + [r for rs in series.values() for r in rs]
    if len({r["logits_sha256"] for r in every}) != 1:
        print("MISMATCH: the forward outputs differ between the engine starts")
        return 1
    print(f"forward outputs identical across all {len(every)} engine starts ({', '.join(['disk', 'cache', *series])})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine(*sys.argv[2:])
    else:
        sys.exit(main())
