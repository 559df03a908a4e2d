"""What the published store ([published] dir, server/store.py) costs a publish, and what
the first attach after a restart costs: one process, one model of random int8 tensors.

    python -m benchmarks published-store-cost --mib 256   # writes results/published-store-cost.json

Starts a daemon with the store off, publishes, attaches; then one with the store on
(publish writes the model to disk, fsync'd), attaches; drops the page cache (needs root;
skipped, and said, where it cannot) and restarts that daemon: the first attach reads the
model back from disk, hashing every byte; the second finds it resident.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import torch

from weightcache import Client
from weightcache.tools.spawn import DaemonProcess, config_text

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="model size (16 tensors)")
    ap.add_argument("--out", type=Path, default=RESULTS / "published-store-cost.json", help="write the figures here as JSON")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="wcstore-", dir="/tmp"))
    sock = str(root / "d.sock")
    rows = args.mib * 2**20 // 16 // 4096
    tensors = {f"layer.{i}.w": torch.randint(-128, 127, (rows, 4096), dtype=torch.int8) for i in range(16)}

    def config(store: bool) -> Path:
        text = config_text(sock, {"cpu": f"{2 * args.mib + 64}MiB"}, [], {"log_level": "info"})
        if store:
            text += f'\n[published]\ndir = "{root / "store"}"\nbudget = "{2 * args.mib + 64}MiB"\n'
        path = root / ("store.toml" if store else "plain.toml")
        path.write_text(text)
        return path

    async def publish() -> tuple[float, bool]:
        async with Client(sock) as c:
            t = time.perf_counter()
            m = await c.publish("m", tensors, fingerprint="x")
            return time.perf_counter() - t, m["on_disk"]

    async def attach() -> float:
        async with Client(sock) as c:
            t = time.perf_counter()
            async with c.attach("m") as w:
                dt = time.perf_counter() - t
                assert torch.equal(w["layer.3.w"], tensors["layer.3.w"])
            return dt

    out: dict[str, object] = {"mib": args.mib}
    for store in (False, True):
        with DaemonProcess(config(store), sock, root / "daemon.log"):
            dt, on_disk = asyncio.run(publish())
            attach_s = asyncio.run(attach())
            print(f"store {'on ' if store else 'off'}: publish {args.mib} MiB {dt:.3f} s (on_disk {on_disk}), "
                  f"attach {attach_s * 1e3:.1f} ms")
            out[f"store_{'on' if store else 'off'}"] = {"publish_s": dt, "on_disk": on_disk, "attach_s": attach_s}
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        cache = "page cache dropped"
    except OSError as exc:
        cache = f"page cache not dropped ({exc.strerror})"
    with DaemonProcess(config(True), sock, root / "daemon.log"):
        first, second = asyncio.run(attach()), asyncio.run(attach())
        print(f"restarted ({cache}): first attach {first:.3f} s (read back, hashed), second {second * 1e3:.1f} ms")
    out["restarted"] = {"page_cache": cache, "first_attach_s": first, "second_attach_s": second}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
