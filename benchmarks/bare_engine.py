"""The smallest fresh engine, side by side with a fresh ``load_file``.

Each measured process is new and runs only this: ``import torch`` (not timed), then, timed
with ``perf_counter`` and ``process_time`` until the tensors are usable, either

  weightcache  ``from weightcache import SyncClient``, ``SyncClient(socket)``, and the
               attach entered (its context manager kept, so no detach falls in the span)
  load_file    ``from safetensors.torch import load_file`` and ``load_file(file)``

with the cyclic GC's collections in the span noted (``gc.callbacks``). Ways alternate
round by round, so that drift in the machine weighs on each alike; ``--base DIR`` adds a
third way, weightcache imported from DIR (another version of the package, e.g. from
``git archive``), to compare two versions in one run. ``benchmarks fresh-attach``'s
``--anchors`` measures the same span inside tools/restart.py's engine, whose own imports
leave the collector in another state (docs/benchmarks.md says what that changes).

    weightcache serve --config c.toml &      # a daemon holding the model (CPU or GPU)
    python -m benchmarks bare-engine --socket /tmp/s.sock --model fresh --file m.safetensors --rounds 41
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

CHILD = r"""
import gc, json, sys, time
import torch
collections, started = [], [0.0]
def note(phase, info):
    if phase == "start":
        started[0] = time.perf_counter()
    else:
        collections.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))
gc.callbacks.append(note)
way, socket, model, path = sys.argv[1:5]
t0, c0 = time.perf_counter(), time.process_time()
if way == "load_file":
    from safetensors.torch import load_file
    tensors = load_file(path)
else:
    from weightcache import SyncClient
    client = SyncClient(socket)
    attached = client.attach(model)
    tensors = attached.__enter__()
t1, c1 = time.perf_counter(), time.process_time()
seen = list(collections)
print(json.dumps({"way": way, "ms": (t1 - t0) * 1e3, "cpu_ms": (c1 - c0) * 1e3, "tensors": len(tensors),
                  "gc_ms": sum(ms for _, ms in seen), "gc_gens": [g for g, _ in seen]}))
"""


def one(way: str, args: argparse.Namespace, pythonpath: str | None) -> dict[str, Any]:
    # Without PYTHONDONTWRITEBYTECODE: the warm-up writes the bytecode, as a wheel install
    # leaves it (compiling the client's modules in every process costs 10-25 ms more).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", CHILD, "load_file" if way == "load_file" else "weightcache",
                          args.socket, args.model, str(args.file)], env=env, cwd="/", capture_output=True, text=True,
                         timeout=120, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "way": way}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model", required=True, help="the daemon's name for the model in --file")
    ap.add_argument("--file", type=Path, required=True, help="the model's .safetensors file, for load_file")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--base", help="a directory holding another version of the weightcache package")
    ap.add_argument("--out", type=Path, help="write every process's figures here (JSON lines)")
    args = ap.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    ways = {"weightcache": here, "load_file": None, **({"base": args.base} if args.base else {})}
    for way, path in ways.items():  # one uncounted warm-up each: bytecode written, page cache warm
        one(way, args, path)
    runs = [one(way, args, path) for _ in range(args.rounds) for way, path in ways.items()]
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in runs))
    p50 = {}
    for way in ways:
        mine = [r for r in runs if r["way"] == way]
        p50[way] = statistics.median(r["ms"] for r in mine)
        print(f"{way:12s} n={len(mine)}  wall p50 {p50[way]:6.2f} ms (min {min(r['ms'] for r in mine):.2f})"
              f"  CPU p50 {statistics.median(r['cpu_ms'] for r in mine):6.2f} ms"
              f"  in GC p50 {statistics.median(r['gc_ms'] for r in mine):.2f} ms")
    print(f"weightcache / load_file: {p50['weightcache'] / p50['load_file']:.2f}x"
          + (f"; base / load_file: {p50['base'] / p50['load_file']:.2f}x" if args.base else ""))


if __name__ == "__main__":
    main()
