"""With the default config (no model_roots, follow_symlinks = true) the
root daemon follows no symbolic link in a directory someone else can change."""

from __future__ import annotations

import os
import time
from typing import Any

from helpers import NOBODY, as_uid, root_only

from ._util import OTHER, Conn, attached_bytes, code, multi_tenant, public_dir, write_checkpoint
from .test_tenants import TENANTS

pytestmark = root_only


def test_a_tenant_cannot_point_a_configured_model_at_another_tenants_file(start_daemon):
    """The operator configures a model whose file lies in tenant A's directory. A swapped
    the file for a symlink to tenant B's 0600 file and attached: the staleness check saw
    a changed file, dropped the copy, reloaded as root through the link, and A read B's
    bytes. Now the reload refuses the link (A's directory is A's to change), and the
    start says the directory is not the operator's alone."""
    a_dir = public_dir("wcdirA-")
    os.chown(a_dir, NOBODY, NOBODY)
    b_dir = public_dir("wcdirB-")
    model = write_checkpoint(a_dir / "m.safetensors", 64 * 1024, 4, seed=1)
    secret = write_checkpoint(b_dir / "secret.safetensors", 64 * 1024, 4, seed=2)
    os.chmod(model, 0o644)
    os.chown(secret, OTHER, OTHER)
    os.chmod(secret, 0o600)
    raw = secret.read_bytes()
    secret_data = raw[8 + int.from_bytes(raw[:8], "little"):][:4096]  # its first tensor's first bytes
    d = multi_tenant(start_daemon, TENANTS, budget="16MiB", models={"m": model})
    # The start checks the configured paths behind the socket (Daemon.start): it may say
    # so a moment after the daemon serves, before anyone loads the model.
    deadline = time.monotonic() + 30
    while "is not the operator's alone" not in d.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "is not the operator's alone" in d.log_text() and str(a_dir) in d.log_text()
    c = Conn(d.socket)
    r = c.call({"id": 1, "op": "load", "name": "m"})
    c.close()
    assert r is not None and r["ok"], r  # A's own file, not through a link: served (copied, cpu.py says why)

    def swap_and_attach() -> dict[str, Any]:
        tmp = a_dir / "m.tmp"
        os.symlink(secret, tmp)
        os.replace(tmp, a_dir / "m.safetensors")
        c = Conn(d.socket, timeout=60)
        try:
            r = c.call({"id": 2, "op": "attach", "name": "m"})
            fds = c.take_fds()
            if r is not None and r.get("ok"):
                data = attached_bytes(r, fds)
                return {"ok": True, "secret": secret_data in data}
            return {"code": code(r)}
        finally:
            c.close()

    got = as_uid(NOBODY, swap_and_attach)
    assert got.get("code") in ("PERMISSION_DENIED", "LOAD_FAILED"), got
    assert "symbolic link in" in d.log_text(), d.log_text()[-2000:]


def test_links_in_directories_only_root_can_change_are_still_followed(start_daemon):
    """The safe default costs the operator nothing where the directories are root's (a
    Hugging Face cache's snapshot links, say)."""
    pub = public_dir("wclinks-")
    real = write_checkpoint(pub / "blob", 64 * 1024, 4, seed=3)
    os.chmod(real, 0o644)
    os.symlink(real, pub / "m.safetensors")
    d = multi_tenant(start_daemon, TENANTS, budget="16MiB", models={"m": pub / "m.safetensors"})
    c = Conn(d.socket)
    r = c.call({"id": 1, "op": "load", "name": "m"})
    c.close()
    assert r is not None and r["ok"], r
    assert "is not the operator's alone" not in d.log_text()
