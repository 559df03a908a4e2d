"""Several GPUs: device = "auto" placement and GPU-to-GPU copies. Skipped
unless CUDA, cuda-bindings and at least two GPUs are present; written for any number of
GPUs (`python -m benchmarks multi-gpu` measures the same paths on big models)."""

import pytest
import torch
from helpers import skip_without_cuda
from safetensors.torch import load_file

skip_without_cuda()

from weightcache import Client  # noqa: E402
from weightcache.cuda_driver import can_access_peer  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs or more")]
GPUS = [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def start(start_daemon, models, budget="2GiB", **opts):
    return start_daemon(budget="1GiB", models=models, budgets=dict.fromkeys(GPUS, budget),
                        **{n: {"device": "auto", **opts.get(n, {})} for n in models})


async def test_auto_models_spread_over_the_gpus_and_stay_where_they_are(start_daemon, gpu_ckpts):
    d = start(start_daemon, {"x": gpu_ckpts["x"], "y": gpu_ckpts["y"]})
    async with Client(d.socket) as c:
        x = await c.load("x")
        y = await c.load("y")
        # both fit anywhere: the second goes where the most budget is free, not beside the first
        assert x["placement"]["reason"] == "free" and y["placement"]["reason"] == "free"
        assert x["device"] != y["device"]
        again = await c.load("x")
        assert (again["device"], again["placement"]["reason"]) == (x["device"], "resident")
        listed = {m["name"]: m for m in await c.models()}
        assert listed[x["name"]]["placement"]["device"] == x["device"]
    assert f"placed x on {x['device']}: free budget there" in d.log_text()


async def test_an_engine_pinned_to_another_gpu_gets_a_peer_copy(start_daemon, gpu_ckpts):
    a, b = GPUS[0], GPUS[1]
    d = start(start_daemon, {"x": gpu_ckpts["x"]})
    ref = load_file(gpu_ckpts["x"])
    async with Client(d.socket) as c:
        assert (await c.load("x", device=a))["device"] == a
        async with c.attach("x", device=b) as m:
            want = "peer" if can_access_peer(1, 0) else "files"
            assert m.source == want  # without peer access, the files (the host tier holds nothing yet)
            assert all(t.device.index == 1 for t in m.values())
            assert all(torch.equal(m[k].cpu(), v) for k, v in ref.items())
        states = {m["name"]: m["state"] for m in await c.models()}
        assert states[f"x@{a}"] == states[f"x@{b}"] == "resident"  # within budget, the source stays
    if can_access_peer(1, 0):
        assert f"copied from {a} (peer) to x@{b}" in d.log_text()


async def test_a_tp_model_gets_distinct_gpus(start_daemon, gpu_ckpts):
    shards = [{"path": str(gpu_ckpts["x"])}, {"path": str(gpu_ckpts["y"])}]
    d = start_daemon(budget="1GiB", models={"tp": None}, budgets=dict.fromkeys(GPUS, "2GiB"),
                     tp={"device": "auto", "shards": shards})
    async with Client(d.socket) as c:
        await c.load("tp")
        placed = [m for m in await c.models() if m["state"] == "resident"]
        assert sorted(m["rank"] for m in placed) == [0, 1]
        assert len({m["device"] for m in placed}) == 2
        async with c.attach("tp", rank=1) as r1:
            ref = load_file(gpu_ckpts["y"])
            assert all(torch.equal(r1[k].cpu(), v) for k, v in ref.items())
