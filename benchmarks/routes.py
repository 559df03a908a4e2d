"""Which of weightcache's files each route runs code in, and how often it comes back to a
file it had left: the counts in docs/architecture.md ("Routes, counted").

Three routes:

  attach    a warm attach: the model resident and unchanged (CPU backend, a page-cache
            arena); the daemon in this process, the engine a SyncClient in a child process
  load      a cold load: the model registered and not resident, its file's pages dropped
            first; the daemon here and the engine's ``load`` request in the child
  eviction  one eviction decision: ``CacheCore.begin_load`` of a model that needs a
            resident one's room (the daemon's cache core, in this process)

Each side records the file of every Python function called (``sys.setprofile``, and
``threading.setprofile`` for the daemon's worker threads) while one request is served.
The child connects first and waits, so its hello is not counted, nor the detach and the
close after the attach. A module's own body (run by a lazy import) is not counted.

Counted per route and side:

  files    the package's files whose functions ran
  returns  returns to a room already left: walking each thread's calls in order, the
           times a call lands in a file the thread had called into before, coming from
           another file (a > b > a counts one; a > a > b counts none)

    python -m benchmarks routes                 # the counts and the files, per route and side
    python -m benchmarks routes --json          # the counts and every file, as JSON
    PYTHONPATH=<other checkout> python -m benchmarks routes   # another version's
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import weightcache

PACKAGE = str(Path(weightcache.__file__).parent)

# The engine: a child process that records its own calls between two lines on stdin.
CHILD = r"""
import json, sys, threading
from pathlib import Path
import weightcache
from weightcache import SyncClient
PACKAGE = str(Path(weightcache.__file__).parent)
calls = []
def prof(frame, event, arg):
    if event == "call" and frame.f_code.co_name != "<module>" and frame.f_code.co_filename.startswith(PACKAGE):
        calls.append(frame.f_code.co_filename[len(PACKAGE) + 1:])
op, socket = sys.argv[1], sys.argv[2]
with SyncClient(socket) as c:
    if op == "attach":
        import weightcache.client.mapping  # what an engine with torch imports while it waits for the hello
    print("ready", flush=True)
    sys.stdin.readline()
    sys.setprofile(prof)
    if op == "attach":
        held = c.attach("m")
        held.__enter__()  # the detach, when it leaves, is not the attach's route
    else:
        c.load("m")
    sys.setprofile(None)
    print("done " + json.dumps(calls), flush=True)
    sys.stdin.readline()  # the daemon stopped counting: now detach and close
    if op == "attach":
        held.__exit__(None, None, None)
"""


class Recorder:
    """A profile function: the package file of every call, per thread, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[int, list[str]] = {}

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.on and event == "call" and frame.f_code.co_name != "<module>":
            f = frame.f_code.co_filename
            if f.startswith(PACKAGE):
                self.calls.setdefault(threading.get_ident(), []).append(f[len(PACKAGE) + 1:])

    def start(self) -> None:
        self.calls, self.on = {}, True

    def stop(self) -> list[list[str]]:
        self.on = False
        return list(self.calls.values())


def returns(seq: list[str]) -> int:
    """Calls that land in a file this sequence had called into before, coming from another."""
    seen: set[str] = set()
    n, prev = 0, None
    for f in seq:
        if f != prev and f in seen:
            n += 1
        seen.add(f)
        prev = f
    return n


def side(threads: list[list[str]]) -> dict[str, Any]:
    files = sorted({f for seq in threads for f in seq})
    return {"files": len(files), "returns": sum(returns(seq) for seq in threads), "list": files}


async def over_the_wire(op: str, socket: str, rec: Recorder) -> dict[str, Any]:
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, op, socket, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    assert (await child.stdout.readline()).strip() == b"ready"
    rec.start()
    child.stdin.write(b"go\n")
    await child.stdin.drain()
    line = (await child.stdout.readline()).decode()
    await asyncio.sleep(0.3)  # what the daemon does after sending the reply (the request's metrics) counts too
    daemon = rec.stop()
    child.stdin.write(b"bye\n")
    await child.stdin.drain()
    await child.wait()
    assert line.startswith("done "), line
    return {"daemon": side(daemon), "engine": side([json.loads(line[5:])])}


def eviction_decision() -> dict[str, Any]:
    """One ``begin_load`` that evicts: three models, a budget for two, the third's load."""
    from weightcache.cache.core import CacheCore

    core = CacheCore({"cpu": 200})
    for name in ("a", "b", "c"):
        core.register(name, "cpu")
    for name in ("a", "b"):
        core.begin_load(name, 100)
        core.finish_load(name)
    rec = Recorder()
    sys.setprofile(rec)
    rec.start()
    try:
        plan = core.begin_load("c", 100)
    finally:
        sys.setprofile(None)
        threads = rec.stop()
    assert plan.evict == ("a",), plan
    return {"daemon": side(threads)}


async def measure() -> dict[str, Any]:
    from weightcache.config import load_settings
    from weightcache.server.main import build

    tmp = Path(tempfile.mkdtemp(prefix="wc-routes-", dir="/tmp"))
    rec = Recorder()
    try:
        g = torch.Generator().manual_seed(0)
        ckpt = tmp / "m.safetensors"
        save_file({f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(8)}, str(ckpt))
        cfg = tmp / "routes.toml"
        cfg.write_text(f'[daemon]\nsocket = "{tmp / "d.sock"}"\n[budgets]\ncpu = "64MiB"\n'
                       f'[[models]]\nname = "m"\npath = "{ckpt}"\ndevice = "cpu"\n')
        threading.setprofile(rec)  # the io pool's and the loader's threads, started after this
        sys.setprofile(rec)
        daemon = build(load_settings(cfg), str(cfg))
        await daemon.start()
        serving = asyncio.ensure_future(daemon.serve())
        try:
            fd = os.open(ckpt, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: its pages dropped
            finally:
                os.close(fd)
            out = {"load": await over_the_wire("load", str(tmp / "d.sock"), rec),
                   "attach": await over_the_wire("attach", str(tmp / "d.sock"), rec)}
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            daemon.request_stop("routes counted")
            await serving
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["eviction"] = eviction_decision()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the counts and the files as JSON")
    out = asyncio.run(measure())
    if p.parse_args().json:
        print(json.dumps(out, indent=1))
        return
    for route, sides in out.items():
        for name, s in sides.items():
            print(f"{route}, {name}: {s['files']} files, {s['returns']} returns to a room already left")
            for f in s["list"]:
                print(f"    {f}")


if __name__ == "__main__":
    main()
