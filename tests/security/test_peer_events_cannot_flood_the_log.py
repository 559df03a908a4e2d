"""Log lines for events peers cause are rate-limited per uid, and what
was left out is counted in the log."""

from __future__ import annotations

import logging
import re
import signal
import socket
from typing import Any

from helpers import NOBODY, as_uid, root_only

from weightcache.peer_log import PeerEventLog

from ._util import OTHER, Conn, code, open_to_all


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_peer_event_log_keeps_a_share_per_uid_and_counts_the_rest() -> None:
    now = [0.0]
    logger = logging.getLogger("wc-test-peer-events")
    logger.propagate = False
    h = _Lines()
    logger.addHandler(h)
    pl = PeerEventLog(logger, burst=3, total=5, window=60, clock=lambda: now[0])
    logged = [pl.log(logging.WARNING, "refused", uid, "refused %d", uid) for uid in [1] * 10 + [2] * 10]
    assert logged.count(True) == 5 and logged[:3] == [True] * 3 and logged[10:12] == [True, True]
    assert h.lines == ["refused 1"] * 3 + ["refused 2"] * 2 and pl.suppressed("refused") == 15
    now[0] = 61  # the window ended: the next event says what the last one left out
    assert pl.log(logging.WARNING, "refused", 1, "refused %d", 1)
    assert h.lines[-2] == "15 more 'refused' line(s) left out in the last 60 s (uid 2: 8, uid 1: 7)", h.lines[-2:]  # most first
    pl.log(logging.WARNING, "refused", 1, "x")
    pl.log(logging.WARNING, "refused", 1, "x")
    pl.log(logging.WARNING, "refused", 1, "x")
    pl.flush()
    assert h.lines[-1].startswith("1 more 'refused' line(s)"), h.lines[-1]


@root_only
def test_refused_connects_and_admin_ops_cannot_flood_the_log(start_daemon):
    """14,653 refused connects wrote 1.76 MiB of warnings in 5 s, pipelined evicts 4.2 MiB:
    one line each. Now at most a few per uid per minute, and the count of the rest."""
    d = open_to_all(start_daemon(extra_daemon={"socket_mode": 0o666, "allowed_uids": [0, NOBODY]}))
    connects = 1000

    def refused() -> int:
        n = 0
        for _ in range(connects):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(d.socket)
            while s.recv(65536):  # the refusal, then EOF
                pass
            s.close()
            n += 1
        return n

    def evicts() -> list[Any]:
        c = Conn(d.socket, timeout=60)
        try:
            out = []
            for batch in range(0, connects, 20):  # pipelined, 20 at a time (a peer not reading is held back)
                for i in range(batch, batch + 20):
                    c.send({"id": 10 + i, "op": "evict", "name": "x"})
                out += [code(c.reply(10 + i)) for i in range(batch, batch + 20)]
            return out
        finally:
            c.close()

    assert as_uid(OTHER, refused, timeout=120) == connects
    got = as_uid(NOBODY, evicts, timeout=120)
    assert isinstance(got, list) and set(got) == {"PERMISSION_DENIED"}, got
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    text = d.log_text()
    conn_lines = text.count("refused conn from")
    admin_lines = text.count("refused admin op 'evict'")
    assert 1 <= conn_lines <= 10 and 1 <= admin_lines <= 10, (conn_lines, admin_lines)
    left: dict[str, int] = {}
    for n, event in re.findall(r"(\d+) more '([^']+)' line\(s\) left out", text):
        left[event] = left.get(event, 0) + int(n)
    assert left.get("refused conn", 0) + conn_lines == connects, (left, conn_lines)
    assert left.get("refused admin op", 0) + admin_lines == connects, (left, admin_lines)
    # (the test daemon logs at debug level, a line per request; what a production daemon
    # at info writes for these is its warnings)
    warnings = sum(len(line) for line in text.splitlines() if " WARNING " in line)
    assert warnings < 16 * 1024, warnings
