"""Two model names for the same files share one arena (cache/core.py, Note [shared
arenas]): the bytes are held and counted once, each name keeps its own leases and
policy, the arena goes only with its last name, and a reload that changes one name's
path splits them."""

import asyncio
import os

import pytest
import torch
from helpers import states

from weightcache import Client
from weightcache.errors import Attached, NoSpace


def used(st) -> int:
    return st["devices"]["cpu"]["used"]


def same_bytes(m1, m2) -> bool:
    return set(m1) == set(m2) and all(torch.equal(m1[k].view(torch.uint8), m2[k].view(torch.uint8)) for k in m1)


async def test_two_names_one_copy_attach_via_both(start_daemon, ckpts):
    d = start_daemon(budget="60MiB", models={"a1": ckpts["a"], "a2": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as c:
        await c.load("a1")
        one = used(await c.status())
        async with c.attach("a1") as m1, c.attach("a2") as m2:
            assert used(await c.status()) == one  # a2 took a1's arena: no second copy
            assert same_bytes(m1, m2) and m1.fingerprint == m2.fingerprint
            listed = {m["name"]: m for m in await c.models()}
            assert listed["a2"]["state"] == "resident" and listed["a2"]["shares_with"] == ["a1"]
            assert listed["b"]["shares_with"] == []
            assert listed["a1"]["nbytes"] == listed["a2"]["nbytes"] == one
        assert "a2 shares the arena of a1" in d.log_text()


async def test_evicting_one_name_while_the_other_is_attached(start_daemon, ckpts):
    d = start_daemon(budget="60MiB", models={"a1": ckpts["a"], "a2": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.load("a1")
        one = used(await c.status())
        async with c.attach("a2") as m2:
            await c.evict("a1")  # a1's name leaves; a2's lease keeps the bytes
            assert await states(c) == {"a1": "evicted", "a2": "resident"}
            assert used(await c.status()) == one
            with pytest.raises(Attached):
                await c.evict("a2")
            async with c.attach("a1") as m1:  # back on the same arena, not loaded again
                assert same_bytes(m1, m2) and used(await c.status()) == one
            before = {k: v.clone() for k, v in m2.items()}
        assert same_bytes(before, m2)
        await c.evict("a1")
        await c.evict("a2")  # the last name: the arena goes
        assert used(await c.status()) == 0


async def test_unregistering_one_name_keeps_the_other(start_daemon, ckpts):
    d = start_daemon(budget="60MiB", models={"a1": ckpts["a"], "a2": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.load("a1")
        await c.load("a2")
        one = used(await c.status())
        async with c.attach("a2") as m2:
            await c.unregister("a1")
            assert used(await c.status()) == one
            async with c.attach("a2") as again:
                assert same_bytes(again, m2)
        assert [m["shares_with"] for m in await c.models()] == [[]]
        await c.unregister("a2")
        assert used(await c.status()) == 0


async def test_the_policy_evicts_a_shared_arena_with_all_its_names(start_daemon, ckpts):
    """Three names in a budget of one and a half copies; a load that needs the room evicts
    the arena under every name, and only once none holds it."""
    size = os.path.getsize(ckpts["a"])
    d = start_daemon(budget=str(int(size * 1.5)), models={"a1": ckpts["a"], "a2": ckpts["a"], "a3": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as c:
        for name in ("a1", "a2", "a3"):
            await c.load(name)
        assert await states(c) == {"a1": "resident", "a2": "resident", "a3": "resident", "b": "registered"}
        async with c.attach("a3"):
            with pytest.raises(NoSpace):
                await c.load("b")  # a1 and a2 are free, but the arena is a3's too
        await c.load("b")
        assert await states(c) == {"a1": "evicted", "a2": "evicted", "a3": "evicted", "b": "resident"}
        assert used(await c.status()) == (await c.models())[-1]["nbytes"]


async def test_a_reload_that_changes_one_names_path_splits_them(start_daemon, ckpts):
    d = start_daemon(budget="60MiB", models={"a1": ckpts["a"], "a2": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.load("a1")
        await c.load("a2")
        one = used(await c.status())
        d.config.write_text(d.config.read_text().replace(f'name = "a1"\npath = "{ckpts["a"]}"',
                                                         f'name = "a1"\npath = "{ckpts["b"]}"'))
        assert (await c.reload())["changed"] == ["a1"]
        listed = {m["name"]: m for m in await c.models()}
        assert listed["a2"]["state"] == "resident" and listed["a2"]["shares_with"] == [] == listed["a1"]["shares_with"]
        assert used(await c.status()) == one  # a2 kept the arena
        await c.load("a1")  # its own files now: its own arena
        async with c.attach("a1") as m1, c.attach("a2") as m2:
            assert m1.fingerprint != m2.fingerprint
            assert used(await c.status()) == one + {m["name"]: m["nbytes"] for m in await c.models()}["a1"]


async def test_names_of_one_arena_point_at_one_record(ckpts):
    """Note [one record per arena] (server/registry.py): the registry keeps one record per
    arena key the core counts, the names of one share key point at the same one, a name
    evicted lets go of the arena without taking it from its sibling, and the arena is
    freed with the last name that holds it."""
    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore
    from weightcache.cache.eviction import arena_key
    from weightcache.config import ModelConfig, Settings
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency

    core = CacheCore({"cpu": 1 << 30})
    backends = {"cpu": CpuBackend("cpu")}
    registry = Registry(core, backends, access=None)
    for n, ckpt in (("m1", "a"), ("m2", "a"), ("b", "b")):
        registry.register(ModelConfig(name=n, path=ckpts[ckpt]))
    residency = Residency(Settings().daemon, core, registry, backends, lambda: False)

    def keyed_as_the_core() -> None:
        assert set(registry.arenas) == {arena_key(e) for e in core.entries.values()}
        for name, m in registry.models.items():
            assert m.resident is registry.arenas[arena_key(core.entry(name))]

    try:
        keyed_as_the_core()
        assert registry.models["m1"].resident is registry.models["m2"].resident
        assert registry.models["b"].resident is not registry.models["m1"].resident
        assert await residency.flights.ensure_resident("m1", 0) == "files"
        assert await residency.flights.ensure_resident("m2", 0) == "resident"  # joined
        res = registry.models["m1"].resident
        arena = res.arena
        assert arena is not None and res.holders == {"m1", "m2"} and registry.models["m2"].seen is not None
        await residency.step_down.carry_out(core.evict("m1"), reason="test")
        assert registry.holding("m1") is None and registry.holding("m2") is arena  # m2 keeps it, and its parse
        assert res.checkpoint is not None and res.holders == {"m2"} and not residency.step_down.releasing
        [dropped] = registry.unregister("m2")
        assert dropped.arena is arena  # the last name holding it: the caller frees it
        residency.step_down.forget([dropped])
        await asyncio.gather(*residency.step_down.releasing)
        assert res.arena is None and res.checkpoint is None and registry.models["m1"].resident is res
        keyed_as_the_core()
        assert await residency.flights.ensure_resident("m1", 0) == "files"  # loads again into the same record
        assert res.arena is not None and res.holders == {"m1"}
        residency.step_down.forget(registry.unregister("m1"))
        await asyncio.gather(*residency.step_down.releasing)
        keyed_as_the_core()
        assert list(registry.arenas) == [arena_key(core.entry("b"))]
    finally:
        for r in registry.arenas.values():
            if r.arena is not None:
                backends["cpu"].free(r.arena)
        residency.io.close()


async def test_a_second_names_fill_drops_the_first_names_host_copy(ckpts):
    """Note [one record per arena]: m1 was demoted to the host tier before m2, a second
    name of its files, was registered; m2 then loads from the files (m1 is not resident,
    so there is nothing to join). The record now holds m2's arena, so m1's host copy,
    which would be a second version of its bytes, is dropped (the core told, the copy
    freed), and m1 joins m2's arena when next asked for. The host tier is the CUDA
    backend's (the core demotes from a GPU only): a CPU backend named cuda:0 stands in for
    it here, its demotion a copy of nothing."""
    from weightcache.backends.base import HostCopy
    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore, State
    from weightcache.config import ModelConfig, Settings
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency

    class HostTierStandIn(CpuBackend):
        supports_host_tier = True

        def __init__(self) -> None:
            super().__init__("cuda:0")
            self.freed: list[HostCopy] = []

        def demote(self, arena):  # type: ignore[no-untyped-def]
            self.free(arena)
            return HostCopy(arena.nbytes)

        def free_host(self, host):  # type: ignore[no-untyped-def]
            self.freed.append(host)

    core = CacheCore({"cuda:0": 1 << 30}, host_budget=1 << 30)
    backend = HostTierStandIn()
    registry = Registry(core, {"cuda:0": backend}, access=None)
    registry.register(ModelConfig(name="m1", path=ckpts["a"], device="cuda:0"))
    residency = Residency(Settings().daemon, core, registry, {"cuda:0": backend}, lambda: False)
    try:
        assert await residency.flights.ensure_resident("m1", 0) == "files"
        await residency.step_down.carry_out(core.evict("m1"), reason="test")
        res = registry.models["m1"].resident
        assert core.entry("m1").state is State.HOST and res.host_copy_of("m1") is not None
        copy = res.host_copy_of("m1")
        registry.register(ModelConfig(name="m2", path=ckpts["a"], device="cuda:0"))
        assert registry.models["m2"].resident is res
        assert await residency.flights.ensure_resident("m2", 0) == "files"  # nothing resident to join
        core.check_invariants()
        assert core.entry("m1").state is State.EVICTED and not core.entry("m1").host_copy
        assert backend.freed == [copy] and res.host is None and res.holders == {"m2"}
        assert await residency.flights.ensure_resident("m1", 0) == "resident"  # joined m2's arena
        assert res.holders == {"m1", "m2"}
    finally:
        for r in registry.arenas.values():
            if r.arena is not None:
                backend.free(r.arena)
        residency.io.close()
