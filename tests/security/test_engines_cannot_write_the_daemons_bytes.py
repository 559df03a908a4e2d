"""An engine cannot change the bytes the daemon serves to every other engine.

On the CPU, a model the daemon copied (a file it may not serve from the page cache, a
published model) is a memfd. Every memfd an attach hands out carries F_SEAL_WRITE,
F_SEAL_SHRINK and F_SEAL_GROW, so that whoever holds the fd (any engine that attached
it) can neither map it writable and shared, nor write, truncate or grow it; an engine that
could would change the weights under every other engine attached to the same arena.
The fds are taken from the raw attach reply, as a hostile engine would hold them."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil

import pytest
import torch

from weightcache import SyncClient

from ._util import Conn

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def attached_memfds(sock: str, name: str) -> list[int]:
    """The memfds of one raw attach of ``name`` (other fds of the reply closed)."""
    c = Conn(sock)
    try:
        r = c.call({"id": 2, "op": "attach", "name": name})
        assert r is not None and r.get("ok"), r
        fds = c.take_fds()
        memfds = [fd for fd in fds if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")]
        for fd in set(fds) - set(memfds):
            os.close(fd)
        return memfds
    finally:
        c.close()


def test_every_attached_memfd_is_sealed_against_writes(start_daemon, ckpts, tmp_path):
    copied = tmp_path / "copied.safetensors"
    shutil.copy(ckpts["a"], copied)
    copied.chmod(0o664)  # writable by its group: the daemon copies it into a memfd
    d = start_daemon(budget="40MiB", models={"copied": copied})
    with SyncClient(d.socket) as c:
        c.publish("published", {"w": torch.arange(4096, dtype=torch.float32)}, fingerprint="sealed-test-v1")
    for name in ("copied", "published"):
        fds = attached_memfds(d.socket, name)
        assert fds, f"{name}: the attach handed out no memfd (the test would prove nothing)"
        try:
            for fd in fds:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                assert seals & SEALS == SEALS, f"{name}: seals {seals:#x}, want F_SEAL_WRITE|SHRINK|GROW"
                with pytest.raises(PermissionError) as shared_write:
                    mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                assert shared_write.value.errno == errno.EPERM
                with pytest.raises(PermissionError):
                    os.pwrite(fd, b"\0", 0)
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, 0)
        finally:
            for fd in fds:
                os.close(fd)
    with SyncClient(d.socket) as c, c.attach("published") as w:  # and the daemon still serves its bytes unchanged
        assert torch.equal(w["w"], torch.arange(4096, dtype=torch.float32))
