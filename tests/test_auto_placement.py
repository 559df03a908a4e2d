"""device = "auto" on a real daemon process, CPU backend: the only candidate device is
the CPU there, so these check the plumbing (config, replica entries, the request's
device, ``models`` and the log); the choice among several devices is the pure core's
(tests/test_placement.py), and GPUs are test_gpu_multi.py's."""

import pytest
import torch
from safetensors.torch import load_file

from weightcache import Client, SyncClient
from weightcache.config import Settings
from weightcache.errors import BadRequest


async def test_auto_model_is_placed_and_says_why(start_daemon, ckpts):
    d = start_daemon(budget="40MiB", models={"m": ckpts["a"]}, m={"device": "auto"})
    async with Client(d.socket) as c:
        [listed] = await c.models()
        assert (listed["name"], listed["replica_of"], listed["state"]) == ("m@cpu", "m", "registered")
        model = await c.load("m")
        assert (model["name"], model["state"], model["device"]) == ("m@cpu", "resident", "cpu")
        assert model["placement"]["device"] == "cpu" and model["placement"]["reason"] == "free"
        async with c.attach("m") as w:  # placed again: resident there now
            ref = load_file(ckpts["a"])
            assert all(torch.equal(w[k], v) for k, v in ref.items())
            [listed] = await c.models()
            assert listed["placement"]["reason"] == "resident"
        async with c.attach("m", device="cpu") as w:
            assert set(w) == set(ref)
        with pytest.raises(BadRequest, match="no budget"):
            await c.load("m", device="cuda:0")
        assert (await c.evict("m"))["evicted"] is True
        assert (await c.load("m", device="cpu"))["placement"]["reason"] == "named"
        assert (await c.status())["placement"]["m"]["device"] == "cpu"
    assert "placed m on cpu: free budget there" in d.log_text()


def test_sync_client_and_a_fixed_model_with_a_device(start_daemon, ckpts):
    d = start_daemon(budget="40MiB", models={"fixed": ckpts["a"]})
    with SyncClient(d.socket) as c:
        assert c.load("fixed", device="cpu")["placement"] is None  # the operator placed it: nothing to decide
        with pytest.raises(BadRequest, match="lives on cpu, not cuda:3"):
            c.load("fixed", device="cuda:3")


async def test_auto_shards_need_distinct_devices(start_daemon, ckpts, tmp_path):
    with pytest.raises(ValueError, match='2 ranks with device "auto" need as many devices'):
        Settings(budgets={"cpu": "1GiB"}, models=[{"name": "tp", "device": "auto",
                                                   "shards": [{"path": "/a"}, {"path": "/b"}]}])
    with pytest.raises(ValueError, match='or set device = "auto" on the model'):
        Settings(budgets={"cpu": "1GiB"}, models=[{"name": "tp", "shards": [{"path": "/a"}, {"path": "/b"}]}])
    # a sharded model with one auto rank and one fixed one: the auto rank goes where the fixed one is not
    d = start_daemon(budget="40MiB", models={"tp": None},
                     tp={"device": "auto", "shards": [{"path": str(ckpts["a"])}, {"path": str(ckpts["b"]), "device": "cpu"}]})
    async with Client(d.socket) as c:
        with pytest.raises(BadRequest, match="cannot be placed"):  # the CPU is rank 1's: no device is left for rank 0
            await c.load("tp")


async def test_an_auto_preload_loads_the_placed_replica_and_a_placement_failure_fails_readiness(start_daemon, ckpts):
    from conftest import eventually

    d = start_daemon(budget="40MiB", models={"p": ckpts["a"], "tp": None}, p={"device": "auto", "preload": True},
                     tp={"device": "auto", "preload": True,
                         "shards": [{"path": str(ckpts["a"])}, {"path": str(ckpts["b"]), "device": "cpu"}]})
    async with Client(d.socket) as c:
        async def settled():
            return not (await c.health())["preloading"]

        await eventually(settled)
        h = await c.health()
        assert not h["ready"] and "cannot be placed" in h["failed_preloads"]["tp"]
        states = {m["name"]: m["state"] for m in await c.models()}
        assert states["p@cpu"] == "resident"


def test_cli_load_device_and_models_show_the_placement(start_daemon, ckpts, capsys, monkeypatch):
    from weightcache.cli import main

    monkeypatch.setenv("COLUMNS", "160")
    d = start_daemon(budget="40MiB", models={"m": ckpts["tiny"]}, m={"device": "auto"})
    s = ("--socket", d.socket)
    capsys.readouterr()
    assert main([*s, "load", "m"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("m@cpu: resident on cpu") and "placed on cpu: free budget there" in out
    assert main([*s, "load", "m", "--device", "cpu"]) == 0
    assert "placed on cpu: named by the request" in capsys.readouterr().out
    assert main([*s, "models"]) == 0
    assert "cpu (auto: named)" in capsys.readouterr().out
    assert main([*s, "load", "m", "--device", "cuda:0"]) != 0
    assert "no budget" in capsys.readouterr().err
