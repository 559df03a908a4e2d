"""The CLI's habits: ``--version``, a quiet exit when the reader of a pipe
goes (``weightcache ps --json | head``), strict JSON (no NaN/Infinity, and
``keep_alive = inf`` refused in the file), examples in each subcommand's help, and
``register`` saying that a runtime registration does not outlive the daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightcache import __version__
from weightcache.cli import build_parser, main
from weightcache.cli.render import print_json
from weightcache.config import load_settings
from weightcache.errors import ConfigError

WC = [sys.executable, "-m", "weightcache"]


@pytest.fixture(autouse=True)
def no_socket_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in ("WEIGHTCACHE_SOCKET", "WEIGHTCACHE_DAEMON__SOCKET", "WEIGHTCACHE_CONFIG"):
        monkeypatch.delenv(env, raising=False)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"weightcache {__version__}\n"


@pytest.mark.parametrize("command", ["ps", "models", "status"])
def test_a_closed_pipe_ends_the_command_quietly(start_daemon, ckpts, command):
    d = start_daemon(budget="20MiB", models={"a": ckpts["a"]})
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes a byte: `| head` that has exited
    try:
        p = subprocess.run([*WC, "--socket", d.socket, command, "--json"], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
    assert p.stderr == "" and p.returncode == 141, (p.returncode, p.stderr)  # 128 + SIGPIPE, as a shell reports it


def test_json_output_is_strict(capsys):
    print_json({"keep_alive": float("inf"), "rate": float("nan"), "nested": [{"x": -float("inf")}], "n": 1.5})
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}")) == {
        "keep_alive": None, "rate": None, "nested": [{"x": None}], "n": 1.5}


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", '"inf"'])
def test_keep_alive_inf_in_the_file_is_refused(tmp_path, value):
    cfg = tmp_path / "wc.toml"
    cfg.write_text(f'[[models]]\nname = "m"\npath = "/m.safetensors"\nkeep_alive = {value}\n')
    with pytest.raises(ConfigError, match=r"models\[0\]\.keep_alive|keep_alive"):
        load_settings(cfg)


def test_every_subcommand_help_has_examples():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    lacking = []
    for name, p in sub.choices.items():  # type: ignore[union-attr]
        text = p.format_help()
        if "examples:" not in text or f"weightcache {name}" not in text.split("examples:", 1)[1]:
            lacking.append(name)
    assert not lacking, f"subcommands whose --help has no examples: {lacking}"


def test_register_says_loudly_that_it_does_not_outlive_the_daemon(start_daemon, ckpts, capsys):
    d = start_daemon(budget="20MiB")
    capsys.readouterr()
    assert main(["--socket", d.socket, "register", "t", str(ckpts["tiny"])]) == 0
    out, err = capsys.readouterr()
    assert "not kept when the daemon restarts" in err and "[[models]]" in err, err
    assert main(["--socket", d.socket, "--json", "register", "u", str(ckpts["a"])]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["name"] == "u" and "not kept when the daemon restarts" in err


def _bad_files(d: Path) -> dict[str, Path]:
    import pickle

    good = d / "good.safetensors"
    from weightcache.tools.synth import write_checkpoint

    write_checkpoint(good, 64 * 1024, 4, seed=3)
    raw = good.read_bytes()
    out = {"pickle": d / "model.bin", "truncated": d / "truncated.safetensors", "garbage": d / "garbage.safetensors"}
    out["pickle"].write_bytes(pickle.dumps({"w": list(range(100))}))
    out["truncated"].write_bytes(raw[: len(raw) // 2])
    out["garbage"].write_bytes(os.urandom(4096))
    return out


@pytest.mark.parametrize("by_path", [False, True], ids=["files", "by-path"])
def test_register_checks_the_header_as_start_does(start_daemon, tmp_path, capsys, by_path):
    bad = _bad_files(tmp_path)
    d = start_daemon(budget="20MiB", models=bad)  # the same files, configured
    from weightcache import SyncClient

    with SyncClient(d.socket) as c:
        def configured() -> dict[str, dict[str, object]]:
            return {m["name"]: m for m in c.models()}

        import time

        deadline = time.monotonic() + 60
        while any(m["state"] != "error" for m in configured().values()):  # the start check runs in the background
            assert time.monotonic() < deadline, configured()
            time.sleep(0.05)
        start_codes = {n: m["last_error"]["code"] for n, m in configured().items()}
    for kind, path in bad.items():
        capsys.readouterr()
        rc = main(["--socket", d.socket, "register", f"r-{kind}", str(path), *(["--by-path"] if by_path else [])])
        out, err = capsys.readouterr()
        assert rc == 1 and out == "", (kind, out, err)
        assert f"weightcache: {start_codes[kind]}: " in err, (kind, start_codes[kind], err)
    assert start_codes == {"pickle": "CORRUPT_CHECKPOINT", "truncated": "CORRUPT_CHECKPOINT", "garbage": "CORRUPT_CHECKPOINT"}
    with SyncClient(d.socket) as c:
        assert sorted(m["name"] for m in c.models()) == sorted(bad)  # nothing registered
