"""The engine command of ``weightcache supervise``, and running it in the forked child
as ``python SCRIPT`` or ``python -m MODULE`` would have."""

from __future__ import annotations

import builtins
import contextlib
import importlib.machinery
import os
import runpy
import shutil
import signal
import sys
import threading
import types
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class EngineCommand:
    """How to run the engine in a forked child, as ``python ...`` would have."""

    orig_argv: tuple[str, ...]  # the command as given: sys.orig_argv
    argv: tuple[str, ...]  # sys.argv at start (runpy rewrites argv[0] for -m, as python does)
    script: str | None  # absolute path of the script, or None with -m
    module: str | None  # -m MODULE
    path0: str  # sys.path[0]: the script's directory (symlinks resolved), or the cwd with -m


def parse_command(cmd: list[str], executable: str = sys.executable) -> EngineCommand:
    """``python engine.py ARGS`` or ``python -m module ARGS``; the interpreter must be this
    one (the engine runs in the supervisor's interpreter, so another one's packages and
    version would silently not apply)."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    usage = "the engine command must be `python SCRIPT [ARGS]` or `python -m MODULE [ARGS]` (after --)"
    if len(cmd) < 2:
        raise ConfigError(f"no engine to run: {usage}")
    found = shutil.which(cmd[0])
    if found is None:
        raise ConfigError(f"{cmd[0]!r} not found: {usage}")
    same = os.path.abspath(found) == os.path.abspath(executable) or (
        os.path.dirname(os.path.abspath(found)) == os.path.dirname(os.path.abspath(executable))
        and os.path.realpath(found) == os.path.realpath(executable))
    if not same:
        raise ConfigError(f"the engine command names {found}, but the supervisor runs in {executable}, and the engine runs in "
                          f"the supervisor's interpreter: start the supervisor with that one ({cmd[0]} -m weightcache supervise ...)")
    if cmd[1] == "-m":
        if len(cmd) < 3:
            raise ConfigError(f"-m needs a module name: {usage}")
        return EngineCommand(tuple(cmd), ("-m", *cmd[3:]), None, cmd[2], os.getcwd())
    if cmd[1].startswith("-"):
        raise ConfigError(f"python option {cmd[1]} cannot apply to an engine forked from a running interpreter: set it for the "
                          f"supervisor instead (e.g. PYTHONUNBUFFERED=1 for -u); {usage}")
    if not os.path.isfile(cmd[1]):
        raise ConfigError(f"can't open file {os.path.abspath(cmd[1])!r}: {usage}")
    script = os.path.abspath(cmd[1])
    return EngineCommand(tuple(cmd), tuple(cmd[1:]), script, None, os.path.dirname(os.path.realpath(script)))



def run_script(path: str) -> None:
    """Run a file as ``__main__`` the way ``python path`` does. Not ``runpy.run_path``: that
    sets ``__file__`` to the path as given (python makes it absolute), runs in a temporary
    module that leaves ``sys.modules`` afterwards, and has no ``__loader__``."""
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__package__ = None
    main.__spec__ = None
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        source = f.read()
    # dont_inherit: this module's `from __future__ import annotations` must not apply to the engine.
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def run_engine(cmd: EngineCommand) -> int | signal.Signals:
    """Run the engine in this (forked) process and end it as the interpreter would: the
    status to exit with, or the signal to die by (an uncaught KeyboardInterrupt)."""
    sys.argv = list(cmd.argv)
    sys.orig_argv = list(cmd.orig_argv)
    if not sys.flags.safe_path and sys.path:
        sys.path[0] = cmd.path0  # the supervisor's own entry (its script's directory) is not the engine's
    result: int | signal.Signals = 0
    try:
        if cmd.module is not None:
            runpy._run_module_as_main(cmd.module, alter_argv=True)  # type: ignore[attr-defined]  # what `python -m` calls
        else:
            assert cmd.script is not None
            run_script(cmd.script)
    except SystemExit as exc:
        result = exit_status(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        result = signal.SIGINT  # python >= 3.8 ends an uncaught KeyboardInterrupt by dying of SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        result = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()  # the interpreter waits for non-daemon threads before atexit, so do we
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return result


def exit_status(exc: SystemExit) -> int:
    """The status ``python`` exits with for this SystemExit."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1

