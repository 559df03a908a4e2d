"""Loads against a real daemon process, CPU (memfd) backend: concurrent attaches share one
load, a load outlives the client that asked for it, status answers while a load runs,
and a checkpoint changed on disk is reloaded rather than served stale."""

import asyncio
import logging
import os
import time

import torch
from conftest import FillGate, RawConn, daemon_in_process, eventually
from helpers import first
from safetensors.torch import save_file

from weightcache import Client
from weightcache.protocol import encode_frame
from weightcache.server.residency.flight import FINISH_ORPHAN_AFTER


async def test_concurrent_attaches_share_one_load(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:

        async def one():
            async with c.attach("a") as m:
                return m.fingerprint

        fps = await asyncio.gather(*(one() for _ in range(8)))
        assert len(set(fps)) == 1
        assert (await c.models())[0]["loads"] == 1


async def test_client_vanishing_mid_request_does_not_cancel_the_load(tmp_path, ckpts):
    """A load whose requester closes its connection before the reply still completes. The
    daemon runs in this process and its load waits on an event the test sets only once the
    daemon has seen the connection close: the close provably comes mid-load (a load of
    this small model finished before the close otherwise, and the test proved nothing)."""
    release = asyncio.Event()

    def hold_loads(daemon):
        load = daemon.residency.flights._load

        async def held(job):
            await release.wait()
            return await load(job)

        daemon.residency.flights._load = held

    async with daemon_in_process(tmp_path, {"a": ckpts["a"]}, hold_loads) as daemon:
        try:
            r = await asyncio.to_thread(RawConn, daemon.socket_path)
            await asyncio.to_thread(r.send, encode_frame({"id": 5, "op": "load", "name": "a"}))

            async def loading():
                return "a" in daemon.residency.flights.jobs

            async def closed():
                return not daemon.connections.conns

            await eventually(loading)
            r.close()  # gone before the reply
            await eventually(closed)
            job = daemon.residency.flights.jobs.get("a")
            assert job is not None and job.task is not None and not job.task.done(), "the load was over before the close"
            release.set()
            async with Client(daemon.socket_path) as c:
                await eventually(lambda: first(c, "state", "resident"))
        finally:
            release.set()  # before the daemon stops: its shutdown waits for loads


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


def _sparse_checkpoint(path, nbytes: int) -> None:
    """One U8 tensor of ``nbytes`` zeros, written sparse: big loads without writing GiBs."""
    import json
    import struct

    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)


async def test_a_load_nobody_waits_for_is_cancelled_and_returns_its_reservation(tmp_path, monkeypatch, caplog):
    """The daemon runs in this process and its fill is held after its first chunk
    (FillGate) until the daemon has seen the engine go: the engine provably dies early in
    the load (a daemon process read the sparse file's holes at GB/s, past the point where
    an orphaned load is finished rather than cancelled, before the test acted)."""
    caplog.set_level(logging.INFO, logger="weightcache")
    big = tmp_path / "big.safetensors"
    size = 64 * 2**20  # held, the load need not be long: 64 chunks, held after the first
    _sparse_checkpoint(big, size)
    gate = FillGate(monkeypatch)
    async with daemon_in_process(tmp_path, {"big": big}, budget="1GiB",
                                 extra_daemon={"load_threads": 1, "load_chunk_bytes": 2**20}) as daemon:
        try:
            engine = await asyncio.to_thread(RawConn, daemon.socket_path)
            await asyncio.to_thread(engine.send, encode_frame({"id": 1, "op": "attach", "name": "big"}))
            async with Client(daemon.socket_path) as c:
                await gate.wait_reached()
                p = (await c.status())["loading"].get("big")
                assert p and 0 < p["bytes_done"] < FINISH_ORPHAN_AFTER * p["bytes_total"], f"not early in the load: {p}"
                job = daemon.residency.flights.jobs["big"]
                engine.close()  # the engine dies early in the load, while it waits for it

                async def abandoned() -> bool:
                    return job.abandoned.is_set()

                await eventually(abandoned, timeout=30)
                gate.release()

                async def cancelled() -> bool:
                    st = await c.status()
                    return st["counters"]["cancelled_loads"] == 1 and not st["loading"]

                await eventually(cancelled, timeout=30)  # the fill's threads run at nice 19: slow on a busy machine
                st = await c.status()
                assert st["devices"]["cpu"]["reserved"] == 0 and st["devices"]["cpu"]["used"] == 0, st["devices"]
                assert st["counters"]["loads"] == 0 and st["counters"]["wasted_loads"] == 0
                assert (await c.models())[0]["state"] == "registered"
                assert "cancelling it" in caplog.text and "cancelled after" in caplog.text
                # Asked for again, it loads from scratch (not the abandoned load's error).
                async with c.attach("big", wait_s=30) as m:
                    assert m.source == "files" and m.nbytes == size
                async with c.attach("big") as m:
                    assert m.source == "resident"
                assert (await c.status())["counters"]["loads"] == 1
        finally:
            gate.release()  # before the daemon stops: its shutdown waits for loads


async def test_waiters_for_room_are_woken_oldest_first():
    from weightcache.server.residency import SpaceFreed

    room = SpaceFreed()
    woken: list[int] = []
    tickets = [room.ticket() for _ in range(3)]

    async def waiter(t: int) -> None:
        await room.wait(t, 5)
        woken.append(t)

    tasks = [asyncio.ensure_future(waiter(t)) for t in reversed(tickets)]  # the youngest waits first
    await asyncio.sleep(0)
    room.notify()
    await asyncio.gather(*tasks)
    assert woken == tickets and room.generation == 1


async def test_a_notification_wakes_the_oldest_waiter_of_each_model_and_settle_the_rest():
    """Waiters for one model would all be refused alike: each detach woke all of them,
    ~2,000 refused retries (34 ms of the loop per detach on the CI VM). Now only the
    oldest of each model tries; the rest follow once it has the model (everyone), or the
    next oldest when it failed another way (it may have held the turn)."""
    from weightcache.server.residency import SpaceFreed

    room = SpaceFreed()
    woken: list[str] = []
    order = ["a1", "b1", "a2", "none1", "a3", "none2", "b2"]
    tickets = {w: room.ticket() for w in order}

    async def waiter(w: str) -> None:
        key = None if w.startswith("none") else w[0]
        await room.wait(tickets[w], 5, key=key)
        woken.append(w)

    async def turns() -> None:  # a woken waiter resumes after a few turns of the loop (wait_for)
        for _ in range(20):
            await asyncio.sleep(0)

    tasks = {w: asyncio.ensure_future(waiter(w)) for w in order}
    await turns()
    room.notify()
    await turns()
    assert woken == ["a1", "b1", "none1", "none2"]  # keyless waiters (shutdown, admission) as before
    room.settle("a", everyone=False)  # a1 failed otherwise than NO_SPACE: a2 tries in its place
    await turns()
    assert woken[4:] == ["a2"]
    room.settle("a", everyone=True)  # a2 got the model: the rest join it
    room.settle("b", everyone=True)
    await asyncio.gather(*tasks.values())
    assert woken[5:] == ["a3", "b2"]
    room.settle("a", everyone=True)  # no one left: nothing to do


async def test_a_request_that_finds_an_abandoned_load_already_done_loads_afresh(ckpts):
    """A cancelled load whose task has ended but whose done callback has not run yet (it
    runs on the loop's next turn, and awaiting a finished task does not yield) is left for
    a fresh load: the retry found the same finished job forever (a RecursionError in a fuzz
    run)."""
    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore
    from weightcache.config import ModelConfig, Settings
    from weightcache.server.registry import Registry
    from weightcache.server.residency import LoadJob, Residency

    core = CacheCore({"cpu": 1 << 30})
    backends = {"cpu": CpuBackend("cpu")}
    registry = Registry(core, backends, access=None)
    registry.register(ModelConfig(name="tiny", path=ckpts["tiny"]))
    residency = Residency(Settings().daemon, core, registry, backends, lambda: False)
    try:
        job = LoadJob("tiny")
        job.abandoned.set()
        job.task = asyncio.get_running_loop().create_future()
        job.task.set_exception(RuntimeError("cancelled load"))
        job.task.exception()
        residency.flights.jobs["tiny"] = job  # finished, its _load_done not yet run
        assert await residency.flights.ensure_resident("tiny", 0) == "files"
        assert core.entry("tiny").state.value == "resident"
    finally:
        for r in registry.arenas.values():
            if r.arena is not None:
                backends["cpu"].free(r.arena)
        residency.io.close()


async def test_waiters_for_a_model_whose_load_fails_before_admission_do_not_fail_one_by_one(ckpts, monkeypatch):
    """Only the oldest request waiting for a model is woken by a detach; when its load
    failed before admission (files no longer parse, the io timeout), only the next oldest
    was woken, so each waiter ran its own failed load in turn (n loads, each up to
    io_timeout_s, where all had joined one before). An error of the model's own wakes
    them all: they join one retry."""
    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore
    from weightcache.config import ModelConfig, Settings
    from weightcache.errors import LoadFailed
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency, io

    core = CacheCore({"cpu": 12 * 2**20})  # room for one of a, b (8 MiB each)
    backends = {"cpu": CpuBackend("cpu")}
    registry = Registry(core, backends, access=None)
    for n in "ab":
        registry.register(ModelConfig(name=n, path=ckpts[n]))
    residency = Residency(Settings().daemon, core, registry, backends, lambda: False)
    try:
        await residency.flights.ensure_resident("a", 0)
        lease = core.attach("a", 1)  # b cannot fit until a is detached
        waiting = [asyncio.ensure_future(residency.flights.ensure_resident("b", 30)) for _ in range(4)]

        async def all_waiting() -> bool:
            return len(residency.room.freed._waiters) == len(waiting)

        await eventually(all_waiting)
        parses = []

        def broken(opened: object) -> None:
            parses.append(opened)
            raise LoadFailed("b: the files no longer parse", model="b")

        monkeypatch.setattr(io, "parse_checkpoint", broken)  # a load parses through io.parse_charged
        # The files changed (else the waiting load reuses the parse it kept).
        st = os.stat(ckpts["b"])
        os.utime(ckpts["b"], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        core.detach(lease.id, 1)
        residency.room.notify()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, LoadFailed) for r in results), results
        assert len(parses) == 2, parses  # the oldest's load, then one the rest joined (was 4: one each, in turn)
    finally:
        for r in registry.arenas.values():
            if r.arena is not None:
                backends["cpu"].free(r.arena)
        residency.io.close()


async def test_two_names_of_one_file_asked_for_at_once_share_one_load(ckpts):
    """The second name joins the first's load while it still opens and parses the files:
    its entry is LOADING only once admitted, and the second load begun meanwhile was
    refused BAD_REQUEST at admission ("join it"). A notification wakes the oldest
    request of each name at once, so this is how waiters for two such names retry."""
    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore
    from weightcache.config import ModelConfig, Settings
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency

    core = CacheCore({"cpu": 1 << 30})
    backends = {"cpu": CpuBackend("cpu")}
    registry = Registry(core, backends, access=None)
    for n in ("m1", "m2"):
        registry.register(ModelConfig(name=n, path=ckpts["a"]))
    residency = Residency(Settings().daemon, core, registry, backends, lambda: False)
    try:
        assert await asyncio.gather(residency.flights.ensure_resident("m1", 0), residency.flights.ensure_resident("m2", 0)) == ["files", "resident"]
        # one record for the two names' arena (Note [one record per arena]), held by both
        res = registry.models["m1"].resident
        assert res is registry.models["m2"].resident and res.holders == {"m1", "m2"}
        assert residency.stats.counters["loads"] == 1
    finally:
        for r in registry.arenas.values():
            if r.arena is not None:
                backends["cpu"].free(r.arena)
        residency.io.close()
