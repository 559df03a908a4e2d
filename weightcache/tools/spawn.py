"""Run a daemon as a child process: for the demo, the benchmarks and the tests.

Production runs ``weightcache serve`` under systemd (or similar); this is the same
command, with a config file written for the occasion and a short socket path.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a daemon or server started next to listen on.
    Chosen below the kernel's ephemeral range (ip_local_port_range): a port the kernel
    picks itself (a bind to port 0) can be picked again for any other socket that binds
    to 0 or connects before the daemon binds it (a NIXL agent's listener took one in a CI
    run: "address already in use"); one outside that range is taken only by a process that
    names it (above the range where it starts too low; the kernel's pick where it covers
    nearly every port). Never the same port twice in one process."""
    low, high = 32768, 60999
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    except (OSError, ValueError):
        pass
    if low - 1024 >= 1000:  # below the range, and not among the well-known ports
        ports = range(max(1024, min(10000, low - 1000)), low)
    elif 65535 - high >= 1000:
        ports = range(high + 1, 65536)
    else:  # the range covers nearly every port: the kernel's own choice is all there is
        ports = range(0)
    for _ in range(1000 if ports else 0):
        port = random.choice(ports)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


def config_text(socket_path: str, budgets: dict[str, str], models: list[dict[str, Any]], daemon: dict[str, Any] | None = None) -> str:
    """A TOML config from plain values: strings, numbers, bools, and lists and dicts
    (inline tables, e.g. a model's ``shards``) of them."""

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + "}"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = ["[daemon]", f"socket = {val(socket_path)}"]
    lines += [f"{k} = {val(v)}" for k, v in (daemon or {}).items()]
    lines += ["", "[budgets]"] + [f"{val(k)} = {val(v)}" for k, v in budgets.items()]
    for m in models:
        lines += ["", "[[models]]"] + [f"{k} = {val(v)}" for k, v in m.items()]
    return "\n".join(lines) + "\n"


def wait_for_socket(path: str, proc: subprocess.Popen[Any], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode} before listening on {path}")
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"daemon did not listen on {path} within {timeout}s")


class DaemonProcess:
    """``with DaemonProcess(config_path, socket_path, log_path) as d:`` runs a daemon;
    leaving the block sends SIGTERM and waits for a clean exit."""

    def __init__(self, config: str | os.PathLike[str], socket_path: str, log: str | os.PathLike[str]) -> None:
        self.config = Path(config)
        self.socket = socket_path
        self.log = Path(log)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> DaemonProcess:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--config", str(self.config)],
                                         stdout=out, stderr=subprocess.STDOUT)
        wait_for_socket(self.socket, self.proc)
        return self

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then wait; returns the exit code (SIGKILL and -9 after ``timeout``)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
