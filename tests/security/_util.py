"""Helpers for the adversarial suite: untrusted peers (forked children that drop to another
uid), raw frames, and measurements of the daemon process (/proc/<pid>)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
from helpers import NOBODY, _child_run

from weightcache.protocol import encode_frame
from weightcache.tools.spawn import DaemonProcess, config_text
from weightcache.tools.synth import synth_tensors, write_checkpoint

OTHER = 65533  # a second untrusted tenant (no passwd entry needed: setuid takes any uid)
MIB = 2**20

__all__ = ["DaemonProcess", "config_text", "synth_tensors", "write_checkpoint"]


MULTI = {"socket_mode": 0o666, "allowed_uids": [0, NOBODY, OTHER]}


def hello(rid: int = 1) -> dict[str, Any]:
    return {"id": rid, "op": "hello", "protocol": 1, "client": "adversary"}


def open_to_all(d: Any) -> Any:
    """Let other uids reach the socket: only the daemon's own checks may refuse them."""
    os.chmod(Path(d.socket).parent, 0o755)
    return d


def multi_tenant(start_daemon: Any, extra: dict[str, Any] | None = None, **kw: Any) -> Any:
    return open_to_all(start_daemon(extra_daemon={**MULTI, **(extra or {})}, **kw))


def public_dir(prefix: str = "wcpub-") -> Path:
    """A directory under /tmp every uid may read (pytest's tmp_path is root-only)."""
    import tempfile

    p = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(p, 0o755)
    return p


@contextlib.contextmanager
def held_as_uid(uid: int, fn: Callable[[], Any], timeout: float = 30) -> Iterator[Any]:
    """Like as_uid, but the child keeps running (holding whatever ``fn`` opened) until the
    block exits: yields ``fn``'s result while the child still holds its connections."""
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        out: Any = {}
        keep: list[Any] = []
        try:
            os.close(r)
            os.close(w2)
            out = _child_run(uid, lambda: fn(keep))
        except BaseException as exc:
            out = {"exception": repr(exc)}
        finally:
            os.write(w, json.dumps(out, default=repr).encode() + b"\n")
            os.close(w)
            with contextlib.suppress(BaseException):
                select.select([r2], [], [], timeout)
            os._exit(0)
    os.close(w)
    os.close(r2)
    data = b""
    try:
        deadline = time.monotonic() + timeout
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise AssertionError(f"child as uid {uid} did not report within {timeout}s")
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
        yield json.loads(data)
    finally:
        os.close(w2)
        os.close(r)
        os.waitpid(pid, 0)


class Conn:
    """A blocking raw protocol connection (usable in forked children too)."""

    def __init__(self, path: str, greet: bool = True, timeout: float = 10) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""
        self.fds: list[int] = []
        if greet:
            r = self.call(hello(0))
            assert r is not None and r.get("ok"), r

    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        data = encode_frame(msg)
        if fds:
            import array

            self.sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            data = data[1:]
        self.sock.sendall(data)

    def recv(self) -> dict[str, Any] | None:
        """The next frame (events included), or None once the daemon closed the connection."""
        import array

        while len(self.buf) < 4 or len(self.buf) < 4 + int.from_bytes(self.buf[:4], "big"):
            try:
                chunk, anc, _flags, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(253 * 4))
            except (ConnectionResetError, BrokenPipeError):
                return None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(payload[: len(payload) - len(payload) % 4])
                    self.fds.extend(a)
            if not chunk:
                return None
            self.buf += chunk
        n = int.from_bytes(self.buf[:4], "big")
        payload, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)

    def reply(self, rid: Any) -> dict[str, Any] | None:
        """The reply to ``rid`` (skipping events and other ids); None if the connection closed."""
        while True:
            m = self.recv()
            if m is None or m.get("id") == rid:
                return m

    def call(self, msg: dict[str, Any], fds: list[int] | None = None) -> dict[str, Any] | None:
        self.send(msg, fds)
        return self.reply(msg["id"])

    def take_fds(self) -> list[int]:
        out, self.fds = self.fds, []
        return out

    def close(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
        self.sock.close()


def calls(path: str, msgs: list[dict[str, Any]], greet: bool = True) -> list[dict[str, Any] | None]:
    """Send each message on one fresh connection and collect its reply (None: closed).
    Fds in replies are closed."""
    c = Conn(path, greet=greet)
    try:
        out = []
        for m in msgs:
            r = c.call(m)
            out.append(r)
            for fd in c.take_fds():
                os.close(fd)
            if r is None:
                break
        return out
    finally:
        c.close()


def code(reply: dict[str, Any] | None) -> str | None:
    if reply is None:
        return "CLOSED"
    if reply.get("ok"):
        return None
    return (reply.get("error") or {}).get("code")


def wait_closed(sock: socket.socket, timeout: float) -> float | None:
    """Read (and discard) until EOF; seconds it took, or None if still open after ``timeout``."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        rl, _, _ = select.select([sock], [], [], left)
        if rl:
            try:
                chunk = sock.recv(1 << 20)
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - t0
            except BlockingIOError:
                continue
            if not chunk:
                return time.monotonic() - t0


# -------------------------------------------------------------------- the daemon process
def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def nfds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def status_latency(path: str, conn: Conn | None = None) -> float:
    c = conn or Conn(path)
    t = time.monotonic()
    r = c.call({"id": 99, "op": "status"})
    dt = time.monotonic() - t
    if conn is None:
        c.close()
    assert r is not None and r.get("ok"), r
    return dt


# -------------------------------------------------------------------- payload helpers
def sealed_memfd(data: bytes, size: int | None = None) -> int:
    size = max(len(data), size or 0)
    fd = os.memfd_create("adversary", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    if size:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            m[: len(data)] = data
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def publish_msg(rid: int, name: str, table: list[list[Any]], nbytes: int, fingerprint: str = "fp",
                replace: bool | None = None, nfds: int = 1) -> dict[str, Any]:
    m: dict[str, Any] = {"id": rid, "op": "publish", "name": name, "device": "cpu", "fingerprint": fingerprint,
                         "arena": {"kind": "memfd", "nbytes": nbytes}, "tensors": table, "fds": nfds}
    if replace is not None:
        m["replace"] = replace
    if not nfds:
        del m["fds"]
    return m


def raw_safetensors(path: Path, header: bytes | str, data: bytes = b"") -> Path:
    """A file with exactly this header (JSON text, not validated) and data."""
    if isinstance(header, str):
        header = header.encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def attached_bytes(reply: dict[str, Any], fds: list[int], tensor: str | None = None) -> bytes:
    """The bytes an attach reply maps (the whole arena, or one tensor), fds closed. A
    "file" arena (the checkpoint's page cache) is put together from its segments."""
    try:
        arena = reply["arena"]
        nbytes = arena["nbytes"]
        if arena["kind"] == "file":
            image = bytearray(nbytes)
            for f, fo, ao, n in struct.iter_unpack("<4Q", arena["segments"]):
                image[ao : ao + n] = os.pread(fds[f], n, fo)
            m: Any = image
        else:
            m = mmap.mmap(fds[0], nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            if tensor is None:
                return bytes(m[:nbytes])
            for name, _dt, _shape, off, n in reply["tensors"]:
                if name == tensor:
                    return bytes(m[off : off + n])
            raise KeyError(tensor)
        finally:
            if isinstance(m, mmap.mmap):
                m.close()
    finally:
        for fd in fds:
            os.close(fd)
