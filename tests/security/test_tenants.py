"""Per-model access and per-tenant quotas, played by two real tenants: forked
children that drop to uid 65534 (NOBODY) and 65533 (OTHER). A model another tenant may
not use is refused PERMISSION_DENIED on every model op and is not named to it in
`models`, `status`, `health` or a NO_SPACE message; daemon-wide figures are the
administrators'; a tenant over its quota evicts its own
models first, else gets NO_SPACE naming the quota; reload changes both in place."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from helpers import NOBODY, as_uid, root_only

from weightcache.cli import main

from ._util import MIB, OTHER, Conn, calls, code, multi_tenant, public_dir, write_checkpoint

pytestmark = root_only

TENANTS = {"allowed_uids": [0, NOBODY, OTHER], "tenant_register": True}


def _ops_on(path: str, name: str) -> dict[str, Any]:
    """Every model op on ``name`` (and a look at what the peer is shown), as the caller."""
    c = Conn(path)
    try:
        out: dict[str, Any] = {}
        for i, (op, extra) in enumerate([("attach", {}), ("load", {}), ("load", {"keep_alive": 0}), ("evict", {}),
                                         ("pin", {}), ("unpin", {}), ("unregister", {})]):
            r = c.call({"id": i + 1, "op": op, "name": name, **extra})
            for fd in c.take_fds():
                os.close(fd)
            out[f"{op}{extra or ''}"] = [code(r), (r.get("error") or {}).get("message", "")]
        models = c.call({"id": 50, "op": "models"})
        status = c.call({"id": 51, "op": "status"})
        health = c.call({"id": 52, "op": "health"})
        out["models"] = [m["name"] for m in models["models"]]
        out["resident"] = [m["name"] for m in status["resident"]]
        out["loading"] = list(status["loading"])
        out["tenants"] = status["tenants"]
        out["daemon_wide"] = [status["connections"], status["leases"], status["counters"]]
        out["health"] = health
        return out
    finally:
        c.close()


def _register(path: str, name: str, file: str, **kw: Any) -> dict[str, Any]:
    from weightcache import Client

    async def go() -> dict[str, Any]:
        async with Client(path) as c:
            try:
                return {"model": await c.register(name, file, send_files=True, **kw)}
            except Exception as exc:
                return {"code": getattr(exc, "code", None), "error": str(exc)}

    return asyncio.run(go())


def _checkpoints(n: int, nbytes: int = MIB) -> list[str]:
    pub = public_dir()
    out = []
    for i in range(n):
        f = write_checkpoint(pub / f"t{i}.safetensors", nbytes, 4, seed=150 + i)
        os.chmod(f, 0o644)
        out.append(str(f))
    return out


def test_a_model_others_may_not_use_is_refused_and_not_shown_to_them(start_daemon, ckpts):
    d = multi_tenant(start_daemon, TENANTS, budget="12MiB", models={"theirs": ckpts["b"], "open": ckpts["a"]},
                     theirs={"allowed_uids": [NOBODY], "preload": True})
    allowed = as_uid(NOBODY, lambda: _ops_on(d.socket, "theirs"))
    # The allowed tenant: attach and load work; the admin ops stay the administrators'.
    assert allowed["attach"][0] is None and allowed["load"][0] is None, allowed
    assert "theirs" in allowed["models"] and "theirs" in allowed["resident"]
    denied = as_uid(OTHER, lambda: _ops_on(d.socket, "theirs"))
    ops = [k for k in denied if k not in ("models", "resident", "loading", "tenants", "health", "daemon_wide")]
    assert len(ops) == 7, ops
    for op in ops:
        got, message = denied[op]
        assert got == "PERMISSION_DENIED", (op, got, message)
        assert str(NOBODY) not in message, (op, message)  # who may use it is not said
    assert "theirs" not in denied["models"] and "open" in denied["models"]
    assert "theirs" not in denied["resident"] and "theirs" not in denied["health"]["preloading"]
    assert "theirs" not in denied["health"]["failed_preloads"]
    # An unknown name is UNKNOWN_MODEL: names are one namespace, which register would tell anyway.
    (r,) = as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "attach", "name": "no-such-model"}]))
    assert code(r) == "UNKNOWN_MODEL"
    # How many engines, leases, loads and evictions the daemon has is what the others do:
    # a tenant is not told; administrators are.
    assert denied["daemon_wide"] == [None, None, None] and allowed["daemon_wide"] == [None, None, None]
    (st,) = calls(d.socket, [{"id": 1, "op": "status"}])
    assert isinstance(st["connections"], int) and isinstance(st["leases"], int) and st["counters"]["loads"] >= 1
    # Administrators see and use everything.
    (r,) = calls(d.socket, [{"id": 1, "op": "models"}])
    assert {m["name"] for m in r["models"]} == {"theirs", "open"}
    assert next(m for m in r["models"] if m["name"] == "theirs")["allowed_uids"] == [NOBODY]


def test_no_space_does_not_name_models_the_requester_may_not_use(start_daemon, ckpts):
    d = multi_tenant(start_daemon, TENANTS, budget="12MiB", models={"secret": ckpts["b"], "open": ckpts["a"]},
                     secret={"allowed_uids": [NOBODY]})
    holder = Conn(d.socket)  # root keeps 'secret' attached: 8 MiB of 12 that nobody can evict
    try:
        r = holder.call({"id": 1, "op": "attach", "name": "secret"})
        assert r["ok"], r
        for fd in holder.take_fds():
            os.close(fd)
        (got,) = as_uid(OTHER, lambda: calls(d.socket, [{"id": 2, "op": "load", "name": "open"}]))
        assert code(got) == "NO_SPACE", got
        err = got["error"]
        assert "secret" not in err["message"], err["message"]
        assert "in 1 model(s) not available to you" in err["message"], err["message"]
        assert all(h["name"] != "secret" for h in err["holders"])
        (mine,) = as_uid(NOBODY, lambda: calls(d.socket, [{"id": 2, "op": "load", "name": "open"}]))
        assert "secret" in mine["error"]["message"]  # it may use it: it is told what holds the memory
    finally:
        holder.close()


def test_a_tenants_registered_model_is_its_own_unless_it_lists_others(start_daemon, capsys):
    priv, shared = _checkpoints(2, 64 * 1024)
    d = multi_tenant(start_daemon, TENANTS, budget="12MiB")
    assert "model" in as_uid(NOBODY, lambda: _register(d.socket, "priv", priv))
    got = as_uid(NOBODY, lambda: _register(d.socket, "shared", shared, allowed_uids=[OTHER]))
    assert got["model"]["allowed_uids"] == [OTHER], got
    other = as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "attach", "name": "priv"},
                                                   {"id": 2, "op": "attach", "name": "shared"},
                                                   {"id": 3, "op": "models"}]))
    assert code(other[0]) == "PERMISSION_DENIED" and code(other[1]) is None, other
    assert [m["name"] for m in other[2]["models"]] == ["shared"]
    assert code(as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "unregister", "name": "shared"}]))[0]) \
        == "PERMISSION_DENIED"  # using is not owning
    owner = as_uid(NOBODY, lambda: calls(d.socket, [{"id": 1, "op": "attach", "name": "priv"}, {"id": 2, "op": "models"}]))
    assert code(owner[0]) is None and {m["name"] for m in owner[1]["models"]} == {"priv", "shared"}
    # `weightcache ps` (an admin's) shows whose each resident model is.
    assert main(["--socket", d.socket, "ps"]) == 0
    out = capsys.readouterr().out
    assert "owner" in out and f"uid {NOBODY}" in out


def test_quota_evicts_the_tenants_own_models_first_then_refuses_naming_it(start_daemon):
    files = _checkpoints(4)
    d = multi_tenant(start_daemon, TENANTS, budget="64MiB")
    text = d.config.read_text()
    d.config.write_text(text + f'\n[quotas."uid:{NOBODY}"]\nbytes = {{ cpu = "2.5MiB" }}\npins = 1\n')
    (r,) = calls(d.socket, [{"id": 1, "op": "reload"}])
    assert f"uid:{NOBODY}" in r["report"]["quotas"], r
    assert "model" in as_uid(OTHER, lambda: _register(d.socket, "o1", files[3]))
    assert code(as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "load", "name": "o1"}]))[0]) is None
    for i in range(3):
        assert "model" in as_uid(NOBODY, lambda i=i: _register(d.socket, f"n{i}", files[i]))

    def tenant() -> dict[str, Any]:
        c = Conn(d.socket)
        try:
            out = {}
            for i in range(3):  # the third is over 2.5 MiB: n0, its own least recently used, goes
                out[f"load n{i}"] = code(c.call({"id": i + 1, "op": "load", "name": f"n{i}"}))
            out["states"] = {m["name"]: m["state"] for m in c.call({"id": 9, "op": "models"})["models"]}
            for i in (1, 2):  # held: nothing of its own is left to evict
                assert c.call({"id": 10 + i, "op": "attach", "name": f"n{i}"})["ok"]
            r = c.call({"id": 20, "op": "load", "name": "n0"})
            out["over"] = r["error"]
            out["tenants"] = c.call({"id": 21, "op": "status"})["tenants"]
            return out
        finally:
            c.close()

    got = as_uid(NOBODY, tenant)
    assert [got[f"load n{i}"] for i in range(3)] == [None, None, None], got
    assert got["states"] == {"n0": "evicted", "n1": "resident", "n2": "resident"}, got
    assert got["over"]["code"] == "NO_SPACE" and got["over"]["quota"] == f"uid:{NOBODY}", got["over"]
    assert f'quotas."uid:{NOBODY}".bytes' in got["over"]["message"]
    assert set(got["tenants"]) <= {f"uid:{NOBODY}", f"gid:{NOBODY}"}, got["tenants"]  # not the other tenant's
    usage = got["tenants"][f"uid:{NOBODY}"]
    assert usage["devices"]["cpu"]["quota"] == int(2.5 * MIB) and MIB * 2 <= usage["devices"]["cpu"]["used"] <= 2.5 * MIB
    # The other tenant's older model was not taken for this tenant's quota.
    (r,) = calls(d.socket, [{"id": 1, "op": "status"}])
    assert "o1" in [m["name"] for m in r["resident"]]
    assert set(r["tenants"]) >= {f"uid:{NOBODY}", f"uid:{OTHER}"}  # administrators see every tenant
    # Pins: under a pins quota the owner may pin its own models, up to the quota; an admin's
    # pins of its models count too. Without one, pinning stays the administrators'.
    pins = as_uid(NOBODY, lambda: calls(d.socket, [{"id": 1, "op": "pin", "name": "n1"},
                                                   {"id": 2, "op": "pin", "name": "n2"},
                                                   {"id": 3, "op": "pin", "name": "o1"},  # not its own
                                                   {"id": 4, "op": "unpin", "name": "n1"}]))
    assert [code(r) for r in pins] == [None, "NO_SPACE", "PERMISSION_DENIED", None], pins
    assert pins[1]["error"]["quota"] == f"uid:{NOBODY}" and f'quotas."uid:{NOBODY}".pins = 1' in pins[1]["error"]["message"]
    assert code(as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "pin", "name": "o1"}]))[0]) == "PERMISSION_DENIED"
    admin = calls(d.socket, [{"id": 1, "op": "pin", "name": "n2"}, {"id": 2, "op": "pin", "name": "n1"}])
    assert code(admin[0]) is None and code(admin[1]) == "NO_SPACE", admin
    # A raised quota applies at once, in place: the same load now fits.
    d.config.write_text(text + f'\n[quotas."uid:{NOBODY}"]\nbytes = {{ cpu = "10MiB" }}\n')
    assert calls(d.socket, [{"id": 1, "op": "reload"}])[0]["ok"]
    assert code(as_uid(NOBODY, lambda: calls(d.socket, [{"id": 1, "op": "load", "name": "n0"}]))[0]) is None


def test_reload_changes_who_may_use_a_model_in_place(start_daemon, ckpts):
    d = multi_tenant(start_daemon, TENANTS, budget="12MiB", models={"m": ckpts["tiny"]}, m={"allowed_uids": [NOBODY]})
    assert calls(d.socket, [{"id": 1, "op": "load", "name": "m"}])[0]["ok"]
    attach = [{"id": 1, "op": "attach", "name": "m"}]
    assert code(as_uid(OTHER, lambda: calls(d.socket, attach))[0]) == "PERMISSION_DENIED"
    config: Path = d.config
    config.write_text(config.read_text().replace(f"allowed_uids = [{NOBODY}]", f"allowed_uids = [{NOBODY}, {OTHER}]"))
    (r,) = calls(d.socket, [{"id": 1, "op": "reload"}])
    assert r["report"]["updated"] == ["m"], r
    assert code(as_uid(OTHER, lambda: calls(d.socket, attach))[0]) is None
    (r,) = calls(d.socket, [{"id": 1, "op": "models"}])
    assert r["models"][0]["state"] == "resident" and r["models"][0]["loads"] == 1  # not reloaded from disk
    config.write_text(config.read_text().replace(f"allowed_uids = [{NOBODY}, {OTHER}]", f"allowed_uids = [{OTHER}]"))
    assert calls(d.socket, [{"id": 1, "op": "reload"}])[0]["report"]["updated"] == ["m"]
    assert code(as_uid(NOBODY, lambda: calls(d.socket, attach))[0]) == "PERMISSION_DENIED"
