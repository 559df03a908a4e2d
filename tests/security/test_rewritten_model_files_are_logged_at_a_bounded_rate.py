"""A tenant that rewrites its own registered file so that each load is refused
(flight.py's open/parse 'load refused') writes a bounded number of lines."""

from __future__ import annotations

import os
import re
import signal

from helpers import NOBODY, as_uid, root_only

from ._util import Conn, code, multi_tenant, public_dir, write_checkpoint
from .test_tenants import TENANTS, _register

pytestmark = root_only
LOADS = 100


def test_rewritten_tenant_file_refusals_are_bounded(start_daemon):
    pub = public_dir()
    f = write_checkpoint(pub / "mine.safetensors", 64 * 1024, 4, seed=3)
    os.chown(f, NOBODY, NOBODY)
    os.chmod(f, 0o644)
    d = multi_tenant(start_daemon, TENANTS)

    def tenant():
        reg = _register(d.socket, "mine", str(f))
        with open(f, "r+b") as fh:  # its own file, rewritten: the header is no longer one
            fh.write(b"\xff" * 16)
        c = Conn(d.socket, timeout=60)
        try:
            return {"reg": reg, "codes": [code(c.call({"id": 10 + i, "op": "load", "name": "mine", "wait_s": 0})) for i in range(LOADS)]}
        finally:
            c.close()

    out = as_uid(NOBODY, tenant, timeout=120)
    assert "model" in out["reg"], out
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    text = d.log_text()
    lines = [x for x in text.splitlines() if "load mine refused" in x]
    left = sum(int(n) for n in re.findall(r"(\d+) more 'load refused' line\(s\) left out", text))
    assert set(out["codes"]) == {"CORRUPT_CHECKPOINT"}, out["codes"]
    # before: 100 ERROR lines, one per load; now 10 WARNING lines and 90 counted
    assert len(lines) <= 10 and len(lines) + left == LOADS, (len(lines), left)
    assert not any(" ERROR " in x for x in lines), lines[:2]
