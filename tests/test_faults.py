"""Fault injection: each fault gets its error and leaves the budget and the daemon's file
descriptors exactly as before."""

import asyncio
import os
import time

import pytest
import torch
from conftest import FillGate, daemon_in_process, eventually
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


async def test_file_truncated_during_load_rolls_back(tmp_path, monkeypatch):
    """The daemon runs in this process and its fill is held after its first chunk
    (FillGate): the truncate provably comes mid-load. Timed against a daemon process, a
    warm or fast read could finish first, and the test waited for "loading" silently."""
    big = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.full((2**20,), i, dtype=torch.uint8) for i in range(24)}, str(big))  # 24 MiB
    gate = FillGate(monkeypatch)
    # One reader, small chunks: held at its first, the rest of the file is still to read.
    async with daemon_in_process(tmp_path, {"big": big}, budget="1GiB",
                                 extra_daemon={"load_threads": 1, "load_chunk_bytes": 65536}) as daemon:
        try:
            async with Client(daemon.socket_path) as c:
                before = (await c.status())["devices"]
                memfds_before = memfds(os.getpid())  # the daemon's are this process's
                load = asyncio.ensure_future(c.load("big"))
                await gate.wait_reached()
                p = (await c.status())["loading"].get("big")
                assert p and 0 < p["bytes_done"] < p["bytes_total"], f"not mid-load: {p}"
                os.truncate(big, big.stat().st_size // 3)  # the disk "loses" two thirds mid-load
                gate.release()
                with pytest.raises(CorruptCheckpoint) as info:
                    await load
                assert info.value.details["reason"] in ("truncated", "changed during load")

                async def rolled_back() -> bool:  # the arena is freed in a thread
                    return (await c.status())["devices"] == before and memfds(os.getpid()) == memfds_before

                await eventually(rolled_back, timeout=30)
                assert (await c.models())[0]["state"] == "registered"
        finally:
            gate.release()  # before the daemon stops: its shutdown waits for loads


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
        # No fd leaked: the count may fall (the daemon closes fds of its own meanwhile), never rise.
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) <= fds_before
