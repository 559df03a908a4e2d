"""What a service manager tells us and learns from us. Readiness: Type=notify units learn
READY=1 and STOPPING=1 from us (the daemon), and from a supervised engine
(weightcache.engine.ready); a reload is announced with RELOADING=1 and ends with READY=1.
Stop signals: which second one is an operator asking again (:class:`StopRequests`).
Imports nothing heavy: an engine calls it on its restart path."""

from __future__ import annotations

import os
import socket
import time


def sd_notify(message: str) -> bool:
    """Tell systemd (Type=notify units) about our state: "READY=1", "STOPPING=1". The
    protocol is one datagram to $NOTIFY_SOCKET; no libsystemd needed. False when not
    under systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path  # '@' = abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


def reloading_message() -> str:
    """RELOADING=1 with the time it began on CLOCK_MONOTONIC: systemd (Type=notify-reload,
    253+) matches a reload to the request that caused it by that time, and without it
    may take an earlier READY=1 as the reload's end (sd_notify(3))."""
    return f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"


class StopRequests:
    """Counts stop signals (SIGTERM, SIGINT, SIGQUIT): the first asks for a graceful stop, a
    later one for stopping now. `timeout(1)` passes a signal on to its command and then to
    its whole process group (as does a script that signals both a pid and its group), so
    a daemon or supervisor run under it receives the same request twice within
    milliseconds: the same signal, from the same sender where the receiver can tell,
    within :attr:`REPEAT_AFTER_S` of the first is that duplicate. Any other, and any later
    one, is the operator asking again. A terminal signals each process of its group once
    per key press, so a signal the kernel sent for the terminal is never a duplicate."""

    REPEAT_AFTER_S = 1.0

    def __init__(self) -> None:
        self.first: tuple[int, int | None, float] | None = None  # (signal, sender pid, when)

    def take(self, sig: int, sender: int | None = None, from_terminal: bool = False) -> str:
        """"first", "duplicate" (the same request delivered twice) or "again"."""
        now = time.monotonic()
        if self.first is None:
            self.first = (sig, sender, now)
            return "first"
        first_sig, first_sender, at = self.first
        if not from_terminal and sig == first_sig and sender == first_sender and now - at < self.REPEAT_AFTER_S:
            return "duplicate"
        return "again"
