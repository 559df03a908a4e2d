"""Plain functions shared by the integration tests (the fixtures are in conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from weightcache import Client

CHILD = str(Path(__file__).with_name("attach_child.py"))  # a stand-in engine process


def spawn_child(d, model, path, mode):
    return subprocess.Popen([sys.executable, CHILD, d.socket, model, str(path), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


async def states(c: Client) -> dict[str, str]:
    return {m["name"]: m["state"] for m in await c.models()}


async def first(c: Client, key: str, value: object) -> bool:
    """Whether the first model's ``key`` has become ``value``."""
    return (await c.models())[0][key] == value


def skip_without_cuda() -> None:
    """Skip the caller (a test, a fixture, or a whole module at its top) unless cuda-bindings
    and a CUDA device are present: CI has no GPU."""
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings not installed")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device", allow_module_level=True)


def gpu_daemon(start_daemon: Any, budget: str, models: dict[str, Path], device: str = "cuda:0", daemon: dict[str, Any] | None = None,
               **opts: Any) -> Any:
    """A daemon with ``budget`` on ``device`` and every model placed there."""
    placed = {n: {"device": device, **opts.get(n, {})} for n in models}
    return start_daemon(budget="1GiB", models=models, extra_daemon=daemon, budgets={device: budget}, **placed)
