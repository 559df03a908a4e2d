"""Big headers are validated and laid out in a worker process, not in the daemon.

Why a process: JSON-parsing and laying out 100k tensors is ~0.6 s of Python that holds
the interpreter lock, in slices the event loop must queue for; beside one tenant's
100k-tensor loads another tenant's attach p99 went up 10-16x (benchmarks abuse
--only headerbomb, 2-core VM), and the parse's transient objects stayed in the daemon's
heap as RSS. A worker holds no lock of the daemon's, runs at nice 5 (the kernel favours the
event loop's thread when they share a core), and takes its garbage with it when it exits. Its
reply is the layout's columns as bytes (tensor_table.py, the fingerprint's heads among
them) and the encoded attach table: nothing per tensor is built in the daemon.

One process per parse, started from ``sys.executable`` (no fork of a daemon that may
hold CUDA contexts and threads): ~90 ms to start on the 2-core VM, paid only by headers
of PARSE_APART_BYTES or more, which real checkpoints stay under (~100 bytes a tensor:
1 MiB is ~10,000 tensors). The reply is a msgpack map and raw buffers, never pickle: a
worker that parsed a hostile header must not be able to make the daemon run anything. Its columns are checked
before use (TensorTable.from_wire, and every row's bytes inside the arena).
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from ..errors import CorruptCheckpoint, LoadFailed
from ..safe_path import safe_sys_path
from .tensor_table import TensorTable, wire_table

if TYPE_CHECKING:
    from .layout import Layout

PARSE_APART_BYTES = 1 << 20  # raw header bytes (all files) from which the parse runs in a worker
WORKER_TIMEOUT_S = 120.0  # a 16 MiB header takes ~3 s; past this the worker is killed
# Not 19: beside two busy processes on the 2-core VM a nice-19 worker got ~1.5% of a core,
# and a tenant's register of a 100k-tensor header timed out (tests/security/test_what_a_model_holds_is_charged_and_released.py
# failed; 258 s for it at nice 10, 111 s at 5). At 5 the loop still outweighs a worker
# 3:1 on a shared core (one headerbomb stress run: attach p99 1.5x alone).
WORKER_NICE = 5
# The directory this copy of weightcache is imported from (site-packages, or a source tree
# for an editable install): the worker imports the package from there and nowhere else.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# Note [what a worker runs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A worker started as ``python -m weightcache.loader.parse_worker`` in the daemon's working
# directory and environment imported weightcache (and msgpack) from that directory first:
# a weightcache/__init__.py planted where the daemon was started ran as the daemon's user
# at a tenant's register and at the operator's reload. So the interpreter runs isolated
# (-I: no working directory or script directory on sys.path, no PYTHON* variables, no
# user site-packages), in /, with a few variables kept (the interpreter may need its
# libraries), and imports from what its command line names: _PACKAGE_ROOT first, then the
# daemon's own sys.path as ``python -P`` would have it (safe_path.py: PYTHONPATH's
# absolute entries kept, the directory the daemon was started in not).
WORKER_CWD = "/"
WORKER_ENV_KEPT = ("PATH", "LD_LIBRARY_PATH", "LANG", "LC_ALL", "LC_CTYPE")
_WORKER_MAIN = ("import sys; sys.path[:0] = sys.argv[1:]; "
                "from weightcache.loader.parse_worker import main; main()")


def worker_command() -> tuple[list[str], dict[str, str]]:
    """The worker's argv and environment (Note [what a worker runs])."""
    env = {k: v for k in WORKER_ENV_KEPT if (v := os.environ.get(k)) is not None}
    return [sys.executable, "-I", "-c", _WORKER_MAIN, _PACKAGE_ROOT, *safe_sys_path()], env


def lay_out_apart(headers: Sequence[tuple[str, int, bytes]]) -> Layout:
    """checkpoint.lay_out(headers), run in a fresh worker process. Blocking (the daemon
    calls it from its io pool). Raises what lay_out would (CorruptCheckpoint), or
    LoadFailed if the worker fails.

    The request goes in a memfd (the worker's stdin), its stderr to another, and the reply
    is read into one buffer the columns are views of: with the request and reply as
    ``communicate`` bytes and the columns as msgpack's copies, a parse of 100k tensors (a
    5.8 MB header) peaked at 52.8 MB of the daemon's heap for 10.9 MB kept (tracemalloc)."""
    from .layout import Layout

    raw_bytes = sum(len(raw) for _path, _size, raw in headers)
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    with _memfd("wc-parse-request") as request, _memfd("wc-parse-errors") as errors:
        packer = msgpack.Packer(use_bin_type=True)
        _write_all(request, packer.pack_array_header(len(headers)))
        for path, size, raw in headers:  # [path, size, raw] with raw as a bin 32, written from where it is
            _write_all(request, packer.pack_array_header(3) + packer.pack(path) + packer.pack(size)
                       + b"\xc6" + len(raw).to_bytes(4, "big"))
            _write_all(request, raw)
        os.lseek(request, 0, os.SEEK_SET)
        try:
            argv, env = worker_command()
            proc = subprocess.Popen(argv, stdin=request, stdout=subprocess.PIPE, stderr=errors, env=env, cwd=WORKER_CWD)
        except OSError as exc:
            raise LoadFailed(f"cannot start the header parse worker: {exc.strerror}", reason="parse worker") from None
        assert proc.stdout is not None
        try:
            with proc.stdout:
                reply = _read_reply(proc.stdout.fileno(), deadline, raw_bytes)
            status = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            reply, status = None, None
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        if status is None:
            raise LoadFailed(f"the header parse worker did not finish within {WORKER_TIMEOUT_S:g}s", reason="parse worker")
        if status != 0 or reply is None:
            err = os.pread(errors, 4096, max(0, os.fstat(errors).st_size - 4096))
            why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {status}"]
            if status == 0:
                why = ["its reply is malformed (truncated)"]
            raise LoadFailed(f"the header parse worker failed: {why[0][:300]}", reason="parse worker")
    meta, parts, table = reply
    try:
        if meta.get("error") is not None:
            e = meta["error"]
            raise CorruptCheckpoint(str(e["message"]), **{str(k): v for k, v in e["details"].items()})
        tensors = TensorTable.from_wire(parts)
        arena_bytes, layout = int(meta["arena_bytes"]), str(meta["layout"])
    except CorruptCheckpoint:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LoadFailed(f"the header parse worker's reply is malformed ({exc})", reason="parse worker") from None
    _check_rows(tensors, arena_bytes, [size for _path, size, _raw in headers])
    return Layout(tensors, arena_bytes, layout, table)


# The reply: an 8-byte little-endian length, a msgpack map of that length (``error``, or
# ``arena_bytes``, ``layout``, ``parts``: the columns' lengths, ``table``: the table's),
# then the columns (TensorTable.to_wire), each padded to 8 bytes, then the table.
_META_MAX = 1 << 20
_REPLY_PER_RAW_BYTE = 64  # a reply is ~2x its header; past this the worker is lying


def _pad(n: int) -> int:
    return -(-n // 8) * 8


def _read_reply(fd: int, deadline: float, raw_bytes: int) -> tuple[dict[str, Any], list[memoryview], bytes] | None:
    """The worker's reply from ``fd``: (meta, column views of one buffer, table), or None
    if it ends early or says sizes no header makes."""
    head = bytearray(8)
    if not _read_into(fd, memoryview(head), deadline):
        return None
    n = int.from_bytes(head, "little")
    if n > _META_MAX:
        return None
    meta_buf = bytearray(n)
    if not _read_into(fd, memoryview(meta_buf), deadline):
        return None
    try:
        meta = msgpack.unpackb(meta_buf, raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("error") is not None:
        return meta, [], b""
    lengths, table_len = meta.get("parts"), meta.get("table")
    if not (isinstance(lengths, list) and all(isinstance(x, int) and x >= 0 for x in lengths) and isinstance(table_len, int)
            and 0 <= sum(map(_pad, lengths)) + table_len <= _REPLY_PER_RAW_BYTE * raw_bytes + _META_MAX):
        return None
    buf = bytearray(sum(map(_pad, lengths)))
    table = bytearray(table_len)
    if not (_read_into(fd, memoryview(buf), deadline) and _read_into(fd, memoryview(table), deadline)):
        return None
    view, parts, at = memoryview(buf), [], 0
    for length in lengths:
        parts.append(view[at : at + length])
        at += _pad(length)
    return meta, parts, bytes(table)


def _read_into(fd: int, view: memoryview, deadline: float) -> bool:
    """Fill ``view`` from ``fd``; False at end of file. TimeoutExpired past ``deadline``."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    pos = 0
    while pos < len(view):
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise subprocess.TimeoutExpired("parse worker", WORKER_TIMEOUT_S)
        got = os.readv(fd, [view[pos:]])
        if not got:
            return False
        pos += got
    return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextlib.contextmanager
def _memfd(name: str) -> Iterator[int]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _check_rows(tensors: TensorTable, arena_bytes: int, sizes: list[int]) -> None:
    """Every row's bytes inside the arena and inside its file: what the daemon reads and
    writes by them, whatever the worker said."""
    for f, fo, nb, ao in zip(tensors.file, tensors.file_offset, tensors.nbytes, tensors.arena_offset, strict=True):
        if not (0 <= f < len(sizes) and nb >= 0 and fo >= 0 and fo + nb <= sizes[f] and ao >= 0 and ao + nb <= arena_bytes):
            raise LoadFailed("the header parse worker's reply places a tensor outside its file or arena", reason="parse worker")


def _serve() -> int:
    """The worker: a msgpack request on stdin, the reply (_read_reply's framing) on stdout, then exit."""
    from .layout import lay_out

    # Refused in some sandboxes: the parse still runs then, at the daemon's priority.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, WORKER_NICE)
    request = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
    headers = [(str(path), int(size), bytes(raw)) for path, size, raw in request]
    out = sys.stdout.buffer
    try:
        laid = lay_out(headers)
    except CorruptCheckpoint as exc:
        meta = msgpack.packb({"error": {"message": exc.message, "details": exc.details}}, use_bin_type=True)
        out.write(len(meta).to_bytes(8, "little") + meta)
    else:
        parts, table = laid.tensors.to_wire(), wire_table(laid.tensors)
        meta = msgpack.packb({"arena_bytes": laid.arena_bytes, "layout": laid.layout, "parts": [len(p) for p in parts],
                              "table": len(table)}, use_bin_type=True)
        out.write(len(meta).to_bytes(8, "little") + meta)
        for p in parts:
            out.write(p)
            out.write(bytes(_pad(len(p)) - len(p)))
        out.write(table)
    out.flush()
    return 0


def main() -> None:
    status = _serve()
    # Past the interpreter's teardown, which frees the parse's objects one by one (~0.1 s
    # for 100k tensors) while the daemon waits for the pipe to close.
    os._exit(status)


if __name__ == "__main__":
    main()
