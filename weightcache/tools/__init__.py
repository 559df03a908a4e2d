"""Tools around the product, not part of it: the benchmark (``weightcache bench``), the
demo (``weightcache demo``), the fresh-engine restart probe they share, a daemon run as a
child process, and synthetic checkpoints. The daemon and the client never import this
package; the CLI imports it only inside the ``bench`` and ``demo`` commands."""
