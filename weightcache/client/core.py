"""The client's side of the protocol with no I/O (what h11 is to httpcore): fed the bytes
and fds a socket gave, it says which replies they completed; asked for a request, it
gives the frame to send. No socket, no waiting, no clock of its own: the transports
(connection.py's asyncio one, sync.py's blocking one) do the I/O and the waits, and both
share everything here, so that the protocol is written once.

It holds: the settings and timeouts, the hello and what the daemon said in it
(``server_info``), request ids, the frame decoder and the fds not yet claimed by a reply,
what to do with a reply nobody waits for, the errors (by what went wrong, never by
message text) and the connect-retry schedule. An attach reply is read into typed
records by protocol/arena.py's ``parse_attach``, which an engine imports with the attach
half (connection.py's ``import_attach_half``, while the hello is answered) rather than
with the client: imported with the client, those records and the reply's reading made a fresh engine's import find and
load two more modules and make ~180 more GC-tracked objects (1,607 against 1,424,
counted with the cyclic GC off after ``import torch``; the 2-core VM). No torch here,
nor in the modules on an engine's import path (tests/test_client_imports.py):
``weightcache health``, the CLI and control calls import only the client and the
standard library: the frames' msgpack is the client's own (protocol/pymsgpack.py), not
the msgpack package, whose import was 1.3-1.8 ms of a fresh engine's span.

Note [timeouts]
---------------
Nothing waits on the daemon without a bound, so a stopped (SIGSTOP), hung or overloaded
daemon cannot hang its engines. Connecting (the socket connect and the hello exchange)
is bounded by ``connect_timeout`` (-> DaemonUnavailable). A request, from waiting for
the write lock through sending to its reply, is bounded by ``request_timeout``, except
``load``, ``attach`` and ``publish``, which may legitimately take minutes: they get
``load_timeout``, by default the daemon's own ``request_timeout_s`` (from its hello
reply; 900 s if it does not say) plus 30 s, so that the daemon's own TIMEOUT, which
says more, normally arrives first. Every method takes ``timeout=`` to override its
default; ``math.inf`` waits without a bound. A request that runs out of time raises
RequestTimeout and is abandoned as in Note [cancellation]. One that ran out of time
while its frame was half sent leaves the stream out of step: the connection is closed.

Note [waiting for the daemon]
-----------------------------
An engine may start before the daemon (systemd ordering races, pods started together).
While the socket does not exist (ENOENT) or nobody listens on it (ECONNREFUSED: not yet,
or a socket left behind by a daemon that died), connecting retries with backoff, 10 ms
doubling to 200 ms, for up to ``wait_for_daemon`` seconds (default 5; 0 tries once;
``$WEIGHTCACHE_WAIT_FOR_DAEMON`` sets the default). Then DaemonUnavailable says which
socket and how to start the daemon. Nothing else is retried: EACCES and EPERM
(PermissionDenied: this user may not use that socket, and waiting will not change it)
and every other error fail at once. ``connect_timeout`` bounds each attempt's connect,
and the hello exchange counts from the start of the attempt that connected.
:class:`Retry` is the schedule; the one loop that follows it is
connection.py's ``ConnectionBase._connect``.

Note [reconnecting]
-------------------
A connection the daemon closed (it stopped, restarted, or dropped this client) or that
broke is not the client's end: the next call connects again (the retry and bounds of
Note [waiting for the daemon]) and goes on. Nothing is lost that reconnecting could
keep: the daemon ended the old connection's leases with it, and what was attached stays
mapped and readable (client/mapping.py's Note [lifetime]). A request that was in flight
when the connection ended fails (the daemon may or may not have done it); one whose
frame the daemon never took (the send found the peer gone: EPIPE, ECONNRESET) is sent
again on the new connection. Each connection is an ``epoch``: a lease belongs to the
epoch that granted it, and ending one of an earlier epoch sends nothing (the daemon
ended it already; its number may name another client's lease now). After connecting
again, ``events`` gets ``{"event": "reconnected", "restarted": bool, "pid": ...,
"previous_pid": ..., "reason": ...}`` and the ``weightcache.client`` logger a warning
that says whether the daemon restarted (its pid changed). If connecting again fails,
the error says both what ended the connection and why connecting failed. Only
``close()`` ends a client for good.

Note [cancellation]
-------------------
A request cancelled (or timed out) between send and reply leaves its id behind; the
transport drops that reply when it comes (:meth:`ClientCore.unclaimed`), closes any fds
it carried and, if it granted a lease, detaches it, so no stale reply reaches a later
caller and no lease leaks.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
from collections import deque
from typing import Any

from ..errors import DaemonUnavailable, PermissionDenied, RequestTimeout, WeightcacheError, error_from_wire
from ..protocol import HEADER, PROTOCOL_VERSION, SOCKET_ENV, FrameDecoder, client_socket_path, close_fds
from ..protocol.pymsgpack import decode_reply, packb

DEFAULT_MAX_FRAME_BYTES = 256 * 2**20  # replies: an attach's tensor table can be long
DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_REQUEST_TIMEOUT = 60.0
DEFAULT_WAIT_FOR_DAEMON = 5.0  # Note [waiting for the daemon]
WAIT_FOR_DAEMON_ENV = "WEIGHTCACHE_WAIT_FOR_DAEMON"
RETRY_FIRST_S, RETRY_MAX_S = 0.01, 0.2  # the backoff between connect attempts
RETRY_ERRNOS = frozenset({errno.ENOENT, errno.ECONNREFUSED})  # the daemon is not there (yet)
START_DAEMON_HINT = ("start it with `weightcache serve --config /etc/weightcache/weightcache.toml` (or `systemctl start weightcache`), "
                     f"or point ${SOCKET_ENV} at the socket it serves")
LONG_OPS = frozenset({"load", "attach", "publish"})  # may take minutes: they get load_timeout
DAEMON_REQUEST_TIMEOUT_S = 900.0  # the daemon's default request_timeout_s, for one whose hello does not say
LOAD_TIMEOUT_MARGIN_S = 30.0  # past the daemon's own timeout, so its TIMEOUT reply arrives first

Reply = tuple[dict[str, Any], list[int]]  # a reply map and the fds that came with it
PEER_GONE_ERRNOS = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN})  # a send found the daemon's end closed


class PeerGone(DaemonUnavailable):
    """A send found the daemon's end of the connection closed, so the daemon never took
    the frame: the request may be sent again on a new connection (Note [reconnecting])."""


def wait_for_daemon_from_env() -> float:
    """``$WEIGHTCACHE_WAIT_FOR_DAEMON`` in seconds, else the default (5)."""
    raw = os.environ.get(WAIT_FOR_DAEMON_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_FOR_DAEMON
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise ValueError(f"${WAIT_FOR_DAEMON_ENV} must be a number of seconds >= 0 (e.g. 5 or 0.5), not {raw!r}")
    return value


class Retry:
    """When to try connecting again (Note [waiting for the daemon]): 10 ms doubling to
    200 ms, until ``wait_for_daemon`` seconds after ``now`` have passed."""

    def __init__(self, wait_for_daemon: float, now: float) -> None:
        self.give_up = now + wait_for_daemon
        self.delay = RETRY_FIRST_S
        self.last = False  # the wait given was cut to the deadline: the attempt after it is the last

    def after(self, exc: OSError, now: float) -> float | None:
        """Seconds to wait before the next attempt after ``exc``; None if ``exc`` is not
        worth retrying or the wait is over (then the caller raises the connect error).
        One wait only is cut short, to end at the deadline: a timer that rounds to whole
        milliseconds (uvloop's) ended those cut waits at once, and the client retried
        in a spin for the deadline's last millisecond (25 attempts in 1 s on a busy VM)."""
        left = self.give_up - now
        if exc.errno not in RETRY_ERRNOS or left <= 0 or self.last:
            return None
        # The cut wait rounded up to a whole ms: a timer of whole ms must not end it before the deadline.
        cut = math.ceil(round(left * 1000, 6)) / 1000
        wait, self.delay = min(self.delay, cut), min(2 * self.delay, RETRY_MAX_S)
        self.last = wait == cut
        return wait


class ClientCore:
    """One client's protocol state, across its connections; no I/O (module docstring).

    ``socket_path`` defaults to ``$WEIGHTCACHE_SOCKET``, then /run/weightcache/weightcache.sock.
    Timeouts are in seconds (Note [timeouts]); ``math.inf`` means no bound. ``wait_for_daemon``:
    None reads ``$WEIGHTCACHE_WAIT_FOR_DAEMON``, else 5 s.
    """

    def __init__(self, socket_path: str | os.PathLike[str] | None = None, *, name: str | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT, load_timeout: float | None = None,
                 wait_for_daemon: float | None = None) -> None:
        for what, value in (("connect_timeout", connect_timeout), ("request_timeout", request_timeout),
                            ("load_timeout", load_timeout)):
            if value is not None and not value > 0:  # also refuses NaN
                raise ValueError(f"{what} must be a positive number of seconds (math.inf for no bound), not {value!r}")
        if wait_for_daemon is None:
            wait_for_daemon = wait_for_daemon_from_env()
        elif not wait_for_daemon >= 0:  # also refuses NaN
            raise ValueError(f"wait_for_daemon must be a number of seconds >= 0 (math.inf for no bound), not {wait_for_daemon!r}")
        self.socket_path = client_socket_path(socket_path)
        self.name = name or f"python/{os.getpid()}"
        self.connect_timeout = connect_timeout
        self.wait_for_daemon = wait_for_daemon
        self.request_timeout = request_timeout
        self.max_frame_bytes = max_frame_bytes
        self._load_timeout = load_timeout
        self._ids = itertools.count(1)
        self.server_info: dict[str, Any] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=64)  # events the daemon announced, newest last
        self.connected = False
        self.closed = False  # close() was called: no connecting again (Note [reconnecting])
        self.epoch = 0  # connections made so far; a lease is of the epoch that granted it
        self.announced_stop = False  # this connection's daemon sent shutting_down
        # Why the connection cannot carry requests: it broke, or was closed. None while it can.
        self.error: WeightcacheError | None = None
        self._decoder = FrameDecoder(max_frame_bytes)
        self._fd_queue: deque[int] = deque()  # fds arrive with the first byte of the frame that names them

    # -- the connection's life --------------------------------------------------------
    def start(self) -> None:
        """A new connection is up: a fresh stream, nothing held from an earlier one."""
        self.discard()
        self._decoder = FrameDecoder(self.max_frame_bytes)
        self.connected, self.error = True, None
        self.epoch += 1
        self.announced_stop = False

    @property
    def lost(self) -> bool:
        """The connection ended without ``close()``: the next call connects again."""
        return self.epoch > 0 and not self.connected and not self.closed

    def close(self) -> DaemonUnavailable:
        """``close()`` was called: the client's end, whatever ended the connection before;
        returns the error later calls raise."""
        self.closed, self.error = True, None
        return DaemonUnavailable("client closed")

    def stop(self, error: WeightcacheError) -> WeightcacheError:
        """The connection is over (``error`` says why, unless an earlier reason stands);
        returns the reason that stands."""
        self.connected = False
        if self.error is None:
            self.error = error
        self.discard()
        return self.error

    def discard(self) -> None:
        """Close the fds that arrived for frames not yet whole."""
        fds, self._fd_queue = self._fd_queue, deque()
        close_fds(fds)

    # -- hello and timeouts ---------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        """The hello request's arguments."""
        return {"protocol": PROTOCOL_VERSION, "client": self.name}

    def accept_hello(self, reply: dict[str, Any]) -> None:
        self.server_info = reply

    @property
    def load_timeout(self) -> float:
        """The default timeout of load, attach and publish (Note [timeouts])."""
        if self._load_timeout is not None:
            return self._load_timeout
        daemon_s = self.server_info.get("request_timeout_s")
        if isinstance(daemon_s, int | float) and not isinstance(daemon_s, bool) and daemon_s > 0:
            return float(daemon_s) + LOAD_TIMEOUT_MARGIN_S
        return DAEMON_REQUEST_TIMEOUT_S + LOAD_TIMEOUT_MARGIN_S

    def limit(self, op: str, timeout: float | None) -> float | None:
        """The seconds ``op`` may take: the override, else its default; None for no bound."""
        if timeout is None:
            timeout = self.load_timeout if op in LONG_OPS else self.request_timeout
        return None if math.isinf(timeout) else timeout

    def connect_deadline(self, started: float) -> float | None:
        """When an attempt that began at ``started`` must have connected and said hello."""
        return None if math.isinf(self.connect_timeout) else started + self.connect_timeout

    # -- requests and replies ---------------------------------------------------------------
    def request(self, op: str, args: dict[str, Any], nfds: int = 0) -> tuple[int, bytes]:
        """A new request's id and frame (arguments that are None left out); raises if the
        connection cannot carry it."""
        if self.error is not None:  # the connection broke or was closed: nobody would read a reply
            raise self.error
        if not self.connected:
            raise DaemonUnavailable("not connected; use 'async with Client()' or connect()")
        rid = next(self._ids)
        msg = {"id": rid, "op": op, **{k: v for k, v in args.items() if v is not None}}
        if nfds:
            msg["fds"] = nfds
        payload = packb(msg)
        return rid, HEADER.pack(len(payload)) + payload

    def receive(self, data: bytes, fds: list[int]) -> list[Reply]:
        """One read's bytes and fds -> the replies it completed, each with its fds (which
        arrive with the first byte of the frame that names them). Events the daemon
        announced go to ``events``. Raises DaemonUnavailable at the end of the stream,
        FrameTooLarge or BadRequest for garbage: the connection is then over."""
        self._fd_queue.extend(fds)
        if not data:
            raise self.ended()
        replies = []
        limit = self.max_frame_bytes
        for payload in self._decoder.feed(data):
            # Replies may hold long arrays (an attach's tensor table) and maps keyed
            # by model: as long as this client's frame limit, not a request's limits.
            reply = decode_reply(payload, limit)
            if "event" in reply:  # unsolicited, e.g. {"event": "shutting_down", "grace_s": 10}
                self.events.append(reply)
                self.announced_stop = self.announced_stop or reply.get("event") == "shutting_down"
                continue
            count = int(reply.get("fds", 0))
            if count > len(self._fd_queue):
                raise DaemonUnavailable(f"weightcache at {self.socket_path} sent a reply naming {count} fds, "
                                        f"but {len(self._fd_queue)} arrived")
            replies.append((reply, [self._fd_queue.popleft() for _ in range(count)]))
        return replies

    @staticmethod
    def checked(reply: dict[str, Any], fds: list[int]) -> Reply:
        """A reply that says ok, or its error raised (its fds closed)."""
        if not reply.get("ok"):
            close_fds(fds)
            raise error_from_wire(reply.get("error") or {})
        return reply, fds

    @staticmethod
    def unclaimed(reply: dict[str, Any], fds: list[int]) -> int | WeightcacheError | None:
        """A reply nobody waits for (Note [cancellation]): its fds are closed here. Returns
        the lease it granted (to detach), the error to fail every request with (one about
        the connection itself, e.g. FRAME_TOO_LARGE, has no id), or None."""
        close_fds(fds)
        if reply.get("id") is None and not reply.get("ok"):
            return error_from_wire(reply.get("error") or {})
        if reply.get("ok") and "lease" in reply and "tensors" in reply:
            return int(reply["lease"])
        return None

    # -- errors, by what went wrong --------------------------------------------------------
    def connect_error(self, exc: OSError) -> WeightcacheError:
        """What a connect that failed for good raises: a clear message by errno."""
        path = self.socket_path
        if exc.errno in (errno.EACCES, errno.EPERM):
            return PermissionDenied(
                f"permission denied connecting to weightcache at {path} as uid {os.geteuid()}: the socket's owner, group "
                "and mode (and its directories') decide who may connect; the daemon's socket_group and socket_mode set "
                "them (docs/deployment.md)", socket=path)
        if exc.errno in RETRY_ERRNOS:
            what = "the socket does not exist" if exc.errno == errno.ENOENT else \
                "nothing is listening on it (a daemon that stopped may have left it behind)"
            return DaemonUnavailable(f"cannot connect to weightcache at {path}: {what}, after waiting "
                                     f"{self.wait_for_daemon:g}s for the daemon. Is it running? {START_DAEMON_HINT}",
                                     socket=path, waited_s=self.wait_for_daemon)
        return DaemonUnavailable(f"cannot connect to weightcache at {path}: {exc.strerror or exc}", socket=path)

    def no_answer(self) -> DaemonUnavailable:
        return DaemonUnavailable(
            f"weightcache at {self.socket_path} did not answer within {self.connect_timeout:g}s "
            "(connect and hello); is the daemon stopped, hung or overloaded?", socket=self.socket_path)

    def timed_out(self, op: str, limit: float | None) -> RequestTimeout:
        return RequestTimeout(
            f"the daemon at {self.socket_path} did not answer {op!r} within {limit:g}s; it may be stopped, "
            "hung or overloaded (a late reply is dropped)", op=op, timeout_s=limit)

    def ended(self) -> DaemonUnavailable:
        """The daemon closed the connection (Note [reconnecting])."""
        why = "it announced it was shutting down" if self.announced_stop else "it stopped or restarted, or dropped this client"
        return DaemonUnavailable(f"the daemon at {self.socket_path} closed the connection ({why}); the leases held on "
                                 "it ended, attached tensors stay readable, and the next call connects again",
                                 socket=self.socket_path)

    def peer_gone(self, op: str, exc: OSError) -> PeerGone:
        """A send that found the daemon's end closed: the frame was not taken (Note [reconnecting])."""
        return PeerGone(f"{self.ended().message} ({op!r} found it closed: {exc.strerror or exc})", socket=self.socket_path)

    def reconnected(self, before: Any, lost: WeightcacheError | None) -> str:
        """Connected again after ``lost`` to a daemon whose pid was ``before``: the
        ``reconnected`` event added to ``events``, and what to log."""
        now = self.server_info.get("pid")
        reason = lost.message if lost is not None else "the connection ended"
        self.events.append({"event": "reconnected", "restarted": now != before, "pid": now, "previous_pid": before,
                            "reason": reason})
        who = f"the daemon restarted (pid {before}, now {now})" if now != before else f"the same daemon (pid {now})"
        return f"connected again to the daemon at {self.socket_path}: {who} ({reason}); the leases of the old connection ended"

    def reconnect_failed(self, lost: WeightcacheError | None, exc: WeightcacheError) -> WeightcacheError:
        """Connecting again after ``lost`` failed with ``exc``: one error that says both."""
        before = lost.message if lost is not None else "the connection to the daemon ended"
        return type(exc)(f"{before}; connecting again failed: {exc.message}", **exc.details)

    def abandoned(self, op: str) -> DaemonUnavailable:
        return DaemonUnavailable(f"connection to {self.socket_path} closed: a {op!r} request was abandoned while its frame "
                                 "was being sent", socket=self.socket_path)

    def broken(self, exc: OSError) -> DaemonUnavailable:
        return DaemonUnavailable(f"connection to {self.socket_path} broke: {exc}")

    def interrupted(self) -> DaemonUnavailable:
        return DaemonUnavailable(f"connection to {self.socket_path} closed: a read was interrupted", socket=self.socket_path)
