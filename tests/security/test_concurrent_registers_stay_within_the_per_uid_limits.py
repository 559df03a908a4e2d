"""Every per-uid limit is reserved atomically before the first await. A
register checked max_files_per_uid before it parsed the header (``await check_files``)
and never again, and checked max_models_per_uid before and after. So a tenant's
concurrent registers all passed the file limit (16 registers of one file each under a
limit of 4: all 16 held), and every one over the model limit parsed its header before
it was refused. Now both are reserved before the parse and returned on every failure."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from helpers import NOBODY, as_uid, root_only

from ._util import Conn, code, multi_tenant, public_dir
from .test_tenants import TENANTS, _checkpoints

pytestmark = root_only

N = 16  # under max_requests_per_connection (32): all in flight at once


def _register_msg(rid: int, name: str, path: str) -> dict[str, Any]:
    return {"id": rid, "op": "register", "name": name, "path": path, "device": "cpu", "files": [[path]], "fds": 1}


def _concurrent_registers(sock: str, path: str, prefix: str) -> list[str | None]:
    """N registers of ``path`` on one connection, all sent before any reply is read."""
    c = Conn(sock, timeout=60)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(N):
            c.send(_register_msg(10 + i, f"{prefix}{i}", path), fds=[fd])
        got: dict[int, str | None] = {}
        while len(got) < N:  # in the order they finish
            r = c.recv()
            assert r is not None, got
            got[r["id"]] = code(r)
        return [got[10 + i] for i in range(N)]
    finally:
        os.close(fd)
        c.close()


def _one(sock: str, rid: int, msg: dict[str, Any], path: str | None = None) -> str | None:
    c = Conn(sock, timeout=60)
    fd = os.open(path, os.O_RDONLY) if path is not None else None
    try:
        return code(c.call(msg, fds=None if fd is None else [fd]))
    finally:
        if fd is not None:
            os.close(fd)
        c.close()


def _owners(d: Any) -> dict[str, Any]:
    c = Conn(d.socket)
    try:
        models = c.call({"id": 1, "op": "models"})["models"]
        return {m["name"]: m.get("owner") for m in models}
    finally:
        c.close()


def test_concurrent_registers_cannot_pass_max_files_per_uid(start_daemon):
    (f,) = _checkpoints(1, 64 * 1024)
    d = multi_tenant(start_daemon, {**TENANTS, "max_files_per_uid": 4})

    def tenant() -> dict[str, Any]:
        burst = _concurrent_registers(d.socket, f, "m")
        mine = sorted(f"m{i}" for i, c in enumerate(burst) if c is None)
        # the refused ones' reservations were all returned: once the held models go, 4 more fit
        gone = [_one(d.socket, 50 + i, {"id": 50 + i, "op": "unregister", "name": n}) for i, n in enumerate(mine)]
        again = [_one(d.socket, 70 + i, _register_msg(70 + i, f"again{i}", f), f) for i in range(5)]
        return {"burst": burst, "gone": gone, "again": again}

    got = as_uid(NOBODY, tenant, timeout=120)
    assert "burst" in got, got
    burst = got["burst"]
    # Before: all 16 registered (16 files held under a limit of 4).
    assert burst.count(None) <= 4, burst
    assert set(burst) <= {None, "LIMIT_EXCEEDED"} and burst.count(None) >= 1, burst
    assert set(got["gone"]) == {None}, got["gone"]
    assert got["again"] == [None] * 4 + ["LIMIT_EXCEEDED"], got["again"]
    held = [n for n, owner in _owners(d).items() if owner == NOBODY]
    assert sorted(held) == [f"again{i}" for i in range(4)], held


def _slow_bad_checkpoint() -> str:
    """A file whose header is refused only once all of it is parsed: 20,000 tensors, the
    last one's bytes past the end of the file (tens of ms of parsing in the io pool)."""
    path = public_dir("wcreg-") / "bad.safetensors"
    n = 20_000
    table: dict[str, Any] = {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)}
    table[f"t{n - 1}"]["data_offsets"] = [n - 1, n + 10]
    header = json.dumps(table).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * n)
    os.chmod(path, 0o644)
    return str(path)


def test_registers_over_max_models_per_uid_are_refused_before_any_parse(start_daemon):
    bad = _slow_bad_checkpoint()
    (good,) = _checkpoints(1, 64 * 1024)
    d = multi_tenant(start_daemon, {**TENANTS, "max_models_per_uid": 3})

    def tenant() -> dict[str, Any]:
        burst = _concurrent_registers(d.socket, bad, "bad")
        # every slot the failed registers reserved is back: 3 fit, the 4th does not
        after = [_one(d.socket, 70 + i, _register_msg(70 + i, f"ok{i}", good), good) for i in range(4)]
        return {"burst": burst, "after": after}

    got = as_uid(NOBODY, tenant, timeout=120)
    assert "burst" in got, got
    burst = got["burst"]
    parsed = [c for c in burst if c != "LIMIT_EXCEEDED"]
    # Before: all 16 parsed the 20,000-tensor header, each refused for it (none for the limit).
    assert len(parsed) <= 3, burst
    assert parsed and "LIMIT_EXCEEDED" not in parsed and None not in parsed, burst
    assert got["after"] == [None, None, None, "LIMIT_EXCEEDED"], got["after"]
