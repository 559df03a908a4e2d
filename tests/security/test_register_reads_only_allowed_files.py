"""Register reads only the files its caller may read: else it is a way to make the root
daemon read any file. By path it is admin-only; tenants (tenant_register = true) register
only by passing fds they opened themselves; admins are confined to model_roots."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from helpers import NOBODY, as_uid, root_only

from ._util import Conn, calls, code, config_text, multi_tenant, public_dir, write_checkpoint

pytestmark = root_only


def _secret(d: Path) -> Path:
    p = write_checkpoint(d / "secret.safetensors", 64 * 1024, 4, seed=21)
    os.chmod(p, 0o600)  # root-only
    return p


def test_register_by_path_is_admin_only(start_daemon, tmp_path):
    secret = _secret(tmp_path)
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY]})  # default admin settings
    got = as_uid(NOBODY, lambda: {"r": calls(d.socket, [
        {"id": 2, "op": "register", "name": "stolen", "path": str(secret)},
        {"id": 3, "op": "attach", "name": "stolen"},
        {"id": 4, "op": "load", "name": "stolen"},
    ])})
    assert "r" in got, got
    reg, att, load = got["r"]
    assert code(reg) == "PERMISSION_DENIED", reg
    assert code(att) == "UNKNOWN_MODEL" and code(load) == "UNKNOWN_MODEL", (att, load)
    # and root does not see it registered either
    (models,) = calls(d.socket, [{"id": 2, "op": "models"}])
    assert "stolen" not in [m["name"] for m in models["models"]]


def test_tenant_register_is_by_fds_only(start_daemon, tmp_path):
    pub = public_dir()
    public = write_checkpoint(pub / "public.safetensors", 64 * 1024, 4, seed=22)
    os.chmod(public, 0o644)
    secret = _secret(pub)  # readable directory, root-only file
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY], "tenant_register": True})

    def tenant():
        from weightcache import Client

        out = {"path": calls(d.socket, [{"id": 2, "op": "register", "name": "bypath", "path": str(public)},
                                        {"id": 3, "op": "register", "name": "bypath2", "path": str(secret)}])}

        async def via_fds(name, path):
            async with Client(d.socket) as c:
                try:
                    await c.register(name, path, send_files=True)
                except Exception as exc:
                    return {"exception": f"{type(exc).__name__}: {exc}", "code": getattr(exc, "code", None)}
                async with c.attach(name) as w:
                    return {"ok": True, "n": len(w)}

        out["secret"] = asyncio.run(via_fds("sneaky", secret))
        out["public"] = asyncio.run(via_fds("mine", public))
        out["after"] = calls(d.socket, [{"id": 4, "op": "attach", "name": "sneaky"}])
        return out

    got = as_uid(NOBODY, tenant)
    assert "path" in got, got
    assert [code(r) for r in got["path"]] == ["PERMISSION_DENIED", "PERMISSION_DENIED"], got["path"]
    # the root-only file: the tenant cannot open it, so it cannot register it
    sec = got["secret"]
    assert "exception" in sec and ("PermissionError" in sec["exception"] or sec["code"] == "PERMISSION_DENIED"), sec
    assert code(got["after"][0]) == "UNKNOWN_MODEL", got["after"]
    # positive control: its own readable file works by fds
    assert got["public"] == {"ok": True, "n": 4}, got["public"]
    (models,) = calls(d.socket, [{"id": 2, "op": "models"}])
    names = [m["name"] for m in models["models"]]
    assert "bypath" not in names and "bypath2" not in names and "sneaky" not in names


def test_admin_register_confined_to_model_roots(start_daemon, tmp_path):
    roots = tmp_path / "models"
    inside = write_checkpoint(roots / "in.safetensors", 64 * 1024, 4, seed=23)
    outside = write_checkpoint(tmp_path / "elsewhere" / "out.safetensors", 64 * 1024, 4, seed=24)
    (roots / "escape.safetensors").symlink_to(outside)
    (roots / "sub").mkdir()
    d = start_daemon(extra_daemon={"model_roots": [str(roots)]})
    c = Conn(d.socket)
    try:
        assert c.call({"id": 2, "op": "register", "name": "in", "path": str(inside)})["ok"]
        tries = {
            "plain": str(outside),
            "dotdot": str(roots / "sub" / ".." / ".." / "elsewhere" / "out.safetensors"),
            "symlink": str(roots / "escape.safetensors"),
            "root-prefix": str(roots) + "-evil/x.safetensors",
            "shadow": "/etc/shadow",
        }
        got = {k: c.call({"id": 3, "op": "register", "name": f"o-{k}", "path": p}) for k, p in tries.items()}
        got["shards"] = c.call({"id": 4, "op": "register", "name": "o-shards",
                                "shards": [{"path": str(inside), "device": "cpu"}, {"path": str(outside), "device": "cpu"}]})
        assert {k: code(r) for k, r in got.items()} == dict.fromkeys(got, "PERMISSION_DENIED"), got
        names = [m["name"] for m in c.call({"id": 5, "op": "models"})["models"]]
        assert names == ["in"], names
    finally:
        c.close()


def test_config_model_outside_model_roots_refuses_to_start(tmp_path):
    roots = tmp_path / "models"
    roots.mkdir()
    outside = write_checkpoint(tmp_path / "elsewhere" / "out.safetensors", 64 * 1024, 4, seed=25)
    sock = os.path.join(tempfile.mkdtemp(prefix="wc-", dir="/tmp"), "s.sock")
    cfg = tmp_path / "c.toml"
    cfg.write_text(config_text(sock, {"cpu": "16MiB"}, [{"name": "escapee-model", "path": str(outside)}],
                               {"model_roots": [str(roots)]}))
    r = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "escapee-model" in r.stderr and str(roots) in r.stderr, r.stderr[-2000:]
    assert not os.path.exists(sock)
