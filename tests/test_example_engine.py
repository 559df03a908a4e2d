"""examples/transformers_engine.py end to end: a transformers model restarted with and
without the cache gives bit-identical forward outputs."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transformers_engine.py"


def test_transformers_engine_example(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLE), "--restarts", "1", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "forward outputs identical across all 2 engine starts" in r.stdout
    assert "disk" in r.stdout and "cache" in r.stdout
