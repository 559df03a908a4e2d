"""Big headers are validated and laid out in a worker process, not in the daemon.

Why a process: JSON-parsing and laying out 100k tensors is ~0.6 s of Python that holds
the interpreter lock, in slices the event loop must queue for; beside one tenant's
100k-tensor loads another tenant's attach p99 went up 10-16x (issue 25, stress_abuse.py
--only headerbomb, 2-core VM), and the parse's transient objects stayed in the daemon's
heap as RSS. A worker holds no lock of the daemon's, runs at nice 19 (the kernel gives the
event loop's thread the CPU first), and takes its garbage with it when it exits. Its
reply is the layout's columns as bytes (tensor_table.py) and the encoded attach table:
nothing per tensor is built in the daemon.

One process per parse, started from ``sys.executable`` (no fork of a daemon that may
hold CUDA contexts and threads): ~90 ms to start on the 2-core VM, paid only by headers
of PARSE_APART_BYTES or more, which real checkpoints stay under (~100 bytes a tensor:
1 MiB is ~10,000 tensors). The reply is msgpack, never pickle: a worker that parsed a
hostile header must not be able to make the daemon run anything. Its columns are checked
before use (TensorTable.from_wire, and every row's bytes inside the arena).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from ..errors import CorruptCheckpoint, LoadFailed
from .tensor_table import TensorTable, wire_table

if TYPE_CHECKING:
    from .layout import Layout

PARSE_APART_BYTES = 1 << 20  # raw header bytes (all files) from which the parse runs in a worker
WORKER_TIMEOUT_S = 120.0  # a 16 MiB header takes ~3 s; past this the worker is killed
WORKER_NICE = 19
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # so the worker imports this copy of weightcache


def lay_out_apart(headers: Sequence[tuple[str, int, bytes]]) -> Layout:
    """checkpoint.lay_out(headers), run in a fresh worker process. Blocking (the daemon
    calls it from its io pool). Raises what lay_out would (CorruptCheckpoint), or
    LoadFailed if the worker fails."""
    from .layout import Layout

    request = msgpack.packb([[path, size, raw] for path, size, raw in headers], use_bin_type=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "weightcache.loader.parse_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    except OSError as exc:
        raise LoadFailed(f"cannot start the header parse worker: {exc.strerror}", reason="parse worker") from None
    try:
        out, err = proc.communicate(request, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise LoadFailed(f"the header parse worker did not finish within {WORKER_TIMEOUT_S:g}s", reason="parse worker") from None
    if proc.returncode != 0:
        why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise LoadFailed(f"the header parse worker failed: {why[0][:300]}", reason="parse worker")
    try:
        reply = msgpack.unpackb(out, raw=False)
        if reply.get("error") is not None:
            e = reply["error"]
            raise CorruptCheckpoint(str(e["message"]), **{str(k): v for k, v in e["details"].items()})
        tensors = TensorTable.from_wire(reply["columns"])
        arena_bytes, layout, table = int(reply["arena_bytes"]), str(reply["layout"]), reply["table"]
        if not isinstance(table, bytes):
            raise ValueError("table is not bytes")
    except CorruptCheckpoint:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, msgpack.UnpackException) as exc:
        raise LoadFailed(f"the header parse worker's reply is malformed ({exc})", reason="parse worker") from None
    _check_rows(tensors, arena_bytes, [size for _path, size, _raw in headers])
    return Layout(tensors, arena_bytes, layout, table)


def _check_rows(tensors: TensorTable, arena_bytes: int, sizes: list[int]) -> None:
    """Every row's bytes inside the arena and inside its file: what the daemon reads and
    writes by them, whatever the worker said."""
    for f, fo, nb, ao in zip(tensors.file, tensors.file_offset, tensors.nbytes, tensors.arena_offset, strict=True):
        if not (0 <= f < len(sizes) and nb >= 0 and fo >= 0 and fo + nb <= sizes[f] and ao >= 0 and ao + nb <= arena_bytes):
            raise LoadFailed("the header parse worker's reply places a tensor outside its file or arena", reason="parse worker")


def _serve() -> int:
    """The worker: a msgpack request on stdin, the reply on stdout, then exit."""
    from .layout import lay_out

    # Refused in some sandboxes: the parse still runs then, at the daemon's priority.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, WORKER_NICE)
    request = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
    headers = [(str(path), int(size), bytes(raw)) for path, size, raw in request]
    try:
        laid = lay_out(headers)
    except CorruptCheckpoint as exc:
        reply: dict[str, Any] = {"error": {"message": exc.message, "details": exc.details}}
    else:
        reply = {"columns": laid.tensors.to_wire(), "arena_bytes": laid.arena_bytes, "layout": laid.layout,
                 "table": wire_table(laid.tensors)}
    sys.stdout.buffer.write(msgpack.packb(reply, use_bin_type=True))
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    status = _serve()
    # Past the interpreter's teardown, which frees the parse's objects one by one (~0.1 s
    # for 100k tensors) while the daemon waits for the pipe to close.
    os._exit(status)
