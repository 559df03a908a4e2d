"""Integration: a real daemon process, real client processes, the CPU (memfd) backend."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import eventually, no_leases
from safetensors.torch import load_file, save_file

from weightcache import Client, SyncClient
from weightcache.errors import (
    Attached,
    BadRequest,
    CorruptCheckpoint,
    DaemonUnavailable,
    LoadFailed,
    NoSpace,
    Pinned,
    ProtocolVersionError,
    UnknownModel,
    UnknownOp,
)
from weightcache.protocol import encode_frame
from weightcache.tools.spawn import wait_for_socket

CHILD = str(Path(__file__).with_name("attach_child.py"))


def spawn_child(d, model, path, mode):
    return subprocess.Popen([sys.executable, CHILD, d.socket, model, str(path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


async def states(c: Client) -> dict[str, str]:
    return {m["name"]: m["state"] for m in await c.models()}


async def first(c: Client, key: str, value: object) -> bool:
    """Whether the first model's ``key`` has become ``value``."""
    return (await c.models())[0][key] == value


async def test_runs_under_uvloop():
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


def test_two_engine_processes_attach_two_models_equal_to_load_file(start_daemon, ckpts):
    d = start_daemon(budget="40MiB", models={"a": ckpts["a"], "sharded": ckpts["sharded"]})
    kids = [spawn_child(d, "a", ckpts["a"], "verify"), spawn_child(d, "sharded", ckpts["sharded"], "verify")]
    for k in kids:
        out, err = k.communicate(timeout=120)
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


async def test_lru_eviction_order_three_models_budget_for_two(start_daemon, ckpts):
    d = start_daemon(budget="18MiB", models={k: ckpts[k] for k in "abc"})
    async with Client(d.socket) as c:
        await c.load("a")
        await c.load("b")
        async with c.attach("a"):  # a becomes the most recently used
            pass
        await c.load("c")
        assert await states(c) == {"a": "resident", "b": "evicted", "c": "resident"}
        await c.load("b")  # now a is least recently used
        assert await states(c) == {"a": "evicted", "b": "resident", "c": "resident"}
        st = (await c.status())["devices"]["cpu"]
        sizes = {m["name"]: m["nbytes"] for m in await c.models()}
        assert st["used"] == sizes["b"] + sizes["c"] and st["used"] <= st["budget"]
    assert "LRU, to make room for c" in d.log_text()


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


async def test_no_space_waits_for_a_detach(start_daemon, ckpts):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as holder, Client(d.socket) as c:
        async with holder.attach("a"):
            waiting = asyncio.ensure_future(c.load("b", wait_s=30))
            await asyncio.sleep(0.3)
            assert not waiting.done()
        assert (await asyncio.wait_for(waiting, 30))["state"] == "resident"


async def test_model_larger_than_budget_fails_at_once(start_daemon, ckpts):
    d = start_daemon(budget="4MiB", models={"a": ckpts["a"], "tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        t = time.monotonic()
        with pytest.raises(NoSpace, match="needs"):
            await c.load("a", wait_s=30)  # waiting cannot help: no wait
        assert time.monotonic() - t < 5
        assert (await c.status())["devices"]["cpu"]["reserved"] == 0
        await c.load("tiny")  # still serving


async def test_concurrent_attaches_share_one_load(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:

        async def one():
            async with c.attach("a") as m:
                return m.fingerprint

        fps = await asyncio.gather(*(one() for _ in range(8)))
        assert len(set(fps)) == 1
        assert (await c.models())[0]["loads"] == 1


async def test_pin_evict_unregister_rules(start_daemon, ckpts):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as c:
        await c.load("a")
        await c.pin("a")
        with pytest.raises(Pinned):
            await c.evict("a")
        with pytest.raises(NoSpace):
            await c.load("b")
        await c.unpin("a")
        async with c.attach("a"):
            with pytest.raises(Attached):
                await c.evict("a")
            with pytest.raises(Attached):
                await c.unregister("a")
        assert (await c.evict("a"))["evicted"] is True
        assert (await c.evict("a"))["evicted"] is False
        await c.unregister("a")
        with pytest.raises(UnknownModel):
            await c.load("a")


async def test_register_at_runtime_and_bad_register(start_daemon, ckpts):
    d = start_daemon()
    async with Client(d.socket) as c:
        m = await c.register("late", ckpts["tiny"])
        assert m["state"] == "registered"
        async with c.attach("late") as w:
            assert len(w) == 5
        with pytest.raises(BadRequest, match="already registered"):
            await c.register("late", ckpts["tiny"])
        with pytest.raises(BadRequest, match="no budget"):
            await c.register("gpu", ckpts["tiny"], device="cuda:3")
        with pytest.raises(BadRequest, match="invalid model"):
            await c.register("bad name", ckpts["tiny"])


async def test_corrupt_and_missing_checkpoints_leave_the_daemon_serving(start_daemon, ckpts, tmp_path):
    bad = tmp_path / "bad.safetensors"
    good_bytes = Path(ckpts["b"]).read_bytes()
    bad.write_bytes(good_bytes[: len(good_bytes) // 2])  # truncated mid-data
    d = start_daemon(models={"a": ckpts["a"], "bad": bad, "gone": tmp_path / "gone.safetensors"})
    async with Client(d.socket) as c:
        before = (await c.status())["devices"]
        with pytest.raises(CorruptCheckpoint) as info:
            await c.load("bad")
        assert info.value.details["file"] == str(bad) and "truncated" in info.value.message
        with pytest.raises(LoadFailed, match="does not exist"):
            await c.load("gone")
        assert (await c.status())["devices"] == before  # budget exactly as before
        models = {m["name"]: m for m in await c.models()}
        assert models["bad"]["state"] == "registered" and models["bad"]["last_error"]["code"] == "CORRUPT_CHECKPOINT"
        async with c.attach("a") as m:
            assert len(m) == 40


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


async def test_bad_inputs_get_errors_and_others_keep_being_served(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"max_frame_bytes": "64KiB"})
    bystander = d.raw()
    # unknown op, bad args, missing id, garbage msgpack: each answered, connection kept
    r = d.raw()
    assert r.call({"id": 1, "op": "explode"})["error"]["code"] == "UNKNOWN_OP"
    assert r.call({"id": 2, "op": "load"})["error"]["code"] == "BAD_REQUEST"
    assert r.call({"id": 3, "op": "load", "name": 7})["error"]["message"].startswith("argument 'name' must be str")
    assert r.call({"op": "status"}) == {"id": None, "ok": False, "error": {"code": "BAD_REQUEST", "message": "request needs an integer 'id'"}}
    r.send(b"\x00\x00\x00\x03\xc1\xc1\xc1")
    assert r.recv()["error"]["code"] == "BAD_REQUEST"
    assert r.call({"id": 4, "op": "status"})["ok"]
    # an oversized frame: answered, then that connection alone is closed
    r.send((10**6).to_bytes(4, "big") + b"x" * 100)
    reply = r.recv()
    assert reply["error"]["code"] == "FRAME_TOO_LARGE"
    assert r.recv() is None
    # raw garbage that happens to announce a huge frame
    g = d.raw(hello=False)
    g.send(b"GET / HTTP/1.1\r\n\r\n")
    assert g.recv()["error"]["code"] == "FRAME_TOO_LARGE"
    # a connection that skips hello, and one with the wrong version
    n = d.raw(hello=False)
    assert n.call({"id": 1, "op": "status"})["error"]["message"].startswith("the first request")
    assert n.call({"id": 2, "op": "hello", "protocol": 99})["error"]["code"] == "PROTOCOL_VERSION"
    # the bystander never noticed
    assert bystander.call({"id": 9, "op": "attach", "name": "tiny"})["ok"]
    assert bystander.call({"id": 10, "op": "status"})["ok"]


async def test_client_maps_error_codes_to_classes(start_daemon):
    d = start_daemon()
    async with Client(d.socket) as c:
        with pytest.raises(UnknownOp):
            await c.request("explode")
        with pytest.raises(UnknownModel):
            await c.load("nope")
    with pytest.raises(DaemonUnavailable, match="not connected"):
        await Client(d.socket).status()
    with pytest.raises(DaemonUnavailable, match="cannot connect"):
        await Client("/tmp/definitely-not-a-weightcache.sock").connect()


async def test_hello_version_mismatch_is_an_exception(start_daemon, monkeypatch):
    d = start_daemon()
    monkeypatch.setattr("weightcache.client.client.PROTOCOL_VERSION", 2)
    with pytest.raises(ProtocolVersionError):
        await Client(d.socket).connect()


async def test_client_vanishing_mid_request_does_not_cancel_the_load(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    r = d.raw()
    r.send(encode_frame({"id": 5, "op": "load", "name": "a"}))
    r.close()  # gone before the reply
    async with Client(d.socket) as c:
        await eventually(lambda: first(c, "state", "resident"))


async def test_cancelled_attach_leaves_no_lease_and_no_stale_reply(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.load("a")
        for delay in (0, 0.001, 0.002, 0.005, 0.01):
            task = asyncio.ensure_future(c.attach("a").__aenter__())
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # the next request gets its own reply, not a leftover attach reply
        st = await c.status()
        assert "devices" in st
        await eventually(lambda: no_leases(c))
        async with c.attach("a") as m:
            assert m.lease > 1, "no cancelled attach was ever granted: the test proved nothing"
        assert (await c.status())["leases"] == 0


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


async def test_keep_alive_evicts_idle_models(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]}, tiny={"keep_alive": 1})
    async with Client(d.socket) as c:
        await c.load("tiny")
        await eventually(lambda: first(c, "state", "evicted"))
    assert "keep_alive expired" in d.log_text()


async def test_preload_does_not_delay_the_socket(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]}, a={"preload": True})
    async with Client(d.socket) as c:
        await eventually(lambda: first(c, "state", "resident"))


async def test_reload_applies_config_changes(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as c, c.attach("a"):
        text = d.config.read_text()
        # drop a (attached: kept) and b; add c
        head = text.split("[[models]]")[0]
        d.config.write_text(head + f'[[models]]\nname = "c"\npath = "{ckpts["c"]}"\n')
        report = await c.reload()
        assert report["added"] == ["c"] and report["removed"] == ["b"]
        assert report["kept"] and report["kept"][0].startswith("a:")
        assert {m["name"] for m in await c.models()} == {"a", "c"}
    # change a model's path and the budget: the model is re-registered, the budget applied
    async with Client(d.socket) as c:
        await c.load("c")
        d.config.write_text(d.config.read_text().replace(str(ckpts["c"]), str(ckpts["b"])).replace('"cpu" = "20MiB"', '"cpu" = "12MiB"'))
        report = await c.reload()
        assert report["changed"] == ["c"] and report["budgets"] == [f"cpu: {12 * 2**20}"]
        assert (await c.status())["devices"]["cpu"]["budget"] == 12 * 2**20
        assert {m["name"]: m["path"] for m in await c.models()}["c"] == str(ckpts["b"])


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


def test_sigterm_shutdown_with_live_leases_removes_the_socket(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    kid = spawn_child(d, "a", ckpts["a"], "hold")
    assert kid.stdout.readline().startswith("ATTACHED")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30) == 0
    assert not os.path.exists(d.socket)
    kid.kill()
    kid.wait()


def test_stale_socket_is_replaced_but_a_live_one_is_not(start_daemon, ckpts, tmp_path):
    d = start_daemon()
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert os.path.exists(d.socket)  # SIGKILL leaves it behind
    cfg = d.config
    p = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for_socket(d.socket, p)
        # a second daemon on the same, now live, socket refuses to start
        r = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "already serving" in r.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        assert "removing stale socket" in p.stderr.read()


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
