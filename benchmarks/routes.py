"""Which of weightcache's files a request's walk runs code in: the counts of
docs/architecture.md's "An attach, hop by hop" and "A load, hop by hop".

A daemon runs in this process (CPU backend, one 8 MiB checkpoint) and an engine in a
child process (SyncClient). Each side records the files of every Python function called
(sys.setprofile, and threading.setprofile for the daemon's worker threads) while one
request is served: a cold ``load``, then a warm ``attach`` of the same model. The child
connects first and waits, so the connection's hello is not counted, nor the detach and the
close after the attach; each side counts only the request. Counted: a file whose
functions ran (a module's own body, run by a lazy import, is not counted), so a record
read only as attributes (server/resident.py's ``Resident`` in an attach) is not.

    python -m benchmarks routes            # the counts and the files, per side
    python -m benchmarks routes --json     # every file:function called, as JSON
    PYTHONPATH=<other checkout> python -m benchmarks routes   # another version's
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import weightcache

PACKAGE = Path(weightcache.__file__).parent

CHILD = r"""
import sys, threading
from pathlib import Path
import weightcache
from weightcache import SyncClient
PACKAGE = Path(weightcache.__file__).parent
files = set()
def prof(frame, event, arg):
    if event == "call" and frame.f_code.co_name != "<module>":
        f = frame.f_code.co_filename
        if f.startswith(str(PACKAGE)):
            files.add(str(Path(f).relative_to(PACKAGE)) + ":" + frame.f_code.co_name)
op, socket = sys.argv[1], sys.argv[2]
with SyncClient(socket) as c:
    if op == "attach":
        import weightcache.client.mapping  # what prefetch_attach imports at connect in an engine with torch
    print("ready", flush=True)
    sys.stdin.readline()
    sys.setprofile(prof)
    if op == "attach":
        held = c.attach("m")
        m = held.__enter__()  # the detach, when it leaves, is not the attach's walk
    else:
        c.load("m")
    sys.setprofile(None)
    print("done", " ".join(sorted(files)), flush=True)
    sys.stdin.readline()  # the daemon stopped counting: now detach and close
    if op == "attach":
        held.__exit__(None, None, None)
"""


class Recorder:
    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.on and event == "call" and frame.f_code.co_name != "<module>":
            f = frame.f_code.co_filename
            if f.startswith(str(PACKAGE)):
                self.files.add(str(Path(f).relative_to(PACKAGE)) + ":" + frame.f_code.co_name)


async def walk(op: str, socket: str, rec: Recorder) -> dict[str, list[str]]:
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, op, socket, stdin=asyncio.subprocess.PIPE,
                                                 stdout=asyncio.subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    assert (await child.stdout.readline()).strip() == b"ready"
    rec.files, rec.on = set(), True
    child.stdin.write(b"go\n")
    await child.stdin.drain()
    line = (await child.stdout.readline()).decode().split()
    await asyncio.sleep(0.3)  # what the daemon does after sending the reply (the request's metrics) counts too
    rec.on = False
    child.stdin.write(b"bye\n")
    await child.stdin.drain()
    await child.wait()
    assert line and line[0] == "done", line
    return {"daemon": sorted(rec.files), "engine": sorted(line[1:])}


async def main(as_json: bool) -> None:
    from weightcache.config import load_settings
    from weightcache.server.main import build

    tmp = Path(tempfile.mkdtemp(prefix="wc-walk-", dir="/tmp"))
    g = torch.Generator().manual_seed(0)
    save_file({f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(8)}, str(tmp / "m.safetensors"))
    cfg = tmp / "walk.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp / "d.sock"}"\n[budgets]\ncpu = "64MiB"\n'
                   f'[[models]]\nname = "m"\npath = "{tmp / "m.safetensors"}"\ndevice = "cpu"\n')
    rec = Recorder()
    threading.setprofile(rec)  # the io pool's and the loader's threads, started after this
    sys.setprofile(rec)
    daemon = build(load_settings(cfg), str(cfg))
    await daemon.start()
    serving = asyncio.ensure_future(daemon.serve())
    try:
        out = {"load": await walk("load", str(tmp / "d.sock"), rec),
               "attach": await walk("attach", str(tmp / "d.sock"), rec)}
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        daemon.request_stop("walk over")
        await serving
        shutil.rmtree(tmp, ignore_errors=True)
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for op, sides in out.items():
        for side, files in sides.items():
            print(f"{op}, {side}: {len({f.partition(':')[0] for f in files})} files")
            for f in sorted({f.partition(":")[0] for f in files}):
                print(f"    {f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    asyncio.run(main(p.parse_args().json))
