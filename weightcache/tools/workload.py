"""``weightcache workload``: many engines attaching many models under one device budget,
replayed under each eviction policy, with the misses measured against the loader's
isolated rate in the same run.

What runs, per policy in ``--policies`` (a fresh daemon each, same trace):

1. the isolated rate per distinct model size, alone on the device: a load from files
   with the page cache warm (and cold, with ``--cold``), and on a GPU with a host tier a
   promotion (evict, which demotes, then load);
2. N engine processes (workload_engine.py) replay the trace through ``SyncClient``: each
   attach is timed, its bytes are checked against sums made once from the files, the
   lease is held for the event's hold time; ``--kill-every LO-HI`` SIGKILLs a random
   engine and starts a replacement that continues that slot's events;
3. meanwhile ``status`` is sampled every 50 ms (peak used+reserved against the budget);
   with ``--cold`` the page cache of every model that is not resident is dropped every
   ~100 ms, so misses from files read the disk;
4. after: leases must be 0, the daemon's counters (loads, promotions, evictions,
   demotions, failed demotions, wasted and cancelled loads) over the workload, and on
   CUDA the free device memory after evicting everything and after the daemon exits.

Popularity is Zipf(``--zipf``) from a seed, or a trace file (``--trace``; the format is in
workload_trace.py and docs/workload.md); ``--write-trace FILE`` writes the generated one
so that the same trace can be replayed under other configurations.

Any wrong byte, a lease left over, the budget exceeded, device memory not returned or an
engine that crashed makes the exit status 1, with the reason printed.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from .workload_setup import WorkloadConfig, check_policies, make_trace, prepare, workload_config
from .workload_trace import write_trace

__all__ = ["run_workload", "workload_config", "write_trace_only"]


def environment(cfg: WorkloadConfig) -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(), "host": platform.node(),
            "gpu": torch.cuda.get_device_name(torch.device(cfg.device)) if cfg.cuda else None}


def write_trace_only(cfg: WorkloadConfig, path: str) -> int:
    trace = make_trace(cfg)
    write_trace(trace, path)
    print(f"wrote {path}: {len(trace.events)} events, {trace.engines} engines, {trace.duration_s:g} s, "
          f"models {', '.join(f'{k}={v}' for k, v in trace.models.items())}")
    return 0


def run_workload(cfg: WorkloadConfig) -> int:
    """Run every policy, print the table, write ``cfg.out`` (and its chart). The exit
    status: 0, or 1 with the failures printed."""
    from .workload_pool import EnginePool
    from .workload_report import print_report, summarize, write_chart
    from .workload_run import PolicyRun, run_policy

    console = Console()
    check_policies(cfg.policies)
    cfg, prep = prepare(cfg, console)
    if cfg.cuda:
        import torch

        torch.cuda.init()  # this process's context exists before the first free-memory reading
    runs: list[PolicyRun] = []
    pool = EnginePool(cfg, prep)
    try:
        with console.status(f"starting {prep.trace.engines} engines"):
            pool.start()
        for policy in cfg.policies:
            with console.status(f"policy {policy}: isolated rates, then {prep.trace.engines} engines, {prep.trace.duration_s:g} s of trace"):
                try:
                    runs.append(run_policy(cfg, prep, pool, policy))
                except Exception as exc:  # the other policies still run; this one fails the result
                    runs.append(PolicyRun(policy, failures=[f"{type(exc).__name__}: {exc}"]))
    finally:
        pool.close()
    result = summarize(cfg, prep, runs, environment(cfg))
    print_report(console, result)
    if cfg.out:
        out = Path(cfg.out)
        out.write_text(json.dumps(result, indent=1) + "\n")
        console.print(f"wrote {out}")
        png = out.with_suffix(".png")
        if write_chart(result, png):
            console.print(f"wrote {png}")
        else:
            console.print("matplotlib is not installed: no chart (pip install matplotlib; weightcache workload --chart FILE.json)")
    for f in result["failures"]:
        console.print(f"[bold red]FAIL[/] {escape(f)}")  # tracebacks hold [n], which rich reads as markup
    return 1 if result["failures"] else 0
