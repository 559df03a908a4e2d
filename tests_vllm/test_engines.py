"""Whole vLLM engines, started as users start them, with `--load-format weightcache` and
no other option: `LLM(...)` in two processes at once (two models, one daemon, one
budget) and the OpenAI server over loopback, against `load_format="auto"` engines.
Each engine start costs ~35-50 s here, so one test holds them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from models import PROMPTS

from weightcache import SyncClient
from weightcache.tools.spawn import free_port

HERE = Path(__file__).resolve().parent
START_S = 600  # an engine start, on a loaded 2-core VM


def start_engine(model: Path, load_format: str, out: Path, hold: bool = False) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(HERE / "engine_child.py"), str(model), "--load-format", load_format, "--out", str(out)]
    log = out.with_suffix(".log").open("w")
    return subprocess.Popen(cmd + (["--hold"] if hold else []), stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                            text=True)


def result(proc: subprocess.Popen[str], out: Path) -> dict[str, Any]:
    deadline = time.monotonic() + START_S
    while not out.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"engine failed ({proc.returncode}):\n{out.with_suffix('.log').read_text()[-5000:]}")
        time.sleep(0.5)
    return json.loads(out.read_text())


def finish(proc: subprocess.Popen[str]) -> None:
    if proc.stdin is not None:
        proc.stdin.write("\n")
        proc.stdin.close()
    assert proc.wait(timeout=120) == 0



def completions(port: int, model: str) -> list[str]:
    body = json.dumps({"model": model, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choices = json.loads(r.read())["choices"]
    return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]


def wait_healthy(proc: subprocess.Popen[str], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not come up ({proc.returncode}):\n{log.read_text()[-5000:]}")
        time.sleep(1)


def test_engines_with_one_flag(daemon, ckpts, tmp_path) -> None:
    # Two engines of two models at once, each with --load-format weightcache alone.
    wc = {m: start_engine(ckpts[m], "weightcache", tmp_path / f"wc-{m}.json", hold=True) for m in ("llama", "qwen")}
    got = {m: result(p, tmp_path / f"wc-{m}.json") for m, p in wc.items()}
    with SyncClient(daemon.socket) as c:
        models = {m["name"]: m for m in c.models()}
        used = c.status()["devices"]["cpu"]["used"]
    llama = [m for n, m in models.items() if n.startswith("vllm-llama-")]
    qwen = [m for n, m in models.items() if n.startswith("vllm-qwen-")]
    assert len(llama) == len(qwen) == 1, sorted(models)
    assert llama[0]["state"] == qwen[0]["state"] == "resident"
    assert used == llama[0]["nbytes"] + qwen[0]["nbytes"]  # one budget holds both
    for m, p in wc.items():
        finish(p)
        log = (tmp_path / f"wc-{m}.log").read_text()
        assert "weightcache: loaded" in log and "from the daemon" in log, log[-3000:]
        assert "default loader" not in log

    # The same models read from disk by vLLM's default loader.
    auto = {m: result(start_engine(ckpts[m], "auto", tmp_path / f"auto-{m}.json"), tmp_path / f"auto-{m}.json")
            for m in ("llama", "qwen")}
    for m in ("llama", "qwen"):
        assert got[m]["tokens"] == auto[m]["tokens"], m
        assert len({tuple(t) for t in auto[m]["tokens"]}) > 1  # prompts that give different tokens

    # The OpenAI server, over loopback, on the same checkpoint: the registration and the
    # arena of the first engine, no second load.
    port = free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpts["llama"]),
                               "--load-format", "weightcache", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "128", "--enforce-eager", "--seed", "0"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_healthy(server, port, log)
        texts = completions(port, str(ckpts["llama"]))
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert texts == auto["llama"]["texts"]
    assert "weightcache: loaded" in log.read_text()
    with SyncClient(daemon.socket) as c:
        again = [m for m in c.models() if m["name"].startswith("vllm-llama-")]
    assert len(again) == 1 and again[0]["loads"] == 1
