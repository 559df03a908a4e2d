"""docs/protocol.md says a client in another language can be written from it alone: the
reply fields it lists must be the ones the daemon sends. A new operator's read-through
found `models` entries with five fields the document did not name, and `pin`'s and
`reload`'s replies with keys it left out."""

from __future__ import annotations

import re
from pathlib import Path

from weightcache import Client

PROTOCOL = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text()


def documented(start: str, end: str) -> set[str]:
    """The quoted field names from ``start`` to the next ``end`` (the code's end)."""
    at = PROTOCOL.index(start)
    return set(re.findall(r'"([a-z_]+)"', PROTOCOL[at:PROTOCOL.index(end, at + len(start))]))


async def test_models_pin_and_reload_replies_carry_the_documented_fields(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        entry = (await c.models())[0]
        pinned = await c.request("pin", name="tiny")
        report = await c.reload()
    lease_fields = {"pid", "uid", "client", "since_s", "count"}
    assert set(entry) == documented('<- {"models": [{', "```") - {"models"} - lease_fields
    assert set(pinned) - {"id", "ok"} == {"model", "shards"}
    assert '`<- {"model": entry, "shards": [entry, ...]}`' in PROTOCOL  # pin / unpin
    assert set(report) == documented('`<- {"report": {', "`.") - {"report"}


def test_the_published_fingerprint_formula_is_the_daemons():
    """The document said "pub:" + sha256; the daemon sends "uid<N>:" + sha256."""
    import hashlib

    from weightcache import tenant_fingerprint

    assert '`f"uid{uid}:" + sha256_hex(f"{uid}\\0{fingerprint}")`' in PROTOCOL
    uid, fingerprint = 1000, "82a6b0f1+int8-v1"
    assert tenant_fingerprint(fingerprint, uid) == f"uid{uid}:" + hashlib.sha256(f"{uid}\0{fingerprint}".encode()).hexdigest()


async def test_status_devices_carry_the_documented_fields(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    async with Client(d.socket) as c:
        cpu = (await c.status())["devices"]["cpu"]
    doc = PROTOCOL[PROTOCOL.index('"devices": {"cpu": {'):].split("}")[0]
    keys = set(re.findall(r'"([a-z_]+)":', doc))  # the keys, not the example values
    assert set(cpu) == keys - {"devices", "cpu"}
    assert cpu["content_hash"] == "host"  # the CPU backend hashes on its loader threads
