"""Time a fresh engine process from spawn to "all weights usable", the ways an engine
can get its weights:

- ``floor``: spawn + ``import torch`` (+ CUDA init on a GPU device): the restart floor;
- ``disk``:  the floor + ``safetensors.torch.load_file`` of every file of the checkpoint;
- ``cache``: the floor + ``from weightcache import SyncClient`` + connect + attach;
- ``ipc`` (GPU only): the floor + the same tensors as torch CUDA IPC handles from a
  process that holds them (``reduce_tensor`` per tensor, one ``cudaIpcOpenMemHandle``
  each on the way in): what vLLM's and SGLang's weight-sharing daemons hand out.

The demo and the benchmarks both use it, so their numbers mean the same thing. The
parent measures wall time until the child prints its READY line; the child reports how
long the weights step alone took (everything after torch and CUDA are ready, imports of
safetensors or weightcache included) and a checksum of the weights, so the ways can be
checked to give the same bytes.

Note [as the engine meets it]
-----------------------------
Every child runs this file by its path, never ``python -m weightcache...``: that would
import the weightcache package before torch, and its cost would fall outside the timed
step (~5-20 ms of a fresh process left out that way). The disk child imports nothing of weightcache (the parent hands it the file list).
Children import weightcache's compiled bytecode, as a ``pip install`` leaves it; with
``bytecode=False`` they import the package from a copy of its sources with
``PYTHONDONTWRITEBYTECODE=1``, so every process compiles it: what an editable checkout
on a host that sets that variable pays.

A further mode, ``fresh`` (:func:`time_fresh_attach`), is the engine's side of an attach
phase by phase: once torch is imported (and on a GPU its CUDA context exists), how long
importing the client takes, then connecting, then the first attach until its tensors are
usable, then a second attach in the same process (what is left once one-time work is done).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READY = "READY "
RESULT = "RESULT "
HOLDING = "HOLDING"
MODES = ("floor", "disk", "cache", "ipc")
PACKAGE = Path(__file__).resolve().parents[1]  # weightcache/


@dataclass
class Restart:
    mode: str
    ready_s: float  # spawn -> READY, as the parent saw it
    import_s: float  # import torch (+ CUDA init) inside the child
    weights_s: float  # load_file, attach or IPC inside the child, its imports included
    checksum: float | None
    tensors: int
    extra_device_bytes: int | None  # GPU memory the weights step took (None on CPU)
    # The weights step's CPU time in the engine process (every thread, not the waits):
    # what the engine's own work costs, steadier than weights_s on a machine others load.
    weights_cpu_s: float | None = None


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

    @property
    def import_to_tensors_ms(self) -> float:
        """What a fresh engine pays for its weights once torch is ready: the figure to keep small."""
        return self.import_client_ms + self.connect_ms + self.first_attach_ms


@contextlib.contextmanager
def source_only_package() -> Iterator[str]:
    """A folder holding a copy of the weightcache package without bytecode: put first on
    PYTHONPATH with PYTHONDONTWRITEBYTECODE=1, every import compiles it from source."""
    with tempfile.TemporaryDirectory(prefix="wc-src-") as tmp:
        shutil.copytree(PACKAGE, Path(tmp) / "weightcache", ignore=shutil.ignore_patterns("__pycache__"))
        yield tmp


def _spawn(mode: str, spec: dict[str, Any], src: str | None = None) -> subprocess.Popen[str]:
    """Run this file by its path (Note [as the engine meets it]) as the child ``mode``.
    ``src``: a source-only copy of the package to import instead (no bytecode)."""
    env = dict(os.environ)
    if src is None:
        # An installed engine imports compiled bytecode; with this set (as on some dev and CI
        # machines) every process compiled the client from source, ~10-20 ms more.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        root = str(PACKAGE.parent)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        root = src
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), mode, json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def time_fresh_attach(*, model: str, socket: str, device: str = "cpu") -> FreshAttach:
    """Spawn a fresh engine (torch imported and CUDA initialised first) and return its
    timings, which it prints as one JSON line."""
    proc = _spawn("fresh", {"model": model, "socket": socket, "device": device})
    out, err = proc.communicate(timeout=600)
    lines = [x for x in out.splitlines() if x.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"fresh engine failed with {proc.returncode}: {err[-2000:]}")
    return FreshAttach(**json.loads(lines[-1][len(RESULT):]))


def time_restart(mode: str, *, files: list[str], model: str, socket: str, device: str = "cpu", ipc_socket: str | None = None,
                 src: str | None = None) -> Restart:
    """One fresh engine process, ``mode`` one of MODES. ``files``: the checkpoint's
    safetensors files (the disk way loads them); ``ipc_socket``: an :func:`ipc_holder`'s
    (the ipc way); ``src``: a :func:`source_only_package` (the cache way then compiles
    the client, as without bytecode)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    t0 = time.perf_counter()
    proc = _spawn(mode, {"files": files, "model": model, "socket": socket, "device": device, "ipc_socket": ipc_socket}, src)
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
                   checksum=info["checksum"], tensors=info["tensors"], extra_device_bytes=info.get("extra_device_bytes"),
                   weights_cpu_s=info.get("weights_cpu_s"))


@contextlib.contextmanager
def ipc_holder(files: list[str], device: str, socket_path: str) -> Iterator[str]:
    """A process that loads the checkpoint onto ``device`` and hands every connecting
    engine its tensors as torch CUDA IPC handles, until the block ends. Yields its socket."""
    proc = _spawn("ipc_holder", {"files": files, "device": device, "socket": socket_path})
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if line.strip() != HOLDING:
            raise RuntimeError(f"the CUDA IPC holder did not start: {proc.communicate(timeout=60)[1][-2000:]}")
        yield socket_path
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


# ------------------------------------------------------------------------------ the children
def _checksum(torch: Any, tensors: dict[str, Any]) -> float:
    # Touches every tensor (so lazily mapped pages really are usable) but stays cheap:
    # the first and last elements of each, summed in float64.
    total = 0.0
    for t in tensors.values():
        flat = t.reshape(-1)
        if flat.numel():
            total += float(flat[0].double()) + float(flat[-1].double())
    return total


def _engine(mode: str, spec: dict[str, Any]) -> None:
    if "weightcache" in sys.modules:
        raise RuntimeError("the engine imported weightcache before timing its weights step")
    t0 = time.perf_counter()
    import torch

    device = spec["device"]
    cuda = device.startswith("cuda")
    if cuda:
        torch.empty(1, device=device)  # CUDA context: part of every engine's start

    def extra_bytes() -> int | None:
        # Device memory taken since the context existed: the weights' cost to this process.
        return free0 - torch.cuda.mem_get_info(torch.device(device))[0] if cuda else None

    free0 = torch.cuda.mem_get_info(torch.device(device))[0] if cuda else 0
    t1, cpu1 = time.perf_counter(), time.process_time()
    if mode == "fresh":
        _fresh(spec["model"], spec["socket"])
        return
    if mode == "ipc_holder":
        _hold_ipc(spec)
        return
    if mode == "floor":
        print(READY + json.dumps({"import_s": t1 - t0, "weights_s": 0.0}), flush=True)
        print(RESULT + json.dumps({"checksum": None, "tensors": 0}), flush=True)
        return
    if mode == "disk":
        from safetensors.torch import load_file

        weights: dict[str, Any] = {}
        for f in spec["files"]:
            weights.update(load_file(f, device=device))
        if cuda:
            torch.cuda.synchronize()
        _report(t0, t1, cpu1, weights, extra_bytes())
        return
    if mode == "ipc":
        _report(t0, t1, cpu1, _receive_ipc(spec["ipc_socket"]), extra_bytes())
        return
    from weightcache import SyncClient

    with SyncClient(spec["socket"], name=f"engine/{mode}") as c, c.attach(spec["model"]) as m:
        _report(t0, t1, cpu1, dict(m), extra_bytes())


def _hold_ipc(spec: dict[str, Any]) -> None:
    """The ipc holder: load the files onto the device, then send each engine that connects
    one pickle of [(name, (rebuild, args)), ...] from torch's ``reduce_tensor``."""
    import pickle
    import socket
    import struct

    from safetensors.torch import load_file
    from torch.multiprocessing.reductions import reduce_tensor

    tensors: dict[str, Any] = {}
    for f in spec["files"]:
        tensors.update(load_file(f, device=spec["device"]))
    payload = pickle.dumps([(name, reduce_tensor(t)) for name, t in tensors.items()])
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(spec["socket"])  # left by a run that was killed
    server.bind(spec["socket"])
    server.listen(8)
    print(HOLDING, flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            conn.sendall(struct.pack(">Q", len(payload)) + payload)
            conn.recv(1)  # the engine closes once it is done: the tensors it opened stay valid while we live


def _receive_ipc(path: str) -> dict[str, Any]:
    import pickle
    import socket
    import struct

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        f = s.makefile("rb")
        (n,) = struct.unpack(">Q", f.read(8))
        handles = pickle.loads(f.read(n))  # a benchmark's own trusted holder: torch's IPC protocol is pickle
    return {name: rebuild(*args) for name, (rebuild, args) in handles}


def _fresh(model: str, socket: str) -> None:
    """The ``fresh`` mode's child: torch (and CUDA) are ready; time the client's part."""
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


def _report(t0: float, t1: float, cpu1: float, weights: dict[str, Any], extra_device_bytes: int | None) -> None:
    """READY as soon as the weights are usable; the checksum (which launches kernels and
    syncs per tensor on a GPU) comes after, so it is not counted as restart time."""
    weights_s, weights_cpu_s = time.perf_counter() - t1, time.process_time() - cpu1
    import torch

    print(READY + json.dumps({"import_s": t1 - t0, "weights_s": weights_s, "weights_cpu_s": weights_cpu_s,
                              "extra_device_bytes": extra_device_bytes}), flush=True)
    print(RESULT + json.dumps({"checksum": _checksum(torch, weights), "tensors": len(weights)}), flush=True)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]  # run by path: this folder's modules are not top-level modules
    _engine(sys.argv[1], json.loads(sys.argv[2]))
