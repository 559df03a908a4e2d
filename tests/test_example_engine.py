"""examples/transformers_engine.py end to end: a transformers model restarted with and
without the cache gives bit-identical forward outputs."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transformers_engine.py"


def test_transformers_engine_example(tmp_path):
    # --supervised adds a series under `weightcache supervise` and one of fresh processes
    # (one run for both: each engine start costs seconds of imports on the CI VM).
    r = subprocess.run([sys.executable, str(EXAMPLE), "--restarts", "1", "--workdir", str(tmp_path), "--supervised"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "forward outputs identical across all 4 engine starts (disk, cache, fresh, supervised)" in r.stdout
    assert "disk" in r.stdout and "cache" in r.stdout
    assert "restart  fresh (s)  supervised (s)" in r.stdout
    assert "recorded" in (tmp_path / "supervisor.log").read_text()  # its engine wrote the module record


def test_a_gpu_the_host_lacks_is_one_line():
    import torch

    device = "cuda:0" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    r = subprocess.run([sys.executable, str(EXAMPLE), "--device", device], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]  # was torch's AssertionError
    assert f"--device {device}: this host has no such CUDA device" in r.stderr
