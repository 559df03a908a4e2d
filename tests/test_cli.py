"""CLI output and seeing who holds what: the commands' output (human and
--json), tables that are not cut when piped, one size convention, --socket anywhere and
from $WEIGHTCACHE_CONFIG, the load's progress and what it evicted, `ps` with the lease
holders, NO_SPACE and ATTACHED naming the holders (as far as the requester may see
them), and register / unregister.

The CLI runs in this process (``main``, with capsys: stdout is not a terminal, as when
piped), against a real daemon; a lease is held by a SyncClient of this process, so its
holder is this pid.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import NOBODY, as_uid, root_only

from weightcache import SyncClient
from weightcache.cache import CacheCore
from weightcache.cli import main
from weightcache.config import DaemonConfig
from weightcache.errors import Attached, NoSpace
from weightcache.server.access import AccessPolicy, Peer
from weightcache.server.handlers import Caller, Request
from weightcache.units import format_size

LONG = "small-fp16-model-" + "x" * 90  # a table cell far wider than 80 columns


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what came before
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    rc, out, err = cli(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# What tiny (a 64 KiB arena, 5 tensors) takes of the budget: its arena and what the daemon
# holds for its parsed header and its two tables (loader/checkpoint.py, Note [held bytes]).
TINY = "73.8 KiB"


@pytest.fixture(autouse=True)
def no_socket_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests say where the daemon is; the environment of whoever runs them must not.
    for env in ("WEIGHTCACHE_SOCKET", "WEIGHTCACHE_DAEMON__SOCKET", "WEIGHTCACHE_CONFIG"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("COLUMNS", "80")  # what rich assumes when piped, made explicit


# -- CLI and output ----------------------------------------------------------------------
def test_every_command_prints_a_line_and_json_without_the_protocol_fields(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB", models={"tiny": ckpts["tiny"]})
    s = ("--socket", d.socket)
    rc, out, _ = cli(capsys, *s, "load", "tiny")
    assert rc == 0 and out == f"tiny: resident on cpu, {TINY}, 5 tensors\n"
    rc, out, _ = cli(capsys, *s, "pin", "tiny")
    assert rc == 0 and out == f"tiny: pinned (resident on cpu, {TINY})\n"
    pinned = cli_json(capsys, *s, "unpin", "tiny")
    assert pinned["name"] == "tiny" and pinned["pinned"] is False and "id" not in pinned
    rc, out, _ = cli(capsys, *s, "evict", "tiny")
    assert rc == 0 and out == f"tiny: evicted, {TINY} freed\n"
    assert cli_json(capsys, *s, "evict", "tiny") == {"evicted": False, "freed": 0, "state": "evicted"}
    rc, out, _ = cli(capsys, *s, "evict", "tiny")
    assert out == "tiny: nothing to evict (evicted)\n"
    assert cli_json(capsys, *s, "load", "tiny")["model"]["state"] == "resident"
    rc, out, _ = cli(capsys, *s, "attach", "tiny")
    assert rc == 0 and out.startswith("attached tiny: lease ") and f", 5 tensors, {TINY} on cpu in " in out, out
    attached = cli_json(capsys, *s, "attach", "tiny")
    assert attached["name"] == "tiny" and attached["tensors"] == 5 and 0 < attached["tensor_bytes"] <= 64 * 1024
    assert attached["nbytes"] == next(m["nbytes"] for m in cli_json(capsys, *s, "models")) > attached["tensor_bytes"]
    rc, out, _ = cli(capsys, *s, "reload")
    assert rc == 0 and out.startswith("reloaded: ")
    assert "id" not in cli_json(capsys, *s, "reload")
    # A failure with --json is JSON too: the code and details, for a script.
    rc, out, err = cli(capsys, *s, "evict", "nope", "--json")
    assert rc == 1 and json.loads(out)["error"]["code"] == "UNKNOWN_MODEL" and "UNKNOWN_MODEL" in err


def test_tables_are_not_cut_when_piped_and_sizes_are_binary(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB", models={LONG: ckpts["tiny"], "a": ckpts["a"]}, **{LONG: {"keep_alive": "5m"}})
    s = ("--socket", d.socket)
    assert cli(capsys, *s, "load", LONG)[0] == 0
    for command in ("models", "ps", "status"):
        rc, out, _ = cli(capsys, *s, command)
        assert rc == 0 and "…" not in out, out
        if command != "status":
            row = next(line for line in out.splitlines() if LONG in line)  # the whole name, on one line
            assert TINY in row, row
    rc, out, _ = cli(capsys, *s, "status")
    assert "20.0 MiB" in out and TINY in out and not re.search(r"\b(GB|MB|kB)\b|\d{4,} B", out), out
    cpu_row = next(line for line in out.splitlines() if "memfd" in line)
    assert cpu_row.rstrip(" │|").endswith("host"), cpu_row  # where the fingerprint is hashed


def test_socket_before_or_after_the_command_or_from_the_config_file(start_daemon, ckpts, capsys, tmp_path, monkeypatch):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    assert cli(capsys, "--socket", d.socket, "status")[0] == 0
    assert cli(capsys, "status", "--socket", d.socket)[0] == 0
    assert cli(capsys, "--socket", "/nonexistent/x.sock", "models", "--socket", d.socket)[0] == 0  # the later one wins
    # Only [daemon] socket is read: the rest of the file is the daemon's business (here
    # a key this version does not know and a budget it would refuse).
    cfg = tmp_path / "client.toml"
    cfg.write_text(f'[daemon]\nsocket = "{d.socket}"\nfuture_key = 1\n[budgets]\ncpu = "1.5"\n')
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(cfg))
    rc, out, err = cli(capsys, "models")
    assert rc == 0 and "tiny" in out, err
    monkeypatch.setenv("WEIGHTCACHE_SOCKET", "/nonexistent/x.sock")  # the environment wins over the file, as for the daemon
    assert cli(capsys, "models")[0] == 1
    monkeypatch.delenv("WEIGHTCACHE_SOCKET")
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(tmp_path / "missing.toml"))
    rc, _, err = cli(capsys, "models")
    assert rc == 2 and "missing.toml" in err


def test_help_of_socket_names_the_config_file(capsys):
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--socket" in out and "[daemon] socket of the file $WEIGHTCACHE_CONFIG names" in out


def test_a_small_load_shows_no_unknown_total_and_a_load_says_what_it_evicted(start_daemon, ckpts, capsys, monkeypatch):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"], "tiny": ckpts["tiny"]})
    s = ("--socket", d.socket)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws the progress bar as on a terminal (to stderr)
    rc, out, err = cli(capsys, *s, "load", "tiny")
    assert rc == 0 and "0/?" not in out + err and " bytes" not in out + err, (out, err)
    monkeypatch.delenv("FORCE_COLOR")
    assert cli(capsys, *s, "load", "a")[0] == 0
    rc, out, _ = cli(capsys, *s, "load", "b")  # 9 MiB holds one 8 MiB model: a and then tiny go (LRU)
    assert rc == 0 and out.splitlines()[1] == f"evicted to make room: a (8.0 MiB), tiny ({TINY})", out
    got = cli_json(capsys, *s, "load", "a")
    assert got["model"]["name"] == "a" and [(e["name"], e["state"]) for e in got["evicted"]] == [("b", "evicted")]
    assert got["evicted"][0]["nbytes"] > 8_000_000
    assert cli_json(capsys, *s, "load", "a")["evicted"] == []  # already resident


# -- seeing who holds what -----------------------------------------------------------------
def test_ps_status_and_models_show_holders_idle_time_and_expiry(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB", models={"a": ckpts["a"], "tiny": ckpts["tiny"], "c": ckpts["c"]},
                     a={"keep_alive": "5m"}, tiny={"keep_alive": "10m"})
    s = ("--socket", d.socket)
    rc, out, _ = cli(capsys, *s, "ps")
    assert rc == 0 and out == "no model is resident\n"
    cli(capsys, *s, "load", "tiny")
    me = f"pid {os.getpid()} engine-x (uid {os.geteuid()})"
    with SyncClient(d.socket, name="engine-x") as c, c.attach("a"):
        rc, out, _ = cli(capsys, *s, "ps")
        rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
        assert set(rows) == {"a", "tiny"}, out  # c is not resident
        assert me in rows["a"] and "5m 00s after the last detach" in rows["a"], out
        assert "8.0 MiB" in rows["a"] and "cpu" in rows["a"]
        assert re.search(r"│\s+\d+s │ in (9m \d\ds|10m 00s)", rows["tiny"]), out  # idle, then keep_alive's expiry
        resident = cli_json(capsys, *s, "ps")  # the same dicts as status's and models' (times move on)
        assert [(m["name"], sorted(m)) for m in resident] == [(m["name"], sorted(m)) for m in cli_json(capsys, *s, "status")["resident"]]
        by_name = {m["name"]: m for m in cli_json(capsys, *s, "status")["resident"]}
        (lease,) = by_name["a"]["leases"]
        assert lease["pid"] == os.getpid() and lease["uid"] == os.geteuid() and lease["client"] == "engine-x"
        assert 0 <= lease["since_s"] < 60 and by_name["a"]["expires_in_s"] is None
        assert 590 < by_name["tiny"]["expires_in_s"] <= 600 and by_name["tiny"]["leases"] == []
        models = {m["name"]: m for m in cli_json(capsys, *s, "models")}
        assert models["a"]["leases"] == [{**lease, "since_s": models["a"]["leases"][0]["since_s"]}]
        assert models["c"]["leases"] == [] and models["c"]["expires_in_s"] is None


def test_no_space_and_attached_errors_name_the_holders(start_daemon, ckpts, capsys):
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "b": ckpts["b"]})
    s = ("--socket", d.socket)
    me = f"pid {os.getpid()} (engine-x, uid {os.geteuid()})"
    with SyncClient(d.socket, name="engine-x") as c, c.attach("a"):
        rc, _, err = cli(capsys, *s, "evict", "a")
        assert rc == 1 and f"ATTACHED: model 'a' has 1 live attachment(s): attached by {me} for " in err, err
        rc, _, err = cli(capsys, *s, "load", "b", "--wait", "0")
        assert rc == 1 and "needs 8.0 MiB on cpu; budget 9.0 MiB" in err and f"a (8.0 MiB, resident, attached by {me}" in err, err
        with pytest.raises(NoSpace) as exc:
            c.load("b", wait_s=0)
        (holder,) = exc.value.details["holders"]
        assert [(h["pid"], h["client"]) for h in holder["leases"]] == [(os.getpid(), "engine-x")]


@root_only
def test_a_tenant_sees_only_its_own_uids_holders(start_daemon, ckpts):
    """Peers are tenants: another uid's pid and client name are not theirs to learn, in
    `models`, `status` or an error; their own are."""
    d = start_daemon(budget="9MiB", models={"a": ckpts["a"], "tiny": ckpts["tiny"], "b": ckpts["b"]},
                     extra_daemon={"socket_mode": 0o666, "allowed_uids": [0, NOBODY], "admin_uids": [0]})
    os.chmod(os.path.dirname(d.socket), 0o755)

    def tenant() -> dict[str, Any]:
        with SyncClient(d.socket, name="tenant-engine") as c, c.attach("tiny"):
            models = {m["name"]: m for m in c.models()}
            resident = {m["name"]: m for m in c.status()["resident"]}
            try:
                c.load("b", wait_s=0)
                error: Any = None
            except NoSpace as exc:
                error = exc.to_wire()
            return {"models": models, "resident": resident, "error": error, "pid": os.getpid()}

    with SyncClient(d.socket, name="root-engine") as c, c.attach("a"):
        got = as_uid(NOBODY, tenant)
        assert "exception" not in got, got
        for view in (got["models"], got["resident"]):
            assert view["a"]["attach_count"] == 1 and view["a"]["leases"] == []  # root's lease: counted, not described
            assert view["tiny"]["leases"] == [{"pid": got["pid"], "uid": NOBODY, "client": "tenant-engine",
                                               "since_s": view["tiny"]["leases"][0]["since_s"], "count": 1}]
        message = got["error"]["message"]
        assert "root-engine" not in message and f"pid {os.getpid()}" not in message, message
        assert "a (8.0 MiB, resident, 1 attached (by other users))" in message and "tenant-engine" in message, message
        assert "root-engine" not in json.dumps(got)
        assert [h["client"] for h in {m["name"]: m for m in c.models()}["a"]["leases"]] == ["root-engine"]


def test_holders_are_described_to_admins_and_their_own_uid_only():
    """The rule itself, without a daemon and without root: lease_holders and the errors
    built from them."""
    from weightcache.server.handlers import lease_holders, redact

    core = CacheCore({"cpu": 1 << 20})
    core.register("m", "cpu")
    core.finish_load(core.begin_load("m", 1000).name)
    admin, alice, bob = (Peer(pid, uid, uid, frozenset({uid})) for pid, uid in ((10, 0), (11, 1001), (12, 1002)))
    conns = {1: Caller(1, alice, "alice-engine"), 2: Caller(2, bob, "bob-engine")}
    core.attach("m", 1)
    core.attach("m", 2)
    ctx: Any = SimpleNamespace(core=core, caller_of=conns.get, registry=SimpleNamespace(groups={}, models={}),
                               access=AccessPolicy(DaemonConfig(admin_uids=[0], allowed_uids=[0, 1001, 1002])))
    assert [h["client"] for h in lease_holders(ctx, ["m"], admin)] == ["alice-engine", "bob-engine"]
    # One call: a lease's age moves between two calls (a fresh clone failed on 0.002 vs 0.003).
    mine = lease_holders(ctx, ["m"], alice)
    assert mine == [{"pid": 11, "uid": 1001, "client": "alice-engine", "since_s": mine[0]["since_s"], "count": 1}]
    req = Request(1, "unregister", {"name": "m"})
    err = redact(ctx, Caller(3, bob, "cli"), req, Attached("model 'm' has 2 live attachment(s)", model="m", attach_count=2))
    assert "pid 12 (bob-engine, uid 1002)" in err.message and "and 1 other(s)" in err.message and "alice" not in err.message
    assert [h["client"] for h in err.details["holders"]] == ["bob-engine"]
    err = redact(ctx, Caller(3, admin, "cli"), req, Attached("model 'm' has 2 live attachment(s)", model="m", attach_count=2))
    assert "pid 11 (alice-engine, uid 1001)" in err.message and "pid 12 (bob-engine" in err.message
    carol = Peer(13, 1003, 1003, frozenset({1003}))
    err = redact(ctx, Caller(3, carol, "cli"), req, Attached("model 'm' has 2 live attachment(s)", model="m", attach_count=2))
    assert err.message.endswith(": 2 attached (by other users)") and err.details["holders"] == []
    # A row per holding connection, however many leases it holds: the reply and the work
    # are bounded by the connections, not by what a peer pipelining attaches piles up.
    for _ in range(3):
        core.attach("m", 1)
    assert [(h["client"], h["count"]) for h in lease_holders(ctx, ["m"], admin)] == [("alice-engine", 4), ("bob-engine", 1)]
    err = redact(ctx, Caller(3, bob, "cli"), req, Attached("model 'm' has 5 live attachment(s)", model="m", attach_count=5))
    assert "pid 12 (bob-engine, uid 1002) for" in err.message and "and 4 other(s)" in err.message, err.message
    err = redact(ctx, Caller(3, admin, "cli"), req, Attached("model 'm' has 5 live attachment(s)", model="m", attach_count=5))
    assert "pid 11 (alice-engine, uid 1001) x4 for" in err.message and "other(s)" not in err.message, err.message


# -- register / unregister -----------------------------------------------------------------
def test_register_and_unregister(start_daemon, ckpts, capsys, tmp_path, monkeypatch):
    d = start_daemon(budget="20MiB")
    s = ("--socket", d.socket)
    monkeypatch.chdir(ckpts["tiny"].parent)  # a relative path is this shell's, not the daemon's
    rc, out, err = cli(capsys, *s, "register", "t", ckpts["tiny"].name, "--keep-alive", "5m")
    assert rc == 0 and out.startswith("registered t: registered on cpu (sent as open files)"), err
    got = cli_json(capsys, *s, "register", "u", ckpts["a"].name, "--by-path", "--preload")
    assert got["name"] == "u" and got["path"] == str(ckpts["a"]) and got["keep_alive"] is None
    models = {m["name"]: m for m in cli_json(capsys, *s, "models")}
    assert models["t"]["keep_alive"] == 300 and models["t"]["path"] == str(ckpts["tiny"])
    assert cli(capsys, *s, "load", "t")[0] == 0
    # u's preload may still run (a model is not unregistered while it loads): join it.
    assert cli(capsys, *s, "load", "u")[0] == 0
    rc, out, _ = cli(capsys, *s, "unregister", "t")
    assert rc == 0 and out == "unregistered t\n"
    assert cli_json(capsys, *s, "unregister", "u") == {"unregistered": "u"}
    assert cli_json(capsys, *s, "models") == []
    rc, _, err = cli(capsys, *s, "unregister", "t")
    assert rc == 1 and "UNKNOWN_MODEL" in err
    for bad in (["register", "v"], ["register", "v", "x.safetensors", "--shard", "cpu=/x"], ["register", "v", "--shard", "/x"],
                ["register", "v", "x", "--keep-alive", "soon"]):
        rc, _, err = cli(capsys, *s, *bad)
        assert rc == 2 and err.startswith("weightcache register: "), (bad, err)


def test_register_says_who_may_use_it_and_status_shows_tenants(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB")
    s = ("--socket", d.socket)
    got = cli_json(capsys, *s, "register", "t", str(ckpts["tiny"]), "--allow-uid", "1000", "--allow-uid", "1001",
                   "--allow-group", "0")
    assert (got["allowed_uids"], got["allowed_gids"]) == ([1000, 1001], [0])
    assert cli(capsys, *s, "load", "t")[0] == 0
    rc, out, _ = cli(capsys, *s, "status")
    me = f"uid:{os.geteuid()}"
    assert rc == 0 and "tenant" in out and me in out, out  # the registering uid's usage
    (m,) = cli_json(capsys, *s, "models")
    assert cli_json(capsys, *s, "status")["tenants"][me]["devices"]["cpu"] == {"used": m["nbytes"], "parsing": 0, "quota": None}
    rc, out, _ = cli(capsys, *s, "ps")
    assert rc == 0 and f"uid {os.geteuid()}" in out, out


def test_models_shows_why_a_model_cannot_load(start_daemon, tmp_path, capsys):
    """A path typo is found at start; the table says so, not only --json."""
    d = start_daemon(models={"typo": tmp_path / "nope.safetensors"})
    for _ in range(100):  # the start-up check runs in the background
        rc, out, _ = cli(capsys, "--socket", d.socket, "models")
        if "does not exist" in out:
            break
        time.sleep(0.05)
    assert rc == 0 and "LOAD_FAILED" in out and "does not exist" in out, out


def test_load_takes_a_keep_alive(start_daemon, ckpts, capsys):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    rc, _, err = cli(capsys, "--socket", d.socket, "load", "tiny", "--keep-alive", "5m", "--quiet")
    assert rc == 0, err
    (m,) = cli_json(capsys, "--socket", d.socket, "models")
    assert m["keep_alive"] == 300
    rc, out, err = cli(capsys, "--socket", d.socket, "load", "tiny", "--keep-alive", "5 weeks", "--quiet")
    assert rc != 0 and "not a duration" in out + err


def test_attach_takes_a_keep_alive(start_daemon, ckpts, capsys):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    rc, _, err = cli(capsys, "--socket", d.socket, "attach", "tiny", "--keep-alive", "0")
    assert rc == 0, err
    for _ in range(100):  # keep_alive 0: evicted once its last lease went (by the daemon's expiry sweep)
        (m,) = cli_json(capsys, "--socket", d.socket, "models")
        if m["state"] == "evicted":
            break
        time.sleep(0.05)
    assert m["state"] == "evicted"
    rc, _, err = cli(capsys, "--socket", d.socket, "attach", "tiny", "--keep-alive", "2h")
    assert rc == 0, err
    (m,) = cli_json(capsys, "--socket", d.socket, "models")
    assert m["state"] == "resident" and m["keep_alive"] == 7200


# -- an operator's first hour (h2): what they mistype ---------------------------------------
def test_json_before_the_command_and_an_unknown_model_says_where_to_look(start_daemon, ckpts, capsys):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    rc, out, err = cli(capsys, "--json", "--socket", d.socket, "status")  # was "unrecognized arguments: --json"
    assert rc == 0 and json.loads(out)["devices"]["cpu"]["budget"] > 0, err
    rc, out, err = cli(capsys, "--socket", d.socket, "load", "tinny")
    assert rc == 1 and err.count("\n") == 1 and "no model named 'tinny'" in err and "`weightcache models` lists" in err, err
    rc, out, err = cli(capsys, "--json", "--socket", d.socket, "load", "tinny")
    assert rc == 1 and json.loads(out)["error"]["code"] == "UNKNOWN_MODEL"


def test_the_socket_of_the_config_file_is_found_as_the_daemon_reads_it(start_daemon, capsys, tmp_path, monkeypatch):
    d = start_daemon()
    sock = Path(d.socket)
    # A relative socket is relative to the config file (config/file.py, config_relative), "~" the home.
    cfg = sock.parent / "etc" / "c.toml"
    cfg.parent.mkdir()
    cfg.write_text(f'[daemon]\nsocket = "../{sock.name}"\n')
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(cfg))
    monkeypatch.chdir(tmp_path)  # not the socket's directory
    rc, out, err = cli(capsys, "status")
    assert rc == 0 and str(sock) in out, err
    monkeypatch.setenv("HOME", str(sock.parent))
    cfg.write_text(f'[daemon]\nsocket = "~/{sock.name}"\n')
    assert cli(capsys, "status")[0] == 0


def test_attach_times_the_attach_not_the_import_of_torch(start_daemon, ckpts):
    """`weightcache attach` printed "in 1266 ms" on the dev VM: its first attach imported
    torch inside the timed span. Torch must be imported when the clock starts."""
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    code = (
        "import sys, time, types\n"
        "import weightcache.cli as cli, weightcache.cli.commands as commands\n"
        "seen = []\n"
        "def perf_counter():\n"
        "    seen.append('torch' in sys.modules)\n"
        "    return time.perf_counter()\n"
        "commands.time = types.SimpleNamespace(perf_counter=perf_counter, sleep=time.sleep)\n"
        f"rc = cli.main(['--socket', {d.socket!r}, 'attach', 'tiny'])\n"
        "print('torch imported at the first clock read:', seen[0])\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "torch imported at the first clock read: True" in proc.stdout, proc.stdout


def test_config_before_or_after_the_command_and_serve_with_the_file_as_argument(start_daemon, capsys, tmp_path):
    d = start_daemon()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[daemon]\nsocket = "{d.socket}"\n')
    for argv in (["--config", str(cfg), "status"], ["status", "--config", str(cfg)]):  # was "invalid choice" / "unrecognized"
        rc, out, err = cli(capsys, *argv)
        assert rc == 0 and d.socket in out, err
    missing = str(tmp_path / "missing.toml")
    for argv in (["--config", missing, "serve"], ["serve", missing]):  # the file is read: it is named, not argparse's
        rc, _, err = cli(capsys, *argv)
        assert rc == 2 and f"config file {missing} does not exist" in err, err
    rc, _, err = cli(capsys, "serve", "--config", str(cfg), missing)
    assert rc == 2 and "two config files" in err


def test_wait_and_hold_take_durations_as_the_config_does(start_daemon, ckpts, capsys):
    d = start_daemon(models={"tiny": ckpts["tiny"]})
    rc, out, err = cli(capsys, "--socket", d.socket, "load", "tiny", "--wait", "5s")  # was "invalid float value: '5s'"
    assert rc == 0 and out.startswith("tiny: resident"), err
    rc, out, err = cli(capsys, "--socket", d.socket, "attach", "tiny", "--hold", "0.01s")
    assert rc == 0 and "holding the lease for 0.01s" in out, err
    with pytest.raises(SystemExit):
        main(["--socket", d.socket, "load", "tiny", "--wait", "5 min"])
    assert "not a duration: '5 min'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "workload"])
def test_benchmarks_on_a_gpu_the_host_lacks_say_so_in_one_line(command, capsys):
    import torch

    device = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    rc, _, err = cli(capsys, command, "--device", device)  # was torch's AssertionError traceback (bench)
    assert rc == 2 and err.startswith(f"weightcache {command}: --device {device}: this host has"), err


def test_verify_of_a_published_model_says_it_has_no_files(start_daemon, capsys):
    import torch

    d = start_daemon()
    with SyncClient(d.socket) as c:
        c.publish("processed", {"w": torch.ones(4)}, fingerprint="x+int8")
    rc, _, err = cli(capsys, "--socket", d.socket, "attach", "processed", "--verify")
    assert rc == 2 and "--verify processed: nothing to compare with: it was published by an engine" in err, err


@pytest.mark.parametrize("value", ["-1", "0"])
def test_register_keep_alive_of_0_or_minus_1_says_what_to_write(value, capsys, tmp_path):
    rc, _, err = cli(capsys, "--socket", str(tmp_path / "none.sock"), "register", "m", str(tmp_path / "m.safetensors"),
                     "--keep-alive", value)  # was "not a duration: '-1'", and for 0 the daemon's pydantic dump
    assert rc == 2 and f"--keep-alive {value}: give a time > 0" in err and "weightcache load --keep-alive" in err, err


def test_a_config_file_that_is_not_text_is_a_message_for_client_commands_too(capsys, tmp_path, monkeypatch):
    # Client commands read the file's [daemon] socket as the daemon reads the file
    # (config/file.py); their own reader let a UnicodeDecodeError out as a traceback.
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b"\xff[daemon]\n")
    monkeypatch.setenv("WEIGHTCACHE_CONFIG", str(cfg))
    rc, _, err = cli(capsys, "status")
    assert rc == 2 and f"config file {cfg} is not UTF-8 text (byte 0)" in err, err
    rc, _, err = cli(capsys, "--config", str(tmp_path / "gone.toml"), "status")
    assert rc == 2 and "does not exist (named by --config; pass --socket or fix it)" in err, err


def test_client_commands_do_not_import_pydantic(tmp_path):
    """Only what needs the config's schema (serve, and the tools that start daemons)
    imports pydantic, ~150 ms at every start: a client command finds the socket in the
    config file (config/file.py) and parses sizes and durations with units.py."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[daemon]\nsocket = "{tmp_path / "none.sock"}"\n[budgets]\ncpu = "1GiB"\n')
    code = ("import sys\n"
            "from weightcache.cli import main\n"
            "for argv in (['health'], ['status'], ['load', 'm', '--wait', '5s'], ['attach', 'm', '--hold', '1m'],\n"
            "             ['register', 'm', 'x.safetensors', '--keep-alive', '1h']):\n"
            "    assert main(['--config', sys.argv[1], *argv]) == 1, argv  # no daemon there\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'pydantic_settings')))\n")
    r = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


# -- one size, sharded models, checkpoints that are not safetensors ---------------------------
def test_one_model_shows_one_size_everywhere(start_daemon, ckpts, capsys, tmp_path):
    """models, ps, load, attach, evict, a reload's eviction and the daemon's log: the bytes
    the budget counts, in one unit (the tensors' own sum, and the arena without what the
    daemon holds for the checkpoint, were shown as two other sizes)."""
    d = start_daemon(budget="20MiB", models={"tiny": ckpts["tiny"]})
    s = ("--socket", d.socket)
    assert cli(capsys, *s, "load", "tiny")[1] == f"tiny: resident on cpu, {TINY}, 5 tensors\n"
    for command in ("models", "ps"):
        assert TINY in next(line for line in cli(capsys, *s, command)[1].splitlines() if "tiny" in line)
    assert f", 5 tensors, {TINY} on cpu in " in cli(capsys, *s, "attach", "tiny")[1]
    assert cli(capsys, *s, "evict", "tiny")[1] == f"tiny: evicted, {TINY} freed\n"
    assert cli(capsys, *s, "load", "tiny")[0] == 0
    d.config.write_text(d.config.read_text().replace('"cpu" = "20MiB"', '"cpu" = "64KiB"'))
    rc, out, err = cli(capsys, *s, "reload")
    assert rc == 0 and f"evicted: tiny ({TINY}): cpu budget lowered" in out, (out, err)
    assert f"evicted tiny ({TINY}): cpu budget lowered" in d.log_text()


def test_sharded_models_in_the_cli_attach_by_rank_and_load_every_rank(start_daemon, ckpts, capsys):
    d = start_daemon(budget="40MiB", models={"tp": None},
                     tp={"shards": [{"path": str(ckpts["a"]), "device": "cpu"}, {"path": str(ckpts["tiny"]), "device": "cpu"}]})
    s = ("--socket", d.socket)
    rc, out, _ = cli(capsys, *s, "load", "tp")
    sizes = {m["name"]: format_size(m["nbytes"]) for m in cli_json(capsys, *s, "models")}
    assert rc == 0 and out.splitlines() == [f"tp@0 (rank 0): resident on cpu, {sizes['tp@0']}, 40 tensors",
                                            f"tp@1 (rank 1): resident on cpu, {TINY}, 5 tensors"], out
    assert [x["rank"] for x in cli_json(capsys, *s, "load", "tp")["shards"]] == [0, 1]
    rc, _, err = cli(capsys, *s, "attach", "tp")
    assert rc == 1 and "sharded over 2 ranks: attach one of them with rank=0 to rank=1 (`weightcache attach tp --rank 0`)" in err, err
    rc, out, err = cli(capsys, *s, "attach", "tp", "--rank", "1", "--verify")
    assert rc == 0 and out.startswith("attached tp rank 1: lease ") and f", 5 tensors, {TINY} on cpu in " in out, (out, err)
    assert f"verified: all 5 tensors equal the bytes in {ckpts['tiny']}" in out, out
    got = cli_json(capsys, *s, "attach", "tp", "--rank", "0")
    assert got["rank"] == 0 and got["tensors"] == 40
    rc, _, err = cli(capsys, *s, "attach", "tp", "--rank", "2")
    assert rc == 1 and "has ranks 0..1, not 2" in err
    assert cli(capsys, *s, "status")[0] == 0  # still serving


def _pickled_dir(root: Path) -> Path:
    """A transformers-style directory of PyTorch .bin shards, as save_pretrained wrote them
    before safetensors was its default."""
    import torch

    d = root / "bin-model"
    d.mkdir()
    for i in (1, 2):
        torch.save({f"w{i}": torch.zeros(4)}, d / f"pytorch_model-0000{i}-of-00002.bin")
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
        "w1": "pytorch_model-00001-of-00002.bin", "w2": "pytorch_model-00002-of-00002.bin"}}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 4}))
    return d


def test_a_directory_of_bin_shards_and_a_config_json_get_errors_that_say_what_to_do(start_daemon, ckpts, capsys, tmp_path):
    bins = _pickled_dir(tmp_path)
    # Served by the daemon from its config file: `models` shows why each cannot load.
    d = start_daemon(budget="20MiB", models={"bins": bins, "index": bins / "pytorch_model.bin.index.json",
                                             "config": bins / "config.json", "tiny": ckpts["tiny"]})
    s = ("--socket", d.socket)
    for name in ("bins", "index"):
        rc, _, err = cli(capsys, *s, "load", name)
        assert rc == 1 and "PyTorch pickle file" in err and "save_pretrained(NEW_DIR)" in err, err
    rc, _, err = cli(capsys, *s, "load", "config")
    assert rc == 1 and "not a checkpoint index: a model's config.json without a \"weight_map\"" in err, err
    assert "KeyError" not in err
    # Registered by a client, which opens the files itself: the same messages, before anything is sent.
    rc, _, err = cli(capsys, *s, "register", "bins2", str(bins))
    assert rc == 1 and "2 PyTorch pickle file(s) (pytorch_model-00001-of-00002.bin, pytorch_model-00002-of-00002.bin)" in err, err
    rc, _, err = cli(capsys, *s, "register", "config2", str(bins / "config.json"))
    assert rc == 1 and "not a checkpoint index" in err and "KeyError" not in err, err
    assert cli(capsys, *s, "load", "tiny")[0] == 0  # and the daemon serves on
