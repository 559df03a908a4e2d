"""Attach and detach against a real daemon process: engine processes get exactly what
load_file reads, zero-copy and read-only; a lease ends with its block, its connection or
its process (SIGKILL, an exit inside the block, a cancelled attach); SyncClient and
load_into_module on top. The CPU (memfd) backend, and the CUDA one too where a test takes
the ``backend`` fixture (that case skips without CUDA); GPU-only behaviour is in
test_gpu.py."""

import asyncio
import signal
import subprocess
import sys

import pytest
import torch
from conftest import eventually, no_leases
from helpers import CHILD, first, spawn_child, states
from safetensors.torch import load_file, save_file

from weightcache import Client, SyncClient
from weightcache.errors import BadRequest, NoSpace, UnknownModel

# Per backend: the models that engine processes attach side by side, a budget that holds
# them, and how long an engine may take. On the CPU two engines attach two models, one of
# them a checkpoint of three files; on a GPU one engine attaches a 256 MiB checkpoint.
ENGINES = {"cpu": (["a", "sharded"], "40MiB", 120), "cuda": (["x"], "2GiB", 300)}


def test_attach_from_another_process_equals_load_file(backend):
    names, budget, timeout = ENGINES[backend.name]
    models = {n: backend.ckpts[n] for n in names}
    d = backend.start(budget, models)
    kids = [spawn_child(d, n, p, "verify") for n, p in models.items()]
    for k in kids:
        out, err = k.communicate(timeout=timeout)
        assert k.returncode == 0, err
        assert out.startswith("OK"), out


async def test_attach_is_zero_copy_and_read_only(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c, c.attach("a") as m1, c.attach("a") as m2:
        name = next(iter(m1))
        # Two attachments in one process are two mappings of the same pages: same bytes,
        # no copy in the daemon (one arena) and the tensors are views of one slab each.
        assert torch.equal(m1[name], m2[name])
        assert m1[name].untyped_storage().nbytes() >= m1.nbytes
        assert m1.fingerprint == m2.fingerprint and m1.lease != m2.lease
        assert (await c.status())["devices"]["cpu"]["used"] < 2 * m1.nbytes
        assert [x["attach_count"] for x in await c.models()] == [2]
    # a write through the read-only mapping kills the writer, not the daemon
    code = ("import sys, torch; from weightcache import SyncClient\n"
            "with SyncClient(sys.argv[1]) as c, c.attach('a') as m:\n"
            "    next(iter(m.values())).view(-1)[0] = 1\n")
    r = subprocess.run([sys.executable, "-c", code, d.socket], capture_output=True, timeout=120)
    assert r.returncode == -signal.SIGSEGV
    async with Client(d.socket) as c:
        assert (await c.models())[0]["attach_count"] == 0
    ref = load_file(ckpts["a"])
    async with Client(d.socket) as c, c.attach("a") as m:
        assert all(torch.equal(m[k], v) for k, v in ref.items())


async def test_sigkilled_engine_releases_its_lease(start_daemon, ckpts):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]})
    kid = spawn_child(d, "a", ckpts["a"], "hold")
    line = await asyncio.to_thread(kid.stdout.readline)
    assert line.startswith("ATTACHED"), kid.stderr.read()
    async with Client(d.socket) as c:
        assert (await c.models())[0]["attach_count"] == 1
        with pytest.raises(NoSpace) as info:
            await c.load("b")  # a is attached: it may not be evicted
        assert info.value.details["holders"][0]["name"] == "a"
        kid.send_signal(signal.SIGKILL)
        kid.wait()
        await eventually(lambda: first(c, "attach_count", 0))
        assert (await c.status())["leases"] == 0
        await c.load("b")  # now a can go
        assert await states(c) == {"a": "evicted", "b": "resident"}


async def test_engine_exiting_inside_an_attach_block_exits_promptly(start_daemon, ckpts):
    # An engine whose main() returns or calls sys.exit() while it serves. Without the
    # client's exit hook, interpreter shutdown finalized the open attach block after the
    # client's loop thread was frozen, and the process hung forever.
    d = start_daemon(models={"a": ckpts["a"]})
    r = await asyncio.to_thread(subprocess.run, [sys.executable, CHILD, d.socket, "a", str(ckpts["a"]), "leave"],
                                capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("ATTACHED"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    async with Client(d.socket) as c:
        await eventually(lambda: first(c, "attach_count", 0))
        assert (await c.status())["leases"] == 0


async def test_cancelled_attach_leaves_no_lease_and_no_stale_reply(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.load("a")
        for delay in (0, 0.001, 0.002, 0.005, 0.01):
            task = asyncio.ensure_future(c.attach("a").__aenter__())
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # An attach that finished before the cancel is an attach entered and never exited:
        # its lease lasts while its tensors do (mapping.py's Note [lifetime]), here the task's result.
        del task
        # the next request gets its own reply, not a leftover attach reply
        st = await c.status()
        assert "devices" in st
        await eventually(lambda: no_leases(c))
        async with c.attach("a") as m:
            assert m.lease > 1, "no cancelled attach was ever granted: the test proved nothing"
        assert (await c.status())["leases"] == 0


async def test_writable_attach_needs_permission_and_a_gpu(start_daemon, ckpts):
    from weightcache.errors import PermissionDenied

    d = start_daemon(models={"tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        with pytest.raises(PermissionDenied, match="allow_writable_attach"):
            await c.attach("tiny", writable=True).__aenter__()
    d2 = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"allow_writable_attach": True})
    async with Client(d2.socket) as c:
        with pytest.raises(BadRequest, match="sealed"):
            await c.attach("tiny", writable=True).__aenter__()
        assert (await c.status())["leases"] == 0


def test_sync_client(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    with SyncClient(d.socket) as c:
        assert c.server_info["protocol"] == 1
        with c.attach("tiny") as m:
            assert c.models()[0]["attach_count"] == 1
            assert len(m) == 5
        assert c.models()[0]["attach_count"] == 0
        with pytest.raises(UnknownModel):
            c.load("nope")


async def test_load_into_module_makes_parameters_views(start_daemon, tmp_path):
    from torch import nn

    from weightcache import load_into_module

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8)).to(torch.bfloat16)
    path = tmp_path / "mlp.safetensors"
    save_file(ref.state_dict(), str(path))
    d = start_daemon(models={"mlp": path})
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    async with Client(d.socket) as c, c.attach("mlp") as w:
        fresh = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8)).to(torch.bfloat16)
        model = load_into_module(fresh, w)
        assert torch.equal(model(x), ref(x))
        assert model[0].weight.data_ptr() == w["0.weight"].data_ptr()  # a view, not a copy
        assert not model[0].weight.requires_grad
        with pytest.raises(RuntimeError, match="read-only"):  # a copy into the sealed memfd would SIGSEGV
            model.load_state_dict(ref.state_dict())
        with pytest.raises(ValueError, match=r"missing keys: \['3\.bias', '3\.weight'\]"):
            load_into_module(nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8), nn.Linear(8, 8)).to(torch.bfloat16), w)
        with pytest.raises(ValueError, match="dtype"):
            load_into_module(nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 8)), w)  # float32 module
        with pytest.raises(ValueError, match="shape"):
            load_into_module(nn.Sequential(nn.Linear(64, 16), nn.LayerNorm(32), nn.Linear(32, 8)).to(torch.bfloat16), w)


def test_tensor_views_of_a_table_with_repeated_shapes_scalars_and_several_dtypes():
    from weightcache.client.mapping import tensor_views

    src = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100,
           "s": torch.tensor(7, dtype=torch.int64), "h": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
           "e": torch.empty(0, 5, dtype=torch.float16)}
    slab, table, off = bytearray(), [], 0
    for name, t in src.items():
        raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        off += -off % 8  # aligned for every dtype
        slab += bytes(off - len(slab)) + raw
        table.append([name, {torch.float32: "F32", torch.int64: "I64", torch.bfloat16: "BF16", torch.float16: "F16"}[t.dtype],
                      list(t.shape), off, len(raw)])
        off += len(raw)
    views = tensor_views(torch.frombuffer(bytearray(slab), dtype=torch.uint8), table)
    for name, t in src.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape and torch.equal(views[name], t), name
    with pytest.raises(BadRequest, match="unknown dtype 'F7'"):
        tensor_views(torch.zeros(16, dtype=torch.uint8), [["x", "F7", [2], 0, 4]])
    with pytest.raises(BadRequest, match="does not fit"):  # nbytes that disagree with the shape
        tensor_views(torch.zeros(64, dtype=torch.uint8), [["x", "F32", [3, 4], 0, 48], ["y", "F32", [3, 4], 48, 12]])
