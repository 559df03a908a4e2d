"""The peer workers' entry point (lend_worker.py, Note [a lend exposes only what is lent],
Note [a fill lands in a worker]): ``python -I -m weightcache.peers.lend_child FD ROLE``,
ROLE "lend" or "fill". A module of its own so that the one ``-m`` runs is not imported by
the package first."""

import sys

from .lend_worker import serve_fd

if __name__ == "__main__":
    serve_fd(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "lend")
