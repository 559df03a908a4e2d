"""`make demo` is the README's quick start, what a newcomer runs first: it must finish,
say what each timing is, and keep its sentences whole when piped (rich wrapped them at 80
columns, splitting the daemon log's path over two lines)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path


def test_the_demo_runs_labels_its_timings_and_keeps_paths_whole_when_piped():
    work = Path(tempfile.mkdtemp(prefix="wc-demo-", dir="/tmp"))  # AF_UNIX paths are short
    proc = subprocess.run([sys.executable, "-m", "weightcache", "demo", "--workdir", str(work), "--restarts", "1",
                           "--model-mib", "4"], capture_output=True, text=True, timeout=300, env={"COLUMNS": "80",
                           "PATH": "/usr/bin:/bin"})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"log: {work / 'daemon.log'}\n" in out, out  # the path on one line
    for label in ("ready (s)", "import torch (s)", "weights step (ms)"):  # a header each, not wrapped
        assert label in out, out
    # what each timing is, in one sentence
    assert "ready: from spawning a new engine process until all its weights are usable" in out, out
    assert "identical weights in every restart" in out
