"""The daemon's side of a read through the fill worker (peers/lend_worker.py, Note [a fill
lands in a worker]) against a scripted worker on a socketpair: no NIXL, no process. A
worker's reports are accepted only for extents it was allowed and has not reported yet;
the daemon never allows more than twice the window ahead of the reports, so a worker
that stops reading cannot fill the socket; anything out of place fails the read."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from weightcache.peers.lend_worker import _FillFromDaemon, _recv, _send
from weightcache.peers.transport import Extent, TransferFailed

BASE = 1 << 20
EXTENTS = [Extent(BASE + 10 * k, 10 * k, 10) for k in range(6)]


def start(window: int = 1) -> tuple[_FillFromDaemon, socket.socket, list[tuple[int, int]], threading.Thread]:
    daemon_end, worker_end = socket.socketpair()
    done: list[tuple[int, int]] = []
    fill = _FillFromDaemon(daemon_end, BASE, EXTENTS, window, lambda dst, n: done.append((dst, n)))
    listener = threading.Thread(target=fill.listen, daemon=True)
    listener.start()
    return fill, worker_end, done, listener


def run_in_thread(fill: _FillFromDaemon, stop: Any = lambda: None, give_up_s: float = 10.0) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            fill.run(stop, lambda _n, _dst: None, time.monotonic() + give_up_s)
            out["ok"] = True
        except TransferFailed as exc:
            out["error"] = str(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    out["thread"] = t
    return out


def test_an_honest_worker_reports_each_allowed_extent_once() -> None:
    fill, worker, done, _ = start(window=2)
    out = run_in_thread(fill)
    seen = 0
    while seen < len(EXTENTS):
        msg = _recv(worker)
        assert msg["op"] == "allow"
        for k in range(seen, int(msg["upto"])):  # type: ignore[call-overload]
            _send(worker, {"done": [10 * k, 10]})
        seen = int(msg["upto"])  # type: ignore[call-overload]
    _send(worker, {"result": "ok"})
    out["thread"].join(5)
    assert out.get("ok") is True, out
    assert done == [(e.dst, e.nbytes) for e in EXTENTS]


def test_a_report_for_an_extent_not_allowed_fails_the_read() -> None:
    fill, worker, done, listener = start()
    _send(worker, {"done": [50, 10]})  # the last extent, before anything was allowed
    listener.join(5)
    out = run_in_thread(fill)
    out["thread"].join(5)
    assert "not allowed" in out["error"] and done == []


def test_a_report_given_twice_fails_the_read() -> None:
    fill, worker, done, _ = start()
    out = run_in_thread(fill)
    assert _recv(worker) == {"op": "allow", "upto": 1}
    _send(worker, {"done": [0, 10]})
    _send(worker, {"done": [0, 10]})  # again: would hash the piece again
    out["thread"].join(5)
    assert "twice" in out["error"] and done == [(BASE, 10)]


def test_ok_with_extents_missing_fails_the_read() -> None:
    fill, worker, _, _ = start(window=3)
    out = run_in_thread(fill)
    assert _recv(worker)["op"] == "allow"
    _send(worker, {"result": "ok"})
    out["thread"].join(5)
    assert "0 of 6" in out["error"]


@pytest.mark.parametrize("window", [1, 2])
def test_allows_stay_within_twice_the_window_of_the_reports(window: int) -> None:
    """A worker that reads its socket but reports nothing gets at most 2 x window allows."""
    fill, worker, _, _ = start(window)
    stopped: list[str] = []
    out = run_in_thread(fill, stop=lambda: stopped[0] if stopped else None)
    worker.settimeout(10)  # the allows that may come, however slow a busy machine is
    allows = [_recv(worker) for _ in range(2 * window)]
    worker.settimeout(0.5)  # and then no more
    with pytest.raises(TimeoutError):
        allows.append(_recv(worker))
    assert [m["upto"] for m in allows] == list(range(1, 2 * window + 1))
    stopped.append("the load was cancelled")
    out["thread"].join(5)
    assert out["error"] == "the load was cancelled"


def test_a_worker_that_goes_away_fails_the_read() -> None:
    fill, worker, _, _ = start()
    out = run_in_thread(fill)
    worker.close()
    out["thread"].join(5)
    assert "went away" in out["error"]


def test_a_huge_report_frame_is_refused_unread() -> None:
    fill, worker, _, listener = start()
    worker.sendall((64 << 20).to_bytes(4, "big"))  # a 64 MiB frame announced
    listener.join(5)
    out = run_in_thread(fill)
    out["thread"].join(5)
    assert "went away" in out["error"] and "bytes" in out["error"]
