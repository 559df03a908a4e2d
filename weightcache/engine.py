"""What an engine calls when ``weightcache supervise`` runs it (docs/deployment.md, "Supervisor").

- :func:`ready` once the engine serves: tells systemd (``READY=1`` to ``$NOTIFY_SOCKET``,
  when set), tells the supervisor (it logs the time from fork to ready), and, when the
  supervisor was started with ``--record FILE``, writes the modules the engine has
  imported to FILE, for the next supervisor start to import before it forks.
- :func:`restart` to be replaced by a fresh engine at once (a model switch, new code in
  modules the supervisor did not preload): exits with :data:`RESTART_EXIT_CODE`, which the
  supervisor restarts without backoff and does not count as a crash.

Both work unsupervised too: :func:`ready` then only notifies systemd, and :func:`restart`
exits with the same code (a plain ``systemd`` unit can list it in ``RestartForceExitStatus=``).

>>> from weightcache import engine
>>> engine.supervised()
False

Importing this module imports nothing heavy: the supervisor imports it before it forks.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from .systemd import sd_notify

# EX_TEMPFAIL in sysexits.h, "try again later": the engine asks to be replaced. Any other
# non-zero status (or a signal) is a crash, restarted with backoff; 0 is "finished".
RESTART_EXIT_CODE = 75


@dataclass(frozen=True)
class SupervisorLink:
    """Set by the supervisor in the forked engine (never from the environment: the
    engine's environment is the one it would have had unsupervised)."""

    supervisor_pid: int
    fd: int  # write end of a close-on-exec pipe to the supervisor: one JSON object per line
    record: str | None  # --record FILE, or None
    template_modules: frozenset[str]  # modules the supervisor had before preloading: never recorded
    preloaded: frozenset[str]  # every module in the template at the fork: a record with nothing new is not rewritten
    engine_dir: str  # sys.path[0] of the engine: its own code, never recorded (so new code is picked up)


_link: SupervisorLink | None = None


def supervised() -> bool:
    """True in an engine that ``weightcache supervise`` forked."""
    return _link is not None


def _send(event: dict[str, object]) -> None:
    if _link is None:
        return
    # The supervisor may be gone: the engine carries on (it gets SIGTERM: PR_SET_PDEATHSIG).
    with contextlib.suppress(OSError):
        os.write(_link.fd, (json.dumps(event) + "\n").encode())


def recordable_modules(names: Iterable[str], modules: Mapping[str, object], exclude: frozenset[str], engine_dir: str) -> list[str]:
    """The names worth importing in the template, in import order: not ``__main__``, not
    what the supervisor imports anyway, not the engine's own code (files under
    ``engine_dir``), which must be re-read on each restart to pick up changes, and not
    modules the import system did not make (no ``__spec__``: a name cannot bring them back)."""
    out = []
    prefix = os.path.join(os.path.realpath(engine_dir), "") if engine_dir else None
    for name in names:
        if name in exclude or name in ("__main__", "__mp_main__"):
            continue
        module = modules.get(name)
        if getattr(module, "__spec__", None) is None:
            continue
        path = getattr(module, "__file__", None)
        if prefix and isinstance(path, str) and os.path.realpath(path).startswith(prefix):
            continue
        out.append(name)
    return out


def write_record(path: str | os.PathLike[str], names: list[str]) -> None:
    """One module name a line, written atomically (a reader never sees half a file)."""
    p = Path(path)
    text = (f"# modules an engine had imported when ready: weightcache supervise --record preloads them "
            f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, pid {os.getpid()})\n" + "".join(n + "\n" for n in names))
    # A name nobody can plant first (random; O_EXCL follows no link): a guessable one let
    # whoever may write the directory have the engine write through a symlink, or move
    # their own file into place as the record, which names the modules the supervisor
    # imports. (Not tempfile: this module must stay cheap to import.)
    tmp = p.with_name(f".{p.name}.{os.urandom(8).hex()}.tmp")
    # 0o644 whatever the umask allows: read_record ignores a record the group may write,
    # so under umask 002 a 0o666 record was written and then never read.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_record(path: str | os.PathLike[str]) -> list[str]:
    """The names in a record file; ``#`` starts a comment. A missing file is an empty list.

    The names are modules the supervisor imports: a record someone else could write
    chooses code a root supervisor runs. So the file must be owned by root or the reader's
    uid and writable by no one else, in directories only they can change (the rule
    open_source applies to checkpoint paths, loader/sources.untrusted_directory);
    otherwise it is ignored (an empty list) and stderr says why."""
    from .loader.sources import untrusted_directory

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        print(f"weightcache.engine: module record {path} not read: {exc.strerror}", file=sys.stderr)
        return []
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        where = untrusted_directory(os.fspath(path))
        trusted = (0, os.geteuid())
        if st.st_uid not in trusted or st.st_mode & 0o022 or where is not None or not stat.S_ISREG(st.st_mode):
            why = (f"directory {where[0]} can be changed by uid {where[1]}" if where is not None
                   else f"it is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}")
            print(f"weightcache.engine: module record {path} ignored: {why} (a record others can write would choose "
                  "the modules this process imports)", file=sys.stderr)
            return []
        text = f.read().decode("utf-8", errors="replace")
    return [s for s in (line.split("#", 1)[0].strip() for line in text.splitlines()) if s]


def ready(notify: bool = True) -> None:
    """Call once the engine serves. Sends ``READY=1`` to systemd when ``$NOTIFY_SOCKET``
    is set and ``notify`` is true (under the supervisor the engine, not the supervisor,
    says when the service is ready: the unit needs ``NotifyAccess=all``); tells the
    supervisor; writes the ``--record`` file. Cheap: call it after every restart."""
    t = time.monotonic()
    if _link is not None and _link.record:
        modules = dict(sys.modules)
        names: list[str] = []
        # Rewritten only when the engine imported something recordable the template did not
        # have: the 8B example's record holds ~2,300 names, and ready() is on the restart path.
        if recordable_modules([n for n in modules if n not in _link.preloaded], modules, _link.template_modules, _link.engine_dir):
            names = recordable_modules(list(modules), modules, _link.template_modules, _link.engine_dir)
            try:
                write_record(_link.record, names)
            except OSError as exc:
                print(f"weightcache.engine: cannot write the module record {_link.record}: {exc}", file=sys.stderr)
                names = []
        _send({"event": "ready", "t": t, "recorded": len(names)})
    else:
        _send({"event": "ready", "t": t})
    if notify:
        sd_notify("READY=1")


def restart(reason: str) -> NoReturn:
    """Ask for a fresh engine now: raises ``SystemExit(RESTART_EXIT_CODE)`` after telling
    the supervisor why (it logs the reason and forks a new engine without backoff).
    Call it from the main thread; ``finally`` blocks and ``atexit`` handlers run as on
    any exit, so leases are detached and files flushed."""
    _send({"event": "restart", "reason": str(reason)[:500], "t": time.monotonic()})
    raise SystemExit(RESTART_EXIT_CODE)
