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

Note [a fill lands in a worker]
-------------------------------
The borrowing side is the same door turned round: while a read runs, the reader's UCX
worker is progressed, and over TCP a lender that drives UCX itself could ask it for any
address of the reader's process. So a fill into host memory is read by a second child,
the fill worker (started as the lend worker is, ``... lend_child FD fill``): the daemon
passes the new arena's memfd (not sealed yet: it is being filled), the child maps it
writable, registers it, and reads the lender's extents into it with its own NIXL agent.
Its address space holds that arena (the lender's own bytes, on their way in), the
interpreter and NIXL. The daemon keeps the pacing (each extent is posted only once the
daemon allowed it: its pages reserved, the rate cap kept; at most 2 x the window ahead of
the reports, so the child's socket never fills) and the checking: it accepts a report
only for an extent it allowed and that was not reported yet, hashes each piece from its
own mapping of the same memfd, and checks the fingerprint before it seals (fill.py,
Note [a peer's bytes are checked]). A piece is hashed only once the child can no longer
write it: before it reports an extent, the child makes read-only every page of its
mapping below the lowest extent not in yet (``Watermark``; both sides compute that bound
from the same reports), so a lender that writes into a piece after it was hashed (over
TCP it may address any of the child's memory while the read runs) faults the child and
fails the fill; the child also seals those pages (``mseal``) and runs under a seccomp
filter, so code a lender got to run in it can neither make them writable again nor
start a process (confine.py, Note [a worker is confined]). A read returns only once the
child and its session are killed and reaped, whatever its ending, so the seal that
follows finds no writable mapping and nothing of one fill can write into, or answer
for, the next. After a clean "ok" the next child is started at once, in a thread: no
child reads two fills, so one that a lender's UCX compromised sees no other fill's bytes. A GPU fill lands in device memory of the
daemon's CUDA context, and still reads through the daemon's own agent.
"""

from __future__ import annotations

import array
import base64
import contextlib
import ctypes
import json
import logging
import mmap
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .transport import Extent

Role = Literal["lend", "fill"]

log = logging.getLogger("weightcache.peers")

HEADER = struct.Struct(">I")
MAX_MESSAGE = 64 * 2**20  # a lend of a file arena lists a region per run of tensors
NOBODY = 65534
RESTART_S = 5.0
PAGE = mmap.PAGESIZE
PR_SET_DUMPABLE = 4
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


def _recv(sock: socket.socket, fds: list[int] | None = None, limit: int = MAX_MESSAGE) -> dict[str, object]:
    (n,) = HEADER.unpack(_recv_exactly(sock, HEADER.size, fds))
    if n > limit:
        raise EOFError(f"a message of {n} bytes")
    msg = json.loads(_recv_exactly(sock, n))
    if not isinstance(msg, dict):
        raise EOFError("a message that is not a map")
    return msg


class Watermark:
    """How far from an arena's start its fill is out of the fill worker's reach: the
    start of the page that holds the lowest extent not in yet (all of it once every
    extent is in). Pages below it hold only bytes already in, and gaps no extent covers:
    the worker makes them read-only before it reports the extent that moved the bound,
    and the daemon hashes a piece only below the bound it computes from the same reports
    (Note [a fill lands in a worker])."""

    def __init__(self, extents: Sequence[tuple[int, int]], size: int) -> None:
        self._starts = sorted(off for off, _ in extents)  # arena offsets; extents never overlap
        self._in: set[int] = set()
        self._next = 0
        self.size = size
        self.upto = 0

    def add(self, off: int) -> int:
        """The extent at arena offset ``off`` is in: the bound now."""
        self._in.add(off)
        while self._next < len(self._starts) and self._starts[self._next] in self._in:
            self._next += 1
        if self._next == len(self._starts):
            self.upto = self.size
        else:
            self.upto = max(self.upto, self._starts[self._next] // PAGE * PAGE)
        return self.upto


# -- the daemon's side ---------------------------------------------------------------------
class LendWorker:
    """The daemon's handle on a peer worker, its lend worker (``role`` "lend") or its fill
    worker ("fill": FillWorker). Blocking: call from threads. One request at a time;
    ``on_gone`` is called (in a thread of its own) once the child is gone."""

    def __init__(self, on_gone: Callable[[str], None], role: Role = "lend") -> None:
        self.role = role
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ids = 0
        self._hold_until = 0.0  # no start before this: RESTART_S after the last, unless that worker was retired
        self._nobody_refused = False  # 65534 could not start the worker: it runs as the daemon's uid
        self._closed = False
        self.deaths = 0  # children that died or broke the protocol
        self.last_death: str | None = None
        self._ended: set[int] = set()  # pids this side killed on purpose (FillWorker): not deaths
        self._retired: set[int] = set()  # pids retired after a clean fill (FillWorker)
        self.lending: set[int] = set()
        self.uid: int | None = None  # the child's
        self.mseal: bool | None = None  # the fill worker's read-only pages sealed (Note [a worker is confined])
        self.guards: list[str] = []  # what confines the running child (confine.py)

    def describe(self) -> dict[str, object]:
        return {"pid": self._proc.pid if self._proc is not None and self._proc.poll() is None else None, "uid": self.uid,
                "lending": len(self.lending), "deaths": self.deaths, "last_death": self.last_death,
                "guards": self.guards}

    def start(self) -> None:
        """Start the child now (its NIXL takes ~1 s), not at the first lend."""
        with self._lock:
            self._start()

    def _start(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        if self._closed:
            raise WorkerGone(f"the {self.role} worker is closed: the daemon is stopping")
        wait = self._hold_until - time.monotonic()
        if wait > 0:
            raise WorkerGone(f"the {self.role} worker died ({self.last_death}); it is started again in {wait:.1f} s")
        self._hold_until = time.monotonic() + RESTART_S
        # As 65534 where the daemon is root: nothing a root daemon may read that the lent
        # fds do not give. Where 65534 cannot run this interpreter or import this package
        # (a virtualenv under a home directory), as the daemon's uid, said in the log.
        # Decided once: a fill worker starts per fill, and 65534 cannot come to run this
        # interpreter later if it could not at first.
        uids = [NOBODY, None] if os.geteuid() == 0 and not self._nobody_refused else [None]
        for uid in uids:
            try:
                proc, sock, hello = self._spawn(uid, self.role)
            except WorkerGone as exc:
                if uid is None:
                    raise
                self._nobody_refused = True
                log.warning("peers: the %s worker cannot run as uid %d (%s); it runs as uid 0, still holding only "
                            "what it %ss", self.role, NOBODY, exc, self.role)
                continue
            self.uid = os.geteuid() if uid is None else uid
            self._proc, self._sock = proc, sock
            threading.Thread(target=self._watch, args=(proc,), name=f"{self.role}-worker-watch", daemon=True).start()
            guards = hello.get("guards")
            self.guards = [str(g) for g in guards] if isinstance(guards, list) else []
            if "mseal" in hello:
                self.mseal = hello["mseal"] is True
            log.info("peers: %s worker started (pid %d, uid %d; %s%s)", self.role, proc.pid, self.uid,
                     ", ".join(self.guards), "" if "mseal" not in hello else ", read-only pages sealed" if self.mseal
                     else "; this kernel has no mseal: its read-only pages are not sealed")
            if not any(g.startswith("landlock") for g in self.guards):
                log.warning("peers: this kernel has no Landlock (Linux 5.13): the %s worker could write into other "
                            "processes of uid %d through /proc (docs/reliability.md)", self.role, self.uid)
            return sock
        raise AssertionError("unreachable")

    @staticmethod
    def _spawn(uid: int | None, role: Role) -> tuple[subprocess.Popen[bytes], socket.socket, dict[str, object]]:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
        env["PATH"] = "/usr/bin:/bin"
        # No shared-memory transports: the worker may create no file (its Landlock domain,
        # confine.py), and UCX's would be in /dev/shm. Peers on one host read through
        # cma or tcp. An operator's UCX_TLS naming them keeps the worker from starting.
        env.setdefault("UCX_TLS", "^mm")
        argv = [sys.executable, "-I", "-m", "weightcache.peers.lend_child", str(child.fileno()), role]
        # A session of its own: killing the worker kills what it forked too (kill_group).
        # Its output through a pipe, never the daemon's own stdout or stderr (a log file
        # there could be written or truncated by a compromised worker): relayed to the log.
        kw: dict[str, Any] = {"pass_fds": [child.fileno()], "cwd": "/", "env": env, "stdin": subprocess.DEVNULL,
                              "start_new_session": True, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE,
                              "close_fds": True}
        if uid is not None:
            kw.update(user=uid, group=uid, extra_groups=[])
        if os.geteuid() == 0:
            _unlimit_memlock()
        try:
            proc = subprocess.Popen(argv, **kw)
        except OSError as exc:
            parent.close()
            raise WorkerGone(f"the {role} worker did not start: {exc}") from None
        finally:
            child.close()
        threading.Thread(target=_relay_output, args=(proc, role), name=f"{role}-worker-output", daemon=True).start()
        parent.settimeout(START_TIMEOUT_S)
        try:
            hello = _recv(parent)
            if hello.get("ok") is not True:
                raise ValueError(str(hello.get("error")))
        except (OSError, EOFError, ValueError) as exc:
            proc.kill()
            proc.wait()
            parent.close()
            raise WorkerGone(f"the {role} worker did not start: {type(exc).__name__}: {exc}") from None
        parent.settimeout(None)
        return proc, parent, hello

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
        if proc.pid in self._retired:
            self._retired.discard(proc.pid)
        elif proc.pid in self._ended:
            self._ended.discard(proc.pid)
            log.info("peers: the %s worker (pid %d) was ended after a fill that did not end cleanly", self.role, proc.pid)
        elif rc != 0:
            self.deaths += 1
            self.last_death = why
            log.warning("peers: the %s worker (pid %d) ended with %s; the %ss it held are over", self.role, proc.pid, why,
                        self.role)
            self._on_gone(why)

    def _ask(self, msg: dict[str, object], fds: Sequence[int] = ()) -> dict[str, object]:
        sock = self._start()
        try:
            _send(sock, msg, fds)
            reply = _recv(sock)
        except (OSError, EOFError, ValueError) as exc:
            if self._proc is not None:
                self._proc.kill()
            raise WorkerGone(f"the {self.role} worker went away: {type(exc).__name__}: {exc}") from None
        if reply.get("ok") is not True:
            raise WorkerGone(f"the {self.role} worker refused: {reply.get('error')}")
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
            self._closed = True
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


# How long past a fill's own deadline (and stall bound) the daemon waits for the fill
# worker's answer before it kills the worker: its read returns within them, or is stuck.
FILL_GRACE_S = 30.0
REPORT_LIMIT = 4096  # bytes of one frame from the fill worker: its reports and answer are small
SEND_TIMEOUT_S = 10.0  # a worker that stops reading its socket is killed, not waited for


class FillWorker(LendWorker):
    """The daemon's handle on its fill worker (Note [a fill lands in a worker]): ``read``
    as Transport.read has it, into an arena the worker maps from its memfd. Each worker
    reads one fill: after it, clean or not, the worker is ended, so a worker that a
    lender's UCX compromised sees no later fill. After a clean one the next worker is
    started at once, in a thread, so its NIXL start (~1 s) is off the next fill's way."""

    def __init__(self, on_gone: Callable[[str], None] = lambda _why: None) -> None:
        super().__init__(on_gone, role="fill")
        self.fills = 0  # reads the workers ran, whatever their outcome
        self.ended = 0  # workers this side ended after a fill that did not end cleanly
        self.retired = 0  # workers ended after their clean fill

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "fills": self.fills, "ended": self.ended, "retired": self.retired,
                "mseal": self.mseal}

    def _retire(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        """End a worker whose fill ended cleanly (under the lock): not a death, and the
        next start is not held back."""
        self._retired.add(proc.pid)
        self.retired += 1
        kill_group(proc)
        if self._proc is proc:
            self._proc = self._sock = None
        sock.close()
        self._hold_until = 0.0

    def _start_ahead(self) -> None:
        if self._closed:
            return
        try:
            self.start()
        except WorkerGone as exc:  # the next fill tries again, and says why if it cannot
            log.warning("peers: the next fill worker did not start: %s", exc)

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:  # alive: ended here on purpose (one that died is a death)
            self._ended.add(proc.pid)
            self.ended += 1
        kill_group(proc)

    def read(self, fd: int, base: int, size: int, remote_md: bytes, extents: Sequence[Extent], memory: str, device_id: int,
             remote_memory: str, remote_device_id: int, *, window: int, on_done: Callable[[int, int], None],
             stop: Callable[[], str | None], deadline: float, stall_s: float = 5.0,
             pace: Callable[[int, int], None] = lambda _n, _dst: None,
             on_safe: Callable[[int], None] = lambda _upto: None) -> None:
        """Transport.read's contract for a host arena of ``size`` bytes that ``fd`` holds
        and this process maps at ``base`` (the extents' ``dst`` are in that mapping): the
        worker keeps up to ``window`` reads in flight, posting each extent only once
        ``pace`` returned for it here (this thread allows them as far ahead as ``pace``
        lets it); ``on_done`` runs in a listening thread as the worker reports each one
        in, then ``on_safe(upto)``: the arena's first ``upto`` bytes are out of the
        worker's reach (Watermark). Once this returns, all of it is. Raises
        TransferFailed as Transport.read does; returns only once the worker's read has
        nothing in flight, or the worker is dead."""
        from .transport import TransferFailed

        if not extents:
            return
        if any(not (base <= e.dst and e.dst + e.nbytes <= base + size) for e in extents):
            raise TransferFailed("an extent lands outside the arena")
        with self._lock:
            try:
                sock = self._start()
            except WorkerGone as exc:
                raise TransferFailed(str(exc)) from None
            proc = self._proc
            self.fills += 1
            # A worker that stops reading: its sends fail after SEND_TIMEOUT_S, not never.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_TIMEOUT_S), 0))
            try:
                _send(sock, {"op": "fill", "size": size, "metadata": base64.b64encode(remote_md).decode(),
                             "memory": memory, "device_id": device_id, "remote_memory": remote_memory,
                             "remote_device_id": remote_device_id, "window": window, "stall_s": stall_s,
                             "timeout_s": max(0.0, deadline - time.monotonic()),
                             "extents": [[e.dst - base, e.src, e.nbytes] for e in extents]}, [fd])
            except OSError as exc:
                if proc is not None:
                    self._end(proc)
                raise TransferFailed(f"the fill worker went away: {exc}") from None
            fill = _FillFromDaemon(sock, base, size, extents, window, on_done, on_safe)
            listener = threading.Thread(target=fill.listen, name="fill-worker-listen", daemon=True)
            listener.start()
            try:
                fill.run(stop, pace, deadline + stall_s + FILL_GRACE_S)
            except BaseException as exc:
                # Nothing may write into the arena once this returns, and nothing of this
                # fill may reach the next: a fill that did not end cleanly (its failure, a
                # stop, a report out of place, a worker that hung or stopped reading) ends
                # the worker, and what it forked, before this returns; the next fill starts
                # a new one (at most one start per RESTART_S).
                with contextlib.suppress(OSError):
                    _send(sock, {"op": "stop", "why": f"the daemon stopped the fill: {type(exc).__name__}: {exc}"})
                if proc is not None:
                    self._end(proc)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # the listener sees the end even if a fork kept the socket
                listener.join()
                if isinstance(exc, OSError):
                    raise TransferFailed(f"the fill worker went away: {exc}") from None
                raise
            with contextlib.suppress(OSError):
                _send(sock, {"op": "finish"})
            if proc is not None:
                self._retire(proc, sock)
        threading.Thread(target=self._start_ahead, name="fill-worker-start", daemon=True).start()


RELAYED_LINES = 200  # of a worker's output, each cut at RELAYED_LINE bytes; the rest dropped
RELAYED_LINE = 1000


_memlock_said = False


def _unlimit_memlock() -> None:
    """RDMA registration pins the memory registered, counted against RLIMIT_MEMLOCK unless
    the process has CAP_IPC_LOCK, which a worker running as 65534 lacks (a root worker
    keeps it: confine.py). So a root daemon lifts its own limit, which the workers it
    starts inherit: to unlimited where it has CAP_SYS_RESOURCE, else its soft limit to its
    hard one, said once. A worker can pin no more than it could allocate."""
    global _memlock_said
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == hard == resource.RLIM_INFINITY:
        return
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        return
    except (OSError, ValueError):
        pass
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
    if not _memlock_said:
        _memlock_said = True
        log.warning("peers: RLIMIT_MEMLOCK stays at %d bytes (no CAP_SYS_RESOURCE to lift it): a worker running as "
                    "uid %d registers no more than that for RDMA (docs/deployment.md)", hard, NOBODY)


def _relay_output(proc: subprocess.Popen[bytes], role: str) -> None:
    """A worker's stderr (NIXL's and UCX's messages) into the daemon's log, bounded: a
    compromised worker may write anything there."""
    assert proc.stderr is not None
    with proc.stderr as out:
        # readline with a limit: a line without end is read in bounded pieces, never whole.
        for n, raw in enumerate(iter(lambda: out.readline(RELAYED_LINE), b"")):
            if n == RELAYED_LINES:
                log.warning("peers: the %s worker (pid %d) wrote more than %d lines; the rest is dropped", role,
                            proc.pid, RELAYED_LINES)
            if n >= RELAYED_LINES:
                continue
            line = raw.decode("utf-8", "replace").rstrip()
            log.log(logging.WARNING if "ERROR" in line or "Error" in line else logging.INFO,
                    "peers: %s worker (pid %d): %s", role, proc.pid, line, extra={"worker": role})


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a worker and everything in its session (start_new_session), and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, 9)
    proc.kill()
    proc.wait()


class _FillFromDaemon:
    """One read through the fill worker, the daemon's side: ``run`` allows the extents one
    by one as ``pace`` lets it, at most 2 x ``window`` ahead of the reports, then waits
    for the answer; ``listen`` (a thread) checks each report against what was allowed
    and not yet reported, hands it to ``on_done`` and the new Watermark to ``on_safe``,
    and notes the answer. Anything out of place is a broken fill (``error``)."""

    def __init__(self, sock: socket.socket, base: int, size: int, extents: Sequence[Extent], window: int,
                 on_done: Callable[[int, int], None], on_safe: Callable[[int], None]) -> None:
        self.sock, self.base, self.extents, self.on_done, self.on_safe = sock, base, extents, on_done, on_safe
        self.mark = Watermark([(e.dst - base, e.nbytes) for e in extents], size)
        self.ahead = 2 * max(window, 1)
        self.answered = threading.Event()  # the worker's read ended and it said "ok"
        self.over = threading.Event()  # the listener is done, answered or not
        self.cond = threading.Condition()
        self.pending: dict[int, int] = {}  # allowed, not reported yet: arena offset -> bytes
        self.reported = 0
        self.error: str | None = None  # why the read failed, as the worker or this side saw it

    def _fail(self, why: str) -> None:
        with self.cond:
            self.error = self.error or why
            self.cond.notify_all()

    def listen(self) -> None:
        try:
            while True:
                try:
                    msg = _recv(self.sock, limit=REPORT_LIMIT)
                except Exception as exc:  # the end, a timeout, a frame too big or not JSON
                    self._fail(f"the fill worker went away: {type(exc).__name__}: {exc}")
                    return
                if "result" in msg:
                    if msg["result"] != "ok":
                        self._fail(str(msg.get("error", "the fill worker's read failed"))[:500])
                    elif self.reported != len(self.extents):
                        self._fail(f"the fill worker answered ok with {self.reported} of {len(self.extents)} extents in")
                    else:
                        self.answered.set()
                    return
                d = msg.get("done")
                with self.cond:
                    ok = (isinstance(d, list) and len(d) == 2 and all(isinstance(x, int) for x in d)
                          and self.pending.get(d[0]) == d[1])
                    if ok:
                        assert isinstance(d, list)
                        del self.pending[d[0]]
                        self.reported += 1
                        self.cond.notify_all()
                if not ok:
                    self._fail("the fill worker reported an extent it was not allowed, or twice")
                    return
                if self.error is None:
                    try:
                        self.on_done(self.base + d[0], d[1])  # type: ignore[index]
                        self.on_safe(self.mark.add(d[0]))  # type: ignore[index]
                    except Exception as exc:  # hashing a piece failed: the fill fails
                        self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self.over.set()
            with self.cond:
                self.cond.notify_all()

    def run(self, stop: Callable[[], str | None], pace: Callable[[int, int], None], give_up_at: float) -> None:
        from .transport import TransferFailed

        def check() -> None:
            why = self.error or stop()
            if why is not None:
                raise TransferFailed(why)
            if self.over.is_set() and not self.answered.is_set():
                raise TransferFailed("the fill worker went away")
            if time.monotonic() > give_up_at:
                raise TransferFailed("the fill worker did not answer in time")

        for k, e in enumerate(self.extents):
            with self.cond:  # at most ``ahead`` allowed and not reported: the worker's socket never fills
                while len(self.pending) >= self.ahead and self.error is None and not self.over.is_set():
                    self.cond.wait(0.05)
                    if stop() is not None or time.monotonic() > give_up_at:
                        break
            check()
            pace(e.nbytes, e.dst)  # its pages reserved, the rate cap kept: then the worker may post it
            with self.cond:
                self.pending[e.dst - self.base] = e.nbytes
            try:
                _send(self.sock, {"op": "allow", "upto": k + 1})
            except OSError as exc:  # gone, or not reading its socket (SEND_TIMEOUT_S)
                raise TransferFailed(f"the fill worker went away: {type(exc).__name__}: {exc}") from None
        while not self.over.wait(0.05):
            check()
        check()


# -- the child -----------------------------------------------------------------------------
def _serve_fills(sock: socket.socket, transport: Any, seals: bool) -> None:
    """The fill worker: one read at a time into the memfd the daemon passed (Note [a fill
    lands in a worker]), each range it makes read-only sealed where ``seals``."""
    while True:
        fds: list[int] = []
        try:
            msg = _recv(sock, fds)
        except (EOFError, OSError):
            os._exit(0)  # the daemon closed the socket, or died
        try:
            if msg.get("op") != "fill" or len(fds) != 1:
                _send(sock, {"result": "failed", "error": f"unknown op {msg.get('op')!r} with {len(fds)} fd(s)"})
                continue
            _FillInWorker(sock, transport, fds.pop(), msg, seals).run()  # it closes the fd
        except Exception as exc:
            with contextlib.suppress(OSError):
                _send(sock, {"result": "failed", "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for fd in fds:
                os.close(fd)


class _FillInWorker:
    """One read in the fill worker: the extents are posted as the daemon's ``allow``s come,
    stopped by its ``stop``; a thread reads those until the daemon's ``finish``, which
    follows this read's answer."""

    def __init__(self, sock: socket.socket, transport: Any, fd: int, msg: dict[str, object], seals: bool) -> None:
        self.sock, self.transport, self.fd, self.msg, self.seals = sock, transport, fd, msg, seals
        self.cond = threading.Condition()
        self.allowed = self.posted = 0
        self.why: str | None = None

    def run(self) -> None:
        from ..backends.page_cache import make_readonly, map_writable, unmap
        from .confine import seal
        from .transport import Extent, TransferFailed

        msg = self.msg
        size, raw = msg.get("size"), msg.get("extents")
        try:
            if not (isinstance(size, int) and size > 0 and isinstance(raw, list)):
                raise ValueError("a fill without a size or extents")
            addr = map_writable(self.fd, size)
        finally:
            # Closed once mapped: no fd left here to write the arena through, past the
            # mapping's protections, nor one another process could open in /proc.
            os.close(self.fd)
        mapped = True
        try:
            extents = [Extent(addr + off, src, n) for off, src, n in raw if off >= 0 and n > 0 and off + n <= size]
            if len(extents) != len(raw):
                raise ValueError("an extent lands outside the arena")
            mark = Watermark([(e.dst - addr, e.nbytes) for e in extents], size)

            def report(dst: int, n: int) -> None:
                below = mark.upto
                if mark.add(dst - addr) > below:  # out of reach before the daemon hashes it
                    make_readonly(addr + below, mark.upto - below)
                    if self.seals:  # and kept so (Note [a worker is confined])
                        seal(addr + below, mark.upto - below)
                _send(self.sock, {"done": [dst - addr, n]})

            listener = threading.Thread(target=self._control, daemon=True)
            listener.start()
            result: dict[str, object] = {"result": "ok"}
            try:
                self.transport.read(base64.b64decode(str(msg["metadata"])), extents, str(msg["memory"]),
                                    int(str(msg["device_id"])), str(msg["remote_memory"]), int(str(msg["remote_device_id"])),
                                    window=int(str(msg["window"])), stall_s=float(str(msg["stall_s"])),
                                    deadline=time.monotonic() + float(str(msg["timeout_s"])),
                                    on_done=report,
                                    stop=self._stop, pace=self._pace)
            except TransferFailed as exc:
                result = {"result": "failed", "error": str(exc)}
            # Unmapped before the answer where nothing is sealed (after a failure, say). A
            # sealed range stays mapped (munmap refuses it) until the daemon kills this
            # process, which it does before it seals the memfd (FillWorker.read).
            unmap(addr, size)
            mapped = False
            _send(self.sock, result)
            if self._stop() == GONE:
                os._exit(0)
            listener.join()
        finally:
            if mapped:
                unmap(addr, size)

    def _control(self) -> None:
        while True:
            try:
                m = _recv(self.sock)
            except (EOFError, OSError, ValueError):
                m = {"op": "stop", "why": GONE}
            with self.cond:
                upto = m.get("upto")
                if m.get("op") == "allow" and isinstance(upto, int):
                    self.allowed = max(self.allowed, upto)
                elif m.get("op") == "stop":
                    self.why = self.why or str(m.get("why"))
                self.cond.notify_all()
                if m.get("op") == "finish" or self.why == GONE:
                    return

    def _pace(self, _nbytes: int, _dst: int) -> None:
        from .transport import TransferFailed

        with self.cond:
            self.cond.wait_for(lambda: self.allowed > self.posted or self.why is not None)
            if self.why is not None:
                raise TransferFailed(self.why)
            self.posted += 1

    def _stop(self) -> str | None:
        with self.cond:
            return self.why


GONE = "the daemon went away"


def _serve(sock: socket.socket, transport: Any) -> None:
    from ..backends.page_cache import map_readonly, unmap

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


def serve_fd(fd: int, role: str = "lend") -> None:
    """The child's life: confine itself, start its NIXL agent, say whether it could, then
    serve the daemon on the socket ``fd`` until it closes (lend_child.py)."""
    from .confine import Unconfined, can_seal, confine
    from .transport import Transport

    logging.basicConfig(level=logging.WARNING, format=f"{role} worker: %(message)s")
    sock = socket.socket(fileno=fd)
    # First, while this is the process's only thread: every thread NIXL starts inherits
    # the confinement (Note [a worker is confined]). Without it the worker does not start.
    why: str | None = None
    guards: list[str] = []
    try:
        guards = confine()
    except Unconfined as exc:
        why = str(exc)
    if why is None and role == "fill":
        # Not dumpable: no other process of its uid (65534 is shared: another daemon's lend
        # worker, any service run as nobody) may open its /proc files, the arena's memfd
        # among them, or ptrace it. Not for the lend worker: a borrower on this host reads
        # from it with process_vm_readv (UCX's cma), which needs exactly that access.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            why = f"prctl: {os.strerror(ctypes.get_errno())}"
    if why is not None:
        _send(sock, {"ok": False, "error": why})
        return
    try:
        transport = Transport()
    except Exception as exc:
        _send(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return
    if role == "fill":
        seals = can_seal()
        _send(sock, {"ok": True, "guards": guards, "mseal": seals})
        _serve_fills(sock, transport, seals)
    else:
        _send(sock, {"ok": True, "guards": guards})
        _serve(sock, transport)
