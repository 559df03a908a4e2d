"""Defaults the client needs. Kept free of pydantic: importing pydantic-settings costs
~150 ms, measured with ``python -X importtime``, and an engine's restart pays for every
import the client makes (docs/benchmarks.md)."""

from __future__ import annotations

import os

DEFAULT_SOCKET = "/run/weightcache/weightcache.sock"
SOCKET_ENV = "WEIGHTCACHE_SOCKET"
CONFIG_ENV = "WEIGHTCACHE_CONFIG"
DAEMON_UID_ENV = "WEIGHTCACHE_DAEMON_UID"  # a daemon uid or user name clients trust besides root and themselves


def client_socket_path(explicit: str | os.PathLike[str] | None = None) -> str:
    """The socket a client connects to: explicit, else ``$WEIGHTCACHE_SOCKET``, else the default."""
    return os.fspath(explicit or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)
