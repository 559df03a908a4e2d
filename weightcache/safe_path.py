"""``sys.path`` without what the directory a process was started in put there."""

from __future__ import annotations

import os
import sys


def safe_sys_path() -> list[str]:
    """This process's ``sys.path`` as ``python -P`` would have it: without the entry the
    interpreter put first (the script's directory, or the working directory with ``-m``
    or ``-c``; none under ``-P``/``-I``) and without relative entries (the working
    directory by another name). What PYTHONPATH names absolutely is kept: the operator's
    choice. Used where code is imported on behalf of a daemon or a supervisor that may
    have been started in a directory others can write (loader/parse_worker.py,
    supervise/loop.py)."""
    first = 0 if sys.flags.safe_path else 1
    return [p for p in sys.path[first:] if p and os.path.isabs(p)]
