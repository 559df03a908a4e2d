"""``python -m benchmarks NAME [ARGS]``: run one tool with its own arguments."""

from __future__ import annotations

import runpy
import sys

from benchmarks import TOOLS


def usage() -> str:
    width = max(map(len, TOOLS))
    rows = "\n".join(f"  {name:{width}s}  {what}" for name, (_, what) in sorted(TOOLS.items()))
    return f"usage: python -m benchmarks NAME [ARGS]   (NAME --help for its arguments)\n\n{rows}"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in TOOLS:
        print(f"python -m benchmarks: unknown tool {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"benchmarks {name}", *rest]
    runpy.run_module(f"benchmarks.{TOOLS[name][0]}", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
