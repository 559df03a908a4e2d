"""Names shared by both ends of the protocol. docs/protocol.md is the full specification."""

PROTOCOL_VERSION = 1

# Ops the daemon answers. Admin ops change what is cached for everyone.
OPS = frozenset(
    {"hello", "status", "models", "load", "attach", "detach", "evict", "pin", "unpin",
     "register", "unregister", "reload", "publish", "health"}
)
ADMIN_OPS = frozenset({"evict", "pin", "unpin", "register", "unregister", "reload"})
