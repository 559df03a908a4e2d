"""Fair shares of the daemon's shared work. One tenant's loads of
100k-tensor headers pushed another tenant's attach p99 from 9.5 to 604 ms and left its
cold loads queued behind them. What is held here by counts and bytes; the latencies
are `python -m benchmarks abuse`'s to measure (docs/reliability.md has the figures)."""

from __future__ import annotations

import asyncio
import threading

import msgpack
import pytest
from conftest import eventually

from weightcache.backends.cpu import CpuBackend
from weightcache.cache import CacheCore
from weightcache.config import DaemonConfig
from weightcache.loader import open_source, parse_checkpoint
from weightcache.loader.tensor_table import TABLE_SLICE
from weightcache.server.registry import Registry
from weightcache.server.residency import Residency
from weightcache.server.residency.io import TENANT_IO_SHARE

from .test_what_a_model_holds_is_charged_and_released import header_bomb


async def test_one_tenant_holds_at_most_a_quarter_of_the_io_pool() -> None:
    """With four io threads, a tenant's four parses ran at once and another tenant's cold
    load waited for a free thread (each of those parses took seconds). Now a tenant holds
    at most TENANT_IO_SHARE of the pool (one thread of four); the others' calls run beside
    its own."""
    core = CacheCore({"cpu": 2**20})
    backends = {"cpu": CpuBackend("cpu")}
    residency = Residency(DaemonConfig(io_threads=4), core, Registry(core, backends, access=None), backends, lambda: False)
    running: dict[int, int] = {1: 0, 2: 0}
    most = {1: 0, 2: 0}
    lock = threading.Lock()
    release = threading.Event()
    share = max(1, int(4 * TENANT_IO_SHARE))
    assert share < 4

    def work(uid: int) -> int:
        with lock:
            running[uid] += 1
            most[uid] = max(most[uid], running[uid])
        release.wait(30)
        with lock:
            running[uid] -= 1
        return uid

    try:
        hog = [asyncio.ensure_future(residency.io.run(work, 1, tenant=1)) for _ in range(4)]

        async def hog_runs() -> bool:
            return running[1] >= share

        async def other_runs() -> bool:
            return running[2] >= 1

        await eventually(hog_runs)
        other = asyncio.ensure_future(residency.io.run(work, 2, tenant=2))
        await eventually(other_runs)
        assert running == {1: share, 2: 1}, running  # the other tenant runs while the hog's others wait
        release.set()
        assert await asyncio.gather(*hog, other) == [1, 1, 1, 1, 2]
        assert most == {1: share, 2: 1}, most
        assert residency.io._shares == {}  # nothing kept per uid once its calls ended
    finally:
        release.set()
        residency.io.close()


async def test_a_call_given_up_keeps_its_share_until_its_thread_returns() -> None:
    """A caller that goes (a register sent, then the connection closed) abandons its call,
    but not the thread running it: had the share been returned with the caller, a tenant
    registering and hanging up in a loop ran every io thread at once."""
    core = CacheCore({"cpu": 2**20})
    backends = {"cpu": CpuBackend("cpu")}
    residency = Residency(DaemonConfig(io_threads=4), core, Registry(core, backends, access=None), backends, lambda: False)
    assert max(1, int(4 * TENANT_IO_SHARE)) == 1
    started = [threading.Event(), threading.Event()]
    release = threading.Event()

    def work(i: int) -> int:
        started[i].set()
        release.wait(30)
        return i

    try:
        first = asyncio.ensure_future(residency.io.run(work, 0, tenant=1))
        assert await asyncio.to_thread(started[0].wait, 10)  # the precondition: its thread runs
        first.cancel()  # the caller goes; the thread cannot
        await asyncio.gather(first, return_exceptions=True)
        second = asyncio.ensure_future(residency.io.run(work, 1, tenant=1))
        await asyncio.sleep(0.3)  # time in which a second thread, wrongly started, would set started[1]
        assert not started[1].is_set(), "a second call took the share of a thread still running"
        release.set()
        assert await asyncio.wait_for(second, 10) == 1
        async def shares_given_back() -> bool:  # by the thread's done callback, on the loop
            return not residency.io._shares

        await eventually(shares_given_back)
        assert residency.io._shares == {}
    finally:
        release.set()
        residency.io.close()


@pytest.mark.parametrize("n", [10, TABLE_SLICE + 1, 3 * TABLE_SLICE + 7])
def test_the_table_packed_in_slices_is_the_same_bytes(tmp_path, n) -> None:
    """msgpack packed a 100k-row table in one C call, 62-180 ms without giving the GIL
    back to the event loop; packed in slices, the bytes must be exactly the same."""
    with open_source(header_bomb(tmp_path / "t.safetensors", n)) as opened:
        ckpt = parse_checkpoint(opened)
    rows = [[t.name, t.dtype, list(t.shape), t.arena_offset, t.nbytes] for t in ckpt.tensors]
    assert ckpt.encoded_tables()[0] == msgpack.packb(rows, use_bin_type=True)
    assert msgpack.unpackb(ckpt.encoded_tables()[0])[-1][0] == ckpt.tensors[-1].name
