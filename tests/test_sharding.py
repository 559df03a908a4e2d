"""Sharded (tensor-parallel) models on a real daemon process, CPU (memfd) backend: one
entry per rank, rank checks on attach, evict and load all ranks or none. Two ranks on
two GPUs: test_gpu.py."""

import pytest
import torch
from safetensors.torch import load_file

from weightcache import Client
from weightcache.errors import Attached, BadRequest


async def test_sharded_model_one_entry_per_rank(start_daemon, ckpts):
    d = start_daemon(budget="40MiB")
    async with Client(d.socket) as c:
        await c.register("tp", shards=[{"path": str(ckpts["a"]), "device": "cpu"}, {"path": str(ckpts["b"]), "device": "cpu"}])
        with pytest.raises(BadRequest, match="rank="):
            await c.attach("tp").__aenter__()
        with pytest.raises(BadRequest, match=r"ranks 0\.\.1"):
            await c.attach("tp", rank=2).__aenter__()
        ref_a, ref_b = load_file(ckpts["a"]), load_file(ckpts["b"])
        async with c.attach("tp", rank=0) as r0, c.attach("tp", rank=1) as r1:
            assert set(r0) == set(ref_a) and all(torch.equal(r0[k], v) for k, v in ref_a.items())
            assert all(torch.equal(r1[k], v) for k, v in ref_b.items())
            models = {m["name"]: m for m in await c.models()}
            assert models["tp@0"]["shard_of"] == "tp" and models["tp@1"]["rank"] == 1
            assert models["tp@0"]["attach_count"] == 1
            with pytest.raises(Attached):
                await c.evict("tp")  # all ranks or none
            assert {m["state"] for m in await c.models()} == {"resident"}
        assert (await c.evict("tp"))["evicted"] is True
        await c.load("tp")  # loads every rank
        assert {m["state"] for m in await c.models()} == {"resident"}
        await c.unregister("tp")
        assert await c.models() == []
        with pytest.raises(BadRequest, match="not sharded"):
            await c.register("solo", ckpts["tiny"])
            await c.attach("solo", rank=1).__aenter__()
