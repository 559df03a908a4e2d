"""Time a fresh engine process from spawn to "all weights usable", three ways:

- ``floor``: spawn + ``import torch`` (+ CUDA init on a GPU device): the restart floor;
- ``disk``:  the floor + ``safetensors.torch.load_file`` of every file of the checkpoint;
- ``cache``: the floor + attach through weightcache.

The demo and the benchmarks both use it, so their numbers mean the same thing. The
parent measures wall time until the child prints its READY line; the child reports how
long the weights step alone took and a checksum of the weights, so the two ways can be
checked to give the same bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

READY = "READY "
RESULT = "RESULT "


@dataclass
class Restart:
    mode: str
    ready_s: float  # spawn -> READY, as the parent saw it
    import_s: float  # import torch (+ CUDA init) inside the child
    weights_s: float  # load_file or attach inside the child
    checksum: float | None
    tensors: int
    extra_device_bytes: int | None  # GPU memory the weights step took (None on CPU)


def time_restart(mode: str, *, path: str, model: str, socket: str, device: str = "cpu") -> Restart:
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "weightcache.tools.restart", mode, path, model, socket, device],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    info: dict[str, Any] = {}
    ready = 0.0
    for line in proc.stdout:
        if line.startswith(READY):
            ready = time.perf_counter() - t0
            info.update(json.loads(line[len(READY):]))
        elif line.startswith(RESULT):
            info.update(json.loads(line[len(RESULT):]))
            break
    proc.stdout.close()
    _, err = proc.communicate(timeout=600)
    if not ready or "checksum" not in info or proc.returncode != 0:
        raise RuntimeError(f"engine ({mode}) failed with {proc.returncode}: {err[-2000:]}")
    return Restart(mode=mode, ready_s=ready, import_s=info["import_s"], weights_s=info["weights_s"],
                   checksum=info["checksum"], tensors=info["tensors"], extra_device_bytes=info.get("extra_device_bytes"))


def _checksum(torch: Any, tensors: dict[str, Any]) -> float:
    # Touches every tensor (so lazily mapped pages really are usable) but stays cheap:
    # the first and last elements of each, summed in float64.
    total = 0.0
    for t in tensors.values():
        flat = t.reshape(-1)
        if flat.numel():
            total += float(flat[0].double()) + float(flat[-1].double())
    return total


def _engine(mode: str, path: str, model: str, socket: str, device: str) -> None:
    t0 = time.perf_counter()
    import torch

    cuda = device.startswith("cuda")
    if cuda:
        torch.empty(1, device=device)  # CUDA context: part of every engine's start

    def extra_bytes() -> int | None:
        # Device memory taken since the context existed: the weights' cost to this process.
        return free0 - torch.cuda.mem_get_info(torch.device(device))[0] if cuda else None

    free0 = torch.cuda.mem_get_info(torch.device(device))[0] if cuda else 0
    t1 = time.perf_counter()
    if mode == "floor":
        print(READY + json.dumps({"import_s": t1 - t0, "weights_s": 0.0}), flush=True)
        print(RESULT + json.dumps({"checksum": None, "tensors": 0}), flush=True)
        return
    if mode == "disk":
        from safetensors.torch import load_file

        from weightcache.loader.checkpoint import discover_files

        weights: dict[str, Any] = {}
        for f in discover_files(path):
            weights.update(load_file(f, device=device))
        if cuda:
            torch.cuda.synchronize()
        _report(t0, t1, weights, extra_bytes())
        return
    from weightcache import SyncClient

    with SyncClient(socket, name=f"engine/{mode}") as c, c.attach(model) as m:
        _report(t0, t1, dict(m), extra_bytes())


def _report(t0: float, t1: float, weights: dict[str, Any], extra_device_bytes: int | None) -> None:
    """READY as soon as the weights are usable; the checksum (which launches kernels and
    syncs per tensor on a GPU) comes after, so it is not counted as restart time."""
    import torch

    print(READY + json.dumps({"import_s": t1 - t0, "weights_s": time.perf_counter() - t1,
                              "extra_device_bytes": extra_device_bytes}), flush=True)
    print(RESULT + json.dumps({"checksum": _checksum(torch, weights), "tensors": len(weights)}), flush=True)


if __name__ == "__main__":
    _engine(*sys.argv[1:6])
