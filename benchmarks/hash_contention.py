"""What a load's content hash takes from an engine computing on the same GPU.

With the hash on the GPU (backends/cuda_hash.py) a load runs kernels in the daemon's CUDA
context; another process's kernels (an engine's) share the GPU with them by time slicing,
unless MPS is used. This runs an "engine" process doing bf16 matmuls back to back and, in
this process, the daemon's loader (``read_checkpoint`` into a VMM arena, as
tools/bench_hash.py does) from a warm page cache: without the hash, with the hash on the
GPU, with it on the host, interleaved, a pause between loads. It reports each variant's
load time and the engine's matmul rate during the loads against its rate in the pauses.

    python3 -m benchmarks hash-contention --device cuda:0 --size-gib 4 --reps 3 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default

BATCH = 20  # matmuls between two timestamps


def engine(device: str, seconds: float, out: str) -> None:
    import torch

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(50):
        a @ b
    torch.cuda.synchronize()
    print("ready", flush=True)
    stamps = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(BATCH):
            a @ b
        torch.cuda.synchronize()
        stamps.append(time.monotonic())
    Path(out).write_text(json.dumps(stamps))


def rate(stamps: list[float], t0: float, t1: float) -> float:
    """Matmuls per second from the batches that ended in (t0, t1]."""
    return sum(t0 < s <= t1 for s in stamps) * BATCH / (t1 - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--tensors", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pause-s", type=float, default=1.0)
    p.add_argument("--workdir", default="/tmp/wc-hash-contention")
    p.add_argument("--out", type=Path, default=RESULTS / "hash-contention.json")
    p.add_argument("--engine", nargs=2, metavar=("SECONDS", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.engine:
        engine(a.device, float(a.engine[0]), a.engine[1])
        return 0

    from weightcache.backends.cuda import CudaBackend
    from weightcache.loader.reader import FILE_DIGESTS
    from weightcache.tools.bench_hash import load_once
    from weightcache.tools.bench_measure import warm_page_cache
    from weightcache.tools.synth import kept_checkpoint

    work = Path(a.workdir)
    path = kept_checkpoint(work / f"c-{a.size_gib:g}g.safetensors", int(a.size_gib * 2**30), a.tensors)
    warm_page_cache(path)
    gpu, host = CudaBackend(a.device), CudaBackend(a.device, hash_on_gpu=False)
    assert gpu.gpu_hash is not None, gpu.gpu_hash_unavailable
    variants = {"no hash": (gpu, False), "hash on the GPU": (gpu, True), "hash on the host": (host, True)}
    for backend, hashing in variants.values():  # uncounted: first-use costs
        load_once(path, backend, 8, 16 << 20, hashing)
    seconds = a.pause_s + a.reps * len(variants) * (a.pause_s + 0.6) + 3
    stamps_file = work / "engine.json"
    child = subprocess.Popen([sys.executable, __file__, "--device", a.device, "--engine", str(seconds), str(stamps_file)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    time.sleep(a.pause_s)
    windows: list[tuple[str, float, float]] = []
    for rep in range(a.reps):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for name in order:
            backend, hashing = variants[name]
            FILE_DIGESTS.clear()  # a first load: every byte hashed
            t0 = time.monotonic()
            load_once(path, backend, 8, 16 << 20, hashing)
            windows.append((name, t0, time.monotonic()))
            time.sleep(a.pause_s)
    child.wait(timeout=seconds + 60)
    stamps = json.loads(stamps_file.read_text())
    gaps = [(windows[i][2] + 0.05, windows[i + 1][1] - 0.05) for i in range(len(windows) - 1)]
    idle = sorted(rate(stamps, g0, g1) for g0, g1 in gaps)
    idle_rate = idle[len(idle) // 2]
    result: dict = {"nbytes": path.stat().st_size, "engine_idle_matmuls_per_s": idle_rate, "variants": {}}
    print(f"engine alone: {idle_rate:.0f} matmuls/s (4096^3 bf16), median of {len(idle)} pauses")
    for name in variants:
        mine = [(t0, t1) for n, t0, t1 in windows if n == name]
        loads = sorted(t1 - t0 for t0, t1 in mine)
        rates = sorted(rate(stamps, t0, t1) / idle_rate for t0, t1 in mine)
        result["variants"][name] = {"load_s": loads, "engine_rate_vs_alone": rates}
        print(f"{name:<18} load p50 {loads[len(loads) // 2] * 1e3:6.1f} ms, "
              f"{result['nbytes'] / loads[len(loads) // 2] / 1e9:5.1f} GB/s; engine during it: "
              f"{rates[len(rates) // 2]:.2f} of alone [{rates[0]:.2f}-{rates[-1]:.2f}]")
    gpu.close()
    host.close()
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
