"""What a staged lend's protocol costs without a GPU (issue 27): the ``stage`` round trips
between two processes' event loops, with no copy behind them.

A lender process serves one lend with peers/server.py's ``serve_lend`` over loopback TCP,
its ring's ``stage`` doing nothing (or ``--copy-mib`` of memmove); this process plays the
fill: a LendChannel (peers/__init__.py) on its event loop, and a thread that keeps
``--slots`` stage requests outstanding and polls ``staged`` the way StagedFill's read
loop does (peers/transport.py's POLL_S between polls that find nothing), asking for the
next chunk as soon as one is staged. Prints chunks per second and the time per chunk: the
floor under a GPU fill's per-chunk cost on the host these run on.

    .venv/bin/python scripts/stage_round_trip.py --chunks 147 --slots 8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from weightcache.backends.base import StagedRing
from weightcache.peers import LendChannel
from weightcache.peers.server import serve_lend
from weightcache.peers.transport import POLL_S


def lender(copy_mib: int) -> None:
    src = ctypes.create_string_buffer(max(copy_mib, 1) * 2**20)
    dst = ctypes.create_string_buffer(max(copy_mib, 1) * 2**20)

    def stage(slot: int, offset: int, nbytes: int, done: Callable[[str | None], None]) -> None:
        if copy_mib:
            ctypes.memmove(dst, src, copy_mib * 2**20)
        done(None)

    ring = StagedRing(0, 64, 2**30, 1 << 50, stage)

    async def main() -> None:
        done = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve_lend(reader, writer, ring, time.monotonic() + 600)
            writer.close()
            done.set()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        print(f"PORT {srv.sockets[0].getsockname()[1]}", flush=True)
        await done.wait()

    asyncio.run(main())


async def fill(port: int, chunks: int, slots: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ch = LendChannel(asyncio.get_running_loop(), reader, writer)
    task = asyncio.ensure_future(ch.run())

    def loop() -> float:
        t0 = time.monotonic()
        for i in range(min(slots, chunks)):
            ch.request(i, i % slots, 0, 1)
        nxt, done = min(slots, chunks), 0
        pending = list(range(min(slots, chunks)))
        while done < chunks:
            got = [i for i in pending if ch.staged(i, 30)]
            if not got:
                time.sleep(POLL_S)
                continue
            for i in got:
                pending.remove(i)
                done += 1
                if nxt < chunks:
                    ch.request(nxt, nxt % slots, 0, 1)
                    pending.append(nxt)
                    nxt += 1
        return time.monotonic() - t0

    took = await asyncio.to_thread(loop)
    task.cancel()
    writer.close()
    return took


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "lender":
        lender(int(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=147, help="chunks a fill asks for (147: 9.15 GiB in 64 MiB)")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--copy-mib", type=int, default=0, help="memmove this much in each stage (0: none)")
    args = p.parse_args()
    secs = []
    for _ in range(args.rounds):
        proc = subprocess.Popen([sys.executable, __file__, "lender", str(args.copy_mib)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            port = next(int(line.split()[1]) for line in proc.stdout if line.startswith("PORT "))
            secs.append(asyncio.run(fill(port, args.chunks, args.slots)))
        finally:
            proc.wait(timeout=30)
    med = statistics.median(secs)
    print(json.dumps({"chunks": args.chunks, "slots": args.slots, "copy_mib": args.copy_mib, "seconds": secs,
                      "median_ms_per_chunk": med / args.chunks * 1e3, "best_ms_per_chunk": min(secs) / args.chunks * 1e3}))


if __name__ == "__main__":
    main()
