"""Rate-limited logs: a load refused or failed for a tenant's model is the
tenant's doing (its quota, its file), and the tenant may ask again as often as it likes.
Each refusal wrote one ERROR line: a tenant asking again and again for loads of a model over its quota
wrote one line per load (300 loads, 300 lines, before). Now such lines go through the
daemon's PeerEventLog (peer_log.py): the first few per uid per minute, then one line
saying how many were left out. The operator's own models' failures stay ERROR lines of
their own share, which no tenant's flood spends."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

from helpers import NOBODY, as_uid, root_only

from ._util import MIB, Conn, code, multi_tenant, write_checkpoint
from .test_tenants import TENANTS, _checkpoints, _register

pytestmark = root_only

LOADS = 300


def _left_out(text: str, event: str) -> int:
    return sum(int(n) for n, e in re.findall(r"(\d+) more '([^']+)' line\(s\) left out", text) if e == event)


def test_a_tenant_pipelining_refused_loads_writes_a_bounded_number_of_lines(start_daemon, tmp_path):
    (big,) = _checkpoints(1, 2 * MIB)
    huge = write_checkpoint(tmp_path / "huge.safetensors", 8 * MIB, 4, seed=7)  # the operator's, over the budget
    d = multi_tenant(start_daemon, TENANTS, budget="4MiB", models={"huge": huge})
    d.config.write_text(d.config.read_text() + f'\n[quotas."uid:{NOBODY}"]\nbytes = {{ cpu = "1MiB" }}\n')
    c = Conn(d.socket)
    try:
        assert f"uid:{NOBODY}" in c.call({"id": 1, "op": "reload"})["report"]["quotas"]
    finally:
        c.close()

    def tenant() -> dict[str, Any]:
        reg = _register(d.socket, "big", big)  # 2 MiB under a 1 MiB quota: it can never load
        c = Conn(d.socket, timeout=60)
        try:
            # one after the other: loads pipelined together join one load, refused once
            got = [code(c.call({"id": 10 + i, "op": "load", "name": "big", "wait_s": 0})) for i in range(LOADS)]
            return {"reg": reg, "codes": got}
        finally:
            c.close()

    out = as_uid(NOBODY, tenant, timeout=120)
    assert "model" in out["reg"], out["reg"]
    assert set(out["codes"]) == {"NO_SPACE"}, out["codes"]
    # The operator's model that can never fit: still said, at ERROR, after the tenant's flood.
    c = Conn(d.socket)
    try:
        assert code(c.call({"id": 2, "op": "load", "name": "huge", "wait_s": 0})) == "NO_SPACE"
    finally:
        c.close()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    text = d.log_text()
    lines = [line for line in text.splitlines() if re.search(r"load big\S* refused", line)]
    left = _left_out(text, "load refused")
    # 300 before (one ERROR line per refused load); now the first few and a count of the rest
    assert 1 <= len(lines) <= 10, (len(lines), lines[:3])
    assert len(lines) + left == LOADS, (len(lines), left)  # each refusal written or counted (10 + 290 here)
    assert not any(" ERROR " in line for line in lines), lines[:3]  # the tenant's quota: nothing for the operator to fix
    assert any(" ERROR " in line and "load huge refused" in line for line in text.splitlines()), \
        [line for line in text.splitlines() if "huge" in line]
    os.remove(big)



def test_routine_lines_of_configured_models_cannot_hide_an_error():
    """Loads of an operator's model refused for room that detaches could free are INFO
    lines, and any peer allowed to use the model may cause them again and again: they
    spent the model's share, and 50 over five models spent the event's total, so a
    configured model's ERROR (its file gone bad) was left out, its count said in a
    WARNING. Now each operator's model and level has its own share, and what is left out
    is summed up at the highest level it had."""
    import logging
    from types import SimpleNamespace

    from weightcache.peer_log import PeerEventLog
    from weightcache.server.residency.fill import Fill

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("test.refused-loads")
    logger.propagate = False
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    fill = SimpleNamespace(registry=SimpleNamespace(access=SimpleNamespace(admin_uids=frozenset())),
                           peer_log=PeerEventLog(logger, clock=lambda: 0.0))

    def model(name: str) -> SimpleNamespace:
        return SimpleNamespace(owner=None, origin="config", config=SimpleNamespace(name=name))

    def event(m: SimpleNamespace, level: int) -> bool:
        return Fill.model_event(fill, m, level, "load refused", "load %s refused", m.config.name)  # type: ignore[arg-type]

    for name in ("m", "a", "b", "c", "d", "e"):  # 20 waits for room on each of six configured models
        for _ in range(20):
            event(model(name), logging.INFO)
    assert event(model("m"), logging.ERROR)  # its first ERROR is written
    assert event(model("z"), logging.ERROR)  # and another model's
    for _ in range(12):
        event(model("m"), logging.ERROR)
    fill.peer_log.flush()
    summaries = {r.getMessage().split("'")[1]: r.levelno for r in records if "left out" in r.getMessage()}
    assert summaries["load refused (ERROR, operator model m)"] == logging.ERROR, summaries
    assert summaries["load refused (INFO, operator model a)"] == logging.WARNING, summaries
    written = [r for r in records if "left out" not in r.getMessage()]
    assert sum(r.levelno == logging.ERROR for r in written) == 10 + 1  # m's share of ERRORs, and z's
