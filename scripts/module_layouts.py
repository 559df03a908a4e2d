"""What the number of modules on a fresh engine's path costs it (issue 23).

Takes the modules a SyncClient engine imports from ``from weightcache import SyncClient``
to usable GPU tensors (the client half and the attach half), strips their imports of one
another, and writes them out grouped into N modules per layout, each group taking its
predecessor's names: the same code, the same order, N modules. Then times, in fresh
processes that imported torch (and, on a GPU, initialised CUDA) first, importing each
layout's groups, the layouts alternating. Only the import is timed, not an attach.

    mkdir /tmp/wc-8edd1eb && git archive 8edd1eb -- weightcache | tar -x -C /tmp/wc-8edd1eb
    python scripts/module_layouts.py --package /tmp/wc-8edd1eb/weightcache --layouts 15,12,1 --rounds 11 [--cuda] [--out f.json]

``--package``: the weightcache package directory to read, of a version with the 15
modules this script names (8edd1eb's: protocol/messages.py and protocol/transport.py,
client/client.py; this version merged them). docs/benchmarks.md ("Session 24") has what
it showed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The engine's path in import order, as of 8edd1eb (15 modules).
PATH = ["errors", "protocol/messages", "protocol/__init__", "__init__", "protocol/transport", "protocol/pymsgpack",
        "client/core", "client/connection", "client/client", "client/sync", "client/__init__", "protocol/arena",
        "client/libcuda", "client/cuda_mapping", "client/mapping"]
LAYOUTS = {
    15: [[m] for m in PATH],
    # session 24's: the protocol's names, frames and sockets in one module, the ops beside the connection
    12: [["errors"], ["protocol/messages", "protocol/__init__", "protocol/transport"], ["__init__"], ["protocol/pymsgpack"],
         ["client/core"], ["client/connection", "client/client"], ["client/sync"], ["client/__init__"], ["protocol/arena"],
         ["client/libcuda"], ["client/cuda_mapping"], ["client/mapping"]],
    1: [PATH],
}
INTERNAL_IMPORT = re.compile(r"^from \.+[\w.]* import")

CHILD = r"""
import importlib, json, sys, time
import torch
if sys.argv[2] == "cuda":
    torch.cuda.init()
sys.path.insert(0, sys.argv[1])
order = json.load(open(sys.argv[1] + "/order.json"))
t = time.perf_counter()
for m in order:
    importlib.import_module(m)
print((time.perf_counter() - t) * 1e3)
"""


def stripped(package: Path, module: str) -> str:
    """A module's source without its imports of the package's own modules (one line or a
    parenthesised run), and without ``from __future__`` (each group says it once)."""
    lines, out, i = (package / f"{module}.py").read_text().splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("from __future__"):
            i += 1
            continue
        if INTERNAL_IMPORT.match(line):
            while "(" in line and ")" not in line:
                i += 1
                line = lines[i]
            i += 1
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def write_layout(package: Path, n: int, into: Path) -> Path:
    d = into / f"n{n}"
    d.mkdir()
    names = [f"wc_n{n}_g{i}" for i in range(len(LAYOUTS[n]))]
    for i, group in enumerate(LAYOUTS[n]):
        head = "from __future__ import annotations\n"
        if i:  # the names of every module before it, as the package's own imports gave them
            head += f"import sys as _s\nglobals().update({{k: v for k, v in vars(_s.modules[{names[i - 1]!r}]).items() if not k.startswith('__')}})\n"
        (d / f"{names[i]}.py").write_text(head + "\n".join(stripped(package, m) for m in group) + "\n")
    (d / "order.json").write_text(json.dumps(names))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(d)], check=True)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--package", type=Path, required=True, help="a weightcache package directory with the 15 modules named here")
    ap.add_argument("--layouts", default="15,12,1", help=f"module counts, of {sorted(LAYOUTS)}")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--cuda", action="store_true", help="initialise CUDA before timing, as an engine has")
    ap.add_argument("--out", type=Path, help="also write every process's time here (JSON)")
    args = ap.parse_args()
    missing = [m for m in PATH if not (args.package / f"{m}.py").is_file()]
    if missing:
        ap.error(f"{args.package} lacks {', '.join(f'{m}.py' for m in missing)}: give a version with the 15 modules "
                 "of 8edd1eb's engine path (see the docstring)")
    counts = [int(n) for n in args.layouts.split(",")]
    if unknown := sorted(set(counts) - set(LAYOUTS)):
        ap.error(f"no layout of {unknown} modules: choose from {sorted(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {n: write_layout(args.package, n, Path(tmp)) for n in counts}
        times: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(args.rounds):
            for n in counts:  # alternating, so that drift weighs on every layout alike
                r = subprocess.run([sys.executable, "-c", CHILD, str(dirs[n]), "cuda" if args.cuda else "cpu"],
                                   capture_output=True, text=True, check=True)
                times[n].append(float(r.stdout.split()[-1]))
    for n in counts:
        print(f"{n:2d} modules: import p50 {statistics.median(times[n]):.2f} ms (min {min(times[n]):.2f}) over {args.rounds}")
    if args.out:
        args.out.write_text(json.dumps({"package": str(args.package), "cuda": args.cuda,
                                        "import_ms": {str(n): times[n] for n in counts}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
