"""``weightcache`` command line: parses arguments and calls into the package; no logic.

parser.py builds the arguments, commands.py runs each subcommand against the daemon (or
a local tool), render.py prints the results (JSON for scripts, rich tables for people).
The socket a client command uses is found by config/file.py's ``daemon_socket``, as the
daemon reads its config, without the schema. Kept light at import: the probes run
``weightcache health`` often, and every command pays for what this package imports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ..errors import ConfigError, WeightcacheError
from .parser import build_parser
from .render import print_json

# What an operator can do next, after the daemon's sentence (which says what is wrong).
_HINTS = {
    "UNKNOWN_MODEL": "; `weightcache models` lists the names it has (add one with `weightcache register NAME PATH` "
                     "or in the config file, then `weightcache reload`)",
}


def _stdout_gone() -> bool:
    """Whether our stdout is a pipe whose reader has gone (``| head`` has exited): poll
    says POLLERR. A BrokenPipeError can also come from the daemon's socket, which is a
    real failure and must not be hidden."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # `weightcache ps --json | head`: the reader took what it wanted. Quiet, as a C
        # tool killed by SIGPIPE is, and with the status a shell gives one (128 + 13).
        # stdout goes to /dev/null so that the interpreter's final flush is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


def _run(args: argparse.Namespace) -> int:
    try:
        if asyncio.iscoroutinefunction(args.func):
            return asyncio.run(args.func(args))
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"weightcache: {exc.message}", file=sys.stderr)
        return 2
    except WeightcacheError as exc:
        if getattr(args, "json", False):  # a script reads the code and details, not the sentence
            print_json({"error": exc.to_wire()})
        print(f"weightcache: {exc}{_HINTS.get(exc.code, '')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


__all__ = ["build_parser", "main"]
