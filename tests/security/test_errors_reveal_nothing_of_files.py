"""Errors and listings reveal nothing of files: a tenant must learn nothing about files
through errors, `models` or `health`: not their existence, size, first bytes, or paths."""

from __future__ import annotations

import json
import os
import struct
import time

from helpers import NOBODY, as_uid, root_only

from ._util import calls, code, multi_tenant, raw_safetensors, write_checkpoint

pytestmark = root_only

SECRET_DIR = "s3cr3t-layout"


def _shadow_numbers() -> list[str]:
    st = os.stat("/etc/shadow")
    with open("/etc/shadow", "rb") as f:
        head = f.read(8)
    nums = {str(st.st_size)}
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        nums |= {str(n), hex(n), str(n + 8)}
    return sorted(nums)


def test_register_is_not_a_file_oracle(start_daemon, tmp_path):
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY]})
    probes = {"shadow": "/etc/shadow", "missing": "/nonexistent/x.safetensors", "dir": "/etc"}

    def tenant():
        out = {}
        for i, (k, p) in enumerate(probes.items()):
            out[k] = calls(d.socket, [{"id": 10 + i, "op": "register", "name": f"p-{k}", "path": p},
                                      {"id": 20 + i, "op": "attach", "name": f"p-{k}"}])
        return out

    got = as_uid(NOBODY, tenant)
    assert "shadow" in got, got
    text = json.dumps(got)
    for n in _shadow_numbers():
        assert n not in text, f"a number derived from /etc/shadow ({n}) reached the tenant: {text[:1500]}"
    for k, (reg, att) in got.items():
        assert code(reg) == "PERMISSION_DENIED", (k, reg)
        assert code(att) == "UNKNOWN_MODEL", (k, att)
    # the refusals cannot tell an existing file from a missing one or a directory
    norm = {k: reg["error"]["message"].replace(probes[k], "<p>").replace(f"p-{k}", "<n>") for k, (reg, _att) in got.items()}
    assert len(set(norm.values())) == 1, norm


def _broken(tmp_path):
    secret = tmp_path / SECRET_DIR
    secret.mkdir()
    corrupt = raw_safetensors(secret / "corrupt.safetensors", '{"t": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}',
                              b"\0" * 10)  # truncated data
    missing = secret / "missing.safetensors"
    good = write_checkpoint(secret / "good.safetensors", 64 * 1024, 4, seed=41)
    return corrupt, missing, good


def test_non_admin_load_errors_hide_paths(start_daemon, tmp_path):
    corrupt, missing, _good = _broken(tmp_path)
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY]}, models={"corrupt": corrupt, "missing": missing})
    got = as_uid(NOBODY, lambda: {"r": calls(d.socket, [
        {"id": 2, "op": "attach", "name": "corrupt"}, {"id": 3, "op": "load", "name": "missing"},
        {"id": 4, "op": "load", "name": "corrupt"}, {"id": 5, "op": "attach", "name": "missing"}])})
    assert "r" in got, got
    a, b, c, e = got["r"]
    assert [code(x) for x in (a, b, c, e)] == ["CORRUPT_CHECKPOINT", "LOAD_FAILED", "CORRUPT_CHECKPOINT", "LOAD_FAILED"], got
    text = json.dumps(got)
    assert SECRET_DIR not in text and "corrupt.safetensors" not in text and "missing.safetensors" not in text, text
    # root (an admin) still gets the file in the error
    (r,) = calls(d.socket, [{"id": 2, "op": "attach", "name": "corrupt"}])
    assert code(r) == "CORRUPT_CHECKPOINT" and SECRET_DIR in json.dumps(r), r


def test_models_and_health_hide_paths_from_non_admins(start_daemon, tmp_path):
    corrupt, missing, good = _broken(tmp_path)
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY]}, models={"good": good, "missing": missing, "corrupt": corrupt},
                     good={"preload": True}, missing={"preload": True}, corrupt={"preload": True})
    deadline = time.monotonic() + 15
    while True:
        (h,) = calls(d.socket, [{"id": 2, "op": "health"}])
        if not h["preloading"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(h["failed_preloads"]) == {"missing", "corrupt"}, h
    assert SECRET_DIR in json.dumps(h["failed_preloads"]), h  # root sees the paths
    (rm,) = calls(d.socket, [{"id": 3, "op": "models"}])
    assert {m["name"]: m["path"] for m in rm["models"]}["good"] == str(good)

    got = as_uid(NOBODY, lambda: {"r": calls(d.socket, [{"id": 2, "op": "models"}, {"id": 3, "op": "health"},
                                                         {"id": 4, "op": "status"}])})
    assert "r" in got, got
    models, health, status = got["r"]
    assert models["ok"] and health["ok"] and status["ok"], got
    for m in models["models"]:
        assert m.get("path") is None, m
        assert SECRET_DIR not in json.dumps(m.get("last_error")), m
        if m["name"] != "good" and m.get("last_error") is not None:
            assert m["last_error"].get("code") in ("LOAD_FAILED", "CORRUPT_CHECKPOINT"), m
    assert set(health["failed_preloads"]) == {"missing", "corrupt"} and health["ready"] is False, health
    assert SECRET_DIR not in json.dumps(got), json.dumps(got)[:2000]


def test_non_admin_permission_errors_hide_paths(start_daemon, tmp_path):
    """A config model whose file was replaced by a symlink out of model_roots: the refusal
    (PERMISSION_DENIED from the loader) must not give a tenant the path or the roots."""
    roots = tmp_path / SECRET_DIR
    roots.mkdir()
    good = write_checkpoint(roots / "swapped.safetensors", 64 * 1024, 4, seed=42)
    outside = write_checkpoint(tmp_path / "outside-root" / "x.safetensors", 64 * 1024, 4, seed=43)
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY], "model_roots": [str(roots)]}, models={"swapped": good})
    os.unlink(good)
    good.symlink_to(outside)
    got = as_uid(NOBODY, lambda: {"r": calls(d.socket, [{"id": 2, "op": "attach", "name": "swapped"},
                                                        {"id": 3, "op": "models"}])})
    assert "r" in got, got
    att, _models = got["r"]
    assert not att["ok"], att
    text = json.dumps(got)
    assert SECRET_DIR not in text and "outside-root" not in text, text[:2000]
