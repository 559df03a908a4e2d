"""What the daemon and the supervisor start runs nothing from the directory they were
started in: a ``weightcache/__init__.py`` or a ``msgpack.py`` planted there (a directory
others may write, e.g. /tmp) is never executed by a parse worker (a register's, a
reload's), and ``weightcache supervise`` preloads the interpreter's modules, not a
planted ``colorsys.py``; the engine keeps its working directory."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from weightcache import Client
from weightcache.loader import open_checkpoint, parse_worker
from weightcache.tools.spawn import wait_for_socket

from ._util import raw_safetensors

PY = sys.executable
TENSORS = 20_000  # a header of ~1.2 MB: parsed in a worker process (parse_worker.PARSE_APART_BYTES)


def big_header(path: Path, n: int = TENSORS) -> Path:
    header = {f"t{i:06d}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    raw = json.dumps(header, separators=(",", ":"))
    assert len(raw) >= parse_worker.PARSE_APART_BYTES
    return raw_safetensors(path, raw)


def plant(work: Path, marker: Path, *modules: str) -> None:
    """Modules in ``work`` that append their name to ``marker`` when executed."""
    for name in modules:
        target = work / name.replace(".", "/") / "__init__.py" if name == "weightcache" else work / f"{name}.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")


def test_a_parse_worker_runs_nothing_from_its_callers_directory_or_environment(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran"
    plant(work, marker, "weightcache", "msgpack")
    path = big_header(tmp_path / "big.safetensors")
    monkeypatch.chdir(work)
    monkeypatch.setenv("PYTHONPATH", str(work))
    ckpt = open_checkpoint(path)
    assert not marker.exists(), f"planted modules ran: {marker.read_text()}"
    assert len(ckpt.tensors) == TENSORS


def test_parse_workers_of_a_daemon_started_in_a_planted_directory_run_nothing_from_it(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    marker = tmp_path / "ran"
    plant(work, marker, "weightcache", "msgpack")
    for name in ("a", "b", "c"):
        big_header(work / "models" / f"{name}.safetensors")
    sockdir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
    sock = os.path.join(sockdir, "d.sock")
    config = work / "x.toml"
    # Relative to the config file, which is named relative to the working directory: both
    # still found after the daemon left it.
    text = f'[daemon]\nsocket = "{sock}"\n\n[budgets]\ncpu = "256MiB"\n\n[[models]]\nname = "a"\npath = "models/a.safetensors"\n'
    config.write_text(text)
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        # -P: the daemon itself as its console script runs it, importing nothing from here.
        proc = subprocess.Popen([PY, "-P", "-m", "weightcache", "serve", "x.toml"], cwd=work, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for_socket(sock, proc)
        assert os.readlink(f"/proc/{proc.pid}/cwd") == "/"

        async def use() -> dict[str, dict]:
            async with Client(sock) as c:
                await c.load("a", timeout=120)
                await c.register("b", str(work / "models" / "b.safetensors"), send_files=False, timeout=120)
                await c.load("b", timeout=120)
                config.write_text(text + '\n[[models]]\nname = "c"\npath = "models/c.safetensors"\n')
                report = await c.reload(timeout=120)
                assert "c" in report["added"], report
                await c.load("c", timeout=120)
                return {m["name"]: m for m in await c.models()}

        models = asyncio.run(use())
    finally:
        proc.terminate()
        proc.wait(30)
    assert not marker.exists(), f"planted modules ran: {marker.read_text()}"
    assert {n: (m["state"], m["tensors"]) for n, m in models.items()} == {
        "a": ("resident", TENSORS), "b": ("resident", TENSORS), "c": ("resident", TENSORS)}, models
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_supervise_preloads_nothing_from_its_working_directory_and_the_engine_keeps_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    work = tmp_path / "work"
    work.mkdir()
    plant(work, marker, "colorsys")  # a standard module nothing else imports: the preload's
    (work / "engine.py").write_text(textwrap.dedent(f"""
        import colorsys, os, json
        json.dump({{"cwd": os.getcwd(), "colorsys": colorsys.__file__}}, open({str(tmp_path / 'engine.json')!r}, "w"))
    """))
    # `python -m weightcache supervise` puts the working directory first on sys.path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([PY, "-m", "weightcache", "supervise", "--preload", "colorsys", "--", PY, "engine.py"], cwd=work,
                       env=env, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), f"planted modules ran: {marker.read_text()}"
    assert p.returncode == 0, p.stderr
    seen = json.loads((tmp_path / "engine.json").read_text())
    assert seen["cwd"] == str(work)
    assert not seen["colorsys"].startswith(str(work)), seen
