"""A neighbour daemon reads only what a lend registered (docs/reliability.md
"Peers"): NIXL refuses a read whose remote range is outside the lender's registration,
over UCX's default transports and over TCP alone (the transport between nodes without
RDMA). The check is NIXL's, in the reader's own library: what it holds against a peer
that runs other code is said in docs/reliability.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from weightcache.peers.transport import unavailable

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"NIXL cannot start here (pip install 'weightcache[peers]'): {WHY}")

ROOT = Path(__file__).resolve().parents[2]

# Two agents in one process: a lender that registers 1 MiB of a 3 MiB mapping (a secret
# sits in the unregistered MiB after it), and a reader that asks for the lent page, the
# page past the registration, and a page of another mapping.
PROGRAM = textwrap.dedent('''
    import json, mmap, threading, time
    from weightcache.backends.cpu import _address
    from weightcache.peers.transport import Extent, Transport

    SECRET = b"SECRET!!" * 512
    lender, reader = Transport(), Transport()
    m = mmap.mmap(-1, 3 << 20)
    base = _address(m)
    m[(1 << 20):(1 << 20) + 4096] = b"L" * 4096
    m[(2 << 20):(2 << 20) + 4096] = SECRET
    other = mmap.mmap(-1, 1 << 20)
    other[:4096] = SECRET
    reg = lender.register([(base + (1 << 20), 1 << 20)], "DRAM")
    stop = threading.Event()
    pump = threading.Thread(target=lender.progress, args=(stop,))  # a lend's progress, as the daemon runs it
    pump.start()
    md = lender.metadata()
    out = {}
    for what, src in (("lent", base + (1 << 20)), ("past the lend", base + (2 << 20)), ("another mapping", _address(other))):
        dst = mmap.mmap(-1, 4096)
        try:
            reader.read(md, [Extent(_address(dst), src, 4096)], "DRAM", 0, "DRAM", 0, window=1, on_done=lambda d, n: None,
                        stop=lambda: None, deadline=time.monotonic() + 20, stall_s=5)
            got = bytes(dst[:4096])
            out[what] = "secret" if got == SECRET else "lent" if got == b"L" * 4096 else "other"
        except Exception as exc:
            out[what] = "refused: " + str(exc)[:200]
    stop.set()
    pump.join()
    lender.deregister(reg)
    print("RESULT " + json.dumps(out), flush=True)
''')


@pytest.mark.parametrize("tls", [None, "tcp"], ids=["ucx-default", "tcp-only"])
def test_a_read_outside_the_registration_is_refused(tls: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    if tls:
        env["UCX_TLS"] = tls
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"rc {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    out = json.loads(line[7:])
    assert out["lent"] == "lent"  # the lend itself reads (so the refusals below are not a broken setup)
    for what in ("past the lend", "another mapping"):
        assert out[what].startswith("refused"), (what, out[what])
        assert "NOT_FOUND" in out[what], out[what]  # NIXL: no registration of the remote agent covers it
