"""Names shared by both ends of the protocol. docs/protocol.md is the full specification."""

import hashlib

PROTOCOL_VERSION = 1

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
