"""The daemon's life and its model registry, with a real daemon process on the CPU (memfd)
backend: the tests' loop is uvloop like the daemon's, preloads run behind a socket that
answers at once, config reload, register at runtime, SIGTERM with live leases, a stale
socket replaced and a live one left alone."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import daemon_in_process, eventually
from helpers import first, spawn_child

from weightcache import Client
from weightcache.errors import BadRequest
from weightcache.systemd import StopRequests
from weightcache.tools.spawn import wait_for_socket


async def test_runs_under_uvloop():
    import uvloop

    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


async def test_preload_does_not_delay_the_socket(tmp_path, ckpts):
    """The socket answers while a preload is still running. The daemon runs in this
    process and its preload waits on an event that only the test sets, once it has been
    answered: a start that waited for its preloads before binding never returns, and the
    test fails, whatever the machine's load."""
    release = asyncio.Event()

    def hold_preloads(daemon):
        preload = daemon.residency.preloads._preload

        async def held(name: str, gates: bool) -> None:
            await release.wait()
            await preload(name, gates)

        daemon.residency.preloads._preload = held

    async with daemon_in_process(tmp_path, {"a": ckpts["a"]}, hold_preloads, a={"preload": True}) as daemon:
        try:
            async with Client(daemon.socket_path) as c:
                health = await c.health()
                assert health["preloading"] == ["a"] and not health["ready"], health
                assert (await c.models())[0]["state"] != "resident"
                release.set()
                await eventually(lambda: first(c, "state", "resident"))
                assert (await c.health())["ready"]
        finally:
            release.set()  # before the daemon stops: its shutdown waits for loads


async def test_reload_applies_config_changes(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as c, c.attach("a"):
        text = d.config.read_text()
        # drop a (attached: kept) and b; add c
        head = text.split("[[models]]")[0]
        d.config.write_text(head + f'[[models]]\nname = "c"\npath = "{ckpts["c"]}"\n')
        report = await c.reload()
        assert report["added"] == ["c"] and report["removed"] == ["b"]
        assert report["failed"] and report["failed"][0].startswith("a: removed from the file, but kept")
        assert {m["name"] for m in await c.models()} == {"a", "c"}
    # change a model's path and the budget: the model is re-registered, the budget applied
    async with Client(d.socket) as c:
        await c.load("c")
        d.config.write_text(d.config.read_text().replace(str(ckpts["c"]), str(ckpts["b"])).replace('"cpu" = "20MiB"', '"cpu" = "12MiB"'))
        report = await c.reload()
        assert report["changed"] == ["c"] and report["budgets"] == [{"device": "cpu", "budget": 12 * 2**20, "previous": 20 * 2**20}]
        assert (await c.status())["devices"]["cpu"]["budget"] == 12 * 2**20
        assert {m["name"]: m["path"] for m in await c.models()}["c"] == str(ckpts["b"])


async def test_register_at_runtime_and_bad_register(start_daemon, ckpts):
    d = start_daemon()
    async with Client(d.socket) as c:
        m = await c.register("late", ckpts["tiny"])
        assert m["state"] == "registered"
        async with c.attach("late") as w:
            assert len(w) == 5
        with pytest.raises(BadRequest, match="already registered"):
            await c.register("late", ckpts["tiny"])
        with pytest.raises(BadRequest, match="no budget"):
            await c.register("gpu", ckpts["tiny"], device="cuda:3")
        with pytest.raises(BadRequest, match="invalid model: name: model name 'bad name' must be"):
            await c.register("bad name", ckpts["tiny"])
        # One line naming the key, as the config file's errors do (pydantic's own dump
        # spanned four lines and a URL).
        with pytest.raises(BadRequest) as bad:
            await c.register("late2", ckpts["tiny"], keep_alive="xyz")
        assert str(bad.value).startswith("BAD_REQUEST: invalid model: keep_alive: not a duration: 'xyz'")
        assert "\n" not in str(bad.value) and "pydantic" not in str(bad.value)


def test_sigterm_shutdown_with_live_leases_removes_the_socket(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    kid = spawn_child(d, "a", ckpts["a"], "hold")
    assert kid.stdout.readline().startswith("ATTACHED")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30) == 0
    assert not os.path.exists(d.socket)
    kid.kill()
    kid.wait()


def test_sigterm_sent_to_the_daemon_and_its_group_is_one_graceful_stop(start_daemon, ckpts):
    """`timeout 600 weightcache serve` passes SIGTERM on to the daemon and then to its whole
    process group: the daemon receives it twice within milliseconds, and must stop as asked
    once (exit 0, socket removed), not as a second, forcing request. A lease held keeps the
    daemon in its shutdown (the grace period) while the second signal comes, so that the
    two are not merged into one by the kernel before the daemon sees the first."""
    d = start_daemon(models={"a": ckpts["a"]}, extra_daemon={"shutdown_grace_s": 3.0})
    kid = spawn_child(d, "a", ckpts["a"], "hold")
    try:
        assert kid.stdout.readline().startswith("ATTACHED")
        sent_at = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        while "shutting down (SIGTERM)" not in d.log_text():
            assert time.monotonic() - sent_at < 30, d.log_text()[-2000:]
            time.sleep(0.01)
        d.proc.send_signal(signal.SIGTERM)
        if time.monotonic() - sent_at >= StopRequests.REPEAT_AFTER_S:
            pytest.skip("the daemon took a second or more to take the first SIGTERM on this machine")
        assert d.proc.wait(timeout=30) == 0
        assert not os.path.exists(d.socket)
        log = d.log_text()
        assert "exiting now" not in log and "taken as the same request" in log, log[-2000:]
    finally:
        kid.kill()
        kid.wait()


def test_stop_requests_a_repeat_is_the_same_signal_and_sender_within_a_second(monkeypatch):
    from weightcache import systemd

    now = [100.0]
    monkeypatch.setattr(systemd.time, "monotonic", lambda: now[0])
    stops = systemd.StopRequests()
    assert stops.take(signal.SIGTERM, 7) == "first"
    now[0] += 0.01
    assert stops.take(signal.SIGTERM, 7) == "duplicate"
    assert stops.take(signal.SIGINT, 7) == "again"  # another signal: the operator asking
    assert stops.take(signal.SIGTERM, 8) == "again"  # another sender
    assert stops.take(signal.SIGTERM, 7, from_terminal=True) == "again"  # a key pressed again
    now[0] += systemd.StopRequests.REPEAT_AFTER_S
    assert stops.take(signal.SIGTERM, 7) == "again"


def test_stale_socket_is_replaced_but_a_live_one_is_not(start_daemon, ckpts, tmp_path):
    d = start_daemon()
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert os.path.exists(d.socket)  # SIGKILL leaves it behind
    cfg = d.config
    p = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)], stderr=subprocess.PIPE, text=True)
    try:
        wait_for_socket(d.socket, p)
        # a second daemon on the same, now live, socket refuses to start
        r = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "already serving" in r.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        assert "removing stale socket" in p.stderr.read()
