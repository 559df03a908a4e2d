"""Tools around the product, not part of it: the benchmark (``weightcache bench``), the
workload benchmark (``weightcache workload``: many engines, many models, one budget), the
demo (``weightcache demo``), the fresh-engine restart probe they share, the daemon's load
log lines read back, a daemon run as a child process, and synthetic checkpoints. The
daemon and the client never import this package; the CLI imports it only inside the
``bench``, ``workload`` and ``demo`` commands."""
