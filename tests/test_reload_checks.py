"""The reload an operator can trust: it checks what start checks (a CPU budget
larger than the host is refused by both), one rule for the exit status (every change
that did not take effect is one line under ``failed`` and a non-zero exit), the models
a lowered budget evicted are listed, sizes are readable in the CLI's lines and numbers in
JSON, and systemd learns of each reload (RELOADING=1 with MONOTONIC_USEC, then READY=1)
while the unit's ExecReload fails with the reload."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import states

from weightcache import Client
from weightcache.cli import main
from weightcache.tools.spawn import config_text, wait_for_socket

MIB = 2**20
UNIT = Path(__file__).resolve().parent.parent / "examples" / "systemd" / "weightcache.service"


def set_budget(cfg: Path, budget: str) -> None:
    text = cfg.read_text()
    new = re.sub(r'^"cpu" = .*$', f'"cpu" = "{budget}"', text, flags=re.M)
    assert new != text or f'"cpu" = "{budget}"' in text
    cfg.write_text(new)


def reload_cli(capsys, sock: str, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["--socket", sock, "reload", *extra])
    return rc, capsys.readouterr().out


async def test_a_budget_larger_than_the_host_is_refused_by_reload_as_by_start(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB", models={"a": ckpts["a"]})
    set_budget(d.config, "100TiB")
    # start refuses this file (test_startup_errors); the reload must too, and say so
    rc, out = await asyncio.to_thread(reload_cli, capsys, d.socket)
    assert rc == 1, out
    assert re.search(r"^failed: budgets\.cpu: 100\.0 TiB is more than the device's .*; give a size it has", out, re.M), out
    async with Client(d.socket) as c:
        assert (await c.status())["devices"]["cpu"]["budget"] == 20 * MIB  # unchanged
    # the same file at start: the same sentence (one function checks both)
    from weightcache.config import load_settings
    from weightcache.errors import ConfigError
    from weightcache.server.settings_reload import resolve_budget

    with pytest.raises(ConfigError) as err:
        resolve_budget("cpu", load_settings(d.config).budgets["cpu"], os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    assert err.value.message in out


async def test_a_lowered_budget_that_attached_models_exceed_fails_the_reload(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB", models={"a": ckpts["a"]})
    async with Client(d.socket) as c, c.attach("a"):
        set_budget(d.config, "4MiB")
        report = await c.reload()
        assert "kept" not in report and not report["budgets"], report
        assert len(report["failed"]) == 1 and report["failed"][0].startswith("budgets.cpu: cannot lower the cpu budget "
                                                                              "to 4.0 MiB: a (8.0 MiB)"), report
        rc, out = await asyncio.to_thread(reload_cli, capsys, d.socket)
        assert rc == 1 and "failed: budgets.cpu: " in out, out
        assert (await c.status())["devices"]["cpu"]["budget"] == 20 * MIB


async def test_a_model_removed_while_attached_fails_the_reload(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB", models={"a": ckpts["a"]})
    async with Client(d.socket) as c, c.attach("a"):
        d.config.write_text(d.config.read_text().split("[[models]]")[0])
        rc, out = await asyncio.to_thread(reload_cli, capsys, d.socket)
        assert rc == 1 and re.search(r"^failed: a: removed from the file, but kept as it was: .*1 live attachment", out, re.M), out


async def test_a_daemon_key_read_at_start_only_fails_the_reload(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB", models={"a": ckpts["a"]})
    d.config.write_text(d.config.read_text().replace("[daemon]\n", '[daemon]\neviction_policy = "gdsf"\n'))
    rc, out = await asyncio.to_thread(reload_cli, capsys, d.socket)
    assert rc == 1 and "failed: daemon.eviction_policy: changed in the file, but read at start only" in out, out


async def test_the_models_a_lowered_budget_evicted_are_listed_with_readable_sizes(start_daemon, ckpts, capsys):
    d = start_daemon(budget="30MiB", models={k: ckpts[k] for k in ("a", "b", "c")})
    async with Client(d.socket) as c:
        for name in ("a", "b", "c"):
            await c.load(name)
        async with c.attach("c"):
            set_budget(d.config, "10MiB")
            rc, out = await asyncio.to_thread(reload_cli, capsys, d.socket)
            assert rc == 0, out
            assert "reloaded: budgets.cpu: 10.0 MiB (was 30.0 MiB)" in out, out
            assert re.search(r"^evicted: a \(8\.0 MiB\): cpu budget lowered$", out, re.M), out
            assert re.search(r"^evicted: b \(8\.0 MiB\): cpu budget lowered$", out, re.M), out
            assert await states(c) == {"a": "evicted", "b": "evicted", "c": "resident"}
            set_budget(d.config, "20MiB")
            rc, out = await asyncio.to_thread(reload_cli, capsys, d.socket, "--json")
            report = json.loads(out)
            assert rc == 0 and report["budgets"] == [{"device": "cpu", "budget": 20 * MIB, "previous": 10 * MIB}], report
            assert report["evicted"] == [] and report["failed"] == []


def test_systemd_hears_of_every_reload_and_the_units_execreload_fails_with_it(tmp_path, ckpts):
    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    notify = os.path.join(sockdir, "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify)
    listener.settimeout(60)
    sock = os.path.join(sockdir, "d.sock")
    cfg = tmp_path / "c.toml"
    good = config_text(sock, {"cpu": "64MiB"}, [{"name": "tiny", "path": str(ckpts["tiny"])}])
    cfg.write_text(good)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTCACHE_")}
    p = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)],
                         env={**env, "NOTIFY_SOCKET": notify}, stderr=subprocess.DEVNULL)

    def exec_reload() -> subprocess.CompletedProcess[str]:
        # The unit's own ExecReload line, with this venv's CLI and this test's config file.
        line = next(x for x in UNIT.read_text().splitlines() if x.startswith("ExecReload="))
        argv = shlex.split(line.removeprefix("ExecReload="))
        assert argv[0].endswith("/weightcache") and "$MAINPID" not in line
        argv = [sys.executable, "-m", "weightcache", *[str(cfg) if a == "/etc/weightcache/weightcache.toml" else a
                                                       for a in argv[1:]]]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

    def reload_messages(trigger) -> tuple[str, str, object]:
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        result = trigger()
        first, second = listener.recv(4096).decode(), listener.recv(4096).decode()
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        m = re.fullmatch(r"RELOADING=1\nMONOTONIC_USEC=(\d+)", first)
        assert m and before <= int(m.group(1)) <= after, first
        return first, second, result

    try:
        assert listener.recv(4096).decode().startswith("READY=1")
        wait_for_socket(sock, p)
        _, ready, r = reload_messages(exec_reload)
        assert r.returncode == 0, r.stdout + r.stderr
        assert ready.startswith("READY=1\n") and ready.endswith("; reloaded"), ready
        cfg.write_text(good.replace('"64MiB"', '"100TiB"'))
        _, ready, r = reload_messages(exec_reload)
        assert r.returncode == 1 and "failed: budgets.cpu: 100.0 TiB is more than" in r.stdout, r.stdout + r.stderr
        assert ready.startswith("READY=1\n") and "1 change(s) of the last reload did not take effect" in ready, ready
        _, ready, _ = reload_messages(lambda: p.send_signal(signal.SIGHUP))  # SIGHUP: the same messages
        assert "did not take effect" in ready, ready
        p.send_signal(signal.SIGTERM)
        assert listener.recv(4096).decode() == "STOPPING=1"
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        p.wait()
        listener.close()
