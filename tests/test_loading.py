"""Loads against a real daemon process, CPU (memfd) backend: concurrent attaches share one
load, a load outlives the client that asked for it, status answers while a load runs,
and a checkpoint changed on disk is reloaded rather than served stale."""

import asyncio
import os
import time

import torch
from conftest import eventually
from helpers import first
from safetensors.torch import save_file

from weightcache import Client
from weightcache.protocol import encode_frame


async def test_concurrent_attaches_share_one_load(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:

        async def one():
            async with c.attach("a") as m:
                return m.fingerprint

        fps = await asyncio.gather(*(one() for _ in range(8)))
        assert len(set(fps)) == 1
        assert (await c.models())[0]["loads"] == 1


async def test_client_vanishing_mid_request_does_not_cancel_the_load(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    r = d.raw()
    r.send(encode_frame({"id": 5, "op": "load", "name": "a"}))
    r.close()  # gone before the reply
    async with Client(d.socket) as c:
        await eventually(lambda: first(c, "state", "resident"))


async def test_status_answers_while_a_load_runs(start_daemon, tmp_path):
    big = tmp_path / "big.safetensors"
    save_file({f"w{i}": torch.empty(32 * 2**20, dtype=torch.uint8) for i in range(12)}, str(big))  # 384 MiB
    d = start_daemon(budget="1GiB", models={"big": big}, extra_daemon={"load_threads": 1, "load_chunk_bytes": 1048576})
    os.posix_fadvise(os.open(big, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    async with Client(d.socket) as c, Client(d.socket) as s:
        load = asyncio.ensure_future(c.load("big"))
        seen_progress = False
        worst = 0.0
        while not load.done():
            t = time.perf_counter()
            st = await s.status()
            worst = max(worst, time.perf_counter() - t)
            seen_progress |= "big" in st["loading"]
            await asyncio.sleep(0.005)
        await load
        assert seen_progress, "status never saw the load in progress"
        assert worst < 1.0, f"status took {worst:.3f}s during a load"


async def test_checkpoint_changed_on_disk_is_reloaded_not_served_stale(start_daemon, tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(1024)}, str(p))
    d = start_daemon(models={"m": p})
    async with Client(d.socket) as c:
        async with c.attach("m") as m:
            old_fp = m.fingerprint
        save_file({"w": torch.ones(2048)}, str(p))
        async with c.attach("m") as m:
            assert m.fingerprint != old_fp and m["w"].shape == (2048,) and bool((m["w"] == 1).all())
    assert "changed on disk" in d.log_text()
