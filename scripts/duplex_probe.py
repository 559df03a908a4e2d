"""Why a promotion under churn runs slower than alone: measure a device-to-host demotion
and a host-to-device promotion, each alone and both at once, through the daemon's own
CUDA backend and, as a baseline without any VMM driver call, through torch's copies.

Issue 12: under the workload benchmark, 2 GiB promotions that overlapped a 4 GiB
victim's demotion filled at ~17 GB/s while the demotion ran at ~41 GB/s; alone each runs
at ~50 GB/s. This tells whether the link, the copy engines or the VMM calls between
chunks (cuMemCreate/Map/SetAccess while growing, cuMemUnmap/Release while demoting)
serialize the two directions.

    python3 scripts/duplex_probe.py --device cuda:0 --out probe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

GIB = 1 << 30


def _timed_pair(a: Callable[[], None], b: Callable[[], None]) -> tuple[float, float, float]:
    """Run ``a`` and ``b`` in two threads started together: (a's s, b's s, both's s)."""
    times = [0.0, 0.0]
    go = threading.Barrier(3)

    def run(i: int, f: Callable[[], None]) -> None:
        go.wait()
        t = time.perf_counter()
        f()
        times[i] = time.perf_counter() - t

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate((a, b))]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return times[0], times[1], time.perf_counter() - t0


def torch_rows(device: str, down: int, up: int) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    src_dev = torch.ones(down, dtype=torch.uint8, device=dev)
    dst_host = torch.empty(down, dtype=torch.uint8, pin_memory=True)
    src_host = torch.ones(up, dtype=torch.uint8, pin_memory=True)
    dst_dev = torch.empty(up, dtype=torch.uint8, device=dev)
    s_down, s_up = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    chunk = GIB

    def d2h(chunked: bool) -> Callable[[], None]:
        def f() -> None:
            with torch.cuda.stream(s_down):
                step = chunk if chunked else down
                for off in range(0, down, step):
                    dst_host[off:off + step].copy_(src_dev[off:off + step], non_blocking=True)
                    if chunked:
                        s_down.synchronize()
                s_down.synchronize()
        return f

    def h2d() -> None:
        with torch.cuda.stream(s_up):
            dst_dev.copy_(src_host, non_blocking=True)
            s_up.synchronize()

    d2h(False)()
    h2d()  # warm
    out: dict[str, Any] = {}
    t = time.perf_counter()
    d2h(False)()
    out["torch D2H alone GB/s"] = down / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    h2d()
    out["torch H2D alone GB/s"] = up / (time.perf_counter() - t) / 1e9
    for chunked in (False, True):
        a, b, _ = _timed_pair(d2h(chunked), h2d)
        tag = "1 GiB chunks, synced" if chunked else "one copy"
        out[f"torch together ({tag}): D2H GB/s"] = down / a / 1e9
        out[f"torch together ({tag}): H2D GB/s"] = up / b / 1e9
    return out


def backend_rows(device: str, down: int, up: int) -> dict[str, Any]:
    from cuda.bindings import driver as cu

    from weightcache import cuda_driver as drv
    from weightcache.backends.cuda import CudaBackend

    be = CudaBackend(device)
    pool = be.start_host_tier(down + 2 * up + GIB)
    be.use_host_pool(pool)

    def filled(n: int) -> Any:
        arena = be.allocate(n, "probe")
        with drv.current(be.ctx):
            drv.check(cu.cuMemsetD8(arena.va, 1, arena.nbytes))
            drv.check(cu.cuCtxSynchronize())
        return arena

    out: dict[str, Any] = {}
    host_up = be.demote(filled(up))  # the copy to promote, made once
    t = time.perf_counter()
    host_down = be.demote(filled(down))
    out["backend demote alone GB/s"] = down / (time.perf_counter() - t) / 1e9
    be.free_host(host_down)
    for lazy in (False, True):
        target = be.allocate_as_room_frees(up, "probe") if lazy else be.allocate(up, "probe")
        t = time.perf_counter()
        be.promote(host_up, target)
        out[f"backend promote alone ({'chunks made while copying' if lazy else 'chunks made first'}) GB/s"] = \
            up / (time.perf_counter() - t) / 1e9
        be.free(target)
    for lazy in (False, True):
        victim = filled(down)
        target = be.allocate_as_room_frees(up, "probe") if lazy else be.allocate(up, "probe")
        copies: list[Any] = []
        a, b, _ = _timed_pair(functools.partial(lambda v, c: c.append(be.demote(v)), victim, copies),
                              functools.partial(be.promote, host_up, target))
        tag = "chunks made while copying" if lazy else "chunks made first"
        out[f"backend together ({tag}): demote GB/s"] = down / a / 1e9
        out[f"backend together ({tag}): promote GB/s"] = up / b / 1e9
        be.free(target)
        for c in copies:
            be.free_host(c)
    be.free_host(host_up)
    be.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--down-gib", type=float, default=4.0, help="bytes demoted (device to host)")
    ap.add_argument("--up-gib", type=float, default=2.0, help="bytes promoted (host to device)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("duplex_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    down, up = int(args.down_gib * GIB), int(args.up_gib * GIB)
    rows = {**torch_rows(args.device, down, up), **backend_rows(args.device, down, up)}
    for k, v in rows.items():
        print(f"{k:70s} {v:7.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "down_bytes": down, "up_bytes": up, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
