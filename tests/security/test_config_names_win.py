"""Names in the config win: a tenant registers a name the operator is about to
add (open to the other tenants) and keeps one lease on it. At reload the config's model
was reported `kept` and never registered, and other tenants attaching the name got the
squatter's bytes. Now the name is claimed at reload: the reload reports it `pending` and
exits non-zero, nobody may attach the squatter's copy any more, and when its last lease
ends the config's model takes the name (config_models.py, Note [config names win])."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from helpers import NOBODY, as_uid, root_only

from weightcache import Client
from weightcache.cli import main

from ._util import OTHER, Conn, calls, code, held_as_uid, multi_tenant
from .test_tenants import TENANTS, _checkpoints, _register

pytestmark = root_only


def _attach_and_keep(path: str) -> Any:
    def fn(keep: list[Any]) -> dict[str, Any]:
        c = Conn(path)
        keep.append(c)  # the lease lives as long as this connection: until the block ends
        r = c.call({"id": 1, "op": "attach", "name": "llama"})
        for fd in c.take_fds():
            os.close(fd)
        return {"code": code(r), "fingerprint": (r or {}).get("fingerprint")}
    return fn


def test_a_config_name_displaces_a_squatter_once_its_leases_end(start_daemon, ckpts, capsys):
    d = multi_tenant(start_daemon, TENANTS, budget="64MiB")
    (squat,) = _checkpoints(1)
    got = as_uid(NOBODY, lambda: _register(d.socket, "llama", squat, allowed_uids=[NOBODY, OTHER]))
    assert "model" in got, got
    with held_as_uid(NOBODY, _attach_and_keep(d.socket)) as held:
        assert held["code"] is None and held["fingerprint"].startswith(f"uid{NOBODY}:"), held
        # The operator adds the name, open to every tenant.
        d.config.write_text(d.config.read_text() + f'\n[[models]]\nname = "llama"\npath = "{ckpts["a"]}"\n')
        capsys.readouterr()
        assert main(["--socket", d.socket, "reload"]) == 1  # the config's model is not serving yet
        out = capsys.readouterr().out
        assert "pending: llama: a model of that name registered by uid 65534 stays while" in out, out
        assert "kept" not in out
        # Nobody gets the squatter's bytes under the operator's name meanwhile.
        for uid in (OTHER, NOBODY):
            r = as_uid(uid, lambda: calls(d.socket, [{"id": 1, "op": "attach", "name": "llama"}]))[0]
            assert code(r) == "PERMISSION_DENIED" and r["error"].get("claimed") is True, (uid, r)
        r = calls(d.socket, [{"id": 1, "op": "attach", "name": "llama"}])[0]  # root too: those are not its bytes
        assert code(r) == "PERMISSION_DENIED", r
    # The squatter's connection closed: its lease ended, and the config's model took the name.

    async def owner_and_attach() -> tuple[Any, str]:
        async with Client(d.socket) as c:
            deadline = time.monotonic() + 60
            while True:
                m = next((m for m in await c.models() if m["name"] == "llama"), None)
                if m is not None and m["owner"] is None:
                    break
                assert time.monotonic() < deadline, f"the config's model never took the name: {m}"
                await asyncio.sleep(0.05)
            async with c.attach("llama") as w:
                return m["owner"], w.fingerprint

    owner, fp = asyncio.run(owner_and_attach())
    assert owner is None and not fp.startswith("uid"), fp
    r = as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "attach", "name": "llama"}]))[0]
    assert code(r) is None and r["fingerprint"] == fp  # the operator's bytes, for every tenant
    assert "the config's model takes the name" in d.log_text()
    # The squatter cannot take it back.
    got = as_uid(NOBODY, lambda: _register(d.socket, "llama", squat))
    assert got.get("code") in ("BAD_REQUEST", "PERMISSION_DENIED"), got
