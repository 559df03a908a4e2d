"""A path swapped during a load is never served. The daemon parses a checkpoint's header,
waits for room, then reads the data: whatever the path points to by then must not be what
gets served. The data comes from the file that was parsed (or the load fails), never from
a file swapped in meanwhile."""

from __future__ import annotations

import os
import select

import pytest
import torch
from conftest import wait_until
from helpers import root_only
from safetensors.torch import save_file

from ._util import Conn, attached_bytes, code, write_checkpoint

pytestmark = root_only

N = 2 << 20  # 2 MiB tensor: with the 8 MiB filler attached it does not fit in 9 MiB


def _pair(tmp_path):
    roots = tmp_path / "models"
    roots.mkdir()
    private = tmp_path / "private"
    private.mkdir()
    bait = roots / "bait.safetensors"
    save_file({"w": torch.full((N,), 0x11, dtype=torch.uint8)}, str(bait))
    secret = private / "secret.safetensors"
    save_file({"w": torch.full((N,), 0x22, dtype=torch.uint8)}, str(secret))  # same header, same size
    os.chmod(secret, 0o600)
    st = os.stat(bait)
    os.utime(secret, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: stat cannot tell them apart
    link = roots / "current.safetensors"
    link.symlink_to(bait)
    return roots, bait, secret, link


@pytest.mark.parametrize("confined", [False, True], ids=["no-roots", "model-roots"])
def test_symlink_swapped_during_load_never_serves_the_other_file(start_daemon, tmp_path, confined):
    roots, _bait, secret, link = _pair(tmp_path)
    filler = write_checkpoint(roots / "filler.safetensors", 8 * 2**20, 20, seed=31)
    d = start_daemon(budget="9MiB", models={"filler": filler}, extra_daemon={"model_roots": [str(roots)]} if confined else None)
    holder = Conn(d.socket)
    c = Conn(d.socket)
    try:
        r = holder.call({"id": 1, "op": "attach", "name": "filler"})
        assert r["ok"], r
        holder.take_fds()
        assert c.call({"id": 2, "op": "register", "name": "victim", "path": str(link)})["ok"]
        c.send({"id": 3, "op": "attach", "name": "victim", "wait_s": 20})
        # The header is parsed and the load refused for room (filler is attached): it waits.
        wait_until(lambda: "load victim refused" in d.log_text())
        assert not select.select([c.sock], [], [], 0)[0], "the load did not wait for room: the test proves nothing"
        tmp = roots / "swap.tmp"
        tmp.symlink_to(secret)
        os.replace(tmp, link)  # atomic swap of the symlink
        assert holder.call({"id": 4, "op": "detach", "lease": r["lease"]})["ok"]
        reply = c.reply(3)
        assert reply is not None, "daemon closed the connection"
        if reply["ok"]:
            data = attached_bytes(reply, c.take_fds(), "w")
            assert data == b"\x11" * N, f"served bytes {data[:4]!r}... instead of the parsed file's"
        else:
            assert code(reply) in ("CORRUPT_CHECKPOINT", "LOAD_FAILED", "PERMISSION_DENIED"), reply
        # and a later attach never serves the swapped-in root-only file either
        again = c.call({"id": 5, "op": "attach", "name": "victim"})
        if again["ok"]:
            assert attached_bytes(again, c.take_fds(), "w") != b"\x22" * N, "served a file outside model_roots"
    finally:
        holder.close()
        c.close()


def _refused(c, rid: int, name: str, path: str) -> dict:
    """Register ``path``; refused then, or (the check may be at open time) its attach fails."""
    r = c.call({"id": rid, "op": "register", "name": name, "path": path})
    if r["ok"]:
        r = c.call({"id": rid + 100, "op": "attach", "name": name})
        for fd in c.take_fds():
            os.close(fd)
    return r


def test_follow_symlinks_false_refuses_a_symlinked_file(start_daemon, tmp_path):
    roots, bait, secret, link = _pair(tmp_path)
    d = start_daemon(extra_daemon={"model_roots": [str(roots)], "follow_symlinks": False})
    c = Conn(d.socket)
    try:
        ok = c.call({"id": 1, "op": "register", "name": "direct", "path": str(bait)})
        assert ok["ok"], ok  # control
        r = _refused(c, 2, "vialink", str(link))
        assert code(r) == "PERMISSION_DENIED", r
        # a symlink planted after registration is not followed at load time either
        os.unlink(bait)
        bait.symlink_to(secret)
        r3 = c.call({"id": 4, "op": "attach", "name": "direct"})
        assert code(r3) in ("PERMISSION_DENIED", "LOAD_FAILED"), r3
    finally:
        c.close()


def test_follow_symlinks_false_refuses_symlinked_directory_components(start_daemon, tmp_path):
    roots, _bait, _secret, _link = _pair(tmp_path)
    (roots / "dirlink").symlink_to(roots)
    d = start_daemon(extra_daemon={"follow_symlinks": False})
    c = Conn(d.socket)
    try:
        r = _refused(c, 2, "viadir", str(roots / "dirlink" / "bait.safetensors"))
        assert code(r) == "PERMISSION_DENIED", r
    finally:
        c.close()
