"""Time a fresh engine process from spawn to "all weights usable", three ways:

- ``floor``: spawn + ``import torch`` (+ CUDA init on a GPU device): the restart floor;
- ``disk``:  the floor + ``safetensors.torch.load_file`` of every file of the checkpoint;
- ``cache``: the floor + attach through weightcache.

The demo and the benchmarks both use it, so their numbers mean the same thing. The
parent measures wall time until the child prints its READY line; the child reports how
long the weights step alone took and a checksum of the weights, so the two ways can be
checked to give the same bytes.

A fourth mode, ``fresh`` (:func:`time_fresh_attach`), is the engine's side of an attach
phase by phase: once torch is imported (and on a GPU its CUDA context exists), how long
importing the client takes, then connecting, then the first attach until its tensors are
usable, then a second attach in the same process (what is left once one-time work is done).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
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


@dataclass
class FreshAttach:
    """One fresh engine process's attach, phase by phase (milliseconds, inside the child,
    all after ``import torch`` and, on a GPU, CUDA init)."""

    import_client_ms: float  # ``from weightcache import SyncClient, load_into_module``: the client on top of torch
    connect_ms: float  # SyncClient(...) returned: connected, hello answered
    first_attach_ms: float  # attach entered -> tensors usable (every lazy import and one-time work of attach included)
    second_attach_ms: float  # the same again in the same process, after the first detached
    tensors: int
    # modules first imported by connect or the first attach (weightcache's by name, others'
    # by top-level package): lazy imports that import_client_ms does not count
    lazy_imports: list[str] = field(default_factory=list)

    @property
    def connect_to_tensors_ms(self) -> float:
        return self.connect_ms + self.first_attach_ms


def _spawn(mode: str, path: str, model: str, socket: str, device: str) -> subprocess.Popen[str]:
    # An installed engine imports compiled bytecode; with this set (as on some dev and CI
    # machines) every process compiled the client from source, ~10-20 ms more, which
    # fell mostly on the cache mode's weights step (2-core VM: 14.1 ms against 4.7).
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if mode != "fresh":
        return subprocess.Popen([sys.executable, "-m", "weightcache.tools.restart", mode, path, model, socket, device],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # ``-m weightcache.tools.restart`` would import the weightcache package before torch,
    # hiding part of the client's import cost: run this file by its path instead, with
    # the package findable (the script's own folder is taken off sys.path in the child).
    here = Path(__file__).resolve()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here.parents[2]), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, str(here), mode, path, model, socket, device], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def time_fresh_attach(*, model: str, socket: str, device: str = "cpu") -> FreshAttach:
    """Spawn a fresh engine (torch imported and CUDA initialised first) and return its
    timings, which it prints as one JSON line."""
    proc = _spawn("fresh", "-", model, socket, device)
    out, err = proc.communicate(timeout=600)
    lines = [x for x in out.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"fresh engine failed with {proc.returncode}: {err[-2000:]}")
    return FreshAttach(**json.loads(lines[-1][len(RESULT):]))


def time_restart(mode: str, *, path: str, model: str, socket: str, device: str = "cpu") -> Restart:
    t0 = time.perf_counter()
    proc = _spawn(mode, path, model, socket, device)
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
    if mode == "fresh":
        _fresh(model, socket)
        return
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


def _fresh(model: str, socket: str) -> None:
    """The ``fresh`` mode's child: torch (and CUDA) are ready; time the client's part."""
    if "weightcache" in sys.modules:
        raise RuntimeError("the fresh engine imported weightcache before timing its import")
    t0 = time.perf_counter()
    from weightcache import SyncClient, load_into_module  # what an engine imports (README)

    t1 = time.perf_counter()
    del load_into_module  # imported for its cost only
    before = set(sys.modules)
    c = SyncClient(socket, name="engine/fresh")
    t2 = time.perf_counter()
    with c:
        with c.attach(model) as m:
            t3 = time.perf_counter()
            n = len(m)
        t4 = time.perf_counter()
        with c.attach(model) as m2:
            t5 = time.perf_counter()
            assert len(m2) == n
    # weightcache's own modules by name, anyone else's by package (e.g. "cuda" for cuda-bindings)
    lazy = sorted({x if x.startswith("weightcache.") else x.split(".")[0] for x in set(sys.modules) - before})
    print(RESULT + json.dumps({"import_client_ms": (t1 - t0) * 1e3, "connect_ms": (t2 - t1) * 1e3, "first_attach_ms": (t3 - t2) * 1e3,
                               "second_attach_ms": (t5 - t4) * 1e3, "tensors": n, "lazy_imports": lazy}), flush=True)


def _report(t0: float, t1: float, weights: dict[str, Any], extra_device_bytes: int | None) -> None:
    """READY as soon as the weights are usable; the checksum (which launches kernels and
    syncs per tensor on a GPU) comes after, so it is not counted as restart time."""
    import torch

    print(READY + json.dumps({"import_s": t1 - t0, "weights_s": time.perf_counter() - t1,
                              "extra_device_bytes": extra_device_bytes}), flush=True)
    print(RESULT + json.dumps({"checksum": _checksum(torch, weights), "tensors": len(weights)}), flush=True)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run by path (fresh mode): this folder's modules are not top-level modules
    _engine(*sys.argv[1:6])
