"""publish: an engine hands the daemon weights it processed itself (quantized, repacked),
so that the next engine attaches the processed form instead of redoing the work."""

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from weightcache import Client, tenant_fingerprint
from weightcache.errors import Attached, BadRequest, LoadFailed, NoSpace
from weightcache.protocol import encode_frame


def processed(seed: int = 0) -> dict[str, torch.Tensor]:
    """What an engine might make at load time: int8 weights with per-row scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(512, 256, generator=g)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return {"layer.0.qweight": (w / scale).round().to(torch.int8), "layer.0.scale": scale.squeeze(1).to(torch.bfloat16),
            "layer.0.bias": torch.randn(512, generator=g), "step": torch.tensor(7)}


async def test_publish_then_another_process_attaches_the_processed_form(start_daemon):
    d = start_daemon(budget="8MiB")
    mine = processed()
    async with Client(d.socket) as c:
        m = await c.publish("q8", mine, fingerprint="src-abc+int8-v1")
        # bound to the publisher: nobody else can publish weights under this fingerprint
        assert m["state"] == "resident" and m["fingerprint"] == tenant_fingerprint("src-abc+int8-v1", os.geteuid())
    code = ("import sys, torch; from weightcache import SyncClient\n"
            "with SyncClient(sys.argv[1]) as c, c.attach('q8') as w:\n"
            "    torch.save({k: v.clone() for k, v in w.items()}, sys.argv[2]); print(w.fingerprint)\n")
    out = d.config.parent / "seen.pt"
    r = subprocess.run([sys.executable, "-c", code, d.socket, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == tenant_fingerprint("src-abc+int8-v1", os.geteuid()), r.stderr
    seen = torch.load(out)
    assert set(seen) == set(mine) and all(torch.equal(seen[k], v) and seen[k].dtype == v.dtype for k, v in mine.items())
    assert "published by" in d.log_text()


async def test_publish_name_clashes_replace_and_attached(start_daemon, ckpts):
    d = start_daemon(budget="20MiB", models={"tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        with pytest.raises(BadRequest, match="exists; publish with replace"):
            await c.publish("tiny", processed(), fingerprint="x")
        await c.publish("q8", processed(0), fingerprint="v1")
        async with c.attach("q8"):
            with pytest.raises(Attached):
                await c.publish("q8", processed(1), fingerprint="v2", replace=True)
        m = await c.publish("q8", processed(1), fingerprint="v2", replace=True)
        assert m["fingerprint"] == tenant_fingerprint("v2", os.geteuid())
        async with c.attach("q8") as w:
            assert torch.equal(w["layer.0.bias"], processed(1)["layer.0.bias"])
        assert (await c.status())["devices"]["cpu"]["used"] == sum(x["nbytes"] for x in await c.models() if x["state"] == "resident")


async def test_publish_budget_failure_leaves_nothing_behind(start_daemon):
    d = start_daemon(budget="64KiB")
    async with Client(d.socket) as c:
        before = (await c.status())["devices"]
        with pytest.raises(NoSpace):
            await c.publish("q8", processed(), fingerprint="x")
        assert await c.models() == [] and (await c.status())["devices"] == before


async def test_evicted_published_model_says_publish_again(start_daemon):
    d = start_daemon(budget="8MiB")
    async with Client(d.socket) as c:
        await c.publish("q8", processed(), fingerprint="x")
        await c.evict("q8")
        with pytest.raises(LoadFailed, match="publish it again"):
            await c.load("q8")
        # reload leaves published models alone (they are not in the config file)
        assert (await c.reload())["removed"] == []


def test_publish_refuses_bad_tables_and_unsealed_memory(start_daemon):
    d = start_daemon(budget="8MiB")
    r = d.raw()
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)

    def publish(tensors, sealed_fd=fd, **extra):
        import array
        import socket as s

        msg = {"id": 9, "op": "publish", "name": "bad", "device": "cpu", "fingerprint": "f",
               "arena": {"kind": "memfd", "nbytes": 4096}, "tensors": tensors, "fds": 1, **extra}
        r.sock.sendmsg([encode_frame(msg)], [(s.SOL_SOCKET, s.SCM_RIGHTS, array.array("i", [sealed_fd]))])
        return r.recv()

    good = [["w", "F32", [4], 0, 16]]
    assert "sealed memfd" in publish(good)["error"]["message"]
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    for table, reason in [([["w", "F32", [5], 0, 16]], "16 bytes for shape"), ([["w", "F32", [4], 8, 16]], "aligned"),
                          ([["w", "F32", [2000], 0, 8000]], "inside"), ([["w", "Q4", [4], 0, 16]], "dtype"),
                          ([["a", "F32", [4], 0, 16], ["b", "F32", [4], 0, 16]], "overlap"), ([], "non-empty")]:
        reply = publish(table)
        assert reply["error"]["code"] == "BAD_REQUEST" and reason in reply["error"]["message"], (table, reply)
    # The arena map is read by the one parser the client's attach uses (protocol/arena.py),
    # each bad field named, before any fd is mapped.
    for arena, reason in [({"kind": "cuda_vmm", "nbytes": 4096, "chunks": [4096], "device_uuid": "GPU-0"},
                           "published as 'memfd' arenas, not 'cuda_vmm'"),
                          ({"kind": "cuda_vmm", "nbytes": 4096}, "'device_uuid' must be a string"),
                          # chunks of 2 MiB and a claim of 1 GiB: a copy would read past them
                          ({"kind": "cuda_vmm", "nbytes": 2**30, "chunks": [2**21], "device_uuid": "GPU-0"},
                           "its chunks hold 2097152 bytes, fewer than its nbytes 1073741824"),
                          ({"kind": "file", "nbytes": 4096, "files": [4096], "segments": b""}, "not 'file'"),
                          ({"kind": "memfd", "nbytes": 0}, "'nbytes' must be a positive integer"),
                          ({"kind": "memfd", "nbytes": True}, "'nbytes' must be a positive integer"),
                          ({"kind": "memfd", "nbytes": 4096, "writable": "yes"}, "'writable' must be a boolean"),
                          ({"nbytes": 4096}, "unknown arena kind None")]:
        reply = publish(good, arena=arena)
        assert reply["error"]["code"] == "BAD_REQUEST" and reason in reply["error"]["message"], (arena, reply)
    assert publish(good)["ok"]  # and a good one on the same connection works
    os.close(fd)
    # a frame claiming fds that did not come is refused
    assert r.call({"id": 10, "op": "status", "fds": 3})["error"]["code"] == "BAD_REQUEST"


async def test_two_engines_publish_concurrently(start_daemon):
    d = start_daemon(budget="8MiB")
    async with Client(d.socket) as a, Client(d.socket) as b:
        await asyncio.gather(a.publish("p0", processed(0), fingerprint="0"), b.publish("p1", processed(1), fingerprint="1"))
        assert sorted(m["name"] for m in await a.models()) == ["p0", "p1"]
