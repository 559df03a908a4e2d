"""A FIFO as a checkpoint fails fast, and a preload that raises something unexpected
makes the daemon not ready."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ._util import Conn, calls, code, raw_safetensors, write_checkpoint


@pytest.mark.parametrize("pool", ["defaults", "small-pool"])
def test_fifo_checkpoints_fail_fast_and_do_not_block_others(start_daemon, tmp_path, pool):
    fifos = {}
    for i in range(3 if pool == "small-pool" else 1):  # more FIFOs than io_threads: a pool they could all block
        p = tmp_path / f"fifo{i}.safetensors"
        os.mkfifo(p)
        fifos[f"fifo{i}"] = p
    good = write_checkpoint(tmp_path / "good.safetensors", 64 * 1024, 4, seed=51)
    d = start_daemon(models={**fifos, "good": good}, extra_daemon={"io_threads": 2, "io_timeout_s": 2} if pool == "small-pool" else None)
    results: dict = {}

    def load(name):
        t0 = time.monotonic()
        try:
            c = Conn(d.socket, timeout=12)
            try:
                results[name] = (c.call({"id": 1, "op": "load", "name": name}), time.monotonic() - t0)
            finally:
                c.close()
        except OSError as exc:
            results[name] = ({"ok": False, "error": {"code": f"client {exc!r}"}}, time.monotonic() - t0)

    threads = [threading.Thread(target=load, args=(n,)) for n in fifos]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the FIFO loads are under way (blocked on their reads) before the good one asks
    load("good")
    for t in threads:
        t.join()
    good_reply, good_s = results["good"]
    assert good_reply["ok"] and good_s < 5, (good_reply, good_s)
    for name in fifos:
        reply, secs = results[name]
        assert code(reply) in ("LOAD_FAILED", "CORRUPT_CHECKPOINT", "BAD_REQUEST"), (name, reply)
        assert secs < 6, (name, secs)
    # an admin registering a FIFO at run time gets an error too, not a hang
    extra = tmp_path / "fifo-late.safetensors"
    os.mkfifo(extra)
    c = Conn(d.socket, timeout=12)
    try:
        r = c.call({"id": 2, "op": "register", "name": "late", "path": str(extra)})
        if r["ok"]:
            r = c.call({"id": 3, "op": "attach", "name": "late"})
        assert code(r) in ("LOAD_FAILED", "CORRUPT_CHECKPOINT", "BAD_REQUEST"), r
    finally:
        c.close()
    d.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    while d.proc.poll() is None and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    if d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait()
        raise AssertionError("daemon did not exit on SIGTERM (a thread still blocked on a FIFO?)")
    assert d.proc.returncode == 0


def test_preload_that_raises_unexpectedly_makes_the_daemon_not_ready(start_daemon, tmp_path):
    deep = raw_safetensors(tmp_path / "deep.safetensors", '{"t": ' + "[" * 200_000 + "]" * 200_000 + "}")
    good = write_checkpoint(tmp_path / "good.safetensors", 64 * 1024, 4, seed=52)
    d = start_daemon(models={"deep": deep, "good": good}, deep={"preload": True}, good={"preload": True})
    deadline = time.monotonic() + 15
    while True:
        (h,) = calls(d.socket, [{"id": 1, "op": "health"}])
        if not h["preloading"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert h["preloading"] == [], h
    assert h["ready"] is False and "deep" in h["failed_preloads"] and "good" not in h["failed_preloads"], h
    (r,) = calls(d.socket, [{"id": 2, "op": "attach", "name": "deep"}])
    assert code(r) == "CORRUPT_CHECKPOINT", r
