"""`make stress`'s tools run, briefly, with the suite, so that a change to the daemon that
breaks them (a wire client that maps only one arena kind, a per-uid limit that refuses
their clients) is found here and not only when someone runs `make stress`. These are
smoke runs; the figures come from `make stress` (docs/reliability.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_churn_stress_runs_and_its_books_balance(tmp_path):
    out = tmp_path / "churn.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "churn", "--clients", "8", "--seconds", "2",
                        "--kill-fraction", "0.25", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert all(summary["checks"].values()), summary["checks"]
    assert summary["killed"] == 2 and summary["replies"].get("ok", 0) > 0
