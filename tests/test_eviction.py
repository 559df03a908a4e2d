"""Eviction against a real daemon process, CPU (memfd) backend: LRU order under a budget
for two of three models, NO_SPACE (at once when waiting cannot help, otherwise after a
detach), pins, the evict and unregister ops, keep_alive."""

import asyncio
import time

import pytest
from conftest import eventually
from helpers import first, states

from weightcache import Client
from weightcache.errors import Attached, BadRequest, NoSpace, Pinned, UnknownModel


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


async def test_the_eviction_reason_names_the_configured_policy(start_daemon, ckpts):
    d = start_daemon(budget="18MiB", models={k: ckpts[k] for k in "abc"}, extra_daemon={"eviction_policy": "gdsf"})
    async with Client(d.socket) as c:
        for name in "abc":
            await c.load(name)
    log = d.log_text()
    assert "GDSF, to make room for c" in log and "LRU, to make room" not in log


async def test_no_space_waits_for_a_detach(start_daemon, ckpts):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as holder, Client(d.socket) as c:
        async with holder.attach("a"):
            waiting = asyncio.ensure_future(c.load("b", wait_s=30))

            async def refused() -> bool:  # the daemon has seen the load and found no room
                return "load b refused" in d.log_text()

            await eventually(refused)
            await asyncio.sleep(0.3)  # time in which a load that did not wait would have its NO_SPACE back
            assert not waiting.done()
        assert (await asyncio.wait_for(waiting, 30))["state"] == "resident"


async def test_an_attach_that_waited_for_a_detach_says_how_long(start_daemon, ckpts):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as holder, Client(d.socket) as c:
        async with c.attach("b", wait_s=30) as m:  # room at once: no wait
            assert m.source == "files" and m.waited_s == 0.0
        async with holder.attach("a"):  # evicts b; a now holds the room b needs
            waiting = asyncio.ensure_future(c.attach("b", wait_s=30).__aenter__())
            # The 0.5 s counts from the daemon's refusal (the attach parked, its wait begun),
            # not from the send: a loaded machine may take that long to handle it at all.
            deadline = time.monotonic() + 30
            while "load b refused" not in d.log_text():
                assert time.monotonic() < deadline and not waiting.done(), "the attach never waited for room"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # the wait that waited_s must count
            assert not waiting.done()
        m = await asyncio.wait_for(waiting, 30)
        assert m.source == "files" and 0.4 < m.waited_s < 30  # the wait for holder's detach, not the load


async def test_model_larger_than_budget_fails_at_once(start_daemon, ckpts):
    d = start_daemon(budget="4MiB", models={"a": ckpts["a"], "tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        t = time.monotonic()
        with pytest.raises(NoSpace, match="needs"):
            await c.load("a", wait_s=30)  # waiting cannot help: no wait
        assert time.monotonic() - t < 5
        assert (await c.status())["devices"]["cpu"]["reserved"] == 0
        await c.load("tiny")  # still serving


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


async def test_keep_alive_evicts_idle_models(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]}, tiny={"keep_alive": 1})
    async with Client(d.socket) as c:
        await c.load("tiny")
        await eventually(lambda: first(c, "state", "evicted"))
    assert "keep_alive expired" in d.log_text()


async def test_request_keep_alive(start_daemon, ckpts):
    """keep_alive on attach and load: 0 evicts once the last lease ends, -1 outlives the
    configured 1 s, and a bad value is BAD_REQUEST naming the argument. That a model
    stays is seen beside a witness, b: registered after it and running out after it
    would, so the sweep that evicts b would have evicted it first."""
    d = start_daemon(models={"tiny": ckpts["tiny"], "a": ckpts["a"], "b": ckpts["b"]}, a={"keep_alive": 1})
    async with Client(d.socket) as c:
        async def evicted(name: str) -> bool:
            return (await states(c))[name] == "evicted"

        with pytest.raises(BadRequest) as bad:
            await c.load("tiny", keep_alive="5 fortnights")
        assert bad.value.details["argument"] == "keep_alive" and "keep_alive" in bad.value.message
        with pytest.raises(BadRequest):
            await c.load("tiny", keep_alive=-2)
        async with c.attach("tiny", keep_alive=0):
            await c.load("b", keep_alive=0)
            await eventually(lambda: evicted("b"))
            assert (await states(c))["tiny"] == "resident"  # leased, it stays
        await eventually(lambda: evicted("tiny"))  # tiny has no configured keep_alive
        assert (await c.load("a", keep_alive=-1))["keep_alive"] is None
        await c.load("b", keep_alive="1s")  # runs out after a's configured 1 s would have
        await eventually(lambda: evicted("b"))
        assert (await states(c))["a"] == "resident"  # configured 1 s, overridden by -1
        assert (await c.load("a", keep_alive="1s"))["keep_alive"] == 1
        await eventually(lambda: evicted("a"))



async def test_max_loaded_models(start_daemon, ckpts):
    """daemon.max_loaded_models: a third load on a device limited to two evicts the least
    recently used though the bytes fit; with both held, NO_SPACE names the key."""
    d = start_daemon(budget="20MiB", models={k: ckpts[k] for k in ("tiny", "a", "b")},
                     extra_daemon={"max_loaded_models": {"cpu": 2}})
    async with Client(d.socket) as c:
        await c.load("tiny")
        await c.load("a")
        await c.load("b")
        assert await states(c) == {"tiny": "evicted", "a": "resident", "b": "resident"}
        async with c.attach("a"), c.attach("b"):
            with pytest.raises(NoSpace) as full:
                await c.load("tiny")
        assert "max_loaded_models" in full.value.message and full.value.details["max_loaded_models"] == 2
