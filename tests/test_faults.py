"""Fault injection: each fault gets its error and leaves the budget and the daemon's file
descriptors exactly as before."""

import asyncio
import os
import time

import pytest
import torch
from safetensors.torch import save_file

from weightcache import Client
from weightcache.errors import CorruptCheckpoint
from weightcache.protocol import encode_frame


def memfds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return n


async def test_file_truncated_during_load_rolls_back(start_daemon, tmp_path):
    big = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.full((8 * 2**20,), i, dtype=torch.uint8) for i in range(24)}, str(big))  # 192 MiB
    # One reader, small chunks, and cold pages: the load takes long enough to cut it short.
    d = start_daemon(budget="1GiB", models={"big": big}, extra_daemon={"load_threads": 1, "load_chunk_bytes": 65536})
    os.posix_fadvise(os.open(big, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    async with Client(d.socket) as c:
        before = (await c.status())["devices"]
        load = asyncio.ensure_future(c.load("big"))
        for _ in range(500):
            if (await c.status())["loading"]:
                break
            await asyncio.sleep(0.002)
        os.truncate(big, big.stat().st_size // 3)  # the disk "loses" two thirds mid-load
        with pytest.raises(CorruptCheckpoint) as info:
            await load
        assert info.value.details["reason"] in ("truncated", "changed during load")
        await asyncio.sleep(0.3)  # the arena is freed in a thread
        assert (await c.status())["devices"] == before
        assert memfds(d.proc.pid) == 0
        assert (await c.models())[0]["state"] == "registered"


async def test_clients_dying_mid_attach_leak_nothing(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.load("a")
        fds_before = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        for i in range(30):
            r = d.raw()
            r.send(encode_frame({"id": 1, "op": "attach", "name": "a"}))
            if i % 2:
                time.sleep(0.01)  # sometimes after the reply (and its fd) is in flight
            r.close()  # never reads the reply: the fds die with the socket buffer
        for _ in range(100):
            st = await c.status()
            if st["leases"] == 0 and st["connections"] == 1:
                break
            await asyncio.sleep(0.05)
        assert st["leases"] == 0 and (await c.models())[0]["attach_count"] == 0
        # The arena itself, no leaked dups: the checkpoint's page cache held through one fd
        # of the file (docs/protocol.md, "file" arenas), or a memfd.
        held = sum(os.path.realpath(f"/proc/{d.proc.pid}/fd/{fd}") == str(ckpts["a"]) for fd in os.listdir(f"/proc/{d.proc.pid}/fd"))
        assert memfds(d.proc.pid) + held == 1
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) == fds_before
