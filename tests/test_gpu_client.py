"""The client's CUDA half on a real GPU: the ctypes binding (weightcache/client/libcuda.py)
instead of cuda-bindings. Skipped without CUDA (and the cuda-bindings the daemon needs).

What the stand-in driver of tests/test_client_libcuda.py cannot show: that the real
driver accepts what the binding passes (a round trip whose bytes equal load_file's),
refuses what it should with a named error (a fd that is no VMM allocation, a GPU this
process cannot see), and that a mapping really goes when its last view does.
"""

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import MIB, eventually
from helpers import gpu_daemon, skip_without_cuda

skip_without_cuda()

from test_client_libcuda import GpuArenaDaemon, is_open, memfds, open_inodes  # noqa: E402

from weightcache import Client  # noqa: E402
from weightcache.client import cuda_mapping, libcuda  # noqa: E402
from weightcache.client.libcuda import CudaError  # noqa: E402
from weightcache.protocol.arena import VmmArenaDesc  # noqa: E402

pytestmark = pytest.mark.gpu


async def test_a_fresh_engine_attaches_through_ctypes_without_cuda_bindings(start_daemon, gpu_ckpts):
    d = gpu_daemon(start_daemon, "2GiB", {"x": gpu_ckpts["x"]})
    async with Client(d.socket) as c:
        await c.load("x")  # resident first: the engine's free-memory reading is device-wide
    code = textwrap.dedent("""
        import json, sys, time
        import torch
        from safetensors.torch import load_file
        torch.empty(1, device="cuda:0")  # the engine's CUDA context
        ref = load_file(sys.argv[2], device="cuda:0")
        free0 = torch.cuda.mem_get_info()[0]
        before = set(sys.modules)  # what the client imports from here to usable tensors
        t0 = time.perf_counter()
        from weightcache import SyncClient
        import_ms = (time.perf_counter() - t0) * 1e3
        with SyncClient(sys.argv[1]) as c, c.attach("x", device="cuda:0") as w:
            new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("cuda", "cupy", "numba", "pycuda"))
            extra = free0 - torch.cuda.mem_get_info()[0]
            same = set(w) == set(ref) and all(torch.equal(w[k], v) for k, v in ref.items())
            on_gpu = all(t.is_cuda and t.device.index == 0 for t in w.values())
        print(json.dumps({"same": same, "extra": extra, "cuda_modules": new, "import_ms": import_ms, "on_gpu": on_gpu}))
    """)
    r = subprocess.run([sys.executable, "-c", code, d.socket, str(gpu_ckpts["x"])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["same"] and got["on_gpu"], got
    assert got["extra"] == 0, got  # zero-copy: no GPU memory of its own
    assert got["cuda_modules"] == [], got  # the client's driver calls went through ctypes
    assert got["import_ms"] < 50, got  # not a benchmark (benchmarks/fresh_attach.py is): only that nothing heavy came in


def test_a_fresh_engine_publishes_gpu_tensors_through_ctypes_without_cuda_bindings(start_daemon):
    # client/publish.py allocates and exports its VMM chunks through libcuda.py now: a
    # publish larger than one ~1 GiB chunk (two fds) must reach the daemon with the same
    # bytes, and pull in no cuda-bindings.
    d = gpu_daemon(start_daemon, "4GiB", {})
    code = textwrap.dedent("""
        import json, sys
        import torch
        torch.empty(1, device="cuda:0")  # the engine's CUDA context
        from weightcache import SyncClient
        g = torch.Generator(device="cuda:0").manual_seed(7)
        mine = {"a": torch.randint(-127, 127, (1 << 30,), dtype=torch.int8, device="cuda:0", generator=g),
                "b": torch.rand((1 << 29) // 2, dtype=torch.bfloat16, device="cuda:0", generator=g),
                "c": torch.arange(5, dtype=torch.int64, device="cuda:0")}
        with SyncClient(sys.argv[1]) as c:
            m = c.publish("pub", mine, fingerprint="src+x")
            with c.attach("pub", device="cuda:0") as w:
                same = set(w) == set(mine) and all(torch.equal(w[k], v) for k, v in mine.items())
        bindings = sorted(n for n in sys.modules if n == "cuda.bindings" or n.startswith("cuda.bindings."))
        print(json.dumps({"same": same, "state": m["state"], "bindings": bindings, "nbytes": m["nbytes"]}))
    """)
    r = subprocess.run([sys.executable, "-c", code, d.socket], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["same"] and got["state"] == "resident", got
    assert got["nbytes"] >= (1 << 30) + (1 << 29), got  # more than one ~1 GiB chunk: several fds went
    assert got["bindings"] == [], got  # publish's driver calls went through ctypes


async def test_a_mapping_goes_when_its_last_view_does(start_daemon, gpu_ckpts):
    # The daemon's memory is reference counted by the driver: an evicted model's memory
    # comes back only once every mapping of it is gone. So eviction freeing the memory
    # only after the client dropped its last tensor shows our unmap ran, and not before.
    d = gpu_daemon(start_daemon, "2GiB", {"x": gpu_ckpts["x"]})
    async with Client(d.socket) as c:
        await c.load("x")
        nbytes = (await c.models())[0]["nbytes"]
        async with c.attach("x", device="cuda:0") as m:
            kept = next(iter(m.values()))  # a view of the whole mapping
            total = float(kept.float().sum())
        del m
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        frees = d.log_text().count("freed an arena")
        assert (await c.evict("x"))["evicted"]

        async def daemon_freed() -> bool:  # its thread released every chunk: only our mapping holds them
            return d.log_text().count("freed an arena") > frees

        await eventually(daemon_freed)  # not a fixed sleep: the check below must come after the free
        assert torch.cuda.mem_get_info()[0] - free0 < nbytes * 0.5, "memory came back while a view was still alive"
        assert float(kept.float().sum()) == total  # and the view still reads the same bytes
        del kept
        gc.collect()

        async def memory_returned() -> bool:
            return torch.cuda.mem_get_info()[0] - free0 >= nbytes * 0.95

        await eventually(memory_returned)


def test_a_fd_that_is_no_vmm_allocation_is_a_named_error():
    drv = libcuda.driver()
    ctx = drv.primary_context(0)
    fd = os.memfd_create("not-vmm", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * MIB)
    try:
        for bad in (fd, -1):  # memory that is not CUDA's, and no file at all
            with pytest.raises(CudaError) as info, drv.current(ctx):
                drv.import_and_map([bad], [2 * MIB])
            assert info.value.details["call"] == "cuMemImportFromShareableHandle", info.value
            assert info.value.details["result"].startswith("CUDA_ERROR_"), info.value
            assert info.value.message.startswith("CUDA driver call cuMemImportFromShareableHandle failed: CUDA_ERROR_")
    finally:
        os.close(fd)
    torch.empty(1, device="cuda:0").add_(1)  # and the context is still good
    torch.cuda.synchronize()


@pytest.mark.parametrize("which", ["not-vmm", "unseen-gpu"])
async def test_a_bad_reply_fails_the_attach_cleanly(which):
    uuid = libcuda.driver().device_uuid(0) if which == "not-vmm" else "GPU-00000000-0000-0000-0000-000000000000"
    d = GpuArenaDaemon(uuid)
    try:
        async with Client(d.path) as c:
            match = "cuMemImportFromShareableHandle failed" if which == "not-vmm" else "no CUDA device this process can see"
            with pytest.raises(CudaError, match=match):
                async with c.attach("m"):
                    pytest.fail("attached")
        assert d.detached == [7]
        assert d.sent_inodes and not set(d.sent_inodes) & open_inodes()
    finally:
        d.close()


async def test_a_device_this_process_cannot_see_is_refused_before_asking(start_daemon, gpu_ckpts):
    d = gpu_daemon(start_daemon, "2GiB", {"x": gpu_ckpts["x"]})
    n = torch.cuda.device_count()
    async with Client(d.socket) as c:
        with pytest.raises(CudaError, match=rf"cuda:{n}: this process sees {n} CUDA device\(s\)"):
            async with c.attach("x", device=f"cuda:{n}"):
                pytest.fail("attached")
        assert (await c.status())["leases"] == 0
        assert [m["state"] for m in await c.models()] == ["registered"]  # nothing was asked of the daemon


def test_map_vmm_closes_fds_when_the_driver_refuses_them():
    fds = memfds(2)
    arena = VmmArenaDesc(4 * MIB, [2 * MIB, 2 * MIB], libcuda.driver().device_uuid(0))
    with pytest.raises(CudaError, match="cuMemImportFromShareableHandle"):
        cuda_mapping.map_vmm(arena, fds)
    assert not any(is_open(fd) for fd in fds)
