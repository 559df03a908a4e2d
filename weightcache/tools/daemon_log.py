"""Reading the daemon's own account of each load from its log: every "loaded" and
"promoted" line gives the bytes, the time and the phases (server/residency/fill.py writes them).
The benchmarks use it to tell the loader's speed under churn from what an engine waits
(which also counts waiting for room and for other loads in the queue)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from typing import Any

LOAD_LINE = re.compile(r"(loaded|promoted) (\S+): \d+ tensors, (\d+) bytes in ([\d.]+)s \(([\d.]+) GB/s; ([^)]*)\)")
# Phases that are not the fill itself: waiting for the queue, for frees, for room.
WAITING = ("admit", "queued", "wait for frees")
# Inside the fill (counted in its time): waiting for room a victim's demotion still holds.
ROOM_WAIT = "room wait in fill"


def load_lines(text: str) -> list[dict[str, Any]]:
    """Every load in ``text``: verb, model, bytes, seconds, GB/s and its phases in ms."""
    out = []
    for m in LOAD_LINE.finditer(text):
        phases = {}
        for part in m.group(6).split(", "):
            label, value, _unit = part.rsplit(" ", 2)
            phases[label] = float(value)
        out.append({"verb": m.group(1), "model": m.group(2), "bytes": int(m.group(3)), "s": float(m.group(4)),
                    "gb_s": float(m.group(5)), "phases_ms": phases})
    return out


def fill_rates(loads: list[dict[str, Any]], size_of: Callable[[str], int] | None = None) -> dict[str, dict[str, Any]]:
    """Per verb and size (``size_of(model)``, default the bytes loaded): the median GB/s
    of the loads' own work (their time less the waiting phases), with the median of
    each phase."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for ld in loads:
        groups.setdefault((ld["verb"], size_of(ld["model"]) if size_of else ld["bytes"]), []).append(ld)
    out: dict[str, dict[str, Any]] = {}
    for (verb, size), lds in sorted(groups.items()):
        own = [ld["s"] - sum(ld["phases_ms"].get(k, 0.0) for k in WAITING) / 1e3 for ld in lds]
        keys = sorted({k for ld in lds for k in ld["phases_ms"]})
        out[f"{verb} {size}"] = {
            "verb": verb, "bytes": size, "n": len(lds),
            "median_GBps": statistics.median(ld["bytes"] / max(s, 1e-9) / 1e9 for ld, s in zip(lds, own, strict=True)),
            "median_phases_ms": {k: statistics.median(ld["phases_ms"].get(k, 0.0) for ld in lds) for k in keys},
        }
    return out
