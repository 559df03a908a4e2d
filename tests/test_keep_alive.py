"""keep_alive by deadlines: the core says how long the sweeper may sleep
(``CacheCore.next_expiry``) and calls ``on_deadline`` when a deadline comes earlier than
that; the sweeper (server/residency/background.py) sleeps until one of the two, so it
evicts a model when its keep_alive runs out and never wakes on a tick."""

import asyncio

from conftest import eventually
from helpers import states

from weightcache import Client
from weightcache.cache import CacheCore, State


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def resident(core: CacheCore, name: str, keep_alive: float | None) -> None:
    core.register(name, "cpu", keep_alive=keep_alive)
    core.begin_load(name, 10)
    core.finish_load(name)


def counting(core: CacheCore) -> list[int]:
    woken = [0]

    def wake() -> None:
        woken[0] += 1

    core.on_deadline = wake
    return woken


def test_next_expiry_is_the_earliest_deadline_of_the_models_that_can_expire():
    clock = Clock()
    core = CacheCore({"cpu": 1000}, clock=clock)
    assert core.next_expiry() is None
    resident(core, "never", None)
    resident(core, "late", 50)
    resident(core, "soon", 20)
    resident(core, "pinned", 5)
    core.set_pinned("pinned", True)
    resident(core, "held", 5)
    lease = core.attach("held", conn=1)
    core.register("unloaded", "cpu", keep_alive=1)
    assert core.next_expiry() == 20
    clock.t += 15
    assert core.next_expiry() == 5 and core.expired() == []
    clock.t += 5
    assert core.next_expiry() == 0 and core.expired() == ["soon"]
    core.evict("soon")
    assert core.next_expiry() == 30
    core.detach(lease.id, conn=1)  # held's keep_alive runs from its detach
    assert core.next_expiry() == 5


def test_the_sweeper_is_woken_only_when_a_deadline_comes_earlier():
    clock = Clock()
    core = CacheCore({"cpu": 1000}, clock=clock)
    woken = counting(core)
    resident(core, "a", 60)  # the first deadline: the sweeper (sleeping without one) must hear of it
    assert woken == [1]
    assert core.next_expiry() == 60  # the sweeper sleeps towards a's deadline
    resident(core, "b", 90)  # later than that: it wakes in time anyway
    core.set_keep_alive("b", 120)
    assert woken == [1]
    core.set_keep_alive("b", 10)  # a shorter keep_alive
    assert woken == [2]
    lease = core.attach("a", conn=1)
    core.set_keep_alive("a", 1)
    assert woken == [2]  # attached: it has no deadline
    core.next_expiry()
    core.detach(lease.id, conn=1)  # a detach starts a deadline before b's
    assert woken == [3]
    core.set_pinned("a", True)
    core.next_expiry()
    core.set_pinned("a", False)  # an unpin brings a's deadline back
    assert woken == [4]


def test_a_model_a_request_waits_for_does_not_expire_before_the_request_is_done():
    clock = Clock()
    core = CacheCore({"cpu": 1000}, clock=clock)
    woken = counting(core)
    core.register("m", "cpu", keep_alive=0)
    e = core.hold("m")  # as SingleFlight.ensure_resident holds it while it loads
    core.begin_load("m", 10)
    core.finish_load("m")
    assert core.expired() == [] and core.next_expiry() is None and woken == [0]
    core.release(e)
    assert core.expired() == ["m"] and woken == [1]


async def test_the_sweeper_sleeps_until_woken_or_until_the_deadline():
    """The loop with no deadline sleeps until woken: a detach wakes it (else this test
    never ends); then it sleeps until the deadline a shorter keep_alive set."""
    from weightcache.backends.cpu import CpuBackend
    from weightcache.config import ModelConfig, Settings
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency

    core = CacheCore({"cpu": 1 << 30})
    registry = Registry(core, {"cpu": CpuBackend("cpu")}, access=None)
    for n in ("x", "y"):
        registry.register(ModelConfig(name=n, path=f"/nonexistent/{n}"))
        core.begin_load(n, 4096)
        core.finish_load(n)
    lease = core.attach("x", conn=1)
    core.set_keep_alive("x", 0)
    residency = Residency(Settings().daemon, core, registry, {"cpu": CpuBackend("cpu")}, lambda: False)
    unset = core.on_deadline
    task = asyncio.ensure_future(residency.keep_alive_loop())

    async def evicted(name: str) -> bool:
        return core.entry(name).state is State.EVICTED or task.done()

    async def waiting() -> bool:  # its first step ends in the wait: it hooks on_deadline first
        return core.on_deadline is not unset

    try:
        await eventually(waiting, timeout=30)
        assert core.next_expiry() is None  # nothing can expire: it sleeps until woken
        core.detach(lease.id, conn=1)
        await eventually(lambda: evicted("x"), timeout=30)
        core.touch("y")
        core.set_keep_alive("y", 0.2)
        assert core.expired() == []
        await eventually(lambda: evicted("y"), timeout=30)
        assert not task.done(), task.exception()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        residency.io.close()


async def test_an_attach_gets_a_model_whose_keep_alive_is_zero(start_daemon, ckpts):
    """keep_alive 0 expires a model as soon as nothing holds it. The load an attach starts
    holds it until the attach has its lease; else the sweep evicted each load before the
    attach could take it, and the attach loaded it again, forever."""
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        async def evicted() -> bool:
            return (await states(c))["tiny"] == "evicted"

        async def attach() -> str:
            async with c.attach("tiny", keep_alive=0) as m:
                return (await states(c))[m.name]

        assert await asyncio.wait_for(attach(), 60) == "resident"
        await eventually(evicted, timeout=30)
        assert await asyncio.wait_for(attach(), 60) == "resident"  # loaded again, with keep_alive 0 in force
        await eventually(evicted, timeout=30)
