"""A load waiting for room keeps its parse, and is woken only by a
detach that frees enough for it."""

from __future__ import annotations

import os
import time
from typing import Any

from helpers import NOBODY, root_only

from ._util import MIB, Conn, held_as_uid, multi_tenant, public_dir, write_checkpoint
from .test_tenants import TENANTS, _register

pytestmark = root_only


def _wait_for(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met within the timeout"
        time.sleep(0.05)


def test_parked_loads_are_not_woken_by_detaches_that_free_too_little(start_daemon):
    """A tenant parked 48 loads (wait_s = 50) over a file with a 2.2 MiB header while room
    was held: every detach, anyone's, woke each of them, and each re-opened and re-parsed
    its header in the shared io pool only to be refused again. Now a detach that frees too
    little wakes none of them, and the one that frees enough finds their parses kept."""
    pub = public_dir("wcpark-")
    files = {n: write_checkpoint(pub / f"{n}.safetensors", size * MIB, 4, seed=i)
             for i, (n, size) in enumerate([("a", 10), ("s", 1), ("p0", 7), ("p1", 7)])}
    for f in files.values():
        os.chmod(f, 0o644)
    d = multi_tenant(start_daemon, TENANTS, budget="16MiB", models={"a": files["a"], "s": files["s"]})
    holder = Conn(d.socket)
    assert holder.call({"id": 1, "op": "attach", "name": "a"})["ok"]
    for fd in holder.take_fds():
        os.close(fd)

    def park(keep: list[Any]) -> dict[str, Any]:
        for n in ("p0", "p1"):
            r = _register(d.socket, n, str(files[n]), allowed_uids=[NOBODY, 0])
            assert "model" in r, r
        c = Conn(d.socket, timeout=120)
        keep.append(c)
        for i, n in enumerate(("p0", "p1")):
            c.send({"id": 10 + i, "op": "load", "name": n, "wait_s": 50})
        return {"parked": True}

    with held_as_uid(NOBODY, park, timeout=120) as got:
        assert got == {"parked": True}, got
        _wait_for(lambda: all(f"load {n} refused" in d.log_text() for n in ("p0", "p1")))
        refused = {n: d.log_text().count(f"load {n} refused") for n in ("p0", "p1")}
        for i in range(20):  # each detach of s frees 1 MiB: p0 and p1 need 7, with 5 free
            r = holder.call({"id": 20 + i, "op": "attach", "name": "s"})
            assert r["ok"], r
            for fd in holder.take_fds():
                os.close(fd)
            assert holder.call({"id": 100 + i, "op": "detach", "lease": r["lease"]})["ok"]
        assert holder.call({"id": 200, "op": "status"})["ok"]  # every detach's wake-ups have run
        again = {n: d.log_text().count(f"load {n} refused") for n in ("p0", "p1")}
        # Before: one refused retry, with a fresh parse, per model per detach (20 more each).
        assert again == refused, (refused, again)
        assert "reusing the parse" not in d.log_text()
        assert holder.call({"id": 300, "op": "detach", "lease": 1})["ok"]  # a's 10 MiB: room for both
        c3 = Conn(d.socket)
        _wait_for(lambda: {m["name"]: m["state"] for m in c3.call({"id": 301, "op": "models"})["models"]}.get("p1")
                  == "resident" and {m["name"]: m["state"] for m in c3.call({"id": 302, "op": "models"})["models"]}
                  .get("p0") == "resident")
        c3.close()
        assert d.log_text().count("reusing the parse kept while it waited for room") >= 1
    holder.close()
