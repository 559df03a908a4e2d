"""How long what a client holds lives, against real daemons (CPU backend): a lease lives as
long as the tensors of an attach whose context manager was dropped unexited (mapping.py's
Note [lifetime]), and a client outlives a daemon restart, connecting again at its next
call (core.py's Note [reconnecting])."""

from __future__ import annotations

import gc
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from weightcache import Client, SyncClient
from weightcache.errors import Attached, DaemonUnavailable
from weightcache.tools.spawn import DaemonProcess


@pytest.fixture(params=["file", "memfd"])
def model_path(request: pytest.FixtureRequest, ckpts: dict[str, Path], tmp_path: Path) -> tuple[str, Path]:
    """A checkpoint served from its files' page cache (three files: three mappings own one
    lease), or copied into a sealed memfd (a group-writable file is not served as is)."""
    if request.param == "file":
        return "file", ckpts["sharded"]
    p = tmp_path / "m.safetensors"
    shutil.copy(ckpts["a"], p)
    p.chmod(0o664)
    return "memfd", p


def _collect() -> None:
    gc.collect()
    gc.collect()


def _wait_no_leases(c: SyncClient) -> None:
    """The detach a finalizer sent is answered before later requests on its connection,
    but the daemon sees it on another connection only once handled: poll, bounded."""
    import time

    deadline = time.monotonic() + 30
    while c.status()["leases"]:
        assert time.monotonic() < deadline, "the lease did not end after its tensors were collected"
        time.sleep(0.05)


def test_a_sync_attach_dropped_unexited_holds_its_lease_until_its_tensors_are_gone(start_daemon, model_path):
    kind, path = model_path
    d = start_daemon(budget="40MiB", models={"m": path})
    with SyncClient(d.socket) as other:
        w = SyncClient(d.socket).attach("m").__enter__()  # neither the client nor the manager is kept
        assert w.arena_kind == kind
        _collect()
        name = next(iter(w))
        expected = w[name].clone()
        assert other.status()["leases"] == 1  # what ps shows
        with pytest.raises(Attached):
            other.evict("m")  # the engine still reads w
        t = w[name]  # one view is enough to hold it
        del w
        _collect()
        assert other.status()["leases"] == 1 and torch.equal(t, expected)
        with pytest.raises(Attached):
            other.evict("m")
        del t
        _collect()
        _wait_no_leases(other)
        assert other.evict("m")["evicted"]


async def test_an_async_attach_dropped_unexited_holds_its_lease_until_its_tensors_are_gone(start_daemon, model_path):
    kind, path = model_path
    d = start_daemon(budget="40MiB", models={"m": path})
    async with Client(d.socket) as other:
        c = await Client(d.socket).connect()
        w = await c.attach("m").__aenter__()
        del c
        _collect()
        assert w.arena_kind == kind and (await other.status())["leases"] == 1
        with pytest.raises(Attached):
            await other.evict("m")
        views = list(w.values())
        del w
        _collect()
        assert (await other.status())["leases"] == 1
        del views
        _collect()
        for _ in range(600):  # the detach is sent from the client's own loop: let it run
            if not (await other.status())["leases"]:
                break
            import asyncio

            await asyncio.sleep(0.05)
        assert (await other.status())["leases"] == 0
        assert (await other.evict("m"))["evicted"]


def test_a_block_exit_still_ends_the_lease_and_a_late_collection_sends_nothing_more(start_daemon, ckpts):
    d = start_daemon(models={"m": ckpts["tiny"]})
    with SyncClient(d.socket) as c:
        with c.attach("m") as w:
            assert c.status()["leases"] == 1
        assert c.status()["leases"] == 0  # at the block's exit, with w still alive
        with c.attach("m") as w2:
            del w
            _collect()  # the first lease's mapping goes: its lease ended already, the second one stays
            assert c.status()["leases"] == 1 and len(w2) == 5


def _restart(d: Any, log: Path) -> DaemonProcess:
    """Stop ``d`` (SIGTERM; its lease outlives the grace period) and start a new daemon on the
    same socket and config."""
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 0
    return DaemonProcess(d.config, d.socket, log).start()


def test_a_sync_client_connects_again_after_a_daemon_restart(start_daemon, ckpts, tmp_path):
    d = start_daemon(models={"m": ckpts["tiny"]})
    c = SyncClient(d.socket, wait_for_daemon=0.5)  # the new daemon listens before the next call
    second = None
    try:
        with c.attach("m") as w:
            name = next(iter(w))
            expected = w[name].clone()
            first_pid = c.server_info["pid"]
            second = _restart(d, tmp_path / "second.log")
            assert c.status()["leases"] == 0  # the next call connects again; the old lease ended with the old daemon
            assert c.server_info["pid"] == second.proc.pid != first_pid
            event = c._client.events[-1]
            assert event["event"] == "reconnected" and event["restarted"] and event["previous_pid"] == first_pid, event
            assert torch.equal(w[name], expected)  # still mapped and readable
        # The block's exit detached nothing: that lease was the old connection's.
        with c.attach("m") as w:
            assert c.status()["leases"] == 1
            third = _restart(second, tmp_path / "third.log")  # and now the block's exit is the first call after it
        second = third
        assert c.status()["leases"] == 0 and c.server_info["pid"] == third.proc.pid
        second.stop()  # gone for good: the next call says what happened, and that connecting again failed
        with pytest.raises(DaemonUnavailable, match=r"closed the connection.*connecting again failed: cannot connect"):
            c.status()
    finally:
        c.close()
        if second is not None:
            second.stop()


async def test_an_async_client_connects_again_after_a_daemon_restart(start_daemon, ckpts, tmp_path):
    import asyncio

    d = start_daemon(models={"m": ckpts["tiny"]})
    second = None
    async with Client(d.socket, wait_for_daemon=0.5) as c:
        try:
            async with c.attach("m") as w:
                name = next(iter(w))
                expected = w[name].clone()
                first_pid = c.server_info["pid"]
                second = await asyncio.to_thread(_restart, d, tmp_path / "second.log")
                assert (await c.status())["leases"] == 0
                assert c.server_info["pid"] == second.proc.pid != first_pid
                assert c.events[-1]["event"] == "reconnected" and c.events[-1]["restarted"]
                assert torch.equal(w[name], expected)
            async with c.attach("m"):
                assert (await c.status())["leases"] == 1
            assert (await c.status())["leases"] == 0
            await asyncio.to_thread(second.stop)
            with pytest.raises(DaemonUnavailable, match=r"closed the connection.*connecting again failed: cannot connect"):
                await c.status()
        finally:
            if second is not None:
                await asyncio.to_thread(second.stop)


async def test_a_block_without_as_holds_its_lease_to_its_end(start_daemon, ckpts):
    d = start_daemon(models={"m": ckpts["tiny"]})
    async with Client(d.socket) as c:
        async with c.attach("m"):  # nothing here keeps a tensor
            _collect()
            assert (await c.status())["leases"] == 1
        assert (await c.status())["leases"] == 0
    with SyncClient(d.socket) as s:
        with s.attach("m"):
            _collect()
            assert s.status()["leases"] == 1
        assert s.status()["leases"] == 0


def test_a_forked_childs_copy_of_the_tensors_ends_no_lease(start_daemon, ckpts):
    """The child shares the parent's socket: a detach sent from it would end the parent's
    lease and put a frame in the parent's stream."""
    import os

    d = start_daemon(models={"m": ckpts["tiny"]})
    with SyncClient(d.socket) as other:
        c = SyncClient(d.socket)
        w = c.attach("m").__enter__()
        pid = os.fork()
        if pid == 0:  # the child drops its copies of the tensors, and with them the mapping
            try:
                del w
                _collect()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert other.status()["leases"] == 1 and c.status()["leases"] == 1
        del w
        _collect()
        _wait_no_leases(other)
        c.close()
