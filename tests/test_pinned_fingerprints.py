"""A pinned fingerprint ([peers] fingerprints) is trusted only for the files it was found
to match (Note [pinned fingerprints], server/residency/pins.py): files rewritten with new
weights of the same layout, the pin left as it was, are never served as the neighbour's
old bytes for long: a fill under the stale pin is verified against the files and
evicted, and once the daemon has read the files the pin is not used for them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_peers import WHY, Pair, ckpt, daemon_pair, model_row, offered, wait_for

from weightcache import Client
from weightcache.loader import fingerprint_files, open_checkpoint

MIB = 2**20
needs_nixl = pytest.mark.skipif(WHY is not None, reason=f"NIXL cannot start here (pip install 'weightcache[peers]'): {WHY}")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    with daemon_pair(tmp_path) as p:
        yield p


def rewrite(path: Path, seed: int) -> None:
    """New weights, the same names, dtypes and shapes: the same header, so the same layout
    (a fine-tune of the same base), in a new file moved into place."""
    from safetensors.torch import load_file, save_file

    layout = open_checkpoint(path).layout
    g = torch.Generator().manual_seed(seed)
    new = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in load_file(str(path)).items()}
    tmp = path.with_suffix(".new")
    save_file(new, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(path)
    assert open_checkpoint(path).layout == layout


async def counter(c: Client, key: str) -> int:
    return int((await c.status())["counters"][key])


async def same_bytes_as_files(c: Client, name: str, path: Path) -> None:
    from safetensors.torch import load_file

    want = load_file(str(path))
    async with c.attach(name) as m:
        assert set(m) == set(want)
        for k in m:
            assert torch.equal(m[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)), k


def start_lender(pair: Pair, tmp_path: Path, seed: int) -> tuple[Any, str]:
    theirs = ckpt(tmp_path / "lender", 4 * MIB, seed=seed)
    return pair.start(0, {"m": theirs}), fingerprint_files(theirs)


@needs_nixl
async def test_a_fill_under_a_pin_the_files_no_longer_match_is_verified_and_evicted(pair: Pair, tmp_path: Path) -> None:
    lender, old = start_lender(pair, tmp_path, seed=1)
    mine = ckpt(tmp_path / "borrower", 4 * MIB, seed=1)
    rewrite(mine, seed=2)  # before this daemon starts: it never saw the old files
    new = fingerprint_files(mine)
    assert new != old
    borrower = pair.start(1, {"m": mine}, {"fingerprints": f'{{ m = "{old}" }}'})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        await wait_for(lambda: offered(b, old))
        await b.load("m")  # filled from the lender under the stale pin, then verified against the files

        async def refuted() -> bool:
            return await counter(b, "neighbour_mismatches") == 1

        await wait_for(refuted)
        assert await counter(b, "neighbour_checks") == 1
        assert model_row(await b.models(), "m")["state"] != "resident"  # evicted: nobody was attached
        assert "filled from a neighbour under fingerprint" in pair.log(1)
        await b.load("m")  # the pin is not trusted for these files any more: read them
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == new, pair.log(1)[-3000:]
        await same_bytes_as_files(b, "m", mine)


@needs_nixl
async def test_files_rewritten_after_a_verified_fill_are_read_not_filled(pair: Pair, tmp_path: Path) -> None:
    lender, old = start_lender(pair, tmp_path, seed=1)
    mine = ckpt(tmp_path / "borrower", 4 * MIB, seed=1)
    borrower = pair.start(1, {"m": mine}, {"fingerprints": f'{{ m = "{old}" }}'})
    async with Client(lender.socket) as a, Client(borrower.socket) as b:
        await a.load("m")
        await wait_for(lambda: offered(b, old))
        await b.load("m")
        assert model_row(await b.models(), "m")["source"] == "neighbour"

        async def verified() -> bool:
            return await counter(b, "neighbour_checks") == 1

        await wait_for(verified)
        assert await counter(b, "neighbour_mismatches") == 0
        await b.evict("m")
        rewrite(mine, seed=2)
        await b.load("m")
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fingerprint_files(mine), pair.log(1)[-3000:]
        assert "the pinned fingerprint is not trusted for these files (its files changed since)" in pair.log(1)
        assert await counter(b, "pin_mismatches") == 1
        assert f"not the one pinned in [peers] fingerprints ({old})" in pair.log(1)
        await same_bytes_as_files(b, "m", mine)


@needs_nixl
async def test_a_single_daemon_says_its_pin_does_not_match_its_files_and_stops_using_it(pair: Pair, tmp_path: Path) -> None:
    """One daemon, a pin its rewritten files do not hold: the load reads the files, says
    the pin is wrong and counts it; a neighbour that starts later with the pinned content
    is not filled from."""
    mine = ckpt(tmp_path / "borrower", 4 * MIB, seed=1)
    old = fingerprint_files(mine)
    rewrite(mine, seed=2)
    borrower = pair.start(1, {"m": mine}, {"fingerprints": f'{{ m = "{old}" }}'})
    async with Client(borrower.socket) as b:
        await b.load("m")
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fingerprint_files(mine)
        assert await counter(b, "pin_mismatches") == 1
        assert f"not the one pinned in [peers] fingerprints ({old})" in pair.log(1)
        await b.evict("m")
        lender, _ = start_lender(pair, tmp_path, seed=1)
        async with Client(lender.socket) as a:
            await a.load("m")
            await wait_for(lambda: offered(b, old))
            await b.load("m")
        row = model_row(await b.models(), "m")
        assert row["source"] == "files" and row["fingerprint"] == fingerprint_files(mine), pair.log(1)[-3000:]
        await same_bytes_as_files(b, "m", mine)


@pytest.mark.parametrize("attached", [False, True])
async def test_bytes_found_not_to_be_the_files_are_evicted_or_served_only_to_those_attached(tmp_path: Path,
                                                                                           attached: bool) -> None:
    """The verification of a neighbour's fill (Pins._verify), in process: an arena whose
    fingerprint its files do not hold is evicted when nobody is attached; else the engine
    attached keeps it, and once it detaches the next load reads the files."""
    import dataclasses

    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore
    from weightcache.config import ModelConfig, Settings
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency

    path = ckpt(tmp_path, 4 * MIB, seed=3)
    core = CacheCore({"cpu": 64 * MIB})
    backends = {"cpu": CpuBackend("cpu")}
    registry = Registry(core, backends, access=None)
    registry.register(ModelConfig(name="m", path=path))
    residency = Residency(Settings().daemon, core, registry, backends, lambda: False)
    try:
        await residency.flights.ensure_resident("m", 0)
        model = registry.models["m"]
        real = model.resident.checkpoint
        assert real is not None
        forged = dataclasses.replace(real, fingerprint="0" * 32)  # as a neighbour's bytes under a stale pin
        model.resident.checkpoint = forged
        lease = core.attach("m", 1) if attached else None
        await residency.pins._verify("m", model, forged)
        assert residency.stats.counters["neighbour_checks"] == 1
        assert residency.stats.counters["neighbour_mismatches"] == 1
        if attached:
            assert core.entry("m").state.value == "resident" and model.resident.checkpoint is forged
            assert await residency.flights.ensure_resident("m", 0) == "resident"  # the attached keep their bytes
            assert model.resident.checkpoint is forged
            assert lease is not None
            core.detach(lease.id, 1)
        else:
            assert core.entry("m").state.value != "resident"
        await residency.flights.ensure_resident("m", 0)  # from the files now
        assert model.resident.checkpoint is not forged
        assert model.resident.checkpoint.fingerprint == fingerprint_files(path)
        assert not model.resident.refuted
    finally:
        await residency.close()
