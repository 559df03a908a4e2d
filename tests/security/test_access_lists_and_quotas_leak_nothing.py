"""Per-model access lists and per-tenant quotas leak nothing: errors and
placements name no model the viewer may not use, a quota error does not tell what its
owner holds, and a tenant's files never share an arena with another name."""

from __future__ import annotations

import os
from typing import Any

from helpers import NOBODY, as_uid, root_only

from ._util import MIB, OTHER, Conn, calls, code, multi_tenant
from .test_tenants import TENANTS, _checkpoints, _register

pytestmark = root_only


def test_a_load_error_kept_in_models_does_not_name_models_the_viewer_may_not_use(start_daemon, ckpts):
    # NO_SPACE as the load's reply names only what the requester may use; the copy kept as
    # the model's last_error (shown by `models` to its owner) named every holder.
    (mine,) = _checkpoints(1, 8 * MIB)
    d = multi_tenant(start_daemon, TENANTS, budget="12MiB", models={"secret": ckpts["b"]}, secret={"allowed_uids": [NOBODY]})
    holder = Conn(d.socket)  # root keeps 'secret' attached: 8 MiB of 12 that nobody can evict
    try:
        r = holder.call({"id": 1, "op": "attach", "name": "secret"})
        assert r["ok"], r
        for fd in holder.take_fds():
            os.close(fd)

        def go() -> list[Any]:
            registered = _register(d.socket, "mine", mine)
            return [registered, *calls(d.socket, [{"id": 1, "op": "load", "name": "mine"}, {"id": 2, "op": "models"}])]

        registered, load, models = as_uid(OTHER, go)
        assert "model" in registered, registered
        assert code(load) == "NO_SPACE" and "secret" not in load["error"]["message"], load
        (m,) = [m for m in models["models"] if m["name"] == "mine"]
        err = m["last_error"]
        assert err is not None and err["code"] == "NO_SPACE", m
        assert "secret" not in str(err), err
        assert "8.0 MiB in 1 model(s) not available to you" in err["message"], err
        # An administrator is told everything.
        (models,) = calls(d.socket, [{"id": 3, "op": "models"}])
        assert "secret" in str(next(m for m in models["models"] if m["name"] == "mine")["last_error"])
    finally:
        holder.close()


def _placement_probe(start_daemon: Any, ckpts: Any) -> tuple[Any, list[Any]]:
    """'secret' (only NOBODY may use it) resident, unattached, in 8 MiB of 12; OTHER
    loads the open device = "auto" model 'pub', whose placement evicts 'secret': its
    replies to load, models and status."""
    d = multi_tenant(start_daemon, TENANTS, budget="12MiB", models={"secret": ckpts["b"], "pub": ckpts["a"]},
                     secret={"allowed_uids": [NOBODY]}, pub={"device": "auto"})
    (r,) = calls(d.socket, [{"id": 1, "op": "load", "name": "secret"}])
    assert r["ok"], r

    def go() -> list[Any]:
        c = Conn(d.socket)
        try:
            return [c.call({"id": 1, "op": "load", "name": "pub"}), c.call({"id": 2, "op": "models"}),
                    c.call({"id": 3, "op": "status"})]
        finally:
            c.close()

    return d, as_uid(OTHER, go)


def test_placement_in_models_does_not_name_models_the_viewer_may_not_use(start_daemon, ckpts):
    d, (load, models, _status) = _placement_probe(start_daemon, ckpts)
    assert load["ok"], load
    for pub in (load["model"], *[m for m in models["models"] if m["replica_of"] == "pub"]):
        assert pub["placement"]["reason"] == "evicts", pub
        assert "secret" not in str(pub["placement"]), pub["placement"]
        assert "1 model(s) not available to you" in pub["placement"]["detail"], pub["placement"]
    (admin,) = calls(d.socket, [{"id": 5, "op": "models"}])  # an administrator is told
    assert "secret" in str([m["placement"] for m in admin["models"] if m["replica_of"] == "pub"])


def test_placement_in_status_does_not_name_models_the_viewer_may_not_use(start_daemon, ckpts):
    _d, (_load, _models, status) = _placement_probe(start_daemon, ckpts)
    assert status["placement"]["pub"]["reason"] == "evicts", status["placement"]
    assert "secret" not in str(status["placement"]), status["placement"]


def test_a_quota_error_does_not_tell_another_tenant_what_the_owner_holds(start_daemon):
    priv, shared = _checkpoints(2, 2 * MIB)
    d = multi_tenant(start_daemon, TENANTS, budget="64MiB")
    d.config.write_text(d.config.read_text() + f'\n[quotas."uid:{NOBODY}"]\nbytes = {{ cpu = "3MiB" }}\npins = 1\n')
    (r,) = calls(d.socket, [{"id": 1, "op": "reload"}])
    assert f"uid:{NOBODY}" in r["report"]["quotas"], r

    def owner() -> list[Any]:  # a private model, loaded and pinned (within its pins quota), and one OTHER may use
        return [_register(d.socket, "priv", priv), _register(d.socket, "shared", shared, allowed_uids=[OTHER]),
                *calls(d.socket, [{"id": 1, "op": "load", "name": "priv"}, {"id": 2, "op": "pin", "name": "priv"}])]

    got = as_uid(NOBODY, owner)
    assert all(code(x) is None and "error" not in x for x in got), got
    (err,) = as_uid(OTHER, lambda: calls(d.socket, [{"id": 1, "op": "load", "name": "shared"}]))
    assert code(err) == "NO_SPACE", err
    assert "quota_used" not in err["error"] and "hold" not in err["error"]["message"], err["error"]


def test_a_tenants_files_never_share_an_arena_with_another_name(start_daemon):
    # A tenant's model is its own open files (register with fds): another name for the same
    # path, even an administrator's, gets its own arena, so it can neither lend the tenant's
    # bytes past its allowed_uids nor count them once against the tenant's quota.
    (f,) = _checkpoints(1, MIB)
    d = multi_tenant(start_daemon, TENANTS, budget="12MiB")
    assert "model" in as_uid(NOBODY, lambda: _register(d.socket, "mine", f))
    (r,) = calls(d.socket, [{"id": 1, "op": "register", "name": "alias", "path": f}])
    assert r["ok"], r
    (a, _b) = as_uid(NOBODY, lambda: calls(d.socket, [{"id": 1, "op": "load", "name": "mine"},
                                                      {"id": 2, "op": "load", "name": "mine"}]))
    (c, models) = calls(d.socket, [{"id": 3, "op": "load", "name": "alias"}, {"id": 4, "op": "models"}])
    assert a["ok"] and c["ok"], (a, c)
    by = {m["name"]: m for m in models["models"]}
    assert by["mine"]["shares_with"] == [] and by["alias"]["shares_with"] == [], by
    assert by["alias"]["loads"] == 1  # loaded from its files, not joined to the tenant's arena
