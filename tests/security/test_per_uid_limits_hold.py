"""Per-uid limits hold whatever a tenant does at once: concurrent publishes cannot pass
max_models_per_uid (each reserves its slot before its first await),
registrations by fds cannot make the daemon hold unbounded fds, and one tenant's
unfinished frames cannot use up the partial-frame budget of all."""

from __future__ import annotations

import os
import time
from typing import Any

from helpers import NOBODY, as_uid, root_only

from weightcache.protocol.framing import HEADER

from ._util import MIB, Conn, calls, code, held_as_uid, multi_tenant, nfds, public_dir, publish_msg, sealed_memfd, write_checkpoint
from .test_tenants import TENANTS

pytestmark = root_only


def test_concurrent_publishes_cannot_pass_max_models_per_uid(start_daemon):
    """120 concurrent publishes under max_models_per_uid = 4 all succeeded: the count was
    checked before two awaits (the table's validation, the fds' opening) and not held.
    Each passing publish now reserves its slot before its first await."""
    d = multi_tenant(start_daemon, {**TENANTS, "max_models_per_uid": 4}, budget="64MiB")

    def tenant() -> list[Any]:
        fd = sealed_memfd(b"\1" * 4096)
        conns = [Conn(d.socket, timeout=60) for _ in range(4)]
        try:
            n = 0
            for c in conns:  # 30 in flight per connection (max_requests_per_connection is 32)
                for _ in range(30):
                    c.send(publish_msg(100 + n, f"burst{n}", [["x", "U8", [1], 0, 1]], 4096), fds=[fd])
                    n += 1
            out = []
            for c in conns:  # replies come in the order the publishes end
                for _ in range(30):
                    r = c.recv()
                    while r is not None and "ok" not in r:  # an event
                        r = c.recv()
                    out.append(code(r))
            return out
        finally:
            os.close(fd)
            for c in conns:
                c.close()

    got = as_uid(NOBODY, tenant, timeout=120)
    assert len(got) == 120
    assert got.count(None) <= 4 and got.count("LIMIT_EXCEEDED") >= 116, sorted(set(got))
    c = Conn(d.socket)
    mine = [m for m in c.call({"id": 1, "op": "models"})["models"] if m["name"].startswith("burst")]
    c.close()
    assert len(mine) == got.count(None) <= 4, mine


def test_tenant_registrations_cannot_hold_unbounded_fds(start_daemon, tmp_path):
    """Each model registered by fds keeps its files open while registered: without a
    per-tenant limit a tenant makes the daemon hold any number of fds (and entries)."""
    pub = public_dir()
    f = write_checkpoint(pub / "m.safetensors", 4096, 1, seed=62)
    os.chmod(f, 0o644)
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY], "tenant_register": True})
    pid = d.proc.pid
    base = nfds(pid)
    n = 3000

    def tenant():
        c = Conn(d.socket, timeout=30)
        fd = os.open(f, os.O_RDONLY)
        ok = refused = 0
        try:
            for i in range(n):
                r = c.call({"id": i + 1, "op": "register", "name": f"r{i}", "path": "m.safetensors",
                            "files": [["m.safetensors"]], "fds": 1}, fds=[fd])
                if r is None:
                    break
                if r.get("ok"):
                    ok += 1
                else:
                    refused += 1
                    if refused > 20:
                        break
        finally:
            os.close(fd)
            c.close()
        return {"ok": ok, "refused": refused}

    got = as_uid(NOBODY, tenant, timeout=120)
    assert "ok" in got, got
    growth = nfds(pid) - base
    assert growth < 1024 + 64, f"a tenant made the daemon hold {growth} more fds ({got['ok']} registrations accepted)"
    assert code(calls(d.socket, [{"id": 1, "op": "status"}])[0]) is None


def test_one_tenant_cannot_use_up_the_partial_frame_budget_of_all(start_daemon):
    """max_partial_frame_bytes is one budget over every connection: a tenant that kept it
    full with frames it never finishes (each for frame_read_timeout_s, then again) made
    every other tenant's frame that arrives in more than one read fail (a publish table,
    a register of many files). max_partial_frame_bytes_per_uid gives each uid a share."""
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY], "max_partial_frame_bytes": 4 * MIB,
                                    "max_partial_frame_bytes_per_uid": 2 * MIB + MIB // 2,
                                    "max_frame_bytes": 2 * MIB, "hello_timeout_s": 30},
                     budget="64MiB")  # the 40k-tensor table's parse counts too (~14 MB: Note [held bytes])

    def hog(keep):
        for _ in range(2):  # the second passes the uid's share: refused, whatever the total
            c = Conn(d.socket)
            keep.append(c)
            try:
                c.sock.sendall(HEADER.pack(2 * MIB - 16) + b"\0" * (2 * MIB - 64 * 1024))
            except OSError:
                pass
        return {"held": len(keep)}

    n = 40_000  # a ~1 MB publish frame: it reaches the daemon in several reads
    fd = sealed_memfd(b"\x05", n * 256)
    table = [[f"t{i}", "U8", [1], i * 256, 1] for i in range(n)]
    try:
        with held_as_uid(NOBODY, hog) as got:
            assert got == {"held": 2}, got
            time.sleep(0.3)  # the daemon has read the hog's half frames before root's publish (nothing reports them)
            c = Conn(d.socket, timeout=30)
            try:
                r = c.call(publish_msg(1, "big-table", table, n * 256), fds=[fd])
            except OSError as exc:
                r = {"ok": False, "error": {"code": f"connection: {exc!r}"}}
            finally:
                c.close()
            assert r is not None and r["ok"], f"another tenant's unfinished frames made root's publish fail: {r}"
    finally:
        os.close(fd)
