"""Two daemons on one GPU: a model resident in one's VMM memory is filled into
the other's through the device rings (backends/cuda_staging.py, peers/staged.py) over
NIXL, bit-exact, its pieces hashed on the GPU once landed; a lender killed mid-transfer
leaves the load to the files and nothing held. Run with the device tool; CI has no GPU.
tests/test_peers_staged.py checks the same protocol on the CPU with host rings."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import skip_without_cuda
from test_peers import Pair, ckpt, daemon_pair, model_row, offered, wait_for

skip_without_cuda()

from weightcache import Client  # noqa: E402
from weightcache.loader import fingerprint_files  # noqa: E402
from weightcache.peers.transport import unavailable  # noqa: E402

MIB = 2**20
WHY = unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"NIXL cannot start here: {WHY}")]


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    with daemon_pair(tmp_path) as p:
        yield p


async def test_a_gpu_model_is_filled_from_a_neighbours_gpu_bit_exact(pair: Pair, tmp_path: Path) -> None:
    path = ckpt(tmp_path, 200 * MIB)  # four slots' worth of chunks, and a tail
    fp = fingerprint_files(path)
    lender = pair.start(0, {"m": path}, budget="2GiB", device="cuda:0")
    borrower = pair.start(1, {"m": path}, {"fingerprints": f'{{ m = "{fp}" }}', "prefer": '"peers"'}, budget="2GiB", device="cuda:0")
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        await wait_for(lambda: offered(b, fp))
        offer = (await b.status())["peers"]["peers"][0]["models"][0]
        assert offer["tier"] == "gpu", offer
        await b.load("m")
        row = model_row(await b.models(), "m")
        assert row["source"] == "neighbour", pair.log(1)[-3000:]
        assert row["fingerprint"] == fp
        async with a.attach("m", device="cuda:0") as ma, b.attach("m", device="cuda:0") as mb:
            assert ma.fingerprint == mb.fingerprint == fp
            for k in ma:
                assert torch.equal(ma[k].reshape(-1).view(torch.uint8), mb[k].reshape(-1).view(torch.uint8)), k
        assert (await b.status())["peers"]["fills"] == {"ok": 1}

        async def lend_ended() -> bool:
            st = await a.status()
            return st["peers"]["lending_now"] == 0 and st["leases"] == 0

        await wait_for(lend_ended)


async def test_a_gpu_lender_killed_mid_transfer_leaves_the_load_to_the_files(pair: Pair, tmp_path: Path) -> None:
    path = ckpt(tmp_path, 512 * MIB)
    fp = fingerprint_files(path)
    lender = pair.start(0, {"m": path}, budget="2GiB", device="cuda:0")
    # Paced to ~4 s (64 MiB chunks) so that the kill lands while bytes move.
    borrower = pair.start(1, {"m": path}, {"fingerprints": f'{{ m = "{fp}" }}', "prefer": '"peers"',
                                           "max_fill_bytes_per_s": '"128MiB"'}, budget="2GiB", device="cuda:0")
    assert lender.proc is not None and borrower.proc is not None
    async with Client(lender.socket) as a:
        await a.load("m")
    async with Client(borrower.socket) as b:
        await wait_for(lambda: offered(b, fp))
        load = asyncio.ensure_future(b.load("m"))

        async def moving() -> bool:
            got = (await b.status())["loading"].get("m")
            return got is not None and 0 < got["bytes_done"] < got["bytes_total"] // 2

        await wait_for(moving)
        os.kill(lender.proc.pid, signal.SIGKILL)
        lender.proc.wait()
        await asyncio.wait_for(load, 120)
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fp, pair.log(1)[-3000:]
        assert "fill of m from peer" in pair.log(1)
        st = await b.status()
        assert st["peers"]["fills"] == {"failed": 1} and st["leases"] == 0
        await b.evict("m")

        async def settled() -> bool:
            return (await b.status())["devices"]["cuda:0"]["used"] == 0

        await wait_for(settled, 10)
    pair.procs.remove(lender)
