"""What a handler gets: the request, who sent it, and the daemon's parts it may use.

A handler is ``async def op(ctx: Context, caller: Caller, req: Request) -> Reply``. It
never sees a connection: ``Caller`` is who asked, ``Request`` what they asked (its fds a
field), ``Context`` the rooms of the daemon it may act on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..backends import Backend
from ..cache import CacheCore
from ..config import Settings
from ..errors import BadRequest
from .access import AccessPolicy, Peer
from .registry import Registry
from .residency import Residency

Reply = tuple[dict[str, Any], list[int]]  # the reply's fields, and fds to send with it (closed once sent)


@dataclass
class Request:
    id: int
    op: str
    args: dict[str, Any]
    # The fds that came with the frame. A handler that keeps some (register) takes them
    # out of this list; whatever is left is closed when the request ends.
    fds: list[int] = field(default_factory=list)

    def arg(self, key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
        """An argument of the expected type, or BadRequest naming it."""
        return arg(self.args, key, typ, default)


@dataclass(frozen=True)
class Caller:
    conn: int  # the connection's id: leases belong to it
    peer: Peer
    client: str  # the name it gave in hello
    # Done once the connection closed: a load it asked for finishes but waits for room no
    # more (SingleFlight.ensure_resident). None where no request runs (a lease's holder).
    gone: asyncio.Future[None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Context:
    settings: Settings
    core: CacheCore
    registry: Registry
    residency: Residency
    access: AccessPolicy
    backends: dict[str, Backend]
    started: float  # monotonic time the daemon started
    socket_path: str
    connections: Callable[[], int]
    caller_of: Callable[[int], Caller | None]  # who holds a connection (a lease's holder); None once it closed
    shutting_down: Callable[[], bool]
    health: Callable[[], dict[str, Any]]
    reload: Callable[[], Awaitable[dict[str, Any]]]
    outlived: Callable[[], list[dict[str, Any]]] = lambda: []  # mappings of an earlier daemon (server/outlived.py)
    other_daemons: Callable[[], list[dict[str, Any]]] = lambda: []  # other `weightcache serve` processes on the host
    peers: Callable[[], dict[str, Any] | None] = lambda: None  # [peers]: the status op's "peers" (weightcache/peers/)
    loop: Callable[[], dict[str, Any] | None] = lambda: None  # the event loop's stalls (server/loop_watch.py)

    def wait_arg(self, req: Request) -> float:
        wait = float(req.arg("wait_s", (int, float), self.settings.daemon.no_space_wait_s))
        if not 0 <= wait < float("inf"):  # also rejects NaN
            raise BadRequest(f"argument 'wait_s' must be a finite number >= 0, got {wait}", argument="wait_s")
        # The request times out at request_timeout_s anyway; the load it starts (which
        # others may join) must not go on waiting for room after that.
        return min(wait, self.settings.daemon.request_timeout_s)


Handler = Callable[[Context, Caller, Request], Awaitable[Reply]]


def arg(args: dict[str, Any], key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
    """``args[key]`` if it has the expected type, ``default`` if absent or nil, else BadRequest."""
    if key not in args or args[key] is None:
        if default is ...:
            raise BadRequest(f"missing argument {key!r}", argument=key)
        return default
    value = args[key]
    if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, float, (int, float))):
        want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise BadRequest(f"argument {key!r} must be {want}, got {type(value).__name__}", argument=key)
    return value
