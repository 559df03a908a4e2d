"""A tenant's models never pass for the operator's: its broken preload does not take the
node out of readiness, its bytes never carry a config model's fingerprint, and a name
it took first does not keep the operator's model out once the config adds it (found
once tenant_register let tenants register by fds)."""

from __future__ import annotations

import asyncio
import os
import time

from conftest import wait_until
from helpers import NOBODY, as_uid, root_only
from safetensors.torch import save_file

from ._util import (
    Conn,
    calls,
    config_text,
    multi_tenant,
    public_dir,
    raw_safetensors,
    synth_tensors,
    write_checkpoint,
)

pytestmark = root_only


def _register_by_fds(path: str, name: str, files: list[str], preload: bool = False) -> dict:
    from weightcache import Client

    async def go():
        async with Client(path) as c:
            try:
                return {"model": await c.register(name, files[0], preload=preload, send_files=True)}
            except Exception as exc:
                return {"code": getattr(exc, "code", None), "error": f"{type(exc).__name__}: {exc}"}

    return asyncio.run(go())


def test_tenant_preload_cannot_make_the_daemon_unready(start_daemon, tmp_path, ckpts):
    """health.ready gates readiness probes (a DaemonSet rollout): a tenant's own broken
    preload must not take the node's daemon out of service."""
    pub = public_dir()
    broken = raw_safetensors(pub / "broken.safetensors", '{"t": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}', b"\0")
    os.chmod(broken, 0o644)
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY], "tenant_register": True}, models={"tiny": ckpts["tiny"]},
                     tiny={"preload": True})
    deadline = time.monotonic() + 10
    while calls(d.socket, [{"id": 1, "op": "health"}])[0]["preloading"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls(d.socket, [{"id": 1, "op": "health"}])[0]["ready"] is True
    got = as_uid(NOBODY, lambda: _register_by_fds(d.socket, "mine", [str(broken)], preload=True))
    if "model" in got:  # accepted: health is read once its preload is over (failed, or loaded after all)
        wait_until(lambda: any(m["name"].endswith("mine") and m["state"] in ("error", "resident")
                               for m in calls(d.socket, [{"id": 3, "op": "models"}])[0]["models"]))
    (h,) = calls(d.socket, [{"id": 2, "op": "health"}])
    if "model" in got:  # accepted: its failure must not count against the daemon's readiness
        assert h["ready"] is True, f"a tenant's broken preload made the daemon unready: {h}"
    else:  # refused: tenants may not register here, or register checks the header first
        assert got.get("code") in ("PERMISSION_DENIED", "CORRUPT_CHECKPOINT"), got
        assert h["ready"] is True, h


def test_tenant_registered_model_cannot_claim_a_config_models_fingerprint(start_daemon, tmp_path):
    """The fingerprint of a checkpoint is sha256(file name, size, header): a tenant who
    knows a public model's header registers a same-sized file with other bytes (a backdoor)
    under the same file name, by fds. Its fingerprint must not be the genuine one."""
    genuine_dir = tmp_path / "models"
    genuine = write_checkpoint(genuine_dir / "model.safetensors", 64 * 1024, 4, seed=61)
    pub = public_dir()
    fake = pub / "model.safetensors"
    tensors = synth_tensors(64 * 1024, 4, seed=61)
    save_file({k: -v for k, v in tensors.items()}, str(fake), metadata={"format": "pt"})  # same header, other bytes
    os.chmod(fake, 0o644)
    assert fake.stat().st_size == genuine.stat().st_size and fake.read_bytes() != genuine.read_bytes()
    d = multi_tenant(start_daemon, {"allowed_uids": [0, NOBODY], "tenant_register": True}, models={"genuine": genuine})
    (r,) = calls(d.socket, [{"id": 1, "op": "load", "name": "genuine"}])
    fp = r["model"]["fingerprint"]
    got = as_uid(NOBODY, lambda: _register_by_fds(d.socket, "genuine-fast", [str(fake)]))
    assert "model" in got, got
    c = Conn(d.socket)
    try:
        r2 = c.call({"id": 2, "op": "attach", "name": "genuine-fast"})
        for fd in c.take_fds():
            os.close(fd)
        assert r2["ok"], r2
        assert r2["fingerprint"] != fp, "a tenant's different bytes carry the operator model's fingerprint"
    finally:
        c.close()


def test_tenant_cannot_squat_a_name_the_operator_adds_later(start_daemon, tmp_path, ckpts):
    """A tenant publishes under a name before the operator adds that name to the config
    and reloads (SIGHUP): engines that attach the operator's name must then get the
    operator's checkpoint, not the tenant's bytes."""
    d = multi_tenant(start_daemon, models={"tiny": ckpts["tiny"]})

    def tenant():
        import torch

        from weightcache import Client

        async def go():
            async with Client(d.socket) as c:
                return {"model": await c.publish("llama-next", {"w": torch.full((4096,), 0x66, dtype=torch.uint8)},
                                                 fingerprint="whatever")}

        return asyncio.run(go())

    got = as_uid(NOBODY, tenant)
    assert "model" in got, got

    text = d.config.read_text()
    sock_line = next(line for line in text.splitlines() if line.startswith("socket"))
    sock = sock_line.split("=", 1)[1].strip().strip('"')
    extra = {"socket_mode": 0o666, "allowed_uids": [0, NOBODY, 65533], "log_level": "debug", "shutdown_grace_s": 2}
    d.config.write_text(config_text(sock, {"cpu": "20MiB"}, [{"name": "tiny", "path": str(ckpts["tiny"])},
                                                           {"name": "llama-next", "path": str(ckpts["a"])}], extra))
    (rep,) = calls(d.socket, [{"id": 1, "op": "reload"}])
    assert rep["ok"], rep
    c = Conn(d.socket)
    try:
        r = c.call({"id": 2, "op": "attach", "name": "llama-next"})
        fds = c.take_fds()
        for fd in fds:
            os.close(fd)
        assert r["ok"], r
        names = [t[0] for t in r["tensors"]]
        assert names != ["w"], f"the operator's 'llama-next' is still the tenant's publish (reload report: {rep['report']})"
    finally:
        c.close()
