"""Names shared by both ends of the protocol. docs/protocol.md is the full specification.

The socket's default path and the environment variables that name it are here too, not
in the config package: the client needs them, and must not import pydantic (~150 ms,
``python -X importtime``) or a module of their own (each module a fresh engine imports
costs ~60-75 µs, issue 23)."""

import hashlib
import os

PROTOCOL_VERSION = 1

DEFAULT_SOCKET = "/run/weightcache/weightcache.sock"
SOCKET_ENV = "WEIGHTCACHE_SOCKET"
CONFIG_ENV = "WEIGHTCACHE_CONFIG"
DAEMON_UID_ENV = "WEIGHTCACHE_DAEMON_UID"  # a daemon uid or user name clients trust besides root and themselves


def client_socket_path(explicit: "str | os.PathLike[str] | None" = None) -> str:
    """The socket a client connects to: explicit, else ``$WEIGHTCACHE_SOCKET``, else the default."""
    return os.fspath(explicit or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)

# Ops the daemon answers. Admin ops change what is cached for everyone.
OPS = frozenset(
    {"hello", "status", "models", "load", "attach", "detach", "evict", "pin", "unpin",
     "register", "unregister", "reload", "publish", "health"}
)

# register, unregister and publish check their own rights (an owner may act on its own models).
ADMIN_OPS = frozenset({"evict", "pin", "unpin", "reload"})


def tenant_fingerprint(fingerprint: str, uid: int) -> str:
    """The fingerprint the daemon gives a model that uid ``uid`` published (with
    ``fingerprint`` as it sent it) or registered with its own files (``fingerprint`` being
    the checkpoint's). Binding the owner's uid in means no tenant can offer weights that
    carry another's fingerprint, or a configured model's: an engine that checks
    ``m.fingerprint == tenant_fingerprint(expected, uid_it_trusts)`` gets only that uid's
    weights.

    >>> tenant_fingerprint("82a6b0f1+int8-v1", 1000)[:12]
    'uid1000:dfc2'
    """
    return f"uid{uid}:" + hashlib.sha256(f"{uid}\0{fingerprint}".encode()).hexdigest()
