"""Fixtures that start the real thing: a daemon process on a short temporary socket.

A test fails if the daemon logged a traceback it did not expect (the loop swallowed an
exception), or if the daemon did not exit cleanly on SIGTERM.

A test that takes ``backend`` runs once per memory backend: ``cpu`` (sealed memfd) and
``cuda`` (VMM, marked ``gpu``), which skips without cuda-bindings or a CUDA device.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvloop
from helpers import gpu_daemon, skip_without_cuda

from weightcache.protocol import encode_frame
from weightcache.protocol.framing import HEADER, decode_payload
from weightcache.tools.spawn import DaemonProcess, config_text
from weightcache.tools.synth import write_checkpoint

MIB = 2**20


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    # The suite runs under uvloop, like the daemon.
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small checkpoints made once per session: a, b, c of 8 MiB, a 3-shard one, a big one."""
    d = tmp_path_factory.mktemp("ckpts")
    out = {name: write_checkpoint(d / f"{name}.safetensors", 8 * MIB, 40, seed=i) for i, name in enumerate("abc")}
    out["sharded"] = write_checkpoint(d / "sharded", 8 * MIB, 30, shards=3, seed=7)
    out["tiny"] = write_checkpoint(d / "tiny.safetensors", 64 * 1024, 5, seed=11)
    return out


@pytest.fixture(scope="session")
def gpu_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints for the GPU tests, made once per session: x, y, z of 256 MiB."""
    d = tmp_path_factory.mktemp("gpu")
    return {n: write_checkpoint(d / f"{n}.safetensors", 256 * MIB, 60, seed=i) for i, n in enumerate("xyz")}


@dataclass
class Backend:
    """A memory backend a test runs over: its name, the checkpoints sized for it, and
    ``start(budget, models)``, a daemon with that budget on its device and every model there."""

    name: str
    ckpts: dict[str, Path]
    start: Callable[[str, dict[str, Path]], DaemonProc]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest, start_daemon: Any) -> Backend:
    """Runs a test on the CPU backend (``ckpts``) and on cuda:0 (``gpu_ckpts``, made only
    once CUDA is known to be there)."""
    if request.param == "cpu":
        return Backend("cpu", request.getfixturevalue("ckpts"), lambda budget, models: start_daemon(budget=budget, models=models))
    skip_without_cuda()
    return Backend("cuda", request.getfixturevalue("gpu_ckpts"), lambda budget, models: gpu_daemon(start_daemon, budget, models))


@dataclass
class DaemonProc:
    socket: str
    config: Path
    proc: subprocess.Popen[bytes]
    log: Path
    allowed_errors: list[str] = field(default_factory=list)

    def log_text(self) -> str:
        return self.log.read_text()

    def raw(self, hello: bool = True) -> RawConn:
        return RawConn(self.socket, hello=hello)


class RawConn:
    """A blocking protocol connection for tests that send exactly the bytes they want."""

    def __init__(self, path: str, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.buf = b""
        if hello:
            assert self.call({"id": 0, "op": "hello", "protocol": 1, "client": "test"})["ok"]

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> dict[str, Any] | None:
        """The next reply frame, or None if the daemon closed the connection."""
        while len(self.buf) < HEADER.size or len(self.buf) < HEADER.size + HEADER.unpack_from(self.buf)[0]:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk
        (n,) = HEADER.unpack_from(self.buf)
        payload, self.buf = self.buf[HEADER.size : HEADER.size + n], self.buf[HEADER.size + n :]
        return decode_payload(payload)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(encode_frame(msg))
        reply = self.recv()
        assert reply is not None, "daemon closed the connection"
        return reply

    def close(self) -> None:
        self.sock.close()


async def no_leases(c: Any) -> bool:
    """For eventually(): the daemon holds no lease (a Client's view)."""
    return bool((await c.status())["leases"] == 0)


async def eventually(check: Any, timeout: float = 10.0, interval: float = 0.05) -> None:
    """Poll the coroutine function ``check`` until it returns something true; fail after
    ``timeout`` seconds (for effects the daemon applies asynchronously)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


def wait_until(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05) -> None:
    """eventually() for sync tests: poll the plain function ``check`` until it returns
    something true; fail after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def write_config(path: Path, sock: str, budget: str, models: dict[str, Path | None], extra_daemon: dict[str, Any] | None = None,
                 budgets: dict[str, str] | None = None, **model_opts: Any) -> None:
    # A model without a path is given its shards in model_opts.
    entries = [{"name": name, **({"path": str(p)} if p else {}), **model_opts.get(name, {})} for name, p in models.items()]
    daemon = {"log_level": "debug", "shutdown_grace_s": 2, **(extra_daemon or {})}
    path.write_text(config_text(sock, {"cpu": budget, **(budgets or {})}, entries, daemon))


@contextlib.asynccontextmanager
async def daemon_in_process(tmp_path: Path, models: dict[str, Path | None], prepare: Callable[[Any], None] | None = None,
                            *, budget: str = "20MiB", extra_daemon: dict[str, Any] | None = None,
                            **model_opts: Any) -> AsyncIterator[Any]:
    """A daemon in the test's own event loop, for a test that holds one of its steps on
    an event it sets itself (a daemon process offers no such hook): ``prepare(daemon)``
    runs between building it and ``start()``. Yields the started ``Daemon``; stops it
    after. ``start()`` returns in well under a second: 30 s means it waited on a held step.
    ``budget`` and ``extra_daemon`` as for ``start_daemon``."""
    from weightcache.config import load_settings
    from weightcache.server.main import build

    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    cfg = tmp_path / "inproc.toml"
    write_config(cfg, os.path.join(sockdir, "d.sock"), budget, models, extra_daemon, **model_opts)
    daemon = build(load_settings(cfg), str(cfg))
    if prepare is not None:
        prepare(daemon)
    serving = None
    try:
        try:
            async with asyncio.timeout(30):
                await daemon.start()
        except TimeoutError:
            pytest.fail("Daemon.start() did not return in 30 s: it waited on a step the test holds")
        serving = asyncio.ensure_future(daemon.serve())
        yield daemon
    finally:
        daemon.request_stop("test over")
        if serving is not None:
            await serving
        shutil.rmtree(sockdir, ignore_errors=True)


class FillGate:
    """Holds a ``daemon_in_process``'s fills mid-read, for a test that acts while a load
    provably runs (truncates its file, drops its requester): from the first chunk a fill
    thread reports (its bytes written, ``reached`` set), every report blocks until
    ``release()``, so at most ``load_threads`` chunks are done while held (a fast machine
    reading holes at GB/s used to finish before the test acted). Swaps the fill's
    Progress through ``monkeypatch``; release before the daemon stops (its shutdown
    waits for loads)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from weightcache.server.residency import fill

        self.reached = threading.Event()
        self.released = threading.Event()
        gate = self

        class HeldProgress(fill.Progress):  # type: ignore[misc]
            def add(self, n: int) -> None:
                super().add(n)
                gate.reached.set()
                if not gate.released.wait(60):
                    raise TimeoutError("FillGate never released")

        monkeypatch.setattr(fill, "Progress", HeldProgress)

    async def wait_reached(self, timeout: float = 30.0) -> None:
        async def reached() -> bool:
            return self.reached.is_set()

        await eventually(reached, timeout=timeout)

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``start_daemon(budget="20MiB", models={...})`` -> DaemonProc (stopped at teardown).
    ``budget`` is the cpu budget; ``budgets={"cuda:0": "2GiB"}`` adds other devices."""
    started: list[DaemonProc] = []
    # Unix socket paths are limited to 107 bytes: keep them short, outside tmp_path.
    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")

    def start(budget: str = "20MiB", models: dict[str, Path | None] | None = None, extra_daemon: dict[str, Any] | None = None,
              budgets: dict[str, str] | None = None, **model_opts: Any) -> DaemonProc:
        sock = os.path.join(sockdir, f"d{len(started)}.sock")
        cfg = tmp_path / f"daemon{len(started)}.toml"
        write_config(cfg, sock, budget, models or {}, extra_daemon, budgets, **model_opts)
        log = tmp_path / f"daemon{len(started)}.log"
        daemon = DaemonProcess(cfg, sock, log)
        try:
            daemon.start()
        finally:
            if daemon.proc is not None:  # teardown stops (and checks) it even if it never listened
                started.append(DaemonProc(socket=sock, config=cfg, proc=daemon.proc, log=log))
        return started[-1]

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
            try:
                d.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
                pytest.fail(f"daemon did not stop on SIGTERM; log:\n{d.log_text()[-3000:]}")
            assert d.proc.returncode == 0, f"daemon exited {d.proc.returncode} on SIGTERM:\n{d.log_text()[-3000:]}"
            assert not os.path.exists(d.socket), "daemon left its socket behind"
        text = d.log_text()
        if "Traceback" in text and not any(e in text for e in d.allowed_errors):
            pytest.fail(f"daemon logged an unexpected traceback:\n{text[-4000:]}")
    shutil.rmtree(sockdir, ignore_errors=True)
