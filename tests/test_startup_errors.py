"""A daemon that cannot start says why in one line naming the key or path and what to do,
exits 2, and leaves no socket behind; in JSON log mode that line is JSON."""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from weightcache.tools.spawn import config_text

CASES = ("second_daemon", "busy_metrics_port", "socket_path_too_long", "socket_parent_is_a_file")


def serve(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=60)


def the_error_line(out: str, fmt: str) -> dict[str, str]:
    """The one error line (as a dict: msg, and in JSON its fields); every line is JSON in JSON mode."""
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    if fmt == "json":
        records = [json.loads(line) for line in lines]  # fails on any line that is not JSON
        errors = [r for r in records if r["level"] == "error"]
    else:
        errors = [{"msg": line.split(": ", 1)[1]} for line in lines if " ERROR " in line]
    assert len(errors) == 1, out
    return errors[0]


@pytest.fixture
def sockdir():
    d = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))  # AF_UNIX paths are short: not under tmp_path
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if not p.is_dir() else p.rmdir()
    d.rmdir()


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("case", CASES)
def test_startup_error_is_one_line_exit_2_and_no_socket(case, fmt, sockdir, tmp_path, start_daemon):
    sock = sockdir / "d.sock"
    daemon: dict[str, object] = {"log_format": fmt}
    held = None
    key, named = "daemon.socket", str(sock)
    if case == "second_daemon":
        first = start_daemon()
        sock = Path(first.socket)
        key, named = "daemon.socket", str(sock)
    elif case == "busy_metrics_port":
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        daemon["metrics_listen"] = f"127.0.0.1:{held.getsockname()[1]}"
        key, named = "daemon.metrics_listen", daemon["metrics_listen"]
    elif case == "socket_path_too_long":
        sock = sockdir / ("x" * 120) / "d.sock"
        named = str(sock)
    else:
        (sockdir / "file").write_text("not a directory\n")
        sock = sockdir / "file" / "d.sock"
        named = str(sockdir / "file")
    cfg = tmp_path / "c.toml"
    cfg.write_text(config_text(str(sock), {"cpu": "16MiB"}, [], daemon))
    try:
        proc = serve(cfg)
    finally:
        if held is not None:
            held.close()
    assert proc.returncode == 2, proc.stderr
    err = the_error_line(proc.stdout + proc.stderr, fmt)
    assert err["msg"].startswith(f"{key}: ") and named in err["msg"], err
    assert any(what in err["msg"] for what in ("stop ", "choose ", "remove ")), err  # says what to do
    if fmt == "json":
        assert err["key"] == key
    if case == "second_daemon":  # the first one's socket is its own: still there, still answering
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
    else:
        assert not os.path.exists(sock)
        assert not (sockdir / ("x" * 120)).exists()  # nothing made on the way to a path that cannot be bound


# cuda:99: no host has it. Without cuda-bindings (CI) the import fails, with them the
# device lookup does: either was a traceback and exit status 1.
BUDGET_CASES = {
    "a GPU the host lacks": ({"cpu": "16MiB", "cuda:99": "1GiB"}, "budgets.cuda:99", "remove the budget"),
    "over the device's memory": ({"cpu": "64TiB"}, "budgets.cpu", "is more than the device's"),
}


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("case", BUDGET_CASES)
def test_a_budget_the_host_cannot_give_is_one_line_exit_2(case, fmt, sockdir, tmp_path):
    budgets, key, says = BUDGET_CASES[case]
    sock = sockdir / "d.sock"
    cfg = tmp_path / "c.toml"
    cfg.write_text(config_text(str(sock), budgets, [], {"log_format": fmt}))
    proc = serve(cfg)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = the_error_line(proc.stdout + proc.stderr, fmt)
    assert err["msg"].startswith(f"{key}: ") and says in err["msg"], err
    if fmt == "json":  # the key as a field, as for the socket's errors (docs/deployment.md)
        assert err["key"] == key, err
    assert not os.path.exists(sock)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_socket_group_the_daemons_user_is_not_in_names_the_key(fmt, sockdir, tmp_path):
    # chown(2) to a group needs membership: a daemon run as a user outside socket_group
    # failed with "daemon.socket: cannot serve on ...: Operation not permitted", which sent
    # the operator to the socket path rather than to the group. The kernel's EPERM is
    # simulated (these tests run as root, whom chown never refuses; a child dropped to
    # nobody cannot import the interpreter's standard library from under /root).
    sock, cfg = sockdir / "d.sock", tmp_path / "c.toml"
    cfg.write_text(config_text(str(sock), {"cpu": "16MiB"}, [], {"log_format": fmt, "socket_group": "root"}))
    refuse = ("import errno, os, sys\n"
              "def chown(*a, **k): raise PermissionError(errno.EPERM, 'Operation not permitted')\n"
              "os.chown = chown\n"
              "from weightcache.cli import main\n"
              "sys.exit(main(['serve', '--config', sys.argv[1]]))\n")
    proc = subprocess.run([sys.executable, "-c", refuse, str(cfg)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = the_error_line(proc.stdout + proc.stderr, fmt)
    assert err["msg"].startswith("daemon.socket_group: ") and "not a member" in err["msg"], err
    if fmt == "json":
        assert err["key"] == "daemon.socket_group", err
    assert not os.path.exists(sock)
