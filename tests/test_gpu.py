"""GPU backend tests: CUDA VMM arenas. Skipped unless CUDA and cuda-bindings are present.

Run on an H200 with the device tool; CI has no GPU and skips them (the closing notes and
docs/benchmarks.md say what ran where). Behaviour the two backends share is tested once,
over both, by the tests that take the ``backend`` fixture (``pytest -m gpu tests`` selects
their CUDA cases with these); this file holds what only a GPU has.
"""

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import MIB, eventually, no_leases
from helpers import CHILD, gpu_daemon, skip_without_cuda
from safetensors.torch import load_file

skip_without_cuda()

from weightcache import Client  # noqa: E402
from weightcache.errors import BadRequest, NoSpace  # noqa: E402

pytestmark = pytest.mark.gpu


def child(d, model, path, mode):
    return subprocess.run([sys.executable, CHILD, d.socket, model, str(path), mode], capture_output=True, text=True, timeout=300)


async def test_attach_in_process_zero_copy_and_zero_extra_memory(start_daemon, gpu_ckpts):
    d = gpu_daemon(start_daemon, "2GiB", {"x": gpu_ckpts["x"]})
    ref = load_file(gpu_ckpts["x"], device="cuda:0")
    async with Client(d.socket) as c:
        await c.load("x")
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        async with c.attach("x", device="cuda:0") as m:
            extra = free0 - torch.cuda.mem_get_info()[0]  # before any kernel runs (kernels load lazily)
            assert extra == 0, f"attaching took {extra} bytes of GPU memory"
            assert all(t.is_cuda for t in m.values())
            assert all(torch.equal(m[k], v) for k, v in ref.items())
            # the tensors are views of one mapping
            ptrs = sorted(t.data_ptr() for t in m.values())
            assert ptrs[-1] - ptrs[0] < m.nbytes + 256 * len(m)


async def test_engine_exiting_inside_an_attach_block_exits_promptly(start_daemon, gpu_ckpts):
    # As the CPU test in test_attach.py, with CUDA mappings to undo at exit.
    d = gpu_daemon(start_daemon, "2GiB", {"x": gpu_ckpts["x"]})
    r = await asyncio.to_thread(child, d, "x", gpu_ckpts["x"], "leave")
    assert r.returncode == 0 and r.stdout.startswith("ATTACHED"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr[-2000:]
    async with Client(d.socket) as c:
        await eventually(lambda: no_leases(c))


def test_write_to_read_only_mapping_fails_in_the_client_only(start_daemon, gpu_ckpts):
    d = gpu_daemon(start_daemon, "2GiB", {"x": gpu_ckpts["x"]})
    d.allowed_errors.append("never")  # the daemon must log no traceback
    r = child(d, "x", gpu_ckpts["x"], "write")
    # A kernel write faults ("illegal memory access"); a copy-engine write is refused
    # ("invalid argument"). Either way the client gets the error.
    assert r.returncode != 0 and "CUDA error" in r.stderr, r.stderr[-2000:]
    r = child(d, "x", gpu_ckpts["x"], "verify")  # the daemon's bytes are intact
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr[-2000:]


async def test_killed_client_releases_lease_and_eviction_frees_gpu_memory(start_daemon, gpu_ckpts):
    d = gpu_daemon(start_daemon, "2GiB", {"x": gpu_ckpts["x"]})
    kid = subprocess.Popen([sys.executable, CHILD, d.socket, "x", str(gpu_ckpts["x"]), "hold"], stdout=subprocess.PIPE, text=True)
    assert kid.stdout.readline().startswith("ATTACHED")
    async with Client(d.socket) as c:
        nbytes = (await c.models())[0]["nbytes"]
        from weightcache.errors import Attached

        with pytest.raises(Attached):
            await c.evict("x")
        free_before = torch.cuda.mem_get_info()[0]
        kid.send_signal(signal.SIGKILL)
        kid.wait()
        await eventually(lambda: no_leases(c))
        assert (await c.evict("x"))["evicted"]

        async def memory_returned() -> bool:  # freed in a thread
            return torch.cuda.mem_get_info()[0] - free_before >= nbytes * 0.95

        await eventually(memory_returned)


async def test_lru_eviction_under_a_small_gpu_budget(start_daemon, gpu_ckpts):
    d = gpu_daemon(start_daemon, "600MiB", {n: gpu_ckpts[n] for n in "xyz"})
    async with Client(d.socket) as c:
        await c.load("x")
        await c.load("y")
        async with c.attach("x"):
            pass
        await c.load("z")
        assert {m["name"]: m["state"] for m in await c.models()} == {"x": "resident", "y": "evicted", "z": "resident"}
        st = (await c.status())["devices"]["cuda:0"]
        assert st["used"] <= st["budget"] and st["backend"] == "cuda_vmm"
        async with c.attach("x"), c.attach("z"):
            with pytest.raises(NoSpace) as info:
                await c.load("y")
            assert {h["name"] for h in info.value.details["holders"]} == {"x", "z"}
        with pytest.raises(BadRequest, match="lives on"):
            await c.attach("x", device="cpu").__aenter__()


async def test_a_miss_fills_while_its_evicted_victim_is_still_being_freed(start_daemon, gpu_ckpts):
    """A load that evicts (no host tier) does not wait for its victim's whole free: the
    arena grows as the victim's chunks come back to the budget (``allocates_as_room_frees``),
    the daemon never holds more than its budget, and every load's bytes are its file's."""
    from safetensors.torch import load

    from weightcache.tools.daemon_log import load_lines

    d = gpu_daemon(start_daemon, "600MiB", {n: gpu_ckpts[n] for n in "xyz"})  # two of the three fit
    async with Client(d.socket) as c:
        await c.load("x")
        await c.load("y")
        for name in "zxyz":  # each evicts the least recently used of the other two
            await c.load(name)
            st = (await c.status())["devices"]["cuda:0"]
            assert st["used"] <= st["budget"], st
            ref = load(gpu_ckpts[name].read_bytes())  # not load_file: its mapping would keep the file cached
            async with c.attach(name) as m:
                assert all(torch.equal(m[k].cpu(), v) for k, v in ref.items()), name
    loads = [ld for ld in load_lines(d.log_text()) if ld["verb"] == "loaded"]
    assert [ld["model"] for ld in loads] == list("xyzxyz"), loads
    assert not any("wait for frees" in ld["phases_ms"] for ld in loads), loads


@pytest.mark.parametrize("setting", ["auto", "c", "tasks"])
def test_a_chunk_loop_that_is_not_built_is_said_at_start(monkeypatch, caplog, setting):
    """Where the C loop is missing, "auto" stages from Python and warns; "c" and "tasks" refuse to start."""
    import weightcache.backends.cuda as cuda_backend
    from weightcache.errors import ConfigError

    monkeypatch.setattr(cuda_backend, "load_chunk_loop", lambda: (None, "not built (a test)"))
    backend = cuda_backend.CudaBackend("cuda:0")
    try:
        if setting != "auto":
            with pytest.raises(ConfigError, match="not built"):
                backend.configure_loads(1, "off", setting)
        else:
            backend.configure_loads(1, "off", setting)
            assert "stage each chunk from Python" in caplog.text
        assert backend.chunk_loop is None
    finally:
        backend.close()


async def test_device_memory_check_beyond_budget(start_daemon, gpu_ckpts):
    # A budget larger than the GPU's free memory: the allocation is refused with NO_SPACE
    # naming the device, and the reservation rolls back.
    d = gpu_daemon(start_daemon, "1.0", {"x": gpu_ckpts["x"]})  # first: its CUDA context needs memory too
    async with Client(d.socket) as c:
        await c.status()
        hog = torch.empty(torch.cuda.mem_get_info()[0] - 128 * MIB, dtype=torch.uint8, device="cuda:0")  # < the 256 MiB model
    try:
        async with Client(d.socket) as c:
            with pytest.raises(NoSpace, match="free on the device"):
                await c.load("x")
            assert (await c.status())["devices"]["cuda:0"]["reserved"] == 0
    finally:
        del hog
        torch.cuda.empty_cache()


async def test_host_tier_demotes_lru_victims_and_promotes_them_back(start_daemon, gpu_ckpts):
    d = gpu_daemon(start_daemon, "600MiB", {n: gpu_ckpts[n] for n in "xyz"}, daemon={"host_budget": "300MiB"})
    ref_y = load_file(gpu_ckpts["y"])
    async with Client(d.socket) as c:
        await c.load("x")
        await c.load("y")
        async with c.attach("x"):
            pass  # y is now the least recently used
        await c.load("z")
        states = {m["name"]: m["state"] for m in await c.models()}
        assert states == {"x": "resident", "y": "host", "z": "resident"}
        sizes = {m["name"]: m["nbytes"] for m in await c.models()}
        assert (await c.status())["devices"]["host"]["used"] == sizes["y"]
        async with c.attach("y") as m:  # promoted from pinned host memory, not read from disk
            assert all(torch.equal(m[k].cpu(), v) for k, v in ref_y.items())
        assert "promoted y" in d.log_text() and "demoted y to the host tier" in d.log_text()
        y = next(m for m in await c.models() if m["name"] == "y")
        assert y["demotions"] == 1 and y["promotions"] == 1
        assert y["state"] == "resident" and y["host_copy"]  # kept (Note [kept host copies])
        st = (await c.status())["devices"]
        assert st["host"]["used"] == sizes["y"] and st["cuda:0"]["used"] <= st["cuda:0"]["budget"]
        victim = next(m["name"] for m in await c.models() if m["state"] != "resident" and m["name"] != "y")
        assert {m["name"]: m["state"] for m in await c.models()}[victim] == "evicted"  # the host tier held y then
        resident = next(m["name"] for m in await c.models() if m["state"] == "resident" and m["name"] != "y")
        assert (await c.evict(resident))["state"] == "host"  # one tier down, in the room of y's kept copy...
        assert not next(m for m in await c.models() if m["name"] == "y")["host_copy"]
        assert (await c.evict(resident))["state"] == "evicted"  # ...and out
        assert (await c.status())["devices"]["host"]["used"] == 0
        assert (await c.evict("y"))["state"] == "host"  # copied out again: its kept copy was dropped
        async with c.attach("y") as m:  # promoted again, then stepped down with no copy to make
            assert all(torch.equal(m[k].cpu(), v) for k, v in ref_y.items())
        assert (await c.evict("y"))["state"] == "host"
        assert "its host copy kept since its promotion" in d.log_text()
        assert (await c.status())["counters"]["kept_copy_demotions"] == 1
        async with c.attach("y") as m:  # the kept copy's bytes are y's
            assert all(torch.equal(m[k].cpu(), v) for k, v in ref_y.items())


async def test_publish_gpu_tensors_then_attach_them_elsewhere(start_daemon, tmp_path):
    d = gpu_daemon(start_daemon, "2GiB", {})
    mine = {"qweight": torch.randint(-127, 127, (2048, 1024), dtype=torch.int8, device="cuda:0"),
            "scale": torch.rand(2048, dtype=torch.bfloat16, device="cuda:0")}
    torch.save({k: v.cpu() for k, v in mine.items()}, tmp_path / "ref.pt")
    async with Client(d.socket) as c:
        m = await c.publish("gq", mine, fingerprint="src+int8")
        assert m["device"] == "cuda:0" and m["state"] == "resident"
    del mine  # the daemon holds its own copy
    code = ("import sys, torch; from weightcache import SyncClient\n"
            "ref = torch.load(sys.argv[2])\n"
            "with SyncClient(sys.argv[1]) as c, c.attach('gq') as w:\n"
            "    assert all(w[k].is_cuda and torch.equal(w[k].cpu(), v) for k, v in ref.items()); print('OK')\n")
    r = subprocess.run([sys.executable, "-c", code, d.socket, str(tmp_path / "ref.pt")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stderr[-2000:]


def test_cold_load_reads_with_o_direct(start_daemon, gpu_ckpts):
    from weightcache.tools.bench_measure import drop_page_cache

    drop_page_cache(gpu_ckpts["z"])
    d = gpu_daemon(start_daemon, "2GiB", {"z": gpu_ckpts["z"]})
    r = child(d, "z", gpu_ckpts["z"], "verify")
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr[-2000:]
    assert "O_DIRECT" in d.log_text(), d.log_text()[-2000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_rank_sharded_model_on_two_gpus(start_daemon, gpu_ckpts, tmp_path):
    shards = [{"path": str(gpu_ckpts["x"]), "device": "cuda:0"}, {"path": str(gpu_ckpts["y"]), "device": "cuda:1"}]
    d = start_daemon(budget="1GiB", models={"tp": None}, budgets={"cuda:0": "2GiB", "cuda:1": "2GiB"}, tp={"shards": shards})
    code = (
        "import sys, torch; from safetensors.torch import load_file; from weightcache import SyncClient\n"
        "rank, path = int(sys.argv[2]), sys.argv[3]\n"
        "torch.cuda.set_device(0)\n"  # each rank's process sees only its GPU, as cuda:0
        "ref = load_file(path)\n"
        "with SyncClient(sys.argv[1]) as c, c.attach('tp', device='cuda:0', rank=rank) as m:\n"
        "    assert all(m[k].device.index == 0 and torch.equal(m[k].cpu(), v) for k, v in ref.items())\n"
        "    print('OK', rank)\n"
    )
    procs = []
    for rank, s in enumerate(shards):
        env = {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": str(rank)}  # engines number GPUs their own way
        procs.append(subprocess.run([sys.executable, "-c", code, d.socket, str(rank), s["path"]], env=env,
                                    capture_output=True, text=True, timeout=300))
    for rank, p in enumerate(procs):
        assert p.returncode == 0 and p.stdout.strip() == f"OK {rank}", p.stderr[-2000:]


async def test_fingerprint_of_a_gpu_load_and_names_sharing_one_arena(start_daemon, gpu_ckpts):
    """The content fingerprint hashed from the pinned staging buffers equals the files'
    (fingerprint_files), survives a round trip through the host tier, and two names of one
    checkpoint hold one VMM arena (one copy in the budget, not demoted: evicted)."""
    from weightcache.loader import fingerprint_files

    d = gpu_daemon(start_daemon, "600MiB", {"x": gpu_ckpts["x"], "x2": gpu_ckpts["x"], "y": gpu_ckpts["y"]},
                   daemon={"host_budget": "300MiB"})
    want = fingerprint_files(gpu_ckpts["x"])
    async with Client(d.socket) as c:
        async with c.attach("x") as m, c.attach("x2") as m2:
            assert m.fingerprint == m2.fingerprint == want
            assert set(m) == set(m2) and all(torch.equal(m[k], m2[k]) for k in m)
            sizes = {r["name"]: r["nbytes"] for r in await c.models()}
            assert (await c.status())["devices"]["cuda:0"]["used"] == sizes["x"]  # one copy for two names
        await c.load("y")
        await c.evict("y")  # alone on its arena: demoted to the host tier
        async with c.attach("y") as my:  # promoted: the fingerprint of its load
            assert my.fingerprint == fingerprint_files(gpu_ckpts["y"])
        await c.evict("x")
        assert {r["name"]: r["state"] for r in await c.models()}["x"] == "evicted"  # x2 keeps the arena: nothing freed
        assert (await c.evict("x2"))["state"] == "evicted"  # a shared arena is evicted, not demoted
        y_bytes = {r["name"]: r["nbytes"] for r in await c.models()}["y"]  # known once y was loaded (0 before)
        assert y_bytes and (await c.status())["devices"]["cuda:0"]["used"] == y_bytes


def test_content_hash_kernel_gives_xxh3_128_at_every_boundary():
    """The GPU's digest of a piece (backends/cuda_hash.py) is the xxhash package's, for
    lengths on each side of a stripe (64), a block (1024), a prefetch stage (4096), a
    whole ring of stages (32 KiB) and a hash piece (16 MiB), at aligned offsets; a launch
    per piece, and all of them in one launch."""
    import ctypes

    import xxhash

    from weightcache import cuda_driver as drv
    from weightcache.backends.cuda import CudaBackend
    from weightcache.loader.reader import HASH_BLOCK

    backend = CudaBackend("cuda:0")
    hasher = backend.gpu_hash
    assert hasher is not None, backend.gpu_hash_unavailable
    data = torch.randint(0, 256, (HASH_BLOCK + 8192,), dtype=torch.uint8, device="cuda:0")
    host = data.cpu().numpy().tobytes()
    cases = [(off, n) for n in (241, 1023, 1024, 1025, 1087, 1088, 4095, 4096, 4097, 32767, 32768, 32769 + 64,
                                (1 << 20) + 13, HASH_BLOCK - 1, HASH_BLOCK) for off in (0, 16, 4096)]
    torch.cuda.synchronize()
    from cuda.bindings import driver as cu

    block = hasher.take_block()
    try:
        with drv.current(backend.ctx):
            stream = drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            for slot, (off, n) in enumerate(cases):
                hasher.launch(stream, data.data_ptr() + off, n, block.dev + 16 * slot)
            drv.check(cu.cuStreamSynchronize(stream))
            drv.check(cu.cuStreamDestroy(stream))
        wrong = [(off, n) for slot, (off, n) in enumerate(cases) if block.digest(slot) != xxhash.xxh3_128_digest(host[off : off + n])]
        assert not wrong, f"digests differ from xxh3-128 for (offset, length) {wrong}"
        # The same pieces in one launch (a block each), as a peer's fill hashes them; slots cleared first.
        ctypes.memset(block.ptr, 0, 16 * len(cases))
        with drv.current(backend.ctx):
            stream = drv.check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            table = hasher.launch_many(stream, [(data.data_ptr() + off, n, block.dev + 16 * slot)
                                                for slot, (off, n) in enumerate(cases)])
            drv.check(cu.cuStreamSynchronize(stream))
            table.free()
            drv.check(cu.cuStreamDestroy(stream))
        wrong = [(off, n) for slot, (off, n) in enumerate(cases) if block.digest(slot) != xxhash.xxh3_128_digest(host[off : off + n])]
        assert not wrong, f"one launch's digests differ from xxh3-128 for (offset, length) {wrong}"
    finally:
        hasher.give_back(block)
        backend.close()


@pytest.mark.parametrize("loop", ["tasks", "c", "python"])
@pytest.mark.parametrize("chunk_mib", [4, 16, 20])
def test_a_load_hashed_on_the_gpu_has_the_files_fingerprint(tmp_path, monkeypatch, chunk_mib, loop):
    """Pieces hashed on the GPU and on the host (small ones, unaligned tails) add up to the
    fingerprint fingerprint_files computes on the host, with pieces cut across chunks
    (4 MiB), one per chunk (16) and several per chunk (20), buffered and from disk
    (O_DIRECT), with the digests spread over several pinned blocks; and the same load
    with the hash on the host gives it too. Through the C chunk loop (where the device
    hashes a whole chunk: cuda_writer.py, Note [the chunk loop in C]), with a thread's
    tasks in one call of it (Note [a thread's tasks in one call]), and without it."""
    from safetensors.torch import save_file

    import weightcache.backends.cuda_writer as cuda_writer
    from weightcache.backends.cuda import CudaBackend
    from weightcache.loader import fingerprint_files, open_source, parse_checkpoint, read_checkpoint
    from weightcache.loader.reader import FILE_DIGESTS, HASH_BLOCK

    monkeypatch.setattr(cuda_writer, "DIGEST_SLOTS", 3)  # a new block every 3 pieces
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "m.safetensors"
    save_file({"big": torch.randn(HASH_BLOCK // 4 * 2 + 12345, generator=g), "mid": torch.randn(300_001, generator=g),
               "small": torch.randn(1000, generator=g), "odd": torch.randint(0, 255, (HASH_BLOCK + 77,), dtype=torch.uint8),
               "empty": torch.zeros(0)}, str(path))
    want = fingerprint_files(path)
    for hash_on_gpu in (True, False):
        backend = CudaBackend("cuda:0", hash_on_gpu=hash_on_gpu)
        assert (backend.gpu_hash is not None) == hash_on_gpu, backend.gpu_hash_unavailable
        try:
            backend.configure_loads(2, "off", loop)  # two staging buffers a thread (page-cache windows: the test below)
            if loop != "python":
                assert backend.chunk_loop is not None, backend.chunk_loop_missing  # `make native` where not installed
            assert backend.loop_tasks == (loop == "tasks")
            for direct_io in ("off", "on"):
                FILE_DIGESTS.clear()
                with open_source(path) as opened:
                    ckpt = parse_checkpoint(opened)
                    arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "t")
                    try:
                        w = backend.writer(arena, chunk_mib << 20)
                        got = read_checkpoint(ckpt, opened, w, threads=3, chunk=chunk_mib << 20, direct_io=direct_io)
                        backend.seal(arena)
                    finally:
                        backend.free(arena)
                assert got == want, (hash_on_gpu, direct_io)
                if direct_io == "off":  # ("on" falls back to buffered reads where the file system refuses O_DIRECT)
                    # The loop takes the chunks whose every byte the device hashes, no others.
                    assert (w.looped_bytes > 0) == (loop != "python" and hash_on_gpu), w.looped_bytes
        finally:
            backend.close()


@pytest.mark.parametrize("loop", ["tasks", "c", "python"])
def test_a_deep_staging_ring_hashes_each_piece_after_all_its_chunks_arrived(tmp_path, loop):
    """``load_depth`` > 1 with chunks smaller than a hash piece: a piece's chunks leave on
    several streams of the thread's ring, and its kernel must wait for all of them. When it
    waited for the last chunk's stream only, 4 of 8 such loads of a 9.8 GB file (4 MiB
    chunks) had a wrong fingerprint on an H100; here 1 GiB, 1 MiB chunks (16 per piece),
    4 buffers a thread."""
    from safetensors.torch import save_file

    from weightcache.backends.cuda import CudaBackend
    from weightcache.loader import fingerprint_files, open_source, parse_checkpoint, read_checkpoint
    from weightcache.loader.reader import FILE_DIGESTS

    g = torch.Generator().manual_seed(7)
    path = tmp_path / "deep.safetensors"
    save_file({f"w{i}": torch.randint(-(2**15), 2**15, (2**26,), dtype=torch.int16, generator=g) for i in range(8)},
              str(path))
    want = fingerprint_files(path)
    backend = CudaBackend("cuda:0")
    assert backend.gpu_hash is not None, backend.gpu_hash_unavailable
    try:
        backend.configure_loads(4, "off", loop)
        assert loop == "python" or backend.chunk_loop is not None, backend.chunk_loop_missing
        got = []
        for _ in range(3):
            FILE_DIGESTS.clear()
            with open_source(path) as opened:
                ckpt = parse_checkpoint(opened)
                arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "deep")
                try:
                    got.append(read_checkpoint(ckpt, opened, backend.writer(arena, 1 << 20), threads=8, chunk=1 << 20,
                                               direct_io="off"))
                    backend.seal(arena)
                finally:
                    backend.free(arena)
        assert got == [want] * 3
    finally:
        backend.close()


def test_staging_buffers_pinned_at_start_are_the_ones_loads_use(tmp_path, gpu_ckpts):
    """prepare_loads pins load_threads x load_depth staging buffers in the background at
    start; a load by that many threads in chunks of that size then pins none of its own."""
    from weightcache.backends.cuda import CudaBackend
    from weightcache.backends.cuda_writer import VmmWriter
    from weightcache.loader import open_source, parse_checkpoint, read_checkpoint

    backend = CudaBackend("cuda:0")
    try:
        backend.configure_loads(2, "off")
        backend.prepare_loads(3, 1 << 20)
        assert backend._prefill is not None
        backend._prefill.join()
        size = VmmWriter.staging_bytes(1 << 20)
        assert backend.staging.created == {size: 6}
        with open_source(gpu_ckpts["x"]) as opened:
            ckpt = parse_checkpoint(opened)
            arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "t")
            try:
                read_checkpoint(ckpt, opened, backend.writer(arena, 1 << 20), threads=3, chunk=1 << 20, direct_io="off")
            finally:
                backend.free(arena)
        assert backend.staging.created == {size: 6}
    finally:
        backend.close()


def _load_with_windows_registered_first(tmp_path, monkeypatch, before_registering=None):
    """A load through CudaBackend with page-cache windows on, each window registered before
    the loader threads start (the registrar is joined in PageWindows' constructor), so
    every chunk the GPU alone hashes is copied from them: (fingerprint or the exception,
    the file's fingerprint, bytes copied from the windows, windows the driver refused)."""
    from safetensors.torch import save_file

    import weightcache.backends.page_windows as page_windows
    from weightcache.backends.cuda import CudaBackend
    from weightcache.loader import fingerprint_files, open_source, parse_checkpoint, read_checkpoint
    from weightcache.loader.reader import FILE_DIGESTS, HASH_BLOCK

    made: list = []
    init = page_windows.PageWindows.__init__
    register = page_windows.PageWindows._register_backwards

    def init_and_wait(self, ctx, files, window=1 << 20):  # several windows, chunks crossing them
        init(self, ctx, files, window)
        made.append(self)
        if self._thread is not None:
            self._thread.join()

    def register_after(self):
        if before_registering is not None:
            before_registering()
        register(self)

    monkeypatch.setattr(page_windows.PageWindows, "__init__", init_and_wait)
    monkeypatch.setattr(page_windows.PageWindows, "_register_backwards", register_after)
    g = torch.Generator().manual_seed(2)
    path = tmp_path / "w.safetensors"
    save_file({"big": torch.randn(HASH_BLOCK // 4 * 3 + 12345, generator=g), "small": torch.randn(1000, generator=g),
               "odd": torch.randint(0, 255, (HASH_BLOCK + 77,), dtype=torch.uint8), "mid": torch.randn(700_001, generator=g)},
              str(path))
    want = fingerprint_files(path)  # also leaves the file in the page cache
    backend = CudaBackend("cuda:0")
    try:
        backend.configure_loads(3, "on")
        assert backend.page_cache_dma
        FILE_DIGESTS.clear()
        with open_source(path) as opened:
            ckpt = parse_checkpoint(opened)
            arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "t")
            writer = backend.writer(arena, 3 << 20)
            try:
                got = read_checkpoint(ckpt, opened, writer, threads=3, chunk=3 << 20, direct_io="off")
                backend.seal(arena)
            except Exception as exc:
                got = exc
            finally:
                backend.free(arena)
    finally:
        backend.close()  # waits for the windows' release
    assert len(made) == 1
    return got, want, writer.registered_bytes, made[0].refused


def test_a_load_copied_from_registered_page_cache_windows_has_the_files_fingerprint(tmp_path, monkeypatch):
    """Chunks copied straight from registered page-cache pages (backends/page_windows.py),
    hashed on the GPU, beside chunks staged because a piece of them is hashed on the host,
    give the fingerprint the host computes from the file."""
    got, want, copied, refused = _load_with_windows_registered_first(tmp_path, monkeypatch)
    assert got == want
    assert copied > 0 and refused == 0


def test_a_file_truncated_before_its_windows_are_registered_fails_the_load_not_the_daemon(tmp_path, monkeypatch):
    """The driver refuses to register pages past the file's new end (no SIGBUS: the CPU
    never touches the mapping); the chunks are staged instead, and the short read fails
    the load with the reason, in a process that goes on."""
    from weightcache.errors import CorruptCheckpoint, LoadFailed

    path = tmp_path / "w.safetensors"
    got, _want, _copied, refused = _load_with_windows_registered_first(
        tmp_path, monkeypatch, before_registering=lambda: os.truncate(path, path.stat().st_size // 2))
    assert isinstance(got, (CorruptCheckpoint, LoadFailed)), got
    assert refused == 1


@pytest.mark.parametrize("loop", ["c", "tasks"])
def test_a_file_truncated_under_the_chunk_loop_fails_the_load_not_the_process(tmp_path, loop):
    """The C chunk loop reads with pread, never through a mapping: a file cut short once
    the load began (after the check that it is the file parsed) ends the load as a
    truncated checkpoint (the loop's short read), and the backend loads the whole file
    afterwards."""
    from safetensors.torch import save_file

    from weightcache.backends.cuda import CudaBackend
    from weightcache.errors import CorruptCheckpoint, LoadFailed
    from weightcache.loader import fingerprint_files, open_source, parse_checkpoint, read_checkpoint
    from weightcache.loader.reader import FILE_DIGESTS

    g = torch.Generator().manual_seed(5)
    path = tmp_path / "cut.safetensors"
    tensors = {f"w{i}": torch.randn(2**22, generator=g) for i in range(4)}  # 64 MiB
    save_file(tensors, str(path))
    backend = CudaBackend("cuda:0")
    backend.configure_loads(1, "off", loop)
    assert backend.chunk_loop is not None, backend.chunk_loop_missing
    try:
        cut = path.stat().st_size // 2
        with open_source(path) as opened:
            ckpt = parse_checkpoint(opened)
            arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "cut")
            try:
                w = backend.writer(arena, 16 << 20)
                begin = w.begin
                w.begin = lambda files: (os.truncate(path, cut), begin(files))[1]
                with pytest.raises((CorruptCheckpoint, LoadFailed)) as failed:
                    read_checkpoint(ckpt, opened, w, threads=1, chunk=16 << 20, direct_io="off")
                assert failed.value.details.get("reason") == "truncated", failed.value
                # One thread, in order: the whole chunks before the cut went through the loop.
                first = min(t.file_offset for t in ckpt.tensors)
                assert w.looped_bytes == (cut - first) // (16 << 20) * (16 << 20) > 0
            finally:
                backend.free(arena)
        save_file(tensors, str(path))
        FILE_DIGESTS.clear()
        with open_source(path) as opened:
            ckpt = parse_checkpoint(opened)
            arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "whole")
            try:
                assert read_checkpoint(ckpt, opened, backend.writer(arena, 16 << 20), threads=4, chunk=16 << 20,
                                       direct_io="off") == fingerprint_files(path)
            finally:
                backend.free(arena)
    finally:
        backend.close()
