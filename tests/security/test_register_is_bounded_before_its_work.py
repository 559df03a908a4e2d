"""A tenant's register is bounded before the daemon reads its headers: one file sent as
many fds is refused as the same file, the headers of one checkpoint together are capped
from their length fields, and what the parse holds while it runs is charged to the
tenant's quota. Before, 32 fds of one file with a 16 MiB header made the daemon hold
+512 MiB and a 512 MiB memfd for the parse worker while the tenant's quota of 8 KiB
showed 0 used."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from helpers import NOBODY, as_uid, root_only

from weightcache.loader.checkpoint import MAX_CHECKPOINT_HEADER_BYTES, MAX_HEADER_BYTES

from ._util import MIB, Conn, calls, code, multi_tenant, public_dir, rss
from .test_tenants import TENANTS
from .test_what_a_model_holds_is_charged_and_released import header_bomb

pytestmark = root_only


def sparse_header(path: Path, n: int) -> Path:
    """A file whose length field says an ``n``-byte header that starts like JSON; the rest is
    a hole (no disk): what the daemon does before reading it is all that is tested."""
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + b"{")
        f.truncate(8 + n)
    os.chmod(path, 0o644)
    return path


def register_fds(sock: str, name: str, paths: list[str]) -> dict[str, Any] | None:
    """A raw register of ``paths`` as one rank's files, each opened by the caller."""
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    c = Conn(sock, timeout=120)
    try:
        return c.call({"id": 2, "op": "register", "name": name, "path": os.path.dirname(paths[0]),
                       "files": [[f"f{i}.safetensors" for i in range(len(fds))]], "fds": len(fds)}, fds)
    finally:
        c.close()
        for fd in fds:
            os.close(fd)


def test_one_file_sent_as_many_fds_is_refused_before_its_header_is_read(start_daemon):
    d = multi_tenant(start_daemon, TENANTS)
    big = str(sparse_header(public_dir("wcdup-") / "big.safetensors", MAX_HEADER_BYTES))
    before = rss(d.proc.pid)
    got = as_uid(NOBODY, lambda: {"r": register_fds(d.socket, "dup", [big] * 8)}, timeout=300)
    r = got["r"]
    assert code(r) == "CORRUPT_CHECKPOINT" and "the same file as" in r["error"]["message"], r
    # 16 bytes of each file were read, not 8 headers of 16 MiB
    assert rss(d.proc.pid) - before < 32 * MIB, (before, rss(d.proc.pid))
    (models,) = calls(d.socket, [{"id": 3, "op": "models"}])
    assert models is not None and models["models"] == [], models


def test_the_headers_of_one_checkpoint_are_capped_together_from_their_lengths(start_daemon):
    d = multi_tenant(start_daemon, TENANTS)
    pub = public_dir("wctotal-")
    n = MAX_CHECKPOINT_HEADER_BYTES // MAX_HEADER_BYTES + 1  # each under the cap of one file, together over
    paths = [str(sparse_header(pub / f"s{i}.safetensors", MAX_HEADER_BYTES)) for i in range(n)]
    before = rss(d.proc.pid)
    got = as_uid(NOBODY, lambda: {"r": register_fds(d.socket, "many", paths)}, timeout=300)
    r = got["r"]
    assert code(r) == "CORRUPT_CHECKPOINT" and f"{MAX_CHECKPOINT_HEADER_BYTES >> 20} MiB limit together" in r["error"]["message"], r
    assert rss(d.proc.pid) - before < 32 * MIB, (before, rss(d.proc.pid))


def test_a_register_parse_is_charged_to_the_tenants_quota(start_daemon):
    """The parse of a 100k-tensor header (~5 MiB) holds ~80 MiB while it runs: over a
    quota of 8 MiB, it is refused before any header is read, naming the quota; under a
    quota that holds it, the register works."""
    d = multi_tenant(start_daemon, TENANTS, budget="1GiB")
    plain = d.config.read_text()
    d.config.write_text(plain + f'\n[quotas."uid:{NOBODY}"]\nbytes = {{ cpu = "8MiB" }}\n')
    (r,) = calls(d.socket, [{"id": 1, "op": "reload"}])
    assert r is not None and r["ok"], r
    bomb = str(header_bomb(public_dir("wcparse-") / "bomb.safetensors"))
    got = as_uid(NOBODY, lambda: {"r": register_fds(d.socket, "hb", [bomb])}, timeout=300)
    r = got["r"]
    assert code(r) == "NO_SPACE" and r["error"]["quota"] == f"uid:{NOBODY}", r
    assert "parsing hb" in r["error"]["message"], r
    (st,) = calls(d.socket, [{"id": 2, "op": "status"}])
    assert st is not None and st["tenants"][f"uid:{NOBODY}"]["devices"]["cpu"]["used"] == 0, st  # released

    d.config.write_text(plain + f'\n[quotas."uid:{NOBODY}"]\nbytes = {{ cpu = "512MiB" }}\n')
    (r,) = calls(d.socket, [{"id": 3, "op": "reload"}])
    assert r is not None and r["ok"], r
    got = as_uid(NOBODY, lambda: {"r": register_fds(d.socket, "hb", [bomb])}, timeout=300)
    assert got["r"] is not None and got["r"]["ok"], got
