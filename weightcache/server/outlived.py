"""Memory that outlived a daemon: what the daemon can and cannot see of it.

An engine that attached a model keeps its mapping when the daemon exits (the memory is
reference counted: that is the point). After a restart the new daemon holds no lease on
it, so `ps` did not show it and no budget counted it. What can be measured:

- **CPU, sealed memfd arenas**: every arena is a memfd named ``weightcache:<model>``, and
  a process that maps one shows it in /proc/<pid>/maps as ``/memfd:weightcache:<model>``.
  At start the daemon reads every process's maps (in a thread) and keeps the ones that
  map such a memfd; ``status`` shows them to administrators (each time re-reading only
  those processes, so that one that has exited leaves the list), and the start logs a
  warning. Those mappings come from an earlier daemon, or from another daemon running on
  the host (either way outside this daemon's budget).
- What it cannot see: /proc/<pid>/maps of another uid needs root (or CAP_SYS_PTRACE): a
  daemon that is not root sees only its own uid's processes, and says how many it could
  not read. A **page-cache arena** is the checkpoint files themselves, mapped read-only:
  a mapping of one is indistinguishable from any reader of the file (safetensors' own
  ``load_file`` maps it too) and shares the page cache with the new daemon's arena, so it
  is not reported. **GPU** VMM memory imported by an engine is invisible in /proc; it
  shows only as less real free memory on the device, which every load checks
  (cuMemGetInfo) and a NO_SPACE names.

The start-up survey reads every /proc/<pid>/maps once: 2.4 ms for the ~70 processes of
the 2-core dev VM, before the socket listens (a host with thousands of processes, or
processes with very many mappings, pays more, once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

MEMFD_PREFIX = "/memfd:weightcache:"  # backends/cpu.py names its arenas "weightcache:<label>"


@dataclass
class Mapper:
    pid: int
    comm: str
    uid: int
    models: dict[str, int] = field(default_factory=dict)  # model -> bytes mapped
    inodes: frozenset[int] = frozenset()  # the memfds' inodes: a later attach to this daemon is not "outlived"

    def describe(self) -> dict[str, Any]:
        return {"pid": self.pid, "comm": self.comm, "uid": self.uid, "models": dict(sorted(self.models.items())),
                "nbytes": sum(self.models.values())}


@dataclass
class Survey:
    mappers: list[Mapper]
    unreadable: int  # processes whose maps this daemon may not read


def _read_mapper(pid: int, only: frozenset[int] | None = None) -> Mapper | None:
    """The weightcache memfds process ``pid`` maps (None if none), only those of inodes
    ``only`` when given; PermissionError and FileNotFoundError (it exited) pass through."""
    models: dict[str, int] = {}
    inodes = set()
    with open(f"/proc/{pid}/maps", "rb") as f:
        for line in f:
            at = line.find(MEMFD_PREFIX.encode())
            if at < 0:
                continue
            fields = line.split()
            inode = int(fields[4])
            if only is not None and inode not in only:
                continue
            start, _, end = fields[0].partition(b"-")
            name = line[at + len(MEMFD_PREFIX):].rstrip(b"\n").removesuffix(b" (deleted)").decode(errors="replace")
            models[name] = models.get(name, 0) + int(end, 16) - int(start, 16)
            inodes.add(inode)
    if not models:
        return None
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        comm, uid = "?", -1
    return Mapper(pid=pid, comm=comm, uid=uid, models=models, inodes=frozenset(inodes))


def survey(exclude: int | None = None) -> Survey:
    """Every process but ``exclude`` (this daemon) that maps a weightcache memfd."""
    mappers, unreadable = [], 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == exclude:
            continue
        try:
            m = _read_mapper(int(entry.name))
        except PermissionError:
            unreadable += 1
            continue
        except OSError:  # exited meanwhile, or a kernel thread
            continue
        if m is not None:
            mappers.append(m)
    return Survey(mappers=mappers, unreadable=unreadable)


def still_mapping(mappers: list[Mapper]) -> list[Mapper]:
    """Those of ``mappers`` that still map a weightcache memfd now (re-read; cheap)."""
    out = []
    for old in mappers:
        try:
            m = _read_mapper(old.pid, only=old.inodes)
        except OSError:
            continue
        if m is not None and m.comm == old.comm:  # a reused pid is another process
            out.append(m)
    return out


# cli/parser.py's subcommands (not imported: the daemon need not load the CLI for this)
_COMMANDS = frozenset({"serve", "status", "models", "ps", "health", "load", "evict", "pin", "unpin", "register",
                       "unregister", "reload", "attach", "demo", "bench", "workload", "supervise"})


def is_daemon(argv: list[str]) -> bool:
    """Whether a command line runs `weightcache serve` (the script, or python -m weightcache):
    its first subcommand name is serve (`weightcache supervise -- python e.py serve` is not)."""
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == "weightcache" or (arg == "weightcache" and i > 0 and argv[i - 1] == "-m"):
            return next((a for a in argv[i + 1:] if a in _COMMANDS), None) == "serve"
    return False


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]


def ancestors(pid: int) -> set[int]:
    """The processes above ``pid`` (its parent, the parent's parent, ...), read from
    /proc/<pid>/stat; those that cannot be read end the chain."""
    out: set[int] = set()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            pid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid in out:  # a loop cannot happen, but a chain read while pids are reused must still end
            break
        out.add(pid)
    return out


def other_daemons(exclude: int | None = None, among: list[int] | None = None) -> list[dict[str, Any]]:
    """The other `weightcache serve` processes on this host (this PID namespace), or of
    ``among`` only: two daemons on different sockets both started, each taking its own
    budget of the same memory (by default half of RAM each), and neither said so.
    /proc/<pid>/cmdline is readable for every process, root or not. ``exclude`` and the
    processes above it are not counted: a daemon started as `timeout 1h weightcache serve`
    (or under nice, sudo, systemd-run) has a parent whose command line names serve too."""
    pids = among if among is not None else [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    skip = {exclude, *ancestors(exclude)} if exclude is not None else set()
    out = []
    for pid in pids:
        if pid in skip:
            continue
        try:
            argv = _argv(pid)
        except OSError:
            continue
        if is_daemon(argv):
            out.append({"pid": pid, "cmdline": " ".join(argv)[:300]})
    return out
