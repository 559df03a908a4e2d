"""Open a checkpoint's files for ``register``, so that the daemon reads them through this
process's descriptors, with this process's rights, and never by a path it opens itself."""

from __future__ import annotations

import os
import stat

from ..checkpoint_files import discover_files
from ..errors import LimitExceeded, LoadFailed, PermissionDenied
from ..protocol import MAX_FDS_PER_MSG


def open_checkpoint_files(parts: list[str]) -> tuple[list[list[str]], list[int]]:
    """Open every file of every part (rank order) read-only: (paths per part, fds in the
    same order, flattened). Raises PermissionDenied / LoadFailed naming the file, after
    closing what it opened.

    >>> names, fds = open_checkpoint_files(["/models/qwen-7b"])   # doctest: +SKIP
    >>> names
    [['/models/qwen-7b/model-00001-of-00002.safetensors', '/models/qwen-7b/model-00002-of-00002.safetensors']]
    """
    names = [[str(f) for f in discover_files(part)] for part in parts]
    count = sum(len(files) for files in names)
    if count > MAX_FDS_PER_MSG:
        raise LimitExceeded(f"the checkpoint has {count} files but one frame carries at most {MAX_FDS_PER_MSG} "
                            "descriptors; register it with send_files=False (as an administrator)",
                            limit=MAX_FDS_PER_MSG)
    fds: list[int] = []
    try:
        for files in names:
            for f in files:
                fds.append(_open_readonly(f))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return names, fds


def _open_readonly(path: str) -> int:
    try:
        # O_NONBLOCK so that a FIFO in the checkpoint cannot hang us; cleared below.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except PermissionError as exc:
        raise PermissionDenied(f"cannot open checkpoint file {path}: {exc.strerror}", file=path) from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise LoadFailed(f"cannot open checkpoint file {path}: {reason}", file=path, reason=reason) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LoadFailed(f"checkpoint file {path} is not a regular file", file=path, reason="not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
