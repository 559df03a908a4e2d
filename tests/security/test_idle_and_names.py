"""What a connection keeps after its requests are answered: nothing of its frames, and a
bounded, printable client name (found by the review after the fix landed)."""

from __future__ import annotations

import time

from ._util import MIB, Conn, rss


def test_idle_connections_do_not_keep_their_last_frame(start_daemon):
    """Each connection sends one complete 12 MiB frame (a hello with junk the protocol
    ignores) and goes idle. The daemon must not keep those frames alive: before, every
    idle connection held its last frame (24 x 12 MiB = 288 MiB here)."""
    d = start_daemon()
    base = rss(d.proc.pid)
    conns = []
    try:
        for _ in range(24):
            c = Conn(d.socket, greet=False)
            c.send({"id": 1, "op": "hello", "protocol": 1, "client": "idle", "junk": b"\0" * (12 * MIB)})
            assert c.recv()["ok"]
            conns.append(c)
        time.sleep(0.5)
        grown = rss(d.proc.pid) - base
        assert grown < 120 * MIB, f"daemon RSS grew {grown / MIB:.0f} MiB for 24 idle connections"
    finally:
        for c in conns:
            c.close()


def test_client_names_are_bounded_and_cannot_forge_log_lines(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    forged = "x\n2026-11-30 00:00:00,000 WARNING weightcache.daemon: FORGED LINE"
    c = Conn(d.socket, greet=False)
    try:
        c.send({"id": 1, "op": "hello", "protocol": 1, "client": forged + "y" * MIB})
        assert c.recv()["ok"]
        c.send({"id": 2, "op": "attach", "name": "tiny"})
        assert c.recv()["ok"]
    finally:
        c.close()
    time.sleep(0.5)  # the daemon logs the released lease when it notices the close
    log = d.log_text()
    assert "closed holding 1 lease" in log
    assert not any(line.startswith("2026-11-30 00:00:00,000") for line in log.splitlines()), "a peer wrote a log line"
    assert "y" * 200 not in log  # the name is cut, not logged whole
