"""After a daemon restart, an engine still mapping the old daemon's copy was
invisible (no lease in `ps`, its memory outside every budget). The new daemon finds the
processes that map an earlier daemon's memfd arenas (/proc/<pid>/maps) before its socket
listens, warns at start, and `status` lists them while they still map it
(server/outlived.py says what it cannot see: page-cache arenas, GPU memory)."""

from __future__ import annotations

import gc
import os
import shutil
import signal

from helpers import spawn_child

from weightcache import SyncClient
from weightcache.cli import main


def test_a_mapping_that_outlived_the_daemon_is_reported_at_start_and_in_status(start_daemon, ckpts, tmp_path, capsys):
    shared = tmp_path / "m.safetensors"
    shutil.copy(ckpts["a"], shared)
    shared.chmod(0o664)  # group-writable: copied into a sealed memfd, not served from the file's page cache
    first = start_daemon(budget="20MiB", models={"m": shared})
    child = spawn_child(first, "m", shared, "hold")
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("ATTACHED"), child.stderr.read() if child.stderr else ""
        first.proc.send_signal(signal.SIGTERM)  # the lease outlives the grace period: the mapping stays
        assert first.proc.wait(timeout=60) == 0
        second = start_daemon(budget="20MiB", models={"m": shared})
        # Other daemons' engines on this host would be listed too (the check cannot tell an
        # earlier daemon from another one): the test looks for its own child only.
        log = second.log_text()
        assert "process(es) still map" in log and f"pid {child.pid} (" in log, log[-2000:]
        with SyncClient(second.socket) as c:
            (m,) = [x for x in c.status()["outlived"] if x["pid"] == child.pid]
            assert m["pid"] == child.pid and m["uid"] == os.getuid() and list(m["models"]) == ["m"], m
            assert c.status()["leases"] == 0  # what ps shows: no lease on it here
            # This process may still map arenas of daemons that earlier tests stopped (they are
            # outlived here too, until their tensors are collected): attaching this daemon's
            # own must add nothing to what is listed for it.
            def mine() -> int:
                return sum(x["nbytes"] for x in c.status()["outlived"] if x["pid"] == os.getpid())

            gc.collect()
            before = mine()
            with c.attach("m") as w:  # this daemon's own arena (mapped here too) is not counted as outlived
                assert m["nbytes"] == m["models"]["m"] >= w.nbytes  # the whole arena (page-rounded) is mapped
                assert child.pid in [x["pid"] for x in c.status()["outlived"]]
                assert mine() <= before
        capsys.readouterr()
        assert main(["--socket", second.socket, "status"]) == 0
        out = capsys.readouterr().out
        assert f"warning: pid {child.pid} (" in out and "still maps 8.0 MiB of an earlier daemon's memory (m)" in out, out
        child.kill()
        child.wait()
        with SyncClient(second.socket) as c:
            assert child.pid not in [x["pid"] for x in c.status()["outlived"]]  # it exited: not reported any more
    finally:
        child.kill()
        child.wait()


def test_a_second_daemon_on_the_host_is_warned_about(start_daemon, capsys):
    first = start_daemon(budget="8MiB")
    second = start_daemon(budget="8MiB")  # another socket: both start (a per-host guard would refuse one)
    assert f"another weightcache daemon runs on this host (pid {first.proc.pid}: " in second.log_text()
    with SyncClient(second.socket) as c:
        others = [o["pid"] for o in c.status()["other_daemons"]]  # other people's daemons on this host too
        assert first.proc.pid in others and second.proc.pid not in others
    capsys.readouterr()
    assert main(["--socket", second.socket, "status"]) == 0
    assert f"warning: another weightcache daemon runs on this host (pid {first.proc.pid})" in capsys.readouterr().out
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0
    with SyncClient(second.socket) as c:
        assert first.proc.pid not in [o["pid"] for o in c.status()["other_daemons"]]


def test_which_command_lines_are_daemons():
    from weightcache.cli import build_parser
    from weightcache.server.outlived import _COMMANDS, is_daemon

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == _COMMANDS  # type: ignore[arg-type]
    assert is_daemon(["/usr/bin/python3", "/opt/wc/.venv/bin/weightcache", "serve", "--config", "/etc/wc.toml"])
    assert is_daemon(["python", "-m", "weightcache", "--config", "/etc/wc.toml", "serve"])
    assert not is_daemon(["/opt/wc/.venv/bin/weightcache", "supervise", "--", "python", "engine.py", "serve"])
    assert not is_daemon(["/opt/wc/.venv/bin/weightcache", "--config", "serve.toml", "status"])
    assert not is_daemon(["python", "engine.py", "serve"])


def test_the_daemons_own_parent_is_not_another_daemon(tmp_path):
    """`timeout 600 weightcache serve` (so nice, sudo, systemd-run): the parent's command
    line names serve too, and was warned about as another daemon."""
    import subprocess
    import sys
    import tempfile

    from conftest import write_config

    from weightcache.tools.spawn import wait_for_socket

    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    sock, cfg, log = os.path.join(sockdir, "d.sock"), tmp_path / "d.toml", tmp_path / "d.log"
    write_config(cfg, sock, "8MiB", {})
    with log.open("wb") as out:
        parent = subprocess.Popen(["timeout", "600", sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_socket(sock, parent)
        with SyncClient(sock) as c:
            status = c.status()
        assert status["pid"] != parent.pid  # the daemon is timeout's child
        assert parent.pid not in [o["pid"] for o in status["other_daemons"]], status["other_daemons"]
        assert f"another weightcache daemon runs on this host (pid {parent.pid}:" not in log.read_text()
    finally:
        parent.send_signal(signal.SIGTERM)  # timeout passes it on to the daemon
        assert parent.wait(timeout=60) == 0, log.read_text()[-2000:]
        shutil.rmtree(sockdir, ignore_errors=True)
