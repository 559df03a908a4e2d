"""The daemon's side of a read through the fill worker (peers/lend_worker.py, Note [a fill
lands in a worker]) against a scripted worker on a socketpair: no NIXL, no process. A
worker's reports are accepted only for extents it was allowed and has not reported yet;
the daemon never allows more than twice the window ahead of the reports, so a worker
that stops reading cannot fill the socket; anything out of place fails the read."""

from __future__ import annotations

import ctypes
import mmap
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import save_file

from weightcache.backends.cpu import CpuBackend
from weightcache.errors import LoadFailed
from weightcache.loader import Progress, fingerprint_files, open_checkpoint
from weightcache.peers.confine import can_seal
from weightcache.peers.fill import Lent, PeerFill
from weightcache.peers.lend_worker import Watermark, _FillFromDaemon, _recv, _send
from weightcache.peers.transport import Extent, TransferFailed

BASE = 1 << 20
EXTENTS = [Extent(BASE + 10 * k, 10 * k, 10) for k in range(6)]


def start(window: int = 1) -> tuple[_FillFromDaemon, socket.socket, list[tuple[int, int]], threading.Thread]:
    daemon_end, worker_end = socket.socketpair()
    done: list[tuple[int, int]] = []
    fill = _FillFromDaemon(daemon_end, BASE, 60, EXTENTS, window, lambda dst, n: done.append((dst, n)), lambda _upto: None)
    listener = threading.Thread(target=fill.listen, daemon=True)
    listener.start()
    return fill, worker_end, done, listener


def run_in_thread(fill: _FillFromDaemon, stop: Any = lambda: None, give_up_s: float = 10.0) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            fill.run(stop, lambda _n, _dst: None, time.monotonic() + give_up_s)
            out["ok"] = True
        except TransferFailed as exc:
            out["error"] = str(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    out["thread"] = t
    return out


def test_an_honest_worker_reports_each_allowed_extent_once() -> None:
    fill, worker, done, _ = start(window=2)
    out = run_in_thread(fill)
    seen = 0
    while seen < len(EXTENTS):
        msg = _recv(worker)
        assert msg["op"] == "allow"
        for k in range(seen, int(msg["upto"])):  # type: ignore[call-overload]
            _send(worker, {"done": [10 * k, 10]})
        seen = int(msg["upto"])  # type: ignore[call-overload]
    _send(worker, {"result": "ok"})
    out["thread"].join(5)
    assert out.get("ok") is True, out
    assert done == [(e.dst, e.nbytes) for e in EXTENTS]


def test_a_report_for_an_extent_not_allowed_fails_the_read() -> None:
    fill, worker, done, listener = start()
    _send(worker, {"done": [50, 10]})  # the last extent, before anything was allowed
    listener.join(5)
    out = run_in_thread(fill)
    out["thread"].join(5)
    assert "not allowed" in out["error"] and done == []


def test_a_report_given_twice_fails_the_read() -> None:
    fill, worker, done, _ = start()
    out = run_in_thread(fill)
    assert _recv(worker) == {"op": "allow", "upto": 1}
    _send(worker, {"done": [0, 10]})
    _send(worker, {"done": [0, 10]})  # again: would hash the piece again
    out["thread"].join(5)
    assert "twice" in out["error"] and done == [(BASE, 10)]


def test_ok_with_extents_missing_fails_the_read() -> None:
    fill, worker, _, _ = start(window=3)
    out = run_in_thread(fill)
    assert _recv(worker)["op"] == "allow"
    _send(worker, {"result": "ok"})
    out["thread"].join(5)
    assert "0 of 6" in out["error"]


@pytest.mark.parametrize("window", [1, 2])
def test_allows_stay_within_twice_the_window_of_the_reports(window: int) -> None:
    """A worker that reads its socket but reports nothing gets at most 2 x window allows."""
    fill, worker, _, _ = start(window)
    stopped: list[str] = []
    out = run_in_thread(fill, stop=lambda: stopped[0] if stopped else None)
    worker.settimeout(10)  # the allows that may come, however slow a busy machine is
    allows = [_recv(worker) for _ in range(2 * window)]
    worker.settimeout(0.5)  # and then no more
    with pytest.raises(TimeoutError):
        allows.append(_recv(worker))
    assert [m["upto"] for m in allows] == list(range(1, 2 * window + 1))
    stopped.append("the load was cancelled")
    out["thread"].join(5)
    assert out["error"] == "the load was cancelled"


def test_a_worker_that_goes_away_fails_the_read() -> None:
    fill, worker, _, _ = start()
    out = run_in_thread(fill)
    worker.close()
    out["thread"].join(5)
    assert "went away" in out["error"]


def test_a_huge_report_frame_is_refused_unread() -> None:
    fill, worker, _, listener = start()
    worker.sendall((64 << 20).to_bytes(4, "big"))  # a 64 MiB frame announced
    listener.join(5)
    out = run_in_thread(fill)
    out["thread"].join(5)
    assert "went away" in out["error"] and "bytes" in out["error"]


# -- what the reader can still write once a piece is hashed --------------------------------
PAGE = mmap.PAGESIZE


def test_the_watermark_stops_at_the_page_of_the_lowest_extent_not_in() -> None:
    # Three extents out of order, the first two sharing the page at PAGE..2*PAGE.
    mark = Watermark([(0, PAGE + 10), (PAGE + 10, PAGE), (2 * PAGE + 10, 100)], 3 * PAGE)
    assert mark.add(PAGE + 10) == 0  # the first is not in: nothing out of reach
    assert mark.add(0) == 2 * PAGE  # the third's page holds bytes still to come
    assert mark.add(2 * PAGE + 10) == 3 * PAGE  # all in: the whole arena, gaps included


def _fill_through(tmp_path: Path, late_write: bool) -> str:
    """A PeerFill into a memfd arena through a stand-in for the fill worker that lands the
    lender's bytes, reports each extent, but keeps write access to all of them (its
    Watermark never moves); with ``late_write`` the lender then changes one byte of the
    first tensor, as a lender over TCP could while the read runs. The fingerprint, or
    the LoadFailed's message."""
    g = torch.Generator().manual_seed(3)
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.randn(70_000, generator=g), "b": torch.randn(5, generator=g),
               "c": torch.randn(300_000, generator=g)}, str(path))
    ckpt = open_checkpoint(path)
    lender = bytearray(max(t.arena_offset + t.nbytes for t in ckpt.tensors))
    data = path.read_bytes()
    for t in ckpt.tensors:
        lender[t.arena_offset : t.arena_offset + t.nbytes] = data[t.file_offset : t.file_offset + t.nbytes]
    src = ctypes.addressof((ctypes.c_char * len(lender)).from_buffer(lender))

    class KeepsWriting:
        def read(self, fd: int, base: int, size: int, md: bytes, extents: list[Extent], *a: Any,
                 on_done: Any, pace: Any, on_safe: Any, **kw: Any) -> None:
            for e in extents:
                pace(e.nbytes, e.dst)
                ctypes.memmove(e.dst, e.src, e.nbytes)
                on_done(e.dst, e.nbytes)
                on_safe(0)
            if late_write:
                first = min(ckpt.tensors, key=lambda t: t.arena_offset if t.nbytes else 1 << 62)
                ctypes.memset(base + first.arena_offset, 0x55, 1)

    backend = CpuBackend("cpu", page_cache=False)
    arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "m")
    lent = Lent(b"", "DRAM", 0, ((0, src, len(lender)),))
    fill = PeerFill(None, backend, lent, fingerprint_files(path), lambda: None, 30.0, worker=cast(Any, KeepsWriting()))
    try:
        got = fill(ckpt, arena, Progress(ckpt.data_bytes))
        assert got is not None
        return got
    except LoadFailed as exc:
        return str(exc)
    finally:
        backend.free(arena)


def test_pieces_are_hashed_only_once_the_worker_can_no_longer_write_them(tmp_path: Path) -> None:
    assert _fill_through(tmp_path, late_write=False) == fingerprint_files(tmp_path / "m.safetensors")
    # Hashed as reported, the late byte went unseen and the fill passed with it.
    assert "do not match this checkpoint's fingerprint" in _fill_through(tmp_path, late_write=True)


CHILD = """
import ctypes, mmap, os, socket, sys, threading
from weightcache.peers import lend_worker as lw
PAGE = mmap.PAGESIZE
fd = os.memfd_create("arena")
os.ftruncate(fd, 3 * PAGE)
daemon, worker = socket.socketpair()
raw = [[0, 0, PAGE + 10], [PAGE + 10, 0, 2 * PAGE - 10]]
target, seals = int(sys.argv[1]), sys.argv[2] == "seal"
libc = ctypes.CDLL(None, use_errno=True)

class Lender:  # lands each extent, then writes where a lender over TCP could
    def read(self, md, extents, memory, device_id, rm, rdid, *, on_done, pace, **kw):
        pace(extents[0].nbytes, extents[0].dst)
        ctypes.memset(extents[0].dst, 1, extents[0].nbytes)
        on_done(extents[0].dst, extents[0].nbytes)
        if sys.argv[3] == "undo":  # code a lender runs in the worker: the reported page writable again
            page = extents[0].dst // PAGE * PAGE
            ok = libc.mprotect(ctypes.c_void_p(page), PAGE, mmap.PROT_READ | mmap.PROT_WRITE) == 0
            print("made writable again" if ok else f"refused: {os.strerror(ctypes.get_errno())}", flush=True)
        pace(extents[1].nbytes, extents[1].dst)
        ctypes.memset(extents[1].dst, 1, extents[1].nbytes)  # in flight: still writable
        print("wrote the extent in flight", flush=True)
        ctypes.memset(extents[0].dst + target, 2, 1)  # into the extent reported
        print("wrote the extent reported", flush=True)
        on_done(extents[1].dst, extents[1].nbytes)

def the_daemon():
    lw._send(daemon, {"op": "allow", "upto": 2})
    while "result" not in lw._recv(daemon):
        pass
    lw._send(daemon, {"op": "finish"})

threading.Thread(target=the_daemon, daemon=True).start()
msg = {"size": 3 * PAGE, "extents": raw, "metadata": "", "memory": "DRAM", "device_id": 0, "remote_memory": "DRAM",
       "remote_device_id": 0, "window": 2, "stall_s": 5, "timeout_s": 10}
lw._FillInWorker(worker, Lender(), fd, msg, seals).run()
print("the read ended", flush=True)
"""


@pytest.mark.parametrize(("offset", "faults"), [(0, True), (PAGE + 5, False)])
def test_a_write_into_a_reported_extent_faults_in_the_worker(offset: int, faults: bool) -> None:
    """The fill worker's own side: once the first extent is reported, its page below the
    second's is read-only in the worker, so a write there kills the worker (SIGSEGV);
    its tail on the page the second extent shares stays writable, and the daemon hashes
    the piece only once that page is out of reach too (the test above)."""
    p = subprocess.run([sys.executable, "-c", CHILD, str(offset), "seal", "write"], capture_output=True, text=True,
                       timeout=60)
    assert "wrote the extent in flight" in p.stdout, p.stderr
    if faults:
        assert p.returncode == -signal.SIGSEGV and "wrote the extent reported" not in p.stdout, (p.returncode, p.stdout)
    else:
        assert p.returncode == 0 and "the read ended" in p.stdout, (p.returncode, p.stdout, p.stderr)


@pytest.mark.skipif(not can_seal(), reason="this kernel has no mseal (Linux 6.10)")
@pytest.mark.parametrize("seals", [True, False])
def test_a_worker_cannot_make_a_reported_page_writable_again(seals: bool) -> None:
    """Code a lender got to run in the fill worker tries to undo the read-only bound
    (Note [a worker is confined]): with the pages sealed, mprotect is refused and the
    write into the reported extent still faults; unsealed (as on a kernel without
    mseal), it succeeds and the write goes through."""
    p = subprocess.run([sys.executable, "-c", CHILD, "0", "seal" if seals else "no", "undo"], capture_output=True,
                       text=True, timeout=60)
    if seals:
        assert "refused: Operation not permitted" in p.stdout, (p.stdout, p.stderr)
        assert p.returncode == -signal.SIGSEGV and "wrote the extent reported" not in p.stdout, (p.returncode, p.stdout)
    else:
        assert "made writable again" in p.stdout and "wrote the extent reported" in p.stdout, (p.stdout, p.stderr)


CONFINED = """
import ctypes, errno, mmap, os, socket, subprocess, sys, threading
from weightcache.backends.page_cache import make_readonly, map_writable
from weightcache.peers.confine import ABI, confine, seal
nr = ABI.denied
victim = int(sys.argv[1])  # a process of this uid, outside the confinement
fd = os.memfd_create("arena")
os.ftruncate(fd, 2 * mmap.PAGESIZE)
addr = map_writable(fd, 2 * mmap.PAGESIZE)
os.close(fd)
mine = sys.argv[2] + ".mine"  # a file of the worker's uid, made before it is confined
open(mine, "w").close()
os.chmod(mine, 0o600)
# A directory standing for /dev/infiniband (WRITABLE_DEVICES), with a "device" in it.
from weightcache.peers import confine as confinement
devices = sys.argv[2] + ".dev"
os.mkdir(devices)
open(devices + "/uverbs0", "w").close()
confinement.WRITABLE_DEVICES = (devices,)
guards = confine()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.mremap.restype = ctypes.c_void_p
seen = []
t = threading.Thread(target=seen.append, args=("thread",)); t.start(); t.join()
def refused(what, call):
    # Python calls raise when refused; libc's (ints) return -1, or MAP_FAILED, and set errno.
    try:
        got = call()
    except OSError as exc:
        assert exc.errno in (errno.EPERM, errno.EACCES), (what, exc)
        return
    if isinstance(got, int) and got in (-1, 2**64 - 1):
        assert ctypes.get_errno() in (errno.EPERM, errno.EACCES), (what, os.strerror(ctypes.get_errno()))
        return
    seen.append(what)
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
refused("fork", os.fork)
refused("spawn", lambda: subprocess.run(["/bin/true"]))
refused("io_uring", lambda: libc.syscall(425, 1, None))
refused("pidfd_getfd", lambda: libc.syscall(438, os.getpid(), 0, 0))
refused("process_madvise", lambda: libc.syscall(440, os.getpid(), iov, 1, 8, 0))
refused("process_vm_writev", lambda: libc.process_vm_writev(victim, iov, 1, iov, 1, 0))
# Into itself, as UCX's CMA transport tries at start (refused, it leaves CMA out): allowed,
# and still bound by page protections: the arena's read-only, sealed range stays unwritten.
mark = ctypes.create_string_buffer(b"x" * 8)
src = (ctypes.c_void_p * 2)(ctypes.addressof(mark), 8)
if libc.process_vm_writev(os.getpid(), src, 1, iov, 1, 0) != 8 or buf.raw != b"x" * 8:
    seen.append("no process_vm_writev into itself: " + os.strerror(ctypes.get_errno()))
make_readonly(addr + mmap.PAGESIZE, mmap.PAGESIZE)
seal(addr + mmap.PAGESIZE, mmap.PAGESIZE)
ro = (ctypes.c_void_p * 2)(addr + mmap.PAGESIZE, 8)
if libc.process_vm_writev(os.getpid(), src, 1, ro, 1, 0) != -1 or ctypes.get_errno() != errno.EFAULT:
    seen.append("process_vm_writev into its read-only range")
refused("madvise(MADV_REMOVE)", lambda: libc.madvise(ctypes.c_void_p(addr), mmap.PAGESIZE, 9))
refused("mremap alias", lambda: libc.mremap(ctypes.c_void_p(addr), 0, mmap.PAGESIZE, 1))
refused("mremap grown", lambda: libc.mremap(ctypes.c_void_p(addr), mmap.PAGESIZE, 2 * mmap.PAGESIZE, 1))
refused("remap_file_pages", lambda: libc.syscall(nr["remap_file_pages"], ctypes.c_void_p(addr), mmap.PAGESIZE, 0, 1, 0))
refused("userfaultfd", lambda: libc.syscall(nr["userfaultfd"], 1))
refused("shmget", lambda: libc.syscall(nr["shmget"], 0, 4096, 0o1600))
refused("add_key", lambda: libc.syscall(nr["add_key"], b"user", b"wc-confine-test", b"x", 1, -2))
refused("unshare", lambda: libc.syscall(nr["unshare"], 0x10000000))  # CLONE_NEWUSER
refused("chmod", lambda: os.chmod(mine, 0o4777))
refused("a Unix socket", lambda: socket.socket(socket.AF_UNIX))
socket.socket(socket.AF_INET).close()  # what UCX's TCP needs stays allowed
if any(g.startswith("landlock") for g in guards):
    refused("/proc/PID/mem", lambda: os.open(f"/proc/{victim}/mem", os.O_RDWR))
    refused("/proc/PID/fd", lambda: os.open(f"/proc/{victim}/fd/0", os.O_RDONLY))
    refused("a file written", lambda: os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT, 0o600))
    try:  # a device beneath WRITABLE_DEVICES opens for writing, as UCX's RDMA transports open theirs
        os.close(os.open(devices + "/uverbs0", os.O_RDWR))
    except OSError as exc:
        seen.append(f"no device opened for writing: {exc}")
    refused("a file made beside the devices", lambda: os.open(devices + "/new", os.O_WRONLY | os.O_CREAT, 0o600))
with open(sys.argv[0] if sys.argv[0] != "-c" else "/etc/hostname", "rb") as f:  # reads stay allowed
    f.read(1)
if os.geteuid() == 0:
    eff = next(line for line in open("/proc/self/status") if line.startswith("CapEff:"))
    if int(eff.split()[1], 16) != 1 << 14:  # CAP_IPC_LOCK alone: RDMA's pinning
        seen.append("capabilities " + eff.split()[1])
print(" ".join(guards), "|", " ".join(seen))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="the filter knows x86_64 and aarch64")
def test_a_confined_worker_starts_threads_but_no_process_and_writes_no_other_process(tmp_path: Path) -> None:
    """Each way around the confinement that two reviews found, refused (Note [a worker is
    confined]): a process started or a namespace entered, another process written
    (directly, through /proc or its fds, SysV IPC, keyrings), a hole punched in the
    arena's memfd, a writable alias or remap of its pages, userfaultfd, a file written or
    its mode changed, a Unix socket made; threads, reads and TCP sockets still work. A process_vm_writev into itself works (UCX offers its CMA
    transport only then), into its own read-only range it faults. The RDMA devices
    (WRITABLE_DEVICES) open for writing; nothing can be made beside them. Root keeps
    CAP_IPC_LOCK alone, for RDMA's pinning."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        p = subprocess.run([sys.executable, "-c", CONFINED, str(victim.pid), str(tmp_path / "written")],
                           capture_output=True, text=True, timeout=60)
    finally:
        victim.kill()
        victim.wait()
    assert p.returncode == 0, p.stderr
    guards, seen = p.stdout.split("|")
    assert seen.split() == ["thread"], p.stdout
    assert "seccomp" in guards.split()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(444, None, 0, 1) > 0:  # this kernel has Landlock: the worker entered a domain
        assert "landlock" in guards, guards
    assert not (tmp_path / "written").exists()


def test_a_workers_output_reaches_the_log_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """A worker may write anything on its stderr: one endless line is relayed in pieces
    of RELAYED_LINE bytes, and no more than RELAYED_LINES of them."""
    from weightcache.peers import lend_worker as lw

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('x' * 10_000_000)"],
                            stderr=subprocess.PIPE)
    with caplog.at_level("INFO", logger="weightcache.peers"):
        lw._relay_output(proc, "fill")
    proc.wait()
    relayed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("peers: fill worker (pid")]
    assert len(relayed) == lw.RELAYED_LINES
    assert all(m.count("x") == lw.RELAYED_LINE for m in relayed)
    assert any("the rest is dropped" in r.getMessage() for r in caplog.records)


def test_the_memlock_limit_the_workers_inherit_is_lifted_as_far_as_the_daemon_can() -> None:
    """RDMA registrations pin memory against RLIMIT_MEMLOCK in a worker without
    CAP_IPC_LOCK (one running as 65534): a root daemon lifts its own limit before it starts
    one, to unlimited where it may raise the hard limit, else the soft one to the hard."""
    code = ("import resource; from weightcache.peers import lend_worker as lw; L = resource.RLIMIT_MEMLOCK\n"
            "soft, hard = resource.getrlimit(L)\n"
            "low = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)\n"
            "resource.setrlimit(L, (low, hard))\n"
            "lw._unlimit_memlock()\n"
            "got = resource.getrlimit(L)\n"
            "print(got[0] == got[1] and got[0] >= hard if hard != resource.RLIM_INFINITY else got[0] == got[1])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True"], p.stdout
