"""Unread replies are bounded: a client that pipelines requests and never reads its
replies must not make the daemon buffer without bound, nor slow down everybody else."""

from __future__ import annotations

import os
import socket
import threading
import time

from weightcache.protocol import encode_frame

from ._util import MIB, Conn, nfds, rss, sealed_memfd

RSS_BOUND = 200 * MIB


def _flood(path: str, frame: bytes, count: int, seconds: float, stop: threading.Event) -> dict:
    """Write ``count`` copies of ``frame`` without ever reading; returns how many went out."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(encode_frame({"id": 0, "op": "hello", "protocol": 1, "client": "flood"}))
    s.setblocking(False)
    batch = frame * 256
    sent = 0
    deadline = time.monotonic() + seconds
    view = memoryview(b"")
    while sent < count * len(frame) and time.monotonic() < deadline and not stop.is_set():
        if not view:
            view = memoryview(batch)
        try:
            n = s.send(view)
        except BlockingIOError:
            time.sleep(0.005)
            continue
        except OSError:
            break
        view = view[n:]
        sent += n
    return {"sock": s, "frames": sent // len(frame)}


def _abuse_and_measure(d, frame: bytes, count: int, seconds: float) -> dict:
    pid = d.proc.pid
    probe = Conn(d.socket)
    base_rss, base_fds = rss(pid), nfds(pid)
    stop = threading.Event()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(_flood(d.socket, frame, count, seconds, stop)))
    t.start()
    lat, peak_rss, peak_fds = [], base_rss, base_fds
    try:
        while t.is_alive():
            t0 = time.monotonic()
            r = probe.call({"id": 5, "op": "status"})
            lat.append(time.monotonic() - t0)
            assert r is not None and r["ok"], r
            peak_rss, peak_fds = max(peak_rss, rss(pid)), max(peak_fds, nfds(pid))
            time.sleep(0.05)
        for _ in range(10):  # the daemon may still be working through what it read
            t0 = time.monotonic()
            assert probe.call({"id": 6, "op": "status"})["ok"]
            lat.append(time.monotonic() - t0)
            peak_rss, peak_fds = max(peak_rss, rss(pid)), max(peak_fds, nfds(pid))
            time.sleep(0.1)
    finally:
        stop.set()
        t.join()
        probe.close()
    return {"sock": out.get("sock"), "frames": out.get("frames"), "growth": peak_rss - base_rss, "fd_growth": peak_fds - base_fds,
            "max_latency": max(lat), "probes": len(lat)}


def test_unread_models_replies_are_bounded(start_daemon, ckpts):
    models = {f"m{i:02d}": ckpts["tiny"] for i in range(24)}  # ~10 KB per models reply
    d = start_daemon(models=models)
    frame = encode_frame({"id": 1, "op": "models"})
    got = _abuse_and_measure(d, frame, 300_000, 6.0)
    try:
        assert got["growth"] < RSS_BOUND, f"daemon RSS grew {got['growth'] / MIB:.0f} MiB ({got['frames']} frames written)"
        assert got["max_latency"] < 1.0, f"status took {got['max_latency']:.2f}s while a client did not read"
        assert d.proc.poll() is None
    finally:
        if got["sock"] is not None:
            got["sock"].close()


def _publish_big_table(path: str, n: int) -> None:
    size = n * 256
    fd = sealed_memfd(b"\x05", size)
    table = [[f"t{i}", "U8", [1], i * 256, 1] for i in range(n)]
    c = Conn(path, timeout=60)
    try:
        r = c.call({"id": 1, "op": "publish", "name": "wide", "device": "cpu", "fingerprint": "wide",
                    "arena": {"kind": "memfd", "nbytes": size}, "tensors": table, "fds": 1}, fds=[fd])
        assert r is not None and r["ok"], r
    finally:
        c.close()
        os.close(fd)


def test_unread_attach_replies_with_a_large_table_are_bounded(start_daemon):
    d = start_daemon(budget="256MiB")
    _publish_big_table(d.socket, 100_000)  # each attach reply: ~3 MB of tensor table, plus an fd
    frame = encode_frame({"id": 1, "op": "attach", "name": "wide"})
    got = _abuse_and_measure(d, frame, 300_000, 6.0)
    try:
        assert got["growth"] < RSS_BOUND, f"daemon RSS grew {got['growth'] / MIB:.0f} MiB ({got['frames']} attaches written)"
        assert got["fd_growth"] < 600, f"daemon holds {got['fd_growth']} more fds"
        assert got["max_latency"] < 1.0, f"status took {got['max_latency']:.2f}s while a client did not read"
    finally:
        if got["sock"] is not None:
            got["sock"].close()
