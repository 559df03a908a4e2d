"""An attacker's view of the wait for room (residency/flight.py: RoomQueue.until_admitted, SpaceFreed) and of
requests whose peer went away: what a peer that may connect, but is not trusted, can make
the daemon keep doing for it once it is gone."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import pytest
from helpers import NOBODY, as_uid, root_only

from weightcache.protocol import encode_frame

from ._util import (
    MIB,
    OTHER,
    Conn,
    calls,
    code,
    config_text,
    multi_tenant,
    publish_msg,
    sealed_memfd,
    write_checkpoint,
)
from .test_tenants import TENANTS, _checkpoints, _register


def _no_space_replies(d) -> int:
    """Load requests the daemon answered NO_SPACE (logged at debug, sent or not)."""
    return d.log_text().count(": load error NO_SPACE")


def _wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met within the timeout"
        time.sleep(0.05)


def _c_cannot_fit(start_daemon, tmp_path, c_mib: int) -> tuple[Any, Conn]:
    """A daemon with models a and b (8 MiB) attached by the returned connection (leases 1
    and 2) and c (``c_mib``), which cannot fit until one of them is detached."""
    ck = {n: write_checkpoint(tmp_path / f"{n}.safetensors", (c_mib if n == "c" else 8) * MIB, 40, seed=i)
          for i, n in enumerate("abc")}
    d = start_daemon(budget=f"{c_mib + 12}MiB", models=ck)
    holder = Conn(d.socket)
    for i, n in enumerate("ab"):
        assert holder.call({"id": 10 + i, "op": "attach", "name": n})["ok"]
        for fd in holder.take_fds():
            os.close(fd)
    return d, holder


def test_a_load_whose_peer_closed_stops_waiting_for_room(start_daemon, tmp_path):
    """A `load` goes on after its peer closes the connection (docs/protocol.md), but it
    must not go on *waiting for room*: a peer could connect, send 31 loads with a long
    wait_s, close, and do it again, without end (the per-connection and per-uid limits
    count open connections only). Each orphan lived up to request_timeout_s, held memory
    and was woken, to try again, by every detach: 6,200 of them made each detach cost
    ~130 ms of the event loop (measured on the CI machine)."""
    d, holder = _c_cannot_fit(start_daemon, tmp_path, 8)
    gone = 0
    for _ in range(4):
        c = Conn(d.socket)
        for j in range(8):
            c.send({"id": 100 + j, "op": "load", "name": "c", "wait_s": 600})
        assert c.call({"id": 200, "op": "status"})["ok"]  # the loads were read before the close
        c.close()
        gone += 8
    _wait_for(lambda: _no_space_replies(d) >= gone)
    # The daemon serves on: a live peer's load that waits for room gets it once a detaches.
    live = Conn(d.socket)
    live.send({"id": 1, "op": "load", "name": "c", "wait_s": 30})
    assert holder.call({"id": 20, "op": "detach", "lease": 1})["ok"]
    r = live.reply(1)
    assert r is not None and r["ok"], r
    assert r["model"]["state"] == "resident"
    assert code(holder.call({"id": 21, "op": "status"})) is None


async def test_keep_alive_goes_on_after_a_model_it_listed_was_attached_meanwhile():
    """The keep_alive loop lists the expired models, then evicts them one by one, waiting
    for each eviction's demotion (a GPU model's copy to the host tier). An engine that
    attached the next listed model during that wait made ``evict`` raise ATTACHED: the
    loop's task died, and no model ever expired again on that daemon. (The CPU backend
    never waits there, so the wait is stood in for here.)"""
    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore
    from weightcache.config import ModelConfig, Settings
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency

    core = CacheCore({"cpu": 1 << 30})
    registry = Registry(core, {"cpu": CpuBackend("cpu")}, access=None)
    for n in ("x", "y"):
        registry.register(ModelConfig(name=n, path=f"/nonexistent/{n}"))
        core.set_keep_alive(n, 0)  # as a request's keep_alive=0 sets it
        core.begin_load(n, 4096)
        core.finish_load(n)
    residency = Residency(Settings().daemon, core, registry, {"cpu": CpuBackend("cpu")}, lambda: False)
    carry_out = residency.step_down.carry_out
    lease = None

    async def demoting(step, reason):  # the first eviction waits, and y is attached meanwhile
        nonlocal lease
        await carry_out(step, reason)
        if lease is None:
            lease = core.attach("y", conn=1)
            await asyncio.sleep(0)

    residency.step_down.carry_out = demoting  # type: ignore[method-assign]
    task = asyncio.ensure_future(residency.keep_alive_loop())
    try:
        await _until(lambda: lease is not None)
        assert core.entry("y").state.value == "resident"  # attached: kept
        core.detach(lease.id, conn=1)
        await _until(lambda: core.entry("y").state.value == "evicted" or task.done())
        assert not task.done(), task.exception()
        assert core.entry("x").state.value == "evicted"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        residency.io.close()


async def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met within the timeout"
        await asyncio.sleep(0.05)


async def test_an_arena_is_freed_only_after_the_thread_filling_it_is_done(ckpts):
    """A publish is cancelled when its peer closes the connection. The thread copying the
    published bytes cannot be cancelled: the arena was freed while it still ran, and the
    copy (or the seal after it) then made a new memfd of the arena's size for an arena
    already freed, which nothing counted or freed again (memory outside every budget; on
    a GPU, a copy into released memory). The load must wait for the thread, then free."""
    import threading

    from weightcache.backends.cpu import CpuBackend
    from weightcache.cache import CacheCore
    from weightcache.config import ModelConfig, Settings
    from weightcache.loader.checkpoint import parse_checkpoint
    from weightcache.loader.sources import open_source
    from weightcache.server.registry import Registry
    from weightcache.server.residency import Residency

    backend = CpuBackend("cpu")
    core = CacheCore({"cpu": 1 << 30})
    registry = Registry(core, {"cpu": backend}, access=None)
    registry.register(ModelConfig(name="m", path=ckpts["tiny"]))
    residency = Residency(Settings().daemon, core, registry, {"cpu": backend}, lambda: False)
    opened = open_source(ckpts["tiny"])
    started, go, copied = threading.Event(), threading.Event(), threading.Event()
    arenas = []

    def slow_copy(ckpt, arena, progress):  # as CopyPublished: the memfd is made in the thread
        arenas.append(arena)
        started.set()
        go.wait(10)
        backend._make_memfd(arena)
        copied.set()

    try:
        ckpt = parse_checkpoint(opened)
        task = asyncio.ensure_future(residency.fill.fill_new_arena("m", ckpt, backend.capacity(ckpt.arena_bytes), 0, slow_copy,
                                                          verb="published"))
        await asyncio.to_thread(started.wait, 10)
        task.cancel()  # the peer went
        await asyncio.sleep(0.2)  # the cancelled load's cleanup runs now, while the thread still copies
        go.set()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(copied.wait, 10)
        while residency.step_down.releasing:
            await asyncio.gather(*residency.step_down.releasing)
        assert arenas and arenas[0].fd == -1 and arenas[0].mapping is None, "the arena's memfd outlived its load"
        assert core.entry("m").state.value == "registered" and core.devices["cpu"].reserved == 0
    finally:
        go.set()
        opened.close()
        for a in arenas:
            backend.free(a)
        residency.io.close()


async def test_a_peer_cannot_take_a_name_the_reload_is_adding(tmp_path, ckpts):
    """The config wins a name (docs/protocol.md, reload): a peer's model of a name the
    config now uses is displaced. The reload checked the new model's files (in the io
    pool, an await) *after* displacing the peer's model and before registering the
    config's: a peer that registered the name again in that window made the reload fail
    half done (BAD_REQUEST "already registered") and kept the name."""
    from weightcache.config import ModelConfig, load_settings
    from weightcache.server.main import build
    from weightcache.tools.spawn import config_text

    cfg = tmp_path / "d.toml"
    sock = str(tmp_path / "s.sock")
    cfg.write_text(config_text(sock, {"cpu": "64MiB"}, [], {}))
    daemon = build(load_settings(str(cfg)), str(cfg))
    peer = ModelConfig(name="x", path=ckpts["b"])
    daemon.registry.register(peer, origin="register", owner=4242)
    cfg.write_text(config_text(sock, {"cpu": "64MiB"}, [{"name": "x", "path": str(ckpts["a"])}], {}))
    check = daemon.config_models.checkpoint_problem

    async def squatting(mc):  # a peer registers the name again while the files are checked
        if "x" not in daemon.registry.groups:
            daemon.registry.register(peer, origin="register", owner=4242)
        return await check(mc)

    daemon.config_models.checkpoint_problem = squatting  # type: ignore[method-assign]
    try:
        report = await daemon.reload_config()
        assert report["displaced"] == ["x"] and report["added"] == ["x"], report
        assert daemon.registry.first("x").origin == "config"
    finally:
        await daemon.residency.close()


@root_only
def test_a_kept_quota_error_does_not_tell_another_tenant_what_the_owner_holds(start_daemon):
    """The NO_SPACE reply of a load over its owner's quota hides the owner's usage from
    another tenant (handlers._own_quota_only); the load also keeps the error as the
    model's ``last_error``, which ``models`` shows to every peer that may use the model:
    it must not carry the owner's quota_bytes, quota_used or "hold N now" either (it holds:
    a non-owner gets last_error redacted)."""
    priv, shared = _checkpoints(2, 2 * MIB)
    d = multi_tenant(start_daemon, TENANTS, budget="64MiB")
    d.config.write_text(d.config.read_text() + f'\n[quotas."uid:{NOBODY}"]\nbytes = {{ cpu = "3MiB" }}\npins = 1\n')
    (r,) = calls(d.socket, [{"id": 1, "op": "reload"}])
    assert f"uid:{NOBODY}" in r["report"]["quotas"], r

    def owner() -> list[Any]:  # a private model, loaded and pinned, and one OTHER may use
        return [_register(d.socket, "priv", priv), _register(d.socket, "shared", shared, allowed_uids=[OTHER]),
                *calls(d.socket, [{"id": 1, "op": "load", "name": "priv"}, {"id": 2, "op": "pin", "name": "priv"}])]

    assert all(code(x) is None and "error" not in x for x in as_uid(NOBODY, owner))
    err, models = as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "load", "name": "shared"}, {"id": 2, "op": "models"}]))
    assert code(err) == "NO_SPACE", err
    kept = next(m for m in models["models"] if m["name"] == "shared")["last_error"]
    assert kept is not None and kept["code"] == "NO_SPACE", kept
    assert "quota_used" not in kept and "quota_bytes" not in kept and "hold" not in kept["message"], kept
    (mine,) = as_uid(NOBODY, lambda: calls(d.socket, [{"id": 1, "op": "models"}]))  # the owner is told
    assert next(m for m in mine["models"] if m["name"] == "shared")["last_error"]["quota_used"] > 0


@root_only
def test_a_peer_that_does_not_read_its_attach_replies_cannot_hold_the_daemons_fds(start_daemon, tmp_path):
    """Every fd an attach reply carries stays "in flight" until the peer reads the reply,
    and Linux counts fds in flight against the *sender's* RLIMIT_NOFILE: past it every
    sendmsg with fds fails ETOOMANYREFS (unless the daemon has CAP_SYS_ADMIN or
    CAP_SYS_RESOURCE; the shipped unit runs it as its own user). A peer pipelining
    attaches it never read had ~200 replies per connection in flight; with 16
    connections and the daemon at 2048 fds, every other peer's attach then went
    unanswered, its lease granted. The daemon now sends a uid's peers at most
    max_fds_per_uid fds they have not read (a connection with none unread always gets
    its next reply), so this test counts the replies it lets wait."""
    f = write_checkpoint(tmp_path / "a.safetensors", 64 * 1024, 4, seed=3)
    d = multi_tenant(start_daemon, models={"a": f}, extra={"max_fds_per_uid": 64})
    greedy = [Conn(d.socket) for _ in range(4)]
    sent = []
    for c in greedy:
        c.sock.setblocking(False)
        n = 0
        with contextlib.suppress(BlockingIOError):
            for i in range(400):
                frame = encode_frame({"id": 10 + i, "op": "attach", "name": "a"})
                assert c.sock.send(frame) == len(frame)  # whole frames only: small ones fit or fail
                n += 1
        sent.append(n)
        c.sock.settimeout(30)
    # Another tenant is served meanwhile; the greedy one's replies wait, not in flight.
    (r,) = as_uid(NOBODY, lambda: calls(d.socket, [{"id": 1, "op": "attach", "name": "a"}]))
    assert r["ok"], r
    probe = Conn(d.socket)

    def leases() -> int:
        return int(probe.call({"id": 1, "op": "status"})["leases"])

    # The attaches the daemon read and granted: each connection's in-flight requests
    # (at most max_requests_per_connection) plus the replies it was let send unread.
    settled = -1
    while settled != (now := leases()):
        settled = now
        time.sleep(0.3)
    assert settled <= 64 + 4 * 32 + 4, settled
    # Nothing is lost: a peer that reads gets every reply (and its fds).
    c = greedy[0]
    got = [c.reply(10 + i) for i in range(sent[0])]
    assert all(x is not None and x["ok"] and x["fds"] == 1 for x in got), got[:3]
    assert len(c.take_fds()) == sent[0]
    for c in greedy:
        c.close()
    probe.close()


def test_a_reply_the_kernel_refuses_closes_the_connection_instead_of_hanging_it(tmp_path):
    """A reply whose sendmsg fails while the peer is still there (ETOOMANYREFS: fds in
    flight past the daemon's RLIMIT_NOFILE, for a daemon without CAP_SYS_ADMIN or
    CAP_SYS_RESOURCE) was dropped with a debug line: the peer waited for it forever, the
    lease it granted held. The connection is closed instead (its leases end, the peer
    sees an error). Here max_fds_per_uid is raised past the daemon's open-file limit so
    that one peer's unread replies reach it, and the daemon runs without those two
    capabilities (setpriv), as the shipped unit runs it."""
    import shutil
    import subprocess
    import sys

    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv")
    f = write_checkpoint(tmp_path / "a.safetensors", 64 * 1024, 4, seed=4)
    sock = f"/tmp/wc-refs-{os.getpid()}.sock"
    cfg = tmp_path / "d.toml"
    cfg.write_text(config_text(sock, {"cpu": "64MiB"}, [{"name": "a", "path": str(f)}],
                               {"log_level": "debug", "max_fds_per_uid": 100_000, "shutdown_grace_s": 1}))
    log = tmp_path / "d.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["setpriv", "--bounding-set", "-sys_admin,-sys_resource", "--inh-caps",
                                 "-sys_admin,-sys_resource", "--", "prlimit", "--nofile=512:512", "--",
                                 sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.05)
        greedy = []
        for _ in range(8):  # ~200 unread replies each: past 512 fds in flight
            c = Conn(sock)
            c.sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                for i in range(400):
                    frame = encode_frame({"id": 10 + i, "op": "attach", "name": "a"})
                    assert c.sock.send(frame) == len(frame)
            greedy.append(c)
        _wait_for(lambda: "Too many references" in log.read_text() or "reply not sent" in log.read_text())
        victim = Conn(sock, timeout=10)
        r = victim.call({"id": 1, "op": "attach", "name": "a"})  # answered, or closed: never left waiting
        assert r is None or r.get("ok"), r
        for c in greedy:
            c.close()
        victim.close()
        probe = Conn(sock)  # the daemon serves on
        assert probe.call({"id": 2, "op": "status"})["ok"]
        probe.close()
    finally:
        proc.terminate()
        proc.wait(20)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)


@root_only
def test_a_tenant_cannot_publish_or_register_models_without_end(start_daemon, tmp_path):
    """Any peer may publish a new name, and a published model stays registered after it is
    evicted (its entry, its name): nothing bounded how many one uid kept. 3,000 tiny
    publishes took 9 s and made every status of another connection take 32 ms (each
    listing, placement and eviction walks every entry; measured on the CI machine), so
    a tenant could make the daemon slower for everyone without end. A uid that is not
    an administrator may hold at most max_models_per_uid models."""
    d = multi_tenant(start_daemon, {**TENANTS, "max_models_per_uid": 3}, budget="64MiB")
    (f,) = _checkpoints(1, 64 * 1024)

    def tenant() -> list[Any]:
        fd = sealed_memfd(b"\1" * 4096)
        c = Conn(d.socket)
        try:
            out = [c.call(publish_msg(10 + i, f"mine{i}", [["x", "U8", [1], 0, 1]], 4096), fds=[fd]) for i in range(3)]
            out.append(c.call(publish_msg(20, "one-too-many", [["x", "U8", [1], 0, 1]], 4096), fds=[fd]))
            out.append(c.call(publish_msg(21, "mine0", [["x", "U8", [1], 0, 1]], 4096, replace=True), fds=[fd]))
            out.append(_register(d.socket, "registered", f))
            out.append(c.call({"id": 22, "op": "unregister", "name": "mine1"}))
            out.append(_register(d.socket, "registered", f))
            return out
        finally:
            os.close(fd)
            c.close()

    got = as_uid(NOBODY, tenant)
    assert all(r["ok"] for r in got[:3]), got[:3]
    assert code(got[3]) == "LIMIT_EXCEEDED" and "max_models_per_uid" in got[3]["error"]["message"], got[3]
    assert got[4]["ok"], got[4]  # replacing its own model takes no new name
    assert got[5].get("code") == "LIMIT_EXCEEDED", got[5]  # registering counts the same
    assert got[6]["ok"] and "model" in got[7], got[6:]  # room again once one is gone
    fd = sealed_memfd(b"\1" * 4096)  # an administrator is not counted
    try:
        c = Conn(d.socket)
        assert all(c.call(publish_msg(30 + i, f"admins{i}", [["x", "U8", [1], 0, 1]], 4096), fds=[fd])["ok"]
                   for i in range(4))
        c.close()
    finally:
        os.close(fd)


def test_every_request_waiting_for_a_model_gets_it_when_room_frees(start_daemon, tmp_path):
    """A detach wakes only the oldest request waiting for each model (SpaceFreed); the
    rest must still follow it, also when the oldest's peer has gone meanwhile, and join
    its load as soon as it is admitted (not once it is done: their waited_s would count it)."""
    d, holder = _c_cannot_fit(start_daemon, tmp_path, 128)
    waiting = []
    for j in range(12):
        c = Conn(d.socket)
        c.send({"id": 100 + j, "op": "attach", "name": "c", "wait_s": 60})
        assert c.call({"id": 1, "op": "status"})["ok"]  # its attach was read before the next: the oldest first
        waiting.append(c)
    waiting.pop(0).close()  # the oldest goes: its turn must not be lost with it
    _wait_for(lambda: ") closed" in d.log_text())  # the daemon saw it go (its request then gives up)
    assert holder.call({"id": 20, "op": "detach", "lease": 1})["ok"]
    for j, c in enumerate(waiting, start=101):
        r = c.reply(j)
        assert r is not None and r["ok"] and r["model"] == "c", r
        assert r["source"] == "files", r  # joined the load in flight
        for fd in c.take_fds():
            os.close(fd)
    models = {m["name"]: m for m in holder.call({"id": 21, "op": "models"})["models"]}
    assert models["c"]["loads"] == 1 and len(models["c"]["leases"]) == 11, models["c"]
