"""Running the daemon in production: systemd readiness, SIGHUP reload, JSON logs, Prometheus metrics."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest
from conftest import eventually

from weightcache import Client
from weightcache.tools.spawn import config_text, free_port, wait_for_socket


def test_sd_notify_ready_and_stopping(tmp_path, ckpts):
    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    notify = os.path.join(sockdir, "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify)
    listener.settimeout(30)
    sock = os.path.join(sockdir, "d.sock")
    cfg = tmp_path / "c.toml"
    cfg.write_text(config_text(sock, {"cpu": "64MiB"}, [{"name": "tiny", "path": str(ckpts["tiny"])}]))
    p = subprocess.Popen([sys.executable, "-m", "weightcache", "serve", "--config", str(cfg)],
                         env={**os.environ, "NOTIFY_SOCKET": notify}, stderr=subprocess.PIPE, text=True)
    try:
        msg = listener.recv(4096).decode()
        assert msg.startswith("READY=1") and sock in msg
        wait_for_socket(sock, p)  # READY came only once the socket was listening
        p.send_signal(signal.SIGTERM)
        assert listener.recv(4096).decode() == "STOPPING=1"
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        listener.close()


async def test_sighup_reloads_the_config(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    head = d.config.read_text().split("[[models]]")[0]
    d.config.write_text(head + f'[[models]]\nname = "b"\npath = "{ckpts["b"]}"\n')
    d.proc.send_signal(signal.SIGHUP)
    async with Client(d.socket) as c:

        async def only_b() -> bool:
            return [m["name"] for m in await c.models()] == ["b"]

        await eventually(only_b)
    assert "reload: {'added': ['b'], 'removed': ['a']}" in d.log_text()


async def test_json_logs(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"log_format": "json", "log_level": "info"})
    async with Client(d.socket) as c:
        await c.load("tiny")
    lines = [json.loads(line) for line in d.log_text().splitlines() if line.strip()]
    assert any(rec["msg"].startswith("loaded tiny") and rec["level"] == "info" for rec in lines)


async def test_metrics_endpoint(start_daemon, ckpts):
    port = free_port()
    d = start_daemon(budget="40MiB", models={"a": ckpts["a"], "tiny": ckpts["tiny"]},
                     extra_daemon={"metrics_listen": f"127.0.0.1:{port}"})
    async with Client(d.socket) as c, c.attach("a"):
        await c.status()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        sizes = {m["name"]: m["nbytes"] for m in await c.models()}
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line and not line.startswith("#")}
    assert series['weightcache_device_budget_bytes{device="cpu"}'] == 40 * 2**20
    assert series['weightcache_device_used_bytes{device="cpu"}'] == sizes["a"]
    assert series['weightcache_model_state{model="a",state="resident"}'] == 1
    assert series['weightcache_model_state{model="tiny",state="registered"}'] == 1
    assert series['weightcache_model_attach_count{model="a"}'] == 1
    assert series['weightcache_model_loads_total{model="a"}'] == 1
    assert series["weightcache_leases"] == 1
    assert series["weightcache_ready"] == 1  # no preloads: ready at once
    assert series['weightcache_last_load_bytes_per_second{model="a"}'] > 0
    assert series['weightcache_request_seconds_count{op="attach"}'] >= 1
    assert series['weightcache_request_seconds_count{op="status"}'] >= 1


@pytest.mark.parametrize("body", ['[daemon]\nlog_format = "xml"'])
def test_bad_log_format_is_a_config_error(tmp_path, body):
    from weightcache.config import load_settings
    from weightcache.errors import ConfigError

    (tmp_path / "c.toml").write_text(body + "\n")
    with pytest.raises(ConfigError, match=r"daemon\.log_format"):
        load_settings(tmp_path / "c.toml")


def test_systemd_units_verify(tmp_path):
    import re
    import shutil

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    units = Path(__file__).resolve().parent.parent / "examples" / "systemd"
    names = []
    for unit in units.glob("*.service"):
        name = unit.name.replace("@.service", "@model.service")
        # The install paths do not exist here; everything else must verify cleanly.
        text = re.sub(r"^(Exec(?:Start|Reload)=)\S+", r"\1/bin/true", unit.read_text(), flags=re.M)
        (tmp_path / name).write_text(text)
        names.append(str(tmp_path / name))
    r = subprocess.run([analyze, "verify", "--man=no", *names], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_kubernetes_manifest_matches_the_tested_config_and_cli():
    yaml = pytest.importorskip("yaml")
    from weightcache.cli import build_parser

    root = Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
    docs = {d["kind"]: d for d in yaml.safe_load_all((root / "weightcache-daemonset.yaml").read_text())}
    assert set(docs) == {"ConfigMap", "Service", "DaemonSet", "Pod"}  # Service: the peers' headless Service
    # The ConfigMap's TOML is the file test_config.py loads.
    assert docs["ConfigMap"]["data"]["weightcache.toml"] == (root / "weightcache.toml").read_text()
    (daemon,) = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    build_parser().parse_args(daemon["args"])
    for probe in ("readinessProbe", "livenessProbe"):
        command = daemon[probe]["exec"]["command"]
        assert command[0] == "weightcache"
        build_parser().parse_args(command[1:])  # exits (fails the test) on a stale command
    assert daemon["readinessProbe"]["exec"]["command"][-2:] == ["health", "--ready"]


def health_cli(d, *args):
    return subprocess.run([sys.executable, "-m", "weightcache", "--socket", d.socket, "health", *args],
                          capture_output=True, text=True, timeout=60)


async def test_health_is_ready_once_preloads_are_resident_and_reports_failures(start_daemon, ckpts, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)  # a header length no file has
    port = free_port()
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "bad": bad}, bad={"preload": True},
                     extra_daemon={"no_space_wait_s": 30, "metrics_listen": f"127.0.0.1:{port}"})
    d.allowed_errors.append("preload of bad failed")
    async with Client(d.socket) as c:
        async def settled() -> bool:
            return not (await c.health())["preloading"]

        await eventually(settled)
        h = await c.health()
        assert h["serving"] and not h["ready"] and "CORRUPT_CHECKPOINT" in h["failed_preloads"]["bad"]
        r = health_cli(d)
        assert r.returncode == 0 and "not ready" in r.stdout  # alive: a liveness probe passes
        r = health_cli(d, "--ready")
        assert r.returncode == 1 and "preload of bad failed" in r.stderr
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "weightcache_ready 0.0" in body and 'weightcache_preload_failed{model="bad"} 1.0' in body
        await c.unregister("bad")
        assert (await c.health())["ready"]

        # A preload that must wait for room keeps the daemon not ready until it is resident.
        async with c.attach("a"):
            await c.register("b", ckpts["b"], preload=True)  # 9 MiB holds one of a, b
            assert (await c.health())["preloading"] == ["b"]
            r = health_cli(d, "--ready")
            assert r.returncode == 1 and "preloading b" in r.stderr

        async def ready() -> bool:
            return bool((await c.health())["ready"])

        await eventually(ready)
        assert {m["name"]: m["state"] for m in await c.models()} == {"a": "evicted", "b": "resident"}
    r = health_cli(d, "--ready")
    assert r.returncode == 0 and r.stdout.strip() == "ready"


async def test_json_logs_carry_fields(start_daemon, ckpts):
    """conn, pid, uid, op, code, model, bytes, seconds as top-level keys, not only in msg."""
    d = start_daemon(models={"a": ckpts["a"]}, extra_daemon={"log_format": "json", "log_level": "debug"})
    async with Client(d.socket) as c:
        with pytest.raises(Exception, match="nope"):
            await c.load("nope")
        await c.load("a")
        await c.evict("a")

    def logged() -> list[dict]:
        return [json.loads(line) for line in d.log_text().splitlines() if line.strip()]

    recs = logged()
    error = next(r for r in recs if r.get("code") == "UNKNOWN_MODEL")
    assert (error["op"], error["model"], error["pid"], error["uid"]) == ("load", "nope", os.getpid(), os.getuid())
    conn = error["conn"]  # not the first: the test's wait for the socket was one

    async def closed() -> bool:
        return any(r.get("conn") == conn and " closed" in r["msg"] for r in logged())

    await eventually(closed)
    recs = logged()
    opened = next(r for r in recs if r.get("conn") == conn and " open" in r["msg"])
    assert (opened["pid"], opened["uid"]) == (os.getpid(), os.getuid())
    gone = next(r for r in recs if r.get("conn") == conn and " closed" in r["msg"])
    assert gone["client"] == error["client"] != "?" and gone["leases"] == 0
    loaded = next(r for r in recs if r["msg"].startswith("loaded a:"))
    assert loaded["model"] == "a" and loaded["bytes"] > 0 and loaded["seconds"] > 0 and loaded["tensors"] == 40
    evicted = next(r for r in recs if r["msg"].startswith("evicted a "))
    assert (evicted["model"], evicted["reason"]) == ("a", "requested") and evicted["bytes"] >= loaded["bytes"]
