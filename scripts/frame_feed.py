#!/usr/bin/env python3
"""Time ``FrameDecoder.feed`` on big frames arriving in 64 KiB reads, as the daemon's
reader gets them (issue 25): milliseconds and minor page faults per frame, with each
payload dropped before the next frame (as the daemon does once a frame is dispatched)
and with the previous one still held. Run it on two checkouts to compare them:

    .venv/bin/python scripts/frame_feed.py
    PYTHONPATH=/tmp/base .venv/bin/python scripts/frame_feed.py   # a `git archive` of the code before
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

from weightcache.protocol import HEADER, FrameDecoder


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frame-bytes", type=int, default=3_500_000, help="payload size (default: biglist's 3.5 MB)")
    ap.add_argument("--frames", type=int, default=20, help="frames per repetition")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    frame = HEADER.pack(args.frame_bytes) + os.urandom(args.frame_bytes)
    out: dict[str, list[dict[str, float]]] = {}
    for keep in (False, True):
        dec = FrameDecoder(16 * 2**20)
        runs = out["previous payload held" if keep else "payload dropped"] = []
        for _ in range(args.reps):
            held: list[bytes] = []
            f0, t0 = faults(), time.perf_counter()
            for _ in range(args.frames):
                for at in range(0, len(frame), 1 << 16):  # a fresh bytes object per read, as recv gives
                    got = dec.feed(frame[at:at + (1 << 16)])
                assert len(got) == 1 and len(got[0]) == args.frame_bytes
                held = got if keep else []
                del got
            runs.append({"ms_per_frame": round((time.perf_counter() - t0) / args.frames * 1e3, 3),
                         "faults_per_frame": round((faults() - f0) / args.frames)})
            del held
    print(json.dumps(out))


if __name__ == "__main__":
    main()
