"""The client never waits on the daemon without a bound (Note [timeouts] in core.py),
and registers with its own file descriptors.

Real processes and real sockets, no mocks of the client: a real daemon (stopped with
SIGSTOP where it must not answer), or ``FakeDaemon``, a plain socket server in a thread
that speaks just enough of the protocol to stay silent on purpose or to record exactly
what the client sent, fds included.
"""

import array
import asyncio
import contextlib
import inspect
import json
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import eventually, no_leases
from helpers import NOBODY, as_uid
from safetensors.torch import load_file

from weightcache import Client, SyncClient
from weightcache.checkpoint_files import discover_files
from weightcache.errors import DaemonUnavailable, LoadFailed, PermissionDenied, RequestTimeout
from weightcache.protocol import FrameDecoder, decode_payload, encode_frame

HANG_GUARD_S = 10  # not a benchmark: only proves the call returned instead of hanging


class FakeDaemon:
    """A Unix socket server in a thread. Answers ``hello`` (adding ``hello_extra``) unless
    ``answer_hello`` is false; records every later request with the (st_dev, st_ino) of
    each fd that came with it (closing the fds at once); answers the ops named in
    ``answers`` with those reply fields, and never answers any other. An op in ``held``
    is answered only once its event is set (the connection goes on serving meanwhile).
    ``accept=False`` never accepts: connections wait in the listen backlog."""

    def __init__(self, *, accept: bool = True, answer_hello: bool = True, hello_extra: dict[str, Any] | None = None,
                 answers: dict[str, dict[str, Any]] | None = None, held: dict[str, threading.Event] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")  # Unix socket paths are short
        self.path = os.path.join(self.dir, "fake.sock")
        self.answer_hello = answer_hello
        self.hello_extra = hello_extra or {}
        self.answers = answers or {}
        self.held = held or {}
        self.received: list[tuple[dict[str, Any], list[tuple[int, int]]]] = []
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(8)
        self.srv.settimeout(0.1)
        self.threads = [threading.Thread(target=self._serve, daemon=True)] if accept else []
        for t in self.threads:
            t.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.conns.append(conn)
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        decoder = FrameDecoder(1 << 30)
        fd_queue: deque[int] = deque()
        sending = threading.Lock()  # a held answer is sent from its own thread

        def send(data: bytes) -> None:
            with sending:
                conn.sendall(data)

        def answer_when_released(event: threading.Event, data: bytes) -> None:
            while not event.wait(0.05):
                if self._stop.is_set():
                    return
            with contextlib.suppress(OSError):
                send(data)
        try:
            while True:
                data, anc, _flags, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(256 * 4), socket.MSG_CMSG_CLOEXEC)
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds = array.array("i")
                        fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                        fd_queue.extend(fds)
                if not data:
                    return
                for frame in decoder.feed(data):
                    req = decode_payload(frame, max_array_len=1 << 30, max_map_len=1 << 30)
                    ids = []
                    for _ in range(req.get("fds", 0)):
                        fd = fd_queue.popleft()
                        st = os.fstat(fd)
                        ids.append((st.st_dev, st.st_ino))
                        os.close(fd)
                    if req["op"] == "hello":
                        if self.answer_hello:
                            send(encode_frame({"id": req["id"], "ok": True, "protocol": 1, "server": "fake",
                                                       "pid": os.getpid(), "max_frame_bytes": 16 * 2**20,
                                                       **self.hello_extra}))
                        continue
                    self.received.append((req, ids))
                    if req["op"] in self.answers:
                        reply = encode_frame({"id": req["id"], "ok": True, **self.answers[req["op"]]})
                        if req["op"] in self.held:
                            t = threading.Thread(target=answer_when_released, args=(self.held[req["op"]], reply), daemon=True)
                            self.threads.append(t)
                            t.start()
                        else:
                            send(reply)
        except OSError:
            return
        finally:
            while fd_queue:
                os.close(fd_queue.popleft())

    def ops(self) -> list[str]:
        return [req["op"] for req, _ in self.received]

    def close(self) -> None:
        self._stop.set()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(timeout=5)
        for c in self.conns:
            c.close()
        self.srv.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeDaemon]]:
    made: list[FakeDaemon] = []

    def make(**kwargs: Any) -> FakeDaemon:
        made.append(FakeDaemon(**kwargs))
        return made[-1]

    yield make
    for f in made:
        f.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def inode(path: str | Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


MODEL = {"model": {"name": "m", "state": "registered"}}

# -- connecting ------------------------------------------------------------------------


@pytest.mark.parametrize("accept", [True, False], ids=["accepted-no-hello", "never-accepted"])
async def test_connect_times_out_when_nobody_answers_hello(fake, accept):
    f = fake(accept=accept, answer_hello=False)
    t = time.monotonic()
    with pytest.raises(DaemonUnavailable, match=r"did not answer within 0\.5s"):
        await Client(f.path, connect_timeout=0.5).connect()
    assert time.monotonic() - t < HANG_GUARD_S


def test_sync_client_connect_times_out_and_stops_its_thread(fake):
    f = fake(answer_hello=False)
    before = {t.ident for t in threading.enumerate()}
    t = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="did not answer within"):
        SyncClient(f.path, connect_timeout=0.5)
    assert time.monotonic() - t < HANG_GUARD_S
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "weightcache-client"]


async def test_connect_to_a_stopped_daemon_times_out(start_daemon):
    d = start_daemon()
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="did not answer within"):
            await Client(d.socket, connect_timeout=0.5).connect()
        assert time.monotonic() - t < HANG_GUARD_S
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    async with Client(d.socket) as c:
        assert (await c.status())["ok"]


# -- requests --------------------------------------------------------------------------


async def test_each_op_gets_its_default_timeout_or_the_override(fake, ckpts):
    f = fake()  # answers hello, then nothing
    async with Client(f.path, request_timeout=0.3, load_timeout=0.6) as c:
        control = [c.status(), c.health(), c.models(), c.evict("x"), c.pin("x"), c.unpin("x"), c.unregister("x"),
                   c.reload(), c.register("x", ckpts["tiny"]), c.register("y", ckpts["tiny"], send_files=False),
                   c.request("detach", lease=1)]
        long = [c.load("x"), c.attach("x").__aenter__(), c.publish("p", {"w": torch.zeros(4)}, fingerprint="f")]
        override = [c.status(timeout=0.2), c.load("x", timeout=0.1), c.attach("x", timeout=0.2).__aenter__(),
                    c.register("z", ckpts["tiny"], timeout=0.1)]
        t = time.monotonic()
        results = await asyncio.gather(*control, *long, *override, return_exceptions=True)
        assert time.monotonic() - t < HANG_GUARD_S
        got = [e for e in results if isinstance(e, RequestTimeout) and e.code == "TIMEOUT"]
        assert len(got) == len(results), results
        assert all("did not answer" in e.message for e in got)
        assert [e.details["timeout_s"] for e in got] == [0.3] * len(control) + [0.6] * len(long) + [0.2, 0.1, 0.2, 0.1]
        assert sorted(e.details["op"] for e in got[len(control):]) == sorted(
            ["load", "attach", "publish", "status", "load", "attach", "register"])
    assert sorted(f.ops()) == sorted(["status", "health", "models", "evict", "pin", "unpin", "unregister", "reload",
                                      "register", "register", "detach", "load", "attach", "publish", "status", "load",
                                      "attach", "register"])


async def test_load_timeout_defaults_to_the_daemons_request_timeout_plus_30s(fake):
    async with Client(fake(hello_extra={"request_timeout_s": 5.0}).path) as c:
        assert c.load_timeout == 35.0
    async with Client(fake().path) as c:  # a daemon that does not say
        assert c.load_timeout == 930.0
    async with Client(fake(hello_extra={"request_timeout_s": 5.0}).path, load_timeout=7.0) as c:
        assert c.load_timeout == 7.0


async def test_math_inf_means_no_bound(fake):
    f = fake(answers={"status": {"devices": {}}})
    async with Client(f.path, request_timeout=math.inf, load_timeout=math.inf, connect_timeout=math.inf) as c:
        assert (await c.status(timeout=math.inf))["devices"] == {}
        waiting = asyncio.ensure_future(c.load("x"))
        done, _ = await asyncio.wait([waiting], timeout=0.3)
        assert not done  # still waiting: no bound
        waiting.cancel()
    with pytest.raises(ValueError, match="positive"):
        Client(f.path, request_timeout=0)


async def test_replies_may_be_larger_than_requests(fake):
    # status's "loading" has one key per model: a daemon with 200 loading is no BAD_REQUEST
    loading = {f"m{i}": {"bytes_done": i, "bytes_total": 100, "bytes_per_s": 1.0, "eta_s": None} for i in range(200)}
    async with Client(fake(answers={"status": {"devices": {}, "loading": loading}}).path) as c:
        assert len((await c.status())["loading"]) == 200


async def test_request_to_a_stopped_daemon_times_out_and_late_replies_are_dropped(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        info = c.server_info
        assert c.load_timeout == (info["request_timeout_s"] + 30 if "request_timeout_s" in info else 930)
    async with Client(d.socket, request_timeout=0.5, load_timeout=0.5) as c:
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(RequestTimeout, match=r"did not answer 'status' within 0\.5s"):
                await c.status()
            assert time.monotonic() - t < HANG_GUARD_S
            with pytest.raises(RequestTimeout, match="did not answer 'attach'"):
                async with c.attach("tiny"):
                    pytest.fail("attached to a stopped daemon")
            with pytest.raises(RequestTimeout):
                await c.models(timeout=0.2)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # The late replies are dropped, not handed to later callers; the late lease is given back.
        status = await c.status(timeout=30)
        assert "devices" in status and "models" not in status
        await eventually(lambda: no_leases(c))
        async with c.attach("tiny") as w:  # the connection is still good
            assert len(w) == 5


def test_sync_client_request_to_a_stopped_daemon_times_out(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    with SyncClient(d.socket, request_timeout=0.5, load_timeout=0.5) as c:
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(RequestTimeout, match="did not answer"):
                c.status()
            with pytest.raises(RequestTimeout, match="did not answer"), c.attach("tiny"):
                pytest.fail("attached to a stopped daemon")
            with pytest.raises(RequestTimeout):
                c.load("tiny", timeout=0.2)
            assert time.monotonic() - t < HANG_GUARD_S
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert "devices" in c.status(timeout=30)
        # The late attach's lease was given back when that status call read its reply
        # (Note [blocking transport]): the detach was sent then, answered since.
        deadline = time.monotonic() + HANG_GUARD_S
        while c.status()["leases"]:
            assert time.monotonic() < deadline, "the late attach's lease was never given back"
            time.sleep(0.05)
        with c.attach("tiny", timeout=30) as w:
            assert len(w) == 5


def test_sync_client_does_its_io_in_the_callers_thread(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    # The threads themselves, not the process-wide count: a thread left by an earlier test
    # that ends meanwhile changed active_count() without this client starting anything.
    before = set(threading.enumerate())

    def new_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t not in before]

    with SyncClient(d.socket) as c:
        assert new_threads() == []  # no loop thread, no reader thread
        with c.attach("tiny") as w:
            assert len(w) == 5 and c.status()["leases"] == 1
            assert new_threads() == []
        assert c.status()["leases"] == 0
    with pytest.raises(DaemonUnavailable, match="client closed"):
        c.status()


def test_threads_sharing_a_sync_client_do_not_wait_for_each_other(fake):
    release = threading.Event()
    f = fake(answers={"status": {"devices": {}}, "load": MODEL}, held={"load": release})  # load: once released
    with SyncClient(f.path) as c:
        loaded: list[Any] = []

        def load() -> None:
            try:
                loaded.append(c.load("x", timeout=60))
            except BaseException as exc:
                loaded.append(exc)

        t = threading.Thread(target=load)
        t.start()
        try:
            deadline = time.monotonic() + HANG_GUARD_S
            while "load" not in f.ops():  # the load is sent: its thread waits for the reply
                assert time.monotonic() < deadline and t.is_alive(), f"the load was never sent: {loaded}"
                time.sleep(0.01)
            for _ in range(20):
                assert c.status(timeout=HANG_GUARD_S)["devices"] == {}  # answered while the load waits
            # No wall-clock bound: the statuses were answered while the load's reply was held,
            # so none of them waited for it (with a bound, a loaded machine failed it).
            assert t.is_alive() and not loaded, f"the load was over before the statuses: {loaded}"
        finally:
            release.set()
        t.join(timeout=HANG_GUARD_S)
        assert loaded == [MODEL["model"]], loaded
        # A thread's timeout is its own: a request never answered fails in its thread alone.
        slow: list[BaseException] = []

        def evict() -> None:
            try:
                c.evict("x", timeout=0.5)
            except BaseException as exc:
                slow.append(exc)

        t = threading.Thread(target=evict)
        t.start()
        t.join(timeout=HANG_GUARD_S)
        assert len(slow) == 1 and isinstance(slow[0], RequestTimeout) and slow[0].details["op"] == "evict", slow
        # Four threads at once: each gets its own reply, whichever thread reads it.
        results: list[Any] = []
        threads = [threading.Thread(target=lambda: results.extend(c.status()["devices"] for _ in range(25)))
                   for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=HANG_GUARD_S)
        assert results == [{}] * 100
    assert f.ops().count("status") == 120


def test_a_sync_client_whose_daemon_goes_away_fails_fast_and_connects_again_at_the_next_call(fake):
    release = threading.Event()
    f = fake(answers={"status": {"devices": {}}, "load": MODEL}, held={"load": release})  # load: never released
    c = SyncClient(f.path, wait_for_daemon=0.2)
    assert c.status()["devices"] == {}
    failed: list[BaseException] = []

    def load() -> None:
        try:
            c.load("x", timeout=30)
        except BaseException as exc:
            failed.append(exc)

    t = threading.Thread(target=load)
    t.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while "load" not in f.ops():
        assert time.monotonic() < deadline, "the load was never sent"
        time.sleep(0.01)
    started = time.monotonic()
    for conn in f.conns:  # the daemon closes the connection (e.g. it stopped)
        conn.shutdown(socket.SHUT_RDWR)
    t.join(timeout=HANG_GUARD_S)
    # The request in flight fails at the end of the stream, not after its timeout.
    assert len(failed) == 1 and isinstance(failed[0], DaemonUnavailable), failed
    assert "closed the connection" in str(failed[0]) and "the next call connects again" in str(failed[0])
    assert time.monotonic() - started < 5
    assert c.status(timeout=30)["devices"] == {}  # the next call connects again
    assert len(f.conns) == 2 and c._client.events[-1]["event"] == "reconnected"
    f.close()  # now nobody listens: the next call says both what happened and why connecting failed
    with pytest.raises(DaemonUnavailable, match=r"connecting again failed: cannot connect .* after waiting 0\.2s"):
        c.models(timeout=30)
    assert time.monotonic() - started < 10
    c.close()
    with pytest.raises(DaemonUnavailable, match="client closed"):
        c.status()  # closed for good: no connecting again


class Interrupted(Exception):
    """What a signal handler raises, as Python's SIGINT handler raises KeyboardInterrupt."""


def test_a_sync_call_interrupted_while_it_waits_leaves_the_client_usable(fake):
    f = fake(answers={"status": {"devices": {}}})  # never answers load

    def interrupt(*_: object) -> None:
        raise Interrupted

    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        with SyncClient(f.path) as c:
            timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            t = time.monotonic()
            with pytest.raises(Interrupted):
                c.load("x", timeout=10)  # interrupted in its wait for the reply
            assert time.monotonic() - t < 5
            timer.join()
            assert c.status()["devices"] == {}  # nothing half read: the connection still serves
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert f.ops() == ["load", "status"]


def test_a_sync_client_call_that_would_suspend_is_refused():
    from weightcache.client.sync import run_to_end

    async def suspends() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="awaited something other than its blocking transport"):
        run_to_end(suspends())


# -- the sync client cannot drift from the async one ------------------------------------


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    """Every public method of ``cls``, inherited ones included (Client's transport methods
    live in Connection), and ``__init__``."""
    names = {name for name in dir(cls) if not name.startswith("_")} | {"__init__"}
    return {name: inspect.signature(getattr(cls, name)) for name in names if callable(getattr(cls, name))}


def test_sync_client_methods_have_the_async_clients_signatures():
    sync, async_ = public_methods(SyncClient), public_methods(Client)
    assert set(sync) == set(async_) - {"connect"}  # a SyncClient connects in __init__
    for name, sig in sync.items():
        want = async_[name]
        assert list(sig.parameters.values()) == list(want.parameters.values()), f"SyncClient.{name}{sig} != Client.{name}{want}"
        if name != "attach":  # a context manager: Iterator vs AsyncIterator
            assert sig.return_annotation == want.return_annotation, name
        # Most are made from Client's method of the same name (sync.py's _blocking), which
        # makes their signatures equal by construction: check that it is the right one.
        made_from = inspect.unwrap(getattr(SyncClient, name))
        if inspect.iscoroutinefunction(made_from):
            assert made_from is inspect.unwrap(getattr(Client, name)), f"SyncClient.{name} runs {made_from.__qualname__}"
        else:  # written out by hand
            assert name in ("__init__", "close", "attach"), name


# -- register with the client's own files -----------------------------------------------


async def test_register_sends_one_fd_per_file_in_rank_order(fake, ckpts):
    f = fake(answers={"register": MODEL, "status": {"devices": {}}})
    a, sharded = ckpts["a"], ckpts["sharded"]
    async with Client(f.path) as c:
        before = open_fds()
        await c.register("one", a)
        await c.register("tp", shards=[{"path": str(a), "device": "cpu"}, {"path": sharded, "device": "cpu"}])
        await c.register("admin", a, send_files=False)
        await c.status()
        assert open_fds() == before  # the client closed its fds (and the fake the ones it got)
    (one, one_fds), (tp, tp_fds), (admin, admin_fds), _ = f.received
    assert one["files"] == [[str(a)]] and one["fds"] == 1 and one_fds == [inode(a)]
    assert one["path"] == str(a) and "shards" not in one
    shard_files = discover_files(sharded)
    assert len(shard_files) == 3
    assert tp["files"] == [[str(a)], shard_files] and tp["fds"] == 4
    assert tp_fds == [inode(a)] + [inode(p) for p in shard_files]
    assert tp["shards"] == [{"path": str(a), "device": "cpu"}, {"path": str(sharded), "device": "cpu"}]
    assert "path" not in tp
    assert "files" not in admin and "fds" not in admin and admin_fds == [] and admin["path"] == str(a)


async def test_register_of_a_file_that_cannot_be_opened_sends_nothing(fake, ckpts, tmp_path):
    f = fake(answers={"register": MODEL, "status": {"devices": {}}})
    index = tmp_path / "model.safetensors.index.json"
    shutil.copy(ckpts["tiny"], tmp_path / "present.safetensors")
    index.write_text(json.dumps({"weight_map": {"a": "present.safetensors", "b": "missing.safetensors"}}))
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    async with Client(f.path) as c:
        before = open_fds()
        with pytest.raises(LoadFailed) as info:
            await c.register("m", index)
        assert info.value.details["file"] == str(tmp_path / "missing.safetensors")
        assert "missing.safetensors" in info.value.message
        with pytest.raises(LoadFailed, match="not a regular file"):  # and it did not hang opening it
            await c.register("m", fifo)
        await c.status()  # answered in order: anything sent before it has arrived
        assert open_fds() == before  # present.safetensors was opened, then closed
    assert f.ops() == ["status"]


def run_unprivileged(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()`` as an unprivileged uid: in a forked child that drops to nobody when we are
    root (root opens any file), else right here."""
    return fn() if os.geteuid() != 0 else as_uid(NOBODY, fn)  # type: ignore[no-any-return]


def test_register_of_a_file_this_peer_may_not_read_is_permission_denied(fake, ckpts):
    f = fake(answers={"register": MODEL, "status": {"devices": {}}})
    os.chmod(f.dir, 0o755)
    os.chmod(f.path, 0o777)
    d = Path(tempfile.mkdtemp(prefix="wc-ckpt-", dir="/tmp"))
    try:
        os.chmod(d, 0o755)
        readable, secret = d / "readable.safetensors", d / "secret.safetensors"
        shutil.copy(ckpts["tiny"], readable)
        shutil.copy(ckpts["tiny"], secret)
        os.chmod(readable, 0o644)
        os.chmod(secret, 0o600 if os.geteuid() == 0 else 0o000)  # root's file; nobody may read it

        def attempt() -> dict[str, Any]:
            async def go() -> dict[str, Any]:
                async with Client(f.path) as c:
                    before = open_fds()
                    try:
                        await c.register("m", shards=[{"path": str(readable)}, {"path": str(secret)}])
                    except PermissionDenied as exc:
                        got = {"code": exc.code, "file": exc.details.get("file"), "message": exc.message}
                    await c.status()
                    return {**got, "leaked": open_fds() - before}
            return asyncio.run(go())

        got = run_unprivileged(attempt)
        assert got.get("code") == "PERMISSION_DENIED", got
        assert got["file"] == str(secret) and str(secret) in got["message"] and got["leaked"] == 0
        assert f.ops() == ["status"]
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_register_with_files_then_attach_on_a_real_daemon(start_daemon, ckpts, tmp_path):
    d = start_daemon(budget="40MiB")
    copy = tmp_path / "copy.safetensors"
    shutil.copy(ckpts["tiny"], copy)
    async with Client(d.socket) as c:
        m = await c.register("byfd", copy)
        assert m["name"] == "byfd" and m["state"] == "registered"
        copy.unlink()  # the daemon reads the fds it was sent, not the path
        ref = load_file(ckpts["tiny"])
        async with c.attach("byfd") as w:
            assert set(w) == set(ref) and all(torch.equal(w[k], v) for k, v in ref.items())
        await c.register("tp", shards=[{"path": str(ckpts["a"]), "device": "cpu"},
                                       {"path": str(ckpts["sharded"]), "device": "cpu"}])
        ref1: dict[str, torch.Tensor] = {}
        for p in discover_files(ckpts["sharded"]):
            ref1.update(load_file(p))
        async with c.attach("tp", rank=1) as w:
            assert set(w) == set(ref1) and all(torch.equal(w[k], v) for k, v in ref1.items())
