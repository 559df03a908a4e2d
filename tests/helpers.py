"""Plain functions shared by the integration tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from weightcache import Client

CHILD = str(Path(__file__).with_name("attach_child.py"))  # a stand-in engine process


def spawn_child(d, model, path, mode):
    return subprocess.Popen([sys.executable, CHILD, d.socket, model, str(path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


async def states(c: Client) -> dict[str, str]:
    return {m["name"]: m["state"] for m in await c.models()}


async def first(c: Client, key: str, value: object) -> bool:
    """Whether the first model's ``key`` has become ``value``."""
    return (await c.models())[0][key] == value


def skip_without_cuda() -> None:
    """Skip the caller (a test, a fixture, or a whole module at its top) unless cuda-bindings
    and a CUDA device are present: CI has no GPU."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings not installed")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)


def gpu_daemon(start_daemon: Any, budget: str, models: dict[str, Path], device: str = "cuda:0", daemon: dict[str, Any] | None = None,
               **opts: Any) -> Any:
    """A daemon with ``budget`` on ``device`` and every model placed there."""
    placed = {n: {"device": device, **opts.get(n, {})} for n in models}
    return start_daemon(budget="1GiB", models=models, extra_daemon=daemon, budgets={device: budget}, **placed)


NOBODY = 65534  # the untrusted peer of the multi-uid tests


def _checkout_readable_by_others() -> bool:
    """Whether a process of another uid can import weightcache from this checkout: every
    folder above it searchable by others (a clone under `mktemp -d`, mode 0700, is not)."""
    here = Path(__file__).resolve().parent
    return all(os.stat(d).st_mode & 0o001 for d in [here, *here.parents])


root_only = pytest.mark.skipif(
    os.geteuid() != 0 or not _checkout_readable_by_others(),
    reason="needs root to act as another uid, and a checkout other uids can read")


def _child_run(uid: int, fn: Callable[[], Any]) -> Any:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    return fn()


def as_uid(uid: int, fn: Callable[[], Any], timeout: float = 60) -> Any:
    """Run ``fn`` in a forked child that dropped to ``uid``; return its (JSON) result, or
    {"exception": repr} if it raised. The parent must not be running an event loop."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        out: Any = {}
        try:
            os.close(r)
            out = _child_run(uid, fn)
        except BaseException as exc:
            out = {"exception": repr(exc)}
        finally:
            try:
                data = json.dumps(out, default=repr).encode()
            except BaseException as exc:
                data = json.dumps({"exception": f"unserialisable result: {exc!r}"}).encode()
            os.write(w, data)
            os._exit(0)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise AssertionError(f"child as uid {uid} did not finish within {timeout}s")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            if not data:
                os.kill(pid, 9)
        os.waitpid(pid, 0)
    return json.loads(data)


def is_open(fd: int) -> bool:
    """Whether ``fd`` is still an open descriptor of this process."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def connect_until_admitted(path: str, timeout: float = 10.0) -> int:
    """Connect to the daemon at ``path``, say hello and ask for status, again while it
    refuses the connection (LIMIT_EXCEEDED, or closed before the hello was read), until
    ``timeout``; returns the attempts it took. For "the slot was given back": the daemon
    frees it once it has seen the close, which a fixed sleep could outrun on a loaded
    machine. Blocking and plain (usable in a child of ``as_uid``)."""
    import socket

    import msgpack

    from weightcache.protocol import encode_frame

    def reply(s: socket.socket) -> dict[str, Any] | None:
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            chunk = s.recv(1 << 16)
            if not chunk:
                return None
            buf += chunk
        return msgpack.unpackb(buf[4 : 4 + int.from_bytes(buf[:4], "big")], raw=False)

    deadline = time.monotonic() + timeout
    for attempt in itertools.count(1):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        try:
            s.connect(path)
            s.sendall(encode_frame({"id": 7, "op": "hello", "protocol": 1, "client": "test"}))
            got = reply(s)
            if got is not None and got.get("ok"):
                s.sendall(encode_frame({"id": 8, "op": "status"}))
                got = reply(s)
                assert got is not None and got.get("ok"), f"admitted, but status failed: {got}"
                return attempt
            if got is not None and (got.get("error") or {}).get("code") != "LIMIT_EXCEEDED":
                raise AssertionError(f"refused for another reason than the connection limit: {got}")
        except (BrokenPipeError, ConnectionResetError) as exc:  # refused and closed before the hello went out
            got = {"exception": repr(exc)}
        finally:
            s.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"no connection admitted within {timeout}s ({attempt} attempts); last: {got}")
        time.sleep(0.05)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def with_faked_driver(monkeypatch: pytest.MonkeyPatch, fake: Any, module: str, children: tuple[tuple[str, str], ...]) -> Any:
    """Imports ``module`` (weightcache.backends.X) with its driver calls made on ``fake``:
    cuda-bindings itself faked where it is absent, ``drv.current`` a no-op. The modules
    imported against the fake are dropped afterwards (``children``: (package, module)
    pairs), so that the tests that skip without CUDA still skip."""
    import importlib
    import types

    before = set(sys.modules)
    try:
        try:
            importlib.import_module("cuda.bindings.driver")
        except ImportError:
            pkg = types.ModuleType("cuda")
            bindings = types.ModuleType("cuda.bindings")
            driver = types.ModuleType("cuda.bindings.driver")
            driver.__dict__.update({k: getattr(fake, k) for k in dir(fake) if k.startswith(("cu", "CU"))})
            pkg.bindings, bindings.driver = bindings, driver  # type: ignore[attr-defined]
            for name, mod in (("cuda", pkg), ("cuda.bindings", bindings), ("cuda.bindings.driver", driver)):
                monkeypatch.setitem(sys.modules, name, mod)
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, "cu", fake)
        monkeypatch.setattr(mod.drv, "current", lambda ctx: contextlib.nullcontext())
        monkeypatch.setattr(mod.drv, "cu", fake)  # drv.check reads CUresult and the error's name from it
        yield mod
    finally:
        import weightcache
        import weightcache.backends

        owners = {"weightcache": weightcache, "weightcache.backends": weightcache.backends}
        for owner, child in children:
            name = f"{owner}.{child}"
            if name not in before and name in sys.modules:
                del sys.modules[name]
                if hasattr(owners[owner], child):
                    delattr(owners[owner], child)
