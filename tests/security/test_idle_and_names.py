"""What a connection keeps after its requests are answered: nothing of its frames, and a
bounded, printable client name."""

from __future__ import annotations

from conftest import wait_until

from ._util import MIB, Conn, rss


def test_idle_connections_do_not_keep_their_last_frame(start_daemon):
    """Each connection sends one complete 12 MiB frame (a hello with junk, refused for its
    size: at most 1 MiB of a request is decoded) and goes idle. The daemon must not keep
    those frames alive: before, every idle connection held its last frame (24 x 12 MiB =
    288 MiB here)."""
    d = start_daemon()
    base = rss(d.proc.pid)
    conns = []
    try:
        for _ in range(24):
            c = Conn(d.socket, greet=False)
            c.send({"id": 1, "op": "hello", "protocol": 1, "client": "idle", "junk": b"\0" * (12 * MIB)})
            r = c.recv()
            assert r["error"]["code"] == "BAD_REQUEST" and r["id"] == 1, r  # and the connection stays open
            conns.append(c)
        # The daemon's RSS falls back once it has let the frames go (24 x 12 MiB if it kept them).
        wait_until(lambda: rss(d.proc.pid) - base < 120 * MIB)
    finally:
        for c in conns:
            c.close()


def test_client_names_are_bounded_and_cannot_forge_log_lines(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    forged = "x\n2026-11-30 00:00:00,000 WARNING weightcache.daemon: FORGED LINE"
    c = Conn(d.socket, greet=False)
    try:
        c.send({"id": 1, "op": "hello", "protocol": 1, "client": forged + "y" * (MIB // 2)})  # within the 1 MiB decoded
        assert c.recv()["ok"]
        c.send({"id": 2, "op": "attach", "name": "tiny"})
        assert c.recv()["ok"]
    finally:
        c.close()
    # The daemon logs the released lease when it notices the close: polled, as a loaded
    # machine may take longer than any fixed sleep.
    wait_until(lambda: "closed holding 1 lease" in d.log_text(), timeout=30)
    log = d.log_text()
    assert not any(line.startswith("2026-11-30 00:00:00,000") for line in log.splitlines()), "a peer wrote a log line"
    assert "y" * 200 not in log  # the name is cut, not logged whole
