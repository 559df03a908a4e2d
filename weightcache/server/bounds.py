"""What one peer's connections may cost the daemon, and the counts that hold them to it.

Note [untrusted peers]
----------------------
Any allowed peer may be hostile. Nothing one connection sends may cost the daemon
unbounded memory, fds, threads or loop time, or delay another connection:
- requests: at most max_requests_per_connection in flight; beyond that, or while a
  reply of more than max_queued_reply_bytes waits for the peer to read it, the daemon
  stops reading the connection (the kernel's buffer then stops the peer);
- frames: one deadline per frame from its first byte (frame_read_timeout_s), a deadline
  for hello, and half-received frames summed over every connection
  (max_partial_frame_bytes);
- bytes read: each uid's connections together are read at most at
  max_read_bytes_per_s_per_uid once they have sent a burst of max_frame_bytes
  (``Bounds.read_pause``); beyond that its readers wait, so the kernel's buffer stops
  the peer's writes and the loop and the host's cores go to others. A tenant that wrote
  refused 3.5 MB frames as fast as it could (~200 MB/s on the 2-core VM) kept a core of
  its own and much of the daemon's busy;
- fds: only with a frame's first bytes, at most max_fds_per_frame, and at most
  max_fds_per_uid waiting for frames not yet complete; and, the other way, at most
  max_fds_per_uid sent to a uid's peers that they have not read (Bounds.fds_out):
  the kernel counts fds in flight against the daemon's RLIMIT_NOFILE;
- decoding: every value is skipped before it is built, and at most 1 MiB of a request
  is built on the loop (framing.decode_payload); a publish's table is built and
  validated in the io pool (Note [deferred values]); attach tables are encoded once.

The counts summed over connections live here (``Bounds``); the reader and sender in
connections.py ask them before they take more. What one connection's reader decides on
its own is here without I/O, so that it is tested with bytes and a clock and no daemon:
``FrameReader`` (frames out of bytes, the fd rule, the hello and frame deadlines) and
``FlowControl`` (whether the connection is read at all).
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import DaemonConfig
from ..errors import BadRequest, LimitExceeded, RequestTimeout, WeightcacheError
from ..protocol import FrameDecoder, close_fds
from .access import Peer


class FlowControl:
    """Whether the daemon reads a connection's next request (uvicorn's FlowControl, for a
    reader task): not while max_requests_per_connection of its requests are in flight,
    nor while more than max_queued_reply_bytes of a reply wait for the peer to read
    them; it reads again as soon as both are back under."""

    def __init__(self, max_requests: int, max_unsent: int) -> None:
        self.max_requests, self.max_unsent = max_requests, max_unsent
        self.in_flight = 0  # requests (and queued replies) of the connection not done
        self.unsent = 0  # the size of the reply being sent, until all of it is out
        self._readable = asyncio.Event()
        self._readable.set()

    @property
    def reading(self) -> bool:
        return self._readable.is_set()

    def set_in_flight(self, n: int) -> None:
        self.in_flight = n
        self._update()

    def set_unsent(self, nbytes: int) -> None:
        self.unsent = nbytes
        self._update()

    async def wait(self) -> None:
        """Until the connection may be read."""
        await self._readable.wait()

    def _update(self) -> None:
        if self.in_flight < self.max_requests and self.unsent <= self.max_unsent:
            self._readable.set()
        else:
            self._readable.clear()


class FrameReader:
    """One connection's read side, without I/O: bytes (and how many fds came with them) in,
    whole frames out, and when the reader must give up waiting. A frame has
    frame_read_timeout_s from its first byte; a connection hello_timeout_s for its hello;
    fds ride on a frame's first byte (a frame must start in the read that brought them)."""

    def __init__(self, max_frame_bytes: int, frame_read_timeout_s: float, hello_timeout_s: float, now: float) -> None:
        self.decoder = FrameDecoder(max_frame_bytes)
        self.frame_read_timeout_s, self.hello_timeout_s = frame_read_timeout_s, hello_timeout_s
        self.hello_deadline = now + hello_timeout_s
        self.frame_deadline: float | None = None  # set when a frame's first byte arrives

    @property
    def pending(self) -> int:
        """Bytes of a frame begun and not complete."""
        return self.decoder.pending

    def timeout(self, greeted: bool, now: float) -> float | None:
        """How long the next read may wait (None: as long as it takes)."""
        deadlines = [t for t in (None if greeted else self.hello_deadline, self.frame_deadline) if t is not None]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def timed_out(self, now: float) -> RequestTimeout:
        """The error that closes a connection whose read waited past :meth:`timeout`."""
        if self.frame_deadline is not None and now >= self.frame_deadline:
            why = f"frame incomplete {self.frame_read_timeout_s:g}s after its first byte"
        else:
            why = f"no hello within {self.hello_timeout_s:g}s"
        return RequestTimeout(f"{why}; closing the connection")

    def feed(self, data: bytes, nfds: int, now: float) -> list[bytes]:
        """The frames ``data`` completes. Raises FrameTooLarge (a frame over the limit: the
        stream is out of step) or BadRequest (fds that came with no frame's first byte)."""
        pending_before = self.decoder.pending
        frames = self.decoder.feed(data)
        started_here = pending_before == 0 or len(frames) > 1 or (len(frames) == 1 and self.decoder.pending > 0)
        if nfds and not started_here:
            raise BadRequest("file descriptors must come with a frame's first byte")
        if not self.decoder.pending:
            self.frame_deadline = None
        elif frames or self.frame_deadline is None:  # a new frame began in this read
            self.frame_deadline = now + self.frame_read_timeout_s
        return frames

    def discard(self) -> None:
        """Drop the half frame (its memory goes now)."""
        self.decoder.discard()


@dataclass
class Connection:
    id: int
    sock: socket.socket
    peer: Peer  # pid, uid, gid(s) from SO_PEERCRED
    flow: FlowControl
    client: str = "?"
    greeted: bool = False
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    tasks: dict[asyncio.Task[None], str] = field(default_factory=dict)  # request in flight -> its op
    fds: deque[int] = field(default_factory=deque)  # received, not yet claimed by a frame ("fds": n)
    partial: int = 0  # bytes of a half-received frame (summed in Bounds.partial_bytes)
    # fds sent since the peer was last seen to have read everything (Bounds.fds_out)
    fds_out: int = 0
    # Done once the peer is gone: its loads go on, but stop waiting for room (Caller.gone).
    gone: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def close_fds(self) -> None:
        fds, self.fds = self.fds, deque()
        close_fds(fds)


class Bounds:
    def __init__(self, settings: DaemonConfig, conns: dict[int, Connection]) -> None:
        self.settings = settings
        self.conns = conns  # Connections' own, by id: the open connections
        self.partial_bytes = 0  # half-received frames over every connection (max_partial_frame_bytes)
        self.partial_by_uid: dict[int, int] = {}  # the same per peer uid (max_partial_frame_bytes_per_uid)
        self._read_tokens: dict[int, tuple[float, float]] = {}  # uid -> (bytes it may still read now, when counted)

    def read_pause(self, uid: int) -> float:
        """Seconds a reader of ``uid``'s connections waits before its next read: its reads
        beyond a burst of max_frame_bytes, at max_read_bytes_per_s_per_uid (0: no limit).
        A token bucket per uid, dropped once it is full again (so that it holds only uids
        that read lately)."""
        rate = self.settings.max_read_bytes_per_s_per_uid
        got = self._read_tokens.get(uid)
        if not rate or got is None:
            return 0.0
        tokens, then = got
        now = time.monotonic()
        tokens = min(float(self.settings.max_frame_bytes), tokens + (now - then) * rate)
        if tokens >= self.settings.max_frame_bytes:
            del self._read_tokens[uid]
            return 0.0
        self._read_tokens[uid] = (tokens, now)
        return -tokens / rate if tokens < 0 else 0.0

    def count_read(self, uid: int, nbytes: int) -> None:
        """``nbytes`` read from one of ``uid``'s connections (read_pause says when it may read again)."""
        if not self.settings.max_read_bytes_per_s_per_uid:
            return
        got = self._read_tokens.get(uid)
        tokens, then = got if got is not None else (float(self.settings.max_frame_bytes), time.monotonic())
        self._read_tokens[uid] = (tokens - nbytes, then)

    def count_partial(self, conn: Connection, pending: int) -> None:
        self.partial_bytes += pending - conn.partial
        self.partial_by_uid[conn.peer.uid] = self.partial_by_uid.get(conn.peer.uid, 0) + pending - conn.partial
        conn.partial = pending

    def check_partial(self, conn: Connection) -> WeightcacheError | None:
        """Half-received frames: a share per uid, so that one tenant cannot hold the
        whole budget and make every other peer's large frame fail; and a total."""
        d = self.settings
        if self.partial_by_uid[conn.peer.uid] > d.max_partial_frame_bytes_per_uid:
            return LimitExceeded(f"uid {conn.peer.uid} holds {d.max_partial_frame_bytes_per_uid} bytes of unfinished "
                                 "frames; send whole frames", limit=d.max_partial_frame_bytes_per_uid)
        if self.partial_bytes > d.max_partial_frame_bytes:
            return LimitExceeded(f"the daemon holds {d.max_partial_frame_bytes} bytes of unfinished frames; "
                                 "send whole frames", limit=d.max_partial_frame_bytes)
        return None

    def check_fds(self, conn: Connection, arrived: int) -> WeightcacheError | None:
        d = self.settings
        if arrived > d.max_fds_per_frame or len(conn.fds) > 2 * d.max_fds_per_frame:
            return LimitExceeded(f"at most {d.max_fds_per_frame} file descriptors per frame", limit=d.max_fds_per_frame)
        waiting = sum(len(c.fds) for c in self.conns.values() if c.peer.uid == conn.peer.uid)
        if waiting > d.max_fds_per_uid:
            return LimitExceeded(f"uid {conn.peer.uid} has {waiting} file descriptors waiting for unfinished frames "
                                 f"(limit {d.max_fds_per_uid})", limit=d.max_fds_per_uid)
        return None

    def unread_fds(self, uid: int) -> int:
        """fds sent to ``uid``'s connections that their peers may not have read yet; a
        connection whose send queue is empty (SIOCOUTQ) has read all of its."""
        total = 0
        for c in self.conns.values():
            if c.peer.uid == uid and c.fds_out:
                try:
                    queued = struct.unpack("i", fcntl.ioctl(c.sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
                except OSError:
                    queued = 0  # closed: its fds went with it
                if not queued:
                    c.fds_out = 0
                total += c.fds_out
        return total

    async def fds_out(self, conn: Connection, n: int) -> None:
        """Wait until ``n`` more fds may go to ``conn``. An fd sent over a Unix socket stays
        "in flight" until the peer reads it, and Linux counts those against the sender's
        RLIMIT_NOFILE: a tenant that pipelined attaches without reading their replies
        held thousands, and past the limit every peer's reply with fds failed
        (ETOOMANYREFS). So a uid's peers get at most max_fds_per_uid fds they have not
        read; a connection with none unread always gets its next reply (a reply may
        carry more). The peer's reading gives no event: polled while over."""
        limit = self.settings.max_fds_per_uid
        while conn.fds_out and self.unread_fds(conn.peer.uid) + n > limit and conn.id in self.conns:
            await asyncio.sleep(0.01)
        conn.fds_out += n
