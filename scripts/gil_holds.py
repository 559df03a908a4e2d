#!/usr/bin/env python3
"""What another thread's long GIL holds cost the event loop's thread, and two of the
daemon's answers to it (session 19, issue 25).

CPython switches threads only between bytecodes: a ``list(map(...))`` over 100k rows
is one bytecode, and holds the GIL to its end. A thread that lets the GIL go in a
syscall (every ``os.close``, ``recv``, ``send``) then waits for the holder to finish
before it runs again. Two measurements, each beside 0, 1 and 2 threads doing such maps:

- ``close``: 253 fds (one SCM_RIGHTS message's worth) closed one ``os.close`` each,
  against one ``os.closerange`` (weightcache.protocol.close_fds);
- ``digests``: read_digests of a 100k-tensor checkpoint in a thread while this thread
  sleeps 0.5 ms in a loop: its worst and median lateness (the longest GIL hold it waited
  behind), the function by DIGEST_SLICE rows as it is and as one slice.

    python scripts/gil_holds.py [--repeats 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from itertools import compress
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = 100_000


def hold_loops(n: int) -> tuple[list[threading.Thread], threading.Event]:
    stop = threading.Event()
    rows, sizes = range(ROWS), [1] * ROWS

    def hold() -> None:
        while not stop.is_set():
            list(compress(rows, map(bool, sizes)))  # one bytecode over 100k rows

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, stop


def close_ms(one_by_one: bool) -> float:
    from weightcache.protocol import close_fds

    null = os.open("/dev/null", os.O_RDONLY)
    fds = [os.dup(null) for _ in range(253)]
    os.close(null)
    t = time.perf_counter()
    if one_by_one:
        for fd in fds:
            os.close(fd)
    else:
        close_fds(fds)
    return (time.perf_counter() - t) * 1e3


def digests_lateness(ckpt: Any, slice_rows: int) -> dict[str, float]:
    from weightcache.loader import content

    pieces = {(i, 0): b"x" for i in range(len(ckpt.tensors))}
    saved, content.DIGEST_SLICE = content.DIGEST_SLICE, slice_rows
    try:
        done: list[float] = []

        def run() -> None:
            t = time.perf_counter()
            content.read_digests(ckpt, pieces, {}, "bench")
            done.append(time.perf_counter() - t)

        late: list[float] = []
        th = threading.Thread(target=run)
        th.start()
        while th.is_alive():
            t = time.perf_counter()
            time.sleep(0.0005)
            late.append(time.perf_counter() - t - 0.0005)
        th.join()
    finally:
        content.DIGEST_SLICE = saved
    return {"read_digests_ms": done[0] * 1e3, "worst_late_ms": max(late) * 1e3, "median_late_ms": statistics.median(late) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch
    from safetensors.torch import save_file

    from weightcache.loader.checkpoint import open_source, parse_checkpoint

    out: dict[str, Any] = {"python": sys.version.split()[0], "close": {}, "digests": {}}
    for holders in (0, 1, 2):
        threads, stop = hold_loops(holders)
        time.sleep(0.05)
        for how, one in (("os.close each", True), ("closerange", False)):
            ms = [close_ms(one) for _ in range(args.repeats)]
            out["close"][f"{holders} holders, {how}"] = ms
            print(f"253 fds, {holders} thread(s) mapping {ROWS} rows, {how:13s}: " + " ".join(f"{m:.2f}" for m in ms) + " ms")
        stop.set()
        for t in threads:
            t.join()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.safetensors"
        save_file({f"t{i}": torch.zeros(1, dtype=torch.uint8) for i in range(ROWS)}, str(path))
        with open_source(path) as opened:
            ckpt = parse_checkpoint(opened)
    from weightcache.loader.content import DIGEST_SLICE

    for label, rows in ((f"by {DIGEST_SLICE} rows", DIGEST_SLICE), ("in one slice", ROWS)):
        runs = [digests_lateness(ckpt, rows) for _ in range(args.repeats)]
        out["digests"][label] = runs
        print(f"read_digests of {ROWS} one-byte tensors {label:13s}: " + "; ".join(
            f"{r['read_digests_ms']:.0f} ms, other thread late {r['worst_late_ms']:.1f} max / {r['median_late_ms']:.2f} median"
            for r in runs))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
