"""Who may connect, limits, timeouts, and an announced, lease-aware shutdown."""

import asyncio
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import eventually
from helpers import NOBODY, as_uid, connect_until_admitted, root_only

from weightcache import Client
from weightcache.errors import LimitExceeded, NoSpace, PermissionDenied, RequestTimeout
from weightcache.protocol import encode_frame


def open_to_all(d) -> None:
    # let another uid reach the socket: the credential check is what must refuse it
    os.chmod(Path(d.socket).parent, 0o755)


def raw_calls(path: str, msgs: list[dict]) -> list[dict | None]:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(path)
    out: list[dict | None] = []
    buf = b""
    import msgpack

    for m in msgs:
        try:
            s.sendall(encode_frame(m))
        except OSError:  # a refused peer's connection may be closed already: its answer is still there to read
            pass
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            chunk = s.recv(65536)
            if not chunk:
                out.append(None)
                return out
            buf += chunk
        n = int.from_bytes(buf[:4], "big")
        out.append(msgpack.unpackb(buf[4 : 4 + n]))
        buf = buf[4 + n :]
    return out


HELLO = {"id": 1, "op": "hello", "protocol": 1, "client": "other-uid"}


@root_only
def test_peer_of_another_uid_is_refused(start_daemon):
    d = start_daemon(extra_daemon={"socket_mode": 0o666})
    open_to_all(d)
    got = as_uid(NOBODY, lambda: {"replies": raw_calls(d.socket, [HELLO])})
    err = got["replies"][0]["error"]
    assert err["code"] == "PERMISSION_DENIED" and "65534" in err["message"], got
    assert "refused conn" in d.log_text() and "uid 65534" in d.log_text()
    assert raw_calls(d.socket, [HELLO])[0]["ok"]  # root still gets in


@root_only
def test_admin_ops_can_be_limited_to_admins(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]},
                     extra_daemon={"socket_mode": 0o666, "allowed_uids": [0, NOBODY], "admin_uids": [0]})
    open_to_all(d)
    msgs = [HELLO, {"id": 2, "op": "status"}, {"id": 3, "op": "evict", "name": "tiny"}, {"id": 4, "op": "models"}]
    hello, status, evict, models = as_uid(NOBODY, lambda: {"r": raw_calls(d.socket, msgs)})["r"]
    assert hello["ok"] and status["ok"] and models["ok"]
    assert evict["error"]["code"] == "PERMISSION_DENIED"


@root_only
def test_tenant_keep_alive_is_capped_by_the_configured_one(start_daemon, ckpts):
    """A peer that is not an administrator cannot keep a model resident longer than the
    operator configured, least of all forever (-1); shorter is its own business."""
    d = start_daemon(models={"tiny": ckpts["tiny"]}, tiny={"keep_alive": "1h"},
                     extra_daemon={"socket_mode": 0o666, "allowed_uids": [0, NOBODY], "admin_uids": [0]})
    open_to_all(d)
    msgs = [HELLO] + [{"id": i, "op": "load", "name": "tiny", "keep_alive": v} for i, v in ((2, -1), (3, "2h"), (4, "30s"))]
    _, never, longer, shorter = as_uid(NOBODY, lambda: {"r": raw_calls(d.socket, msgs)})["r"]
    assert [r["model"]["keep_alive"] for r in (never, longer, shorter)] == [3600, 3600, 30]
    root_never = raw_calls(d.socket, [HELLO, {"id": 2, "op": "load", "name": "tiny", "keep_alive": -1}])[1]
    assert root_never["model"]["keep_alive"] is None  # an administrator's -1 stands


def test_socket_mode_and_group(start_daemon):
    d = start_daemon(extra_daemon={"socket_mode": 0o660, "socket_group": "nogroup"})
    st = os.stat(d.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 65534


@pytest.mark.parametrize("problem", ["symlink", "world-writable"])
def test_unsafe_socket_directory_is_refused(tmp_path, problem):
    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    real = base / "real"
    real.mkdir()
    if problem == "symlink":
        sockdir = base / "link"
        sockdir.symlink_to(real)
    else:
        sockdir = real
        os.chmod(real, 0o777)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[daemon]\nsocket = "{sockdir}/s.sock"\n')
    r = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert ("symlink" if problem == "symlink" else "world-writable") in r.stderr


async def test_client_refuses_a_symlinked_socket(start_daemon, tmp_path):
    d = start_daemon()
    link = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp")) / "l.sock"
    link.symlink_to(d.socket)
    with pytest.raises(PermissionDenied, match="symlink"):
        await Client(link).connect()


@root_only
async def test_client_refuses_a_daemon_running_as_an_untrusted_uid():
    path = os.path.join(tempfile.mkdtemp(prefix="wc-", dir="/tmp"), "fake.sock")
    os.chmod(os.path.dirname(path), 0o777)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # an impostor "daemon" as nobody
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            srv = socket.socket(socket.AF_UNIX)
            srv.bind(path)
            os.chmod(path, 0o666)
            srv.listen(1)
            os.write(ready_w, b"1")
            _conn, _ = srv.accept()
            time.sleep(2)  # holds the connection open while the client checks who answered
        finally:
            os._exit(0)
    os.read(ready_r, 1)
    try:
        with pytest.raises(PermissionDenied, match="uid 65534"):
            await Client(path).connect()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


async def test_max_connections(start_daemon):
    d = start_daemon(extra_daemon={"max_connections": 3})
    held = [d.raw() for _ in range(3)]
    extra = d.raw(hello=False)
    reply = extra.recv()
    assert reply["error"]["code"] == "LIMIT_EXCEEDED" and extra.recv() is None
    held[0].close()
    # The slot comes back once the daemon has seen the close: retried until it has, not
    # after a fixed sleep that a loaded machine outran.
    await asyncio.to_thread(connect_until_admitted, d.socket)


async def test_max_leases_per_connection(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"max_leases_per_connection": 2})
    async with Client(d.socket) as c, Client(d.socket) as other, c.attach("tiny"), c.attach("tiny"):
        with pytest.raises(LimitExceeded):
            await c.attach("tiny").__aenter__()
        async with other.attach("tiny") as m:  # other connections are unaffected
            assert len(m) == 5


async def test_request_timeout(start_daemon, ckpts):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]}, extra_daemon={"request_timeout_s": 0.5})
    async with Client(d.socket) as holder, Client(d.socket) as c, holder.attach("a"):
        t = time.monotonic()
        with pytest.raises(RequestTimeout):
            await c.load("b", wait_s=3)  # waits for a detach that does not come
        assert time.monotonic() - t < 2.5
        assert (await c.status())["ok"]


async def test_half_sent_frame_is_timed_out(start_daemon):
    d = start_daemon(extra_daemon={"frame_read_timeout_s": 0.5})
    idle = d.raw()  # idle connections are never timed out
    slow = d.raw()
    t = time.monotonic()  # before the send: taken after it, a preemption between them shortened the measured wait
    slow.send(encode_frame({"id": 1, "op": "status"})[:3])
    reply = slow.recv()
    assert reply["error"]["code"] == "TIMEOUT" and slow.recv() is None
    assert 0.4 < time.monotonic() - t < 5
    await asyncio.sleep(0.6)  # idle past frame_read_timeout_s (0.5 s) once more: no frame begun, nothing to time out
    assert idle.call({"id": 2, "op": "status"})["ok"]


async def test_shutdown_announces_itself_and_waits_for_leases(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"shutdown_grace_s": 20})
    async with Client(d.socket) as c:
        async with c.attach("tiny"):
            d.proc.send_signal(signal.SIGTERM)

            async def announced() -> bool:
                return bool(c.events)

            await eventually(announced)
            assert c.events[0]["event"] == "shutting_down" and c.events[0]["leases"] == 1
            health = await c.health()
            assert health["serving"] is False and health["ready"] is False  # probes see it too
            with pytest.raises(Exception, match="SHUTTING_DOWN"):
                await c.attach("tiny").__aenter__()
            await asyncio.sleep(0.5)  # time in which a daemon that did not wait for the lease would exit
            assert d.proc.poll() is None  # still waiting for our lease
            t = time.monotonic()
        # detached: the daemon exits well before its 20 s grace
        assert await asyncio.to_thread(d.proc.wait, 15) == 0
        assert time.monotonic() - t < 10
    assert not os.path.exists(d.socket)


async def test_a_long_wait_s_does_not_make_joiners_wait(start_daemon, ckpts):
    """One request's wait_s must not hold others that ask for the same model: each waits
    for room as long as it asked, then gets NO_SPACE; the patient one still gets it."""
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]})
    async with Client(d.socket) as holder, Client(d.socket) as patient, Client(d.socket) as hasty:
        async with holder.attach("a"):
            waiting = asyncio.ensure_future(patient.load("b", wait_s=30))

            async def patient_waits() -> bool:  # refused for room, and waiting for it
                return "load b refused" in d.log_text()

            await eventually(patient_waits)
            t = time.monotonic()
            with pytest.raises(NoSpace):
                await hasty.load("b", wait_s=0.2)
            assert time.monotonic() - t < 3
            assert not waiting.done()
        assert (await waiting)["state"] == "resident"  # room came with the detach
