"""The lend worker's entry point (lend_worker.py, Note [a lend exposes only what is lent]):
``python -I -m weightcache.peers.lend_child FD``. A module of its own so that the one
``-m`` runs is not imported by the package first."""

import sys

from .lend_worker import serve_fd

if __name__ == "__main__":
    serve_fd(int(sys.argv[1]))
