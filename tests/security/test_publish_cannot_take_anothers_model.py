"""Publish must not let a tenant replace or impersonate models that are not its own."""

from __future__ import annotations

import asyncio

from helpers import NOBODY, as_uid, root_only
from safetensors.torch import load_file

from ._util import (
    OTHER,
    Conn,
    attached_bytes,
    calls,
    multi_tenant,
    publish_msg,
    sealed_memfd,
)

pytestmark = root_only


def _tensors(v: int):
    import torch

    return {"w": torch.full((4096,), v, dtype=torch.uint8), "b": torch.arange(64, dtype=torch.int32) * v}


def _publish(path: str, name: str, v: int, fingerprint: str, replace: bool = False) -> dict:
    """In a child: publish with the real client; returns the model entry or the error."""
    from weightcache import Client

    async def go():
        async with Client(path) as c:
            try:
                return {"model": await c.publish(name, _tensors(v), fingerprint=fingerprint, replace=replace)}
            except Exception as exc:
                return {"code": getattr(exc, "code", None), "error": f"{type(exc).__name__}: {exc}"}

    return asyncio.run(go())


def _root_attach(path: str, name: str, tensor: str) -> tuple[dict, bytes | None]:
    c = Conn(path)
    try:
        r = c.call({"id": 7, "op": "attach", "name": name})
        return r, (attached_bytes(r, c.take_fds(), tensor) if r and r.get("ok") else None)
    finally:
        c.close()


def _entry(path: str, name: str) -> dict | None:
    (r,) = calls(path, [{"id": 3, "op": "models"}])
    return next((m for m in r["models"] if m["name"] == name), None)


def test_publish_cannot_replace_a_config_model(start_daemon, ckpts):
    d = multi_tenant(start_daemon, models={"victim": ckpts["tiny"]}, victim={"pin": True})
    assert calls(d.socket, [{"id": 2, "op": "load", "name": "victim"}])[0]["ok"]
    original = load_file(str(ckpts["tiny"]))
    first = next(iter(original))

    def tenant():
        # no fds at all: must fail before anything is unregistered
        nofd = calls(d.socket, [publish_msg(2, "victim", [["x", "U8", [1], 0, 1]], 4096, replace=True, nfds=0)])
        real = _publish(d.socket, "victim", 7, "evil", replace=True)
        return {"nofd": nofd, "real": real}

    got = as_uid(NOBODY, tenant)
    assert "nofd" in got, got
    assert got["nofd"][0] is not None and not got["nofd"][0]["ok"], got["nofd"]
    assert got["real"].get("code") == "PERMISSION_DENIED", got["real"]
    e = _entry(d.socket, "victim")
    assert e is not None and e["pinned"] and e["state"] == "resident", e
    r, data = _root_attach(d.socket, "victim", first)
    assert r["ok"], r
    import torch

    assert data == original[first].contiguous().view(-1).view(torch.uint8).numpy().tobytes(), "victim's bytes changed"


def test_published_fingerprint_is_bound_to_the_publisher(start_daemon, ckpts):
    d = multi_tenant(start_daemon, models={"src": ckpts["tiny"]})
    (r,) = calls(d.socket, [{"id": 2, "op": "load", "name": "src"}])
    fp = r["model"]["fingerprint"]
    assert fp
    got = as_uid(NOBODY, lambda: _publish(d.socket, "lookalike", 3, fp))
    assert "model" in got, got
    assert got["model"]["fingerprint"] != fp, "a tenant claimed another model's fingerprint"
    r2, _ = _root_attach(d.socket, "lookalike", "w")
    assert r2["ok"] and r2["fingerprint"] != fp and r2["fingerprint"] == got["model"]["fingerprint"], r2


def test_only_the_owner_replaces_a_published_model(start_daemon):
    d = multi_tenant(start_daemon)
    got = as_uid(NOBODY, lambda: _publish(d.socket, "shared", 1, "v1"))
    assert "model" in got, got
    other = as_uid(OTHER, lambda: _publish(d.socket, "shared", 2, "v2", replace=True))
    assert other.get("code") == "PERMISSION_DENIED", other
    r, data = _root_attach(d.socket, "shared", "w")
    assert r["ok"] and data == b"\x01" * 4096, r

    def owner():
        ok = _publish(d.socket, "shared", 3, "v3", replace=True)
        # failed replaces: a bad table (validated first), then missing fds (fails after validation)
        bad_table = calls(d.socket, [publish_msg(4, "shared", [["x", "U8", [2], 0, 1]], 4096, replace=True, nfds=0)])
        fd = sealed_memfd(b"\x09" * 4096)
        c = Conn(d.socket)
        try:
            bad_seal = c.call(publish_msg(5, "shared", [["x", "U8", [1], 0, 1]], 1 << 30, replace=True), fds=[fd])
        finally:
            c.close()
            import os

            os.close(fd)
        nofd = calls(d.socket, [publish_msg(6, "shared", [["x", "U8", [1], 0, 1]], 4096, replace=True, nfds=0)])
        return {"ok": ok, "bad": [bad_table[0], bad_seal, nofd[0]]}

    got = as_uid(NOBODY, owner)
    assert "model" in got.get("ok", {}), got
    assert all(b is not None and not b["ok"] for b in got["bad"]), got["bad"]
    r, data = _root_attach(d.socket, "shared", "w")
    assert r is not None and r["ok"] and data == b"\x03" * 4096, (r, data and data[:4])
