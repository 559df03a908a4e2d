"""``weightcache workload``'s figures: the engines' result lines of each policy's run
turned into one JSON object (:func:`summarize`), a table of the policies side by side,
and a PNG chart drawn from the JSON object alone (so ``--chart FILE.json`` redraws an
earlier run's). No torch here."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..units import format_size
from .bench_measure import pct
from .daemon_log import ROOM_WAIT, fill_rates

if TYPE_CHECKING:
    from .workload_run import PolicyRun
    from .workload_setup import Prepared, WorkloadConfig

HIT = "hit"
MISS_CLASSES = ("host tier", "page cache", "disk cold")
# The isolated figure each kind of miss is held against (keys of PolicyRun.isolated[size]).
ISOLATED_KEY = {"host tier": "host_tier_GBps", "page cache": "page_cache_GBps", "disk cold": "disk_cold_GBps"}
TOLERATED_ERRORS = {"NO_SPACE"}  # a budget too small for what the engines hold at once: a figure, not a fault


def classify(source: str, cold: bool) -> str:
    """The attach reply's source -> how the figures name it. Loads from files are page-cache
    reads unless the bench kept dropping the page cache (``--cold``)."""
    return {"resident": HIT, "host": "host tier", "files": "disk cold" if cold else "page cache"}.get(source, source)


def _spread(xs: list[float], scale: float = 1.0) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": pct(xs, 50) * scale, "p99": pct(xs, 99) * scale, "mean": statistics.fmean(xs) * scale,
            "max": max(xs) * scale}


def _miss_rates(run: PolicyRun, prep: Prepared, cls: str, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Effective GB/s of each miss (model bytes / attach latency), against the isolated
    rate of the same size and source measured in the same daemon."""
    ratios: list[float] = []
    by_size: dict[str, Any] = {}
    for r in recs:
        size = str(prep.trace.models[r["model"]])
        gbps = r["nbytes"] / r["attach_s"] / 1e9
        iso = run.isolated.get(size, {}).get(ISOLATED_KEY.get(cls, ""))
        s = by_size.setdefault(size, {"gbps": [], "ratios": [], "isolated_GBps": iso})
        s["gbps"].append(gbps)
        if iso:
            s["ratios"].append(gbps / iso)
            ratios.append(gbps / iso)
    gbps_all = [r["nbytes"] / r["attach_s"] / 1e9 for r in recs]
    # The same, less the time the daemon waited for room that other engines' attached
    # models held (the reply's waited_s): the engines' contention, not the load's speed.
    less_waits = [r["nbytes"] / max(r["attach_s"] - r.get("waited_s", 0.0), 1e-9) / 1e9
                  / run.isolated[str(prep.trace.models[r["model"]])][ISOLATED_KEY[cls]]
                  for r in recs if run.isolated.get(str(prep.trace.models[r["model"]]), {}).get(ISOLATED_KEY.get(cls, ""))]
    waited = [r["waited_s"] for r in recs if r.get("waited_s", 0.0) > 0]
    return {
        "n": len(recs), "median_GBps": statistics.median(gbps_all), "median_vs_isolated": statistics.median(ratios) if ratios else None,
        "median_vs_isolated_less_waits": statistics.median(less_waits) if less_waits else None,
        "waited_for_detaches": {"n": len(waited), "median_s": statistics.median(waited) if waited else None},
        "by_size": {size: {"n": len(s["gbps"]), "median_GBps": statistics.median(s["gbps"]), "isolated_GBps": s["isolated_GBps"],
                           "median_vs_isolated": statistics.median(s["ratios"]) if s["ratios"] else None}
                    for size, s in sorted(by_size.items(), key=lambda kv: int(kv[0]))},
    }


def _daemon_fills(run: PolicyRun, prep: Prepared, cold: bool) -> dict[str, Any]:
    """The daemon's own rate for each size and source during the workload (its time less
    the waiting for the queue, frees and room), against the isolated rate."""
    out = fill_rates(run.daemon_loads, lambda model: int(prep.trace.models[model]))
    for f in out.values():
        key = "host_tier_GBps" if f["verb"] == "promoted" else "disk_cold_GBps" if cold else "page_cache_GBps"
        iso = run.isolated.get(str(f["bytes"]), {}).get(key)
        f["isolated_GBps"] = iso
        f["vs_isolated"] = f["median_GBps"] / iso if iso else None
    return out


def _daemon_fills_all(run: PolicyRun) -> dict[str, Any]:
    """Per verb, every size together: the median of the loads' own rate (as in
    ``daemon_fills``, a fill's wait for room counted in it), and how many waited for room
    in the fill (a victim's chunks still being copied out) and for how long (median of those)."""
    out: dict[str, Any] = {}
    for f in fill_rates(run.daemon_loads, lambda _model: 0).values():
        verb = f["verb"]
        waits = [ld["phases_ms"].get(ROOM_WAIT, 0.0) for ld in run.daemon_loads if ld["verb"] == verb]
        waited = [w for w in waits if w > 0]
        out[verb] = {"n": f["n"], "median_GBps": f["median_GBps"], "waited_for_room": len(waited),
                     "room_wait_median_ms": statistics.median(waited) if waited else None}
    return out


def summarize_run(cfg: WorkloadConfig, prep: Prepared, run: PolicyRun) -> dict[str, Any]:
    recs = run.records
    attaches = [r for r in recs if "source" in r]
    errors = Counter(str(r["error"]) for r in recs if "error" in r)
    ended = {(r["slot"], r["ev"]) for r in recs if "model" in r}
    lost = {(r["slot"], r["ev"]) for r in recs if "begin" in r} - ended  # its engine was killed or crashed
    skipped = sum(int(r["skipped"]) for r in recs if "skipped" in r)
    by_class: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in attaches:
        by_class[classify(r["source"], cfg.cold)].append(r)
    misses = [r for cls, rs in by_class.items() if cls != HIT for r in rs]
    failures = list(run.failures)
    odd = {code: n for code, n in errors.items() if code not in TOLERATED_ERRORS}
    if odd:
        example = next(r["message"] for r in recs if r.get("error") in odd)
        failures.append(f"attaches failed: {odd}, e.g. {example}")
    return {
        "hit_ratio": len(by_class[HIT]) / len(attaches) if attaches else None,
        "attaches": len(attaches), "hits": len(by_class[HIT]), "misses": {cls: len(rs) for cls, rs in by_class.items() if cls != HIT},
        "latency_ms": {cls: _spread([r["attach_s"] for r in rs], 1e3) for cls, rs in by_class.items()},
        "miss_rates": {cls: _miss_rates(run, prep, cls, rs) for cls, rs in by_class.items() if cls != HIT},
        "daemon_fills": _daemon_fills(run, prep, cfg.cold),
        "daemon_fills_all": _daemon_fills_all(run),
        "total_miss_s": sum(r["attach_s"] for r in misses),
        "mismatches": sum(1 for r in recs if "mismatch" in r),
        "events": {"in_trace": len(prep.trace.events), "ended": len(ended), "errors": dict(errors), "lost_in_flight": len(lost),
                   "skipped_late": skipped, "not_run": len(prep.trace.events) - len(ended) - len(lost) - skipped},
        "counters": run.counters, "peak": run.peak, "status_samples": run.samples, "leases_after": run.leases_after,
        "memory": run.memory, "kills": run.kills, "wall_s": run.wall_s, "phases_s": run.phases_s, "daemon_exit": run.daemon_exit,
        "lateness_s": _spread([r["late_s"] for r in recs if "late_s" in r]),
        "verify_ms": _spread([r["verify_s"] for r in attaches], 1e3),
        "isolated": run.isolated, "failures": failures,
        "notes": [f"isolated promotion of {_size(k)}: {v['promote_error']}" for k, v in run.isolated.items() if "promote_error" in v],
    }


def summarize(cfg: WorkloadConfig, prep: Prepared, runs: list[PolicyRun], env: dict[str, Any]) -> dict[str, Any]:
    policies = {run.policy: summarize_run(cfg, prep, run) for run in runs}
    t = prep.trace
    return {
        "config": {**asdict(cfg), "budget_bytes": cfg.budget_bytes}, "environment": env,
        "trace": {"path": str(prep.trace_path), "events": len(t.events), "engines": t.engines, "duration_s": t.duration_s,
                  "models": t.models, "model_bytes": {n: r["nbytes"] for n, r in prep.refs.items()}, "generator": t.generator},
        "policies": policies,
        "failures": [f"{p}: {f}" for p, s in policies.items() for f in s["failures"]],
    }


def _ms(s: dict[str, Any]) -> str:
    return f"{s['p50']:.1f} / {s['p99']:.1f} ms" if s.get("n") else "-"


def _size(n: int | str) -> str:
    return format_size(int(n))


def print_report(console: Console, r: dict[str, Any]) -> None:
    pols = r["policies"]
    cfg, tr = r["config"], r["trace"]
    t = Table(title=f"weightcache workload on {cfg['device']} ({r['environment'].get('gpu') or 'CPU'}): {tr['engines']} engines, "
                    f"{len(tr['models'])} models ({', '.join(_size(v) for v in tr['models'].values())}), budget "
                    f"{_size(cfg['budget_bytes'])}" + (f", host tier {_size(cfg['host_budget'])}" if cfg["host_budget"] else ""))
    t.add_column("figure")
    for p in pols:
        t.add_column(p, justify="right")

    def row(label: str, fn: Any) -> None:
        cells = []
        for s in pols.values():
            try:
                cells.append(str(fn(s)))
            except (KeyError, TypeError, ZeroDivisionError):
                cells.append("-")
        t.add_row(label, *cells)

    row("attaches / events in the trace", lambda s: f"{s['attaches']} / {s['events']['in_trace']}")
    row("lost in flight / skipped (late) / not run", lambda s: "{lost_in_flight} / {skipped_late} / {not_run}".format(**s["events"]))
    row("attach errors", lambda s: ", ".join(f"{k} {v}" for k, v in s["events"]["errors"].items()) or "0")
    row("hit ratio", lambda s: f"{s['hit_ratio']:.1%}")
    row("hit latency p50 / p99", lambda s: _ms(s["latency_ms"][HIT]))
    classes = [c for c in MISS_CLASSES if any(c in s["misses"] for s in pols.values())]
    classes += sorted({c for s in pols.values() for c in s["misses"]} - set(classes))
    for cls in classes:
        row(f"miss ({cls}): n, p50 / p99", lambda s, c=cls: f"{s['misses'][c]}, {_ms(s['latency_ms'][c])}")
        row(f"miss ({cls}): GB/s, vs isolated", lambda s, c=cls: "{:.2f}, {}".format(
            s["miss_rates"][c]["median_GBps"], "-" if s["miss_rates"][c]["median_vs_isolated"] is None
            else f"{s['miss_rates'][c]['median_vs_isolated']:.2f}x"))
        row(f"miss ({cls}): waited for detaches (n, p50); vs isolated less those waits", lambda s, c=cls: "{}, {}; {}".format(
            s["miss_rates"][c]["waited_for_detaches"]["n"],
            "-" if s["miss_rates"][c]["waited_for_detaches"]["median_s"] is None
            else f"{s['miss_rates'][c]['waited_for_detaches']['median_s'] * 1e3:.0f} ms",
            "-" if s["miss_rates"][c]["median_vs_isolated_less_waits"] is None
            else f"{s['miss_rates'][c]['median_vs_isolated_less_waits']:.2f}x"))
    row("total miss time", lambda s: f"{s['total_miss_s']:.2f} s")
    fills = sorted({k for s in pols.values() for k in s["daemon_fills"]}, key=lambda k: (k.split()[0], int(k.split()[1])))
    for key in fills:  # the loader's own speed under churn, without the queueing an engine also waits for
        verb, nbytes = key.split()
        row(f"daemon {verb} {_size(nbytes)}: n, GB/s, vs isolated", lambda s, k=key: "{}, {:.1f}, {}".format(
            s["daemon_fills"][k]["n"], s["daemon_fills"][k]["median_GBps"],
            "-" if s["daemon_fills"][k]["vs_isolated"] is None else f"{s['daemon_fills'][k]['vs_isolated']:.2f}x"))
    for verb in ("loaded", "promoted"):
        row(f"daemon {verb}, every size: n, GB/s; waited for room in the fill (n, p50)", lambda s, v=verb: "{}, {:.1f}; {}, {}".format(
            s["daemon_fills_all"][v]["n"], s["daemon_fills_all"][v]["median_GBps"], s["daemon_fills_all"][v]["waited_for_room"],
            "-" if s["daemon_fills_all"][v]["room_wait_median_ms"] is None
            else f"{s['daemon_fills_all'][v]['room_wait_median_ms']:.1f} ms"))
    for k in ("loads", "promotions", "evictions", "demotions", "kept_copy_demotions", "failed_demotions", "wasted_loads",
              "cancelled_loads"):
        row(k.replace("_", " "), lambda s, k=k: s["counters"][k])
    devices = sorted({d for s in pols.values() for d in s["peak"]})
    for dev in devices:
        row(f"peak used+reserved / budget ({dev})",
            lambda s, d=dev: f"{_size(s['peak'][d]['used_reserved'])} / {_size(s['peak'][d]['budget'])}")
    row("status samples", lambda s: s["status_samples"])
    row("leases after the engines exit", lambda s: s["leases_after"])
    row("byte mismatches", lambda s: s["mismatches"])
    row("engines killed", lambda s: s["kills"])
    row("lateness p50 / p99", lambda s: f"{s['lateness_s']['p50']:.2f} / {s['lateness_s']['p99']:.2f} s")
    row("byte check p50", lambda s: f"{s['verify_ms']['p50']:.1f} ms")
    if cfg["device"].startswith("cuda"):
        row("device free: idle daemon -> all evicted", lambda s: "{} -> {}".format(
            _size(s["memory"]["free_daemon_idle"]), _size(s["memory"]["free_after_evict_all"])))
        row("device free: before -> after the daemon", lambda s: "{} -> {}".format(
            _size(s["memory"]["free_before_daemon"]), _size(s["memory"]["free_after_daemon_exit"])))
    sizes = sorted({k for s in pols.values() for k in s["isolated"]}, key=int)
    for size in sizes:
        for key, label in (("page_cache_GBps", "page cache"), ("disk_cold_GBps", "disk cold"), ("host_tier_GBps", "host tier")):
            if any(key in s["isolated"].get(size, {}) for s in pols.values()):
                row(f"isolated {_size(size)}: {label} GB/s", lambda s, z=size, k=key: f"{s['isolated'][z][k]:.2f}")
    row("workload wall time", lambda s: f"{s['wall_s']:.1f} s")
    row("bench phases", lambda s: ", ".join(f"{k} {v:.1f}" for k, v in s["phases_s"].items()))
    console.print(t)
    for policy, summary in pols.items():
        for note in summary["notes"]:
            console.print(f"[yellow]{policy}: {escape(note)}[/]")


def write_chart(r: dict[str, Any], png: Path) -> bool:
    """Hit ratio, attach latency by kind and miss speed against the isolated rate, per
    policy, from the JSON object. False when matplotlib is missing (it is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    pols = r["policies"]
    names = list(pols)
    kinds = [HIT, *[c for c in MISS_CLASSES if any(c in s["latency_ms"] for s in pols.values())]]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.5))
    a1.bar(names, [(s["hit_ratio"] or 0) * 100 for s in pols.values()], color=[f"C{i}" for i in range(len(names))])
    a1.set_ylabel("hit ratio (%)")
    a1.set_ylim(0, 100)
    width = 0.8 / max(1, len(names))
    for i, (p, s) in enumerate(pols.items()):
        xs = [k + i * width for k in range(len(kinds))]
        p50 = [s["latency_ms"].get(k, {}).get("p50", 0) for k in kinds]
        p99 = [s["latency_ms"].get(k, {}).get("p99", 0) for k in kinds]
        a2.bar(xs, p99, width, alpha=0.35, color=f"C{i}")
        a2.bar(xs, p50, width, label=f"{p} (p50; pale: p99)", color=f"C{i}")
        miss = [k for k in kinds if k != HIT]
        a3.bar([k + i * width for k in range(len(miss))],
               [s["miss_rates"].get(k, {}).get("median_vs_isolated") or 0 for k in miss], width, label=p, color=f"C{i}")
    a2.set_xticks([k + width * (len(names) - 1) / 2 for k in range(len(kinds))], kinds)
    a2.set_yscale("log")
    a2.set_ylabel("attach latency (ms)")
    a2.legend(fontsize=8)
    miss = [k for k in kinds if k != HIT]
    a3.set_xticks([k + width * (len(names) - 1) / 2 for k in range(len(miss))], miss)
    a3.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    a3.set_ylabel("miss GB/s / isolated GB/s (median)")
    a3.legend(fontsize=8)
    cfg = r["config"]
    fig.suptitle(f"workload on {cfg['device']} ({r['environment'].get('gpu') or 'CPU'}): {r['trace']['engines']} engines, "
                 f"{len(r['trace']['models'])} models, budget {_size(cfg['budget_bytes'])}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
