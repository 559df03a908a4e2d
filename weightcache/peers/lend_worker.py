"""Lending host memory from a child process that holds nothing but what is lent.

Note [a lend exposes only what is lent]
---------------------------------------
NIXL checks a read's range only in the reader's library. Over TCP, UCX emulates remote
reads and writes in the *lender's* worker (software RMA), which serves whatever address
it is asked: a peer that patched the lend's metadata read bytes of another model out of
the daemon's heap, and wrote into it. So the daemon never registers its own memory for a
host lend. It starts one child per daemon (``python -I -m weightcache.peers.lend_child``,
cwd ``/``, an environment of UCX_/NIXL_ settings only, uid and gid 65534 when the daemon
runs as root) that runs the lending NIXL agent. For each lend the daemon passes the
arena's files (a sealed memfd, or a file arena's read-only opens of its checkpoint
files) over a Unix socket; the child maps them PROT_READ, registers the lent ranges,
and answers with its metadata. The child's address space holds the lent arenas, the
interpreter and NIXL: no other model, no tenant's tables, no key. A write into a lent
range faults (the mapping is read-only; a sealed memfd or an O_RDONLY file cannot be
mapped writable) and kills the child, not the daemon: the daemon ends every lend the
child held (their borrowers fall back to their files), counts it (``status``:
``peers.lend_worker``), and starts a new child at the next lend, at most once per
RESTART_S.

GPU lends are not covered: their rings are device memory of the daemon's CUDA context,
and the child has none (docs/reliability.md, "Peers: threat model and bounds").
"""

from __future__ import annotations

import array
import base64
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("weightcache.peers")

HEADER = struct.Struct(">I")
MAX_MESSAGE = 64 * 2**20  # a lend of a file arena lists a region per run of tensors
NOBODY = 65534
RESTART_S = 5.0
START_TIMEOUT_S = 60.0


class WorkerGone(Exception):
    """The lend worker died or broke its protocol; every lend it held is over."""


@dataclass(frozen=True)
class LentFiles:
    """What a host lend shares: each file as (fd, size), and each region as (file index,
    offset in the file, arena offset, bytes), in arena order."""

    files: Sequence[tuple[int, int]]
    regions: Sequence[tuple[int, int, int, int]]


def _send(sock: socket.socket, msg: dict[str, object], fds: Sequence[int] = ()) -> None:
    data = json.dumps(msg).encode()
    buf = HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([buf[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        buf = buf[1:]
    sock.sendall(buf)


def _recv_exactly(sock: socket.socket, n: int, fds: list[int] | None = None) -> bytes:
    out = bytearray()
    while len(out) < n:
        if fds is not None and not out:
            data, anc, _flags, _ = sock.recvmsg(n, socket.CMSG_SPACE(4 * 256))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % 4])
                    fds.extend(got)
        else:
            data = sock.recv(n - len(out))
        if not data:
            raise EOFError("the other end closed")
        out += data
    return bytes(out)


def _recv(sock: socket.socket, fds: list[int] | None = None) -> dict[str, object]:
    (n,) = HEADER.unpack(_recv_exactly(sock, HEADER.size, fds))
    if n > MAX_MESSAGE:
        raise EOFError(f"a message of {n} bytes")
    msg = json.loads(_recv_exactly(sock, n))
    if not isinstance(msg, dict):
        raise EOFError("a message that is not a map")
    return msg


# -- the daemon's side ---------------------------------------------------------------------
class LendWorker:
    """The daemon's handle on its lend worker. Blocking: call from threads. One request at
    a time; ``on_gone`` is called (in a thread of its own) once the child is gone."""

    def __init__(self, on_gone: Callable[[str], None]) -> None:
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ids = 0
        self._started_at = 0.0
        self.deaths = 0  # children that died or broke the protocol
        self.last_death: str | None = None
        self.lending: set[int] = set()
        self.uid: int | None = None  # the child's

    def describe(self) -> dict[str, object]:
        return {"pid": self._proc.pid if self._proc is not None and self._proc.poll() is None else None, "uid": self.uid,
                "lending": len(self.lending), "deaths": self.deaths, "last_death": self.last_death}

    def start(self) -> None:
        """Start the child now (its NIXL takes ~1 s), not at the first lend."""
        with self._lock:
            self._start()

    def _start(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        wait = self._started_at + RESTART_S - time.monotonic()
        if self._started_at and wait > 0:
            raise WorkerGone(f"the lend worker died ({self.last_death}); it is started again in {wait:.1f} s")
        self._started_at = time.monotonic()
        # As 65534 where the daemon is root: nothing a root daemon may read that the lent
        # fds do not give. Where 65534 cannot run this interpreter or import this package
        # (a virtualenv under a home directory), as the daemon's uid, said in the log.
        uids = [NOBODY, None] if os.geteuid() == 0 else [None]
        for uid in uids:
            try:
                proc, sock = self._spawn(uid)
            except WorkerGone as exc:
                if uid is None:
                    raise
                log.warning("peers: the lend worker cannot run as uid %d (%s); it runs as uid 0, still holding only "
                            "what it lends", NOBODY, exc)
                continue
            self.uid = os.geteuid() if uid is None else uid
            self._proc, self._sock = proc, sock
            threading.Thread(target=self._watch, args=(proc,), name="lend-worker-watch", daemon=True).start()
            log.info("peers: lend worker started (pid %d, uid %d)", proc.pid, self.uid)
            return sock
        raise AssertionError("unreachable")

    @staticmethod
    def _spawn(uid: int | None) -> tuple[subprocess.Popen[bytes], socket.socket]:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
        env["PATH"] = "/usr/bin:/bin"
        argv = [sys.executable, "-I", "-m", "weightcache.peers.lend_child", str(child.fileno())]
        kw: dict[str, Any] = {"pass_fds": [child.fileno()], "cwd": "/", "env": env, "stdin": subprocess.DEVNULL,
                              "stderr": subprocess.DEVNULL if uid is not None else None, "close_fds": True}
        if uid is not None:
            kw.update(user=uid, group=uid, extra_groups=[])
        try:
            proc = subprocess.Popen(argv, **kw)
        except OSError as exc:
            parent.close()
            raise WorkerGone(f"the lend worker did not start: {exc}") from None
        finally:
            child.close()
        parent.settimeout(START_TIMEOUT_S)
        try:
            hello = _recv(parent)
            if hello.get("ok") is not True:
                raise ValueError(str(hello.get("error")))
        except (OSError, EOFError, ValueError) as exc:
            proc.kill()
            proc.wait()
            parent.close()
            raise WorkerGone(f"the lend worker did not start: {type(exc).__name__}: {exc}") from None
        parent.settimeout(None)
        return proc, parent

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        rc = proc.wait()
        why = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        with self._lock:
            if self._proc is proc:
                self._proc = None
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                self.lending.clear()
        if rc != 0:
            self.deaths += 1
            self.last_death = why
            log.warning("peers: the lend worker (pid %d) ended with %s; the lends it held are over", proc.pid, why)
            self._on_gone(why)

    def _ask(self, msg: dict[str, object], fds: Sequence[int] = ()) -> dict[str, object]:
        sock = self._start()
        try:
            _send(sock, msg, fds)
            reply = _recv(sock)
        except (OSError, EOFError, ValueError) as exc:
            if self._proc is not None:
                self._proc.kill()
            raise WorkerGone(f"the lend worker went away: {type(exc).__name__}: {exc}") from None
        if reply.get("ok") is not True:
            raise WorkerGone(f"the lend worker refused: {reply.get('error')}")
        return reply

    def lend(self, lent: LentFiles) -> tuple[int, bytes, list[tuple[int, int, int]]]:
        """Map and register ``lent`` in the child: (lend id, NIXL metadata, regions as
        (arena offset, the child's address, bytes))."""
        with self._lock:
            self._ids += 1
            lend_id = self._ids
            reply = self._ask({"op": "lend", "id": lend_id, "sizes": [s for _, s in lent.files],
                               "regions": [list(r) for r in lent.regions]}, [fd for fd, _ in lent.files])
            self.lending.add(lend_id)
        md = reply.get("metadata")
        regions = reply.get("regions")
        if not isinstance(md, str) or not isinstance(regions, list):
            raise WorkerGone("the lend worker's reply is malformed")
        return lend_id, base64.b64decode(md), [(int(a), int(b), int(c)) for a, b, c in regions]

    def end(self, lend_id: int) -> None:
        with self._lock:
            if lend_id not in self.lending:
                return  # the child that held it is gone, and its mappings with it
            self.lending.discard(lend_id)
            self._ask({"op": "end", "id": lend_id})

    def close(self) -> None:
        with self._lock:
            proc, sock = self._proc, self._sock
            self._proc = self._sock = None
        if sock is not None:
            sock.close()  # the child ends at EOF
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the child -----------------------------------------------------------------------------
def _serve(sock: socket.socket) -> None:
    from ..backends.page_cache import map_readonly, unmap
    from .transport import Transport

    try:
        transport = Transport()
    except Exception as exc:
        _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    _send(sock, {"ok": True})
    lends: dict[int, tuple[object, list[tuple[int, int]]]] = {}  # id -> (registration, [(addr, size)])
    stop = threading.Event()
    pump = threading.Thread(target=transport.progress, args=(stop,), daemon=True)
    pump.start()
    while True:
        fds: list[int] = []
        try:
            msg = _recv(sock, fds)
        except (EOFError, OSError):
            # The daemon closed the socket, or died: its lends die with it at once (no
            # interpreter teardown while a peer's reads go on).
            os._exit(0)
        try:
            if msg.get("op") == "lend":
                lend_id, sizes, regions = msg["id"], msg["sizes"], msg["regions"]
                assert isinstance(lend_id, int) and isinstance(sizes, list) and isinstance(regions, list)
                maps: list[tuple[int, int]] = []
                try:
                    for fd, size in zip(fds, sizes, strict=True):  # read-only: a write into a lend faults here
                        maps.append((map_readonly(fd, size) if size else 0, size))
                    out = [(ao, maps[f][0] + fo, n) for f, fo, ao, n in regions
                           if n and fo >= 0 and fo + n <= maps[f][1]]
                    reg = transport.register([(addr, n) for _, addr, n in out], "DRAM")
                except BaseException:
                    for addr, size in maps:
                        if addr:
                            unmap(addr, size)
                    raise
                lends[lend_id] = (reg, maps)
                _send(sock, {"ok": True, "metadata": base64.b64encode(transport.metadata()).decode(),
                             "regions": [list(r) for r in out]})
            elif msg.get("op") == "end":
                lend_id = msg["id"]
                held = lends.pop(lend_id, None) if isinstance(lend_id, int) else None
                if held is not None:
                    transport.deregister(held[0])
                    for addr, size in held[1]:
                        if addr:
                            unmap(addr, size)
                _send(sock, {"ok": True})
            else:
                _send(sock, {"ok": False, "error": f"unknown op {msg.get('op')!r}"})
        except Exception as exc:
            _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for fd in fds:
                os.close(fd)


def serve_fd(fd: int) -> None:
    """The child's life: serve the daemon on the socket ``fd`` until it closes (lend_child.py)."""
    logging.basicConfig(level=logging.WARNING, format="lend worker: %(message)s")
    _serve(socket.socket(fileno=fd))
