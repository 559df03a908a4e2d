"""Workload traces for ``weightcache workload``: what each engine attaches, when, for how long.

A trace is JSON lines. The first line may be a header (an object with the key
``weightcache_trace``); every other line is one event::

    {"weightcache_trace": 1, "models": {"m0": 1073741824, "m1": 2147483648}, "engines": 2,
     "duration_s": 60.0, "generator": {"zipf": 1.1, "seed": 0, "hold": [0, 0.4], "gap": [0, 0.05]}}
    {"t": 0.013, "engine": 0, "model": "m1", "hold": 0.21}
    {"t": 0.020, "engine": 1, "model": "m0", "hold": 0.05}

- ``t``: seconds after the workload starts at which the engine should attach.
- ``engine``: the engine slot (0..N-1). A slot's events run one after another in ``t``
  order: an engine attaches at ``t`` or, if it is still busy with the previous event
  (a slow miss), as soon as it is free; the delay is reported as lateness.
- ``model``: a model name (the header's ``models``, or m0, m1, ... from ``--models``).
- ``hold``: seconds the engine keeps the lease after the attach returned.

The header is optional: without one, model sizes come from the command line, the
number of engines is the highest slot plus one and the duration the last ``t``. Its
``generator`` records how a generated trace was made (ignored on reading).

No torch here: the CLI's ``--write-trace`` and the engines read this module.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30
HEADER_KEY = "weightcache_trace"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Event:
    t: float
    engine: int
    model: str
    hold: float


@dataclass
class Trace:
    models: dict[str, int]  # name -> bytes; empty for a header-less trace until sizes are given
    engines: int
    duration_s: float
    events: list[Event]
    generator: dict[str, Any] = field(default_factory=dict)

    def for_engine(self, slot: int) -> list[Event]:
        return sorted((e for e in self.events if e.engine == slot), key=lambda e: e.t)

    def header(self) -> dict[str, Any]:
        return {HEADER_KEY: FORMAT_VERSION, "models": self.models, "engines": self.engines, "duration_s": self.duration_s,
                "generator": self.generator}


def model_names(n: int) -> list[str]:
    return [f"m{i}" for i in range(n)]


def parse_range(text: str) -> tuple[float, float]:
    """``"0-0.4"`` -> (0.0, 0.4); ``"0.2"`` -> (0.2, 0.2)."""
    lo, sep, hi = text.partition("-")
    a, b = float(lo), float(hi) if sep else float(lo)
    if a < 0 or b < a:
        raise ValueError(f"not a range LO-HI with 0 <= LO <= HI: {text!r}")
    return a, b


def zipf_trace(models: dict[str, int], engines: int, duration_s: float, alpha: float, seed: int,
               hold: tuple[float, float] = (0.0, 0.4), gap: tuple[float, float] = (0.0, 0.05)) -> Trace:
    """Each engine attaches a model drawn from Zipf(``alpha``), holds it, pauses ``gap``,
    and again, until ``duration_s``. Which model gets which popularity rank is a seeded
    shuffle, so that the most popular model is not always the smallest. Deterministic in
    its arguments."""
    if not models or engines < 1 or duration_s <= 0:
        raise ValueError("a trace needs models, at least one engine and a positive duration")
    rng = random.Random(seed)
    ranked = list(models)
    rng.shuffle(ranked)
    weights = [1.0 / (k + 1) ** alpha for k in range(len(ranked))]
    total = sum(weights)
    events: list[Event] = []
    for slot in range(engines):
        t = rng.uniform(0, max(gap[1], 0.05))  # engines do not all start in the same instant
        while t < duration_s:
            h = rng.uniform(*hold)
            events.append(Event(round(t, 6), slot, rng.choices(ranked, weights)[0], round(h, 6)))
            t += h + rng.uniform(*gap)
    events.sort(key=lambda e: (e.t, e.engine))
    return Trace(dict(models), engines, duration_s, events, generator={
        "zipf": alpha, "seed": seed, "hold": list(hold), "gap": list(gap),
        "popularity": {name: round(w / total, 6) for name, w in zip(ranked, weights, strict=True)}})


def write_trace(trace: Trace, path: str | Path) -> None:
    lines = [json.dumps(trace.header())]
    lines += [json.dumps({"t": e.t, "engine": e.engine, "model": e.model, "hold": e.hold}) for e in trace.events]
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # --write-trace /tmp/new/x.jsonl was a traceback
    Path(path).write_text("\n".join(lines) + "\n")


def read_trace(path: str | Path) -> Trace:
    """Parse a trace; a malformed line raises ValueError naming its line number."""
    header: dict[str, Any] = {}
    events: list[Event] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not a JSON object")
            if HEADER_KEY in obj:
                if n != 1 or obj[HEADER_KEY] != FORMAT_VERSION:
                    raise ValueError(f"a header must be the first line and have {HEADER_KEY} = {FORMAT_VERSION}")
                header = obj
                continue
            e = Event(float(obj["t"]), int(obj["engine"]), str(obj["model"]), float(obj["hold"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: {exc}") from None
        if e.t < 0 or e.engine < 0 or e.hold < 0:
            raise ValueError(f"{path}:{n}: t, engine and hold must be >= 0")
        events.append(e)
    if not events:
        raise ValueError(f"{path}: no events")
    events.sort(key=lambda e: (e.t, e.engine))
    models = {str(k): int(v) for k, v in header.get("models", {}).items()}
    engines = max(int(header.get("engines", 0)), max(e.engine for e in events) + 1)
    duration = float(header.get("duration_s", max(e.t for e in events)))
    return Trace(models, engines, duration, events, generator=dict(header.get("generator", {})))
