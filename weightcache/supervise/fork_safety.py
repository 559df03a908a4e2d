"""May this process fork an engine? The supervisor's checks, and what the child resets.

Note [fork safety]
------------------
``weightcache supervise`` imports an engine's modules once (the template) and forks each
engine from it. A fork copies memory and file descriptors, but only the calling thread,
so the template must hold nothing a child cannot own:

1. **No CUDA.** A CUDA context does not survive fork (the child's calls fail or hang).
   Refused when torch is imported and ``torch.cuda.is_initialized()``, or when the driver
   was initialised by anyone: ``cuInit`` opens the GPU's device files (``/dev/nvidiactl``,
   ``/dev/nvidia-uvm``, ``/dev/nvidiaN``), so a descriptor or mapping of one in the
   template means a driver in use. The library merely loaded is fine: torch 2.11 (cu130)
   maps ``libcuda.so`` when it is imported, without initialising it, and engines forked
   after that attached and ran on the H200 (the fork test in tests/test_supervisor.py; a check on the mapped
   library refused every torch template there).
2. **One thread.** Another thread's locks (malloc's, the import lock, a library's) may be
   held at the fork and are never released in the child. Refused when
   ``/proc/self/task`` lists more than one task (native threads count: OpenMP, BLAS,
   gRPC) or ``threading.active_count() > 1``. The decision is made per kind of thread,
   by whether its library makes fork safe itself (registers fork handlers that stop or
   reset it), never by timing:

   - **OpenBLAS's pool is stopped, then waited for.** OpenBLAS, which numpy loads,
     starts ``cores - 1`` threads at load; it registers ``blas_thread_shutdown_`` as its
     own ``pthread_atfork`` prepare handler and restarts the pool at its next call, so
     calling it first is what a fork would do anyway (measured on the dev VM: numpy's
     OpenBLAS pool gone after the call, back in the child at the first matmul). The call
     joins the pool's threads, but a joined thread is still listed in
     ``/proc/self/task`` until the kernel has torn it down (the join returns when the
     thread's tid is cleared, before it leaves the thread group), and on a loaded 2-core
     VM the check once found it there (a refusal one start in a few). So once
     a pool was asked to stop, the check waits for the threads to leave, up to
     ``POOL_STOP_WAIT_S``, and refuses only what is still running then: a start that
     succeeds succeeds every time, and a template with a thread of another kind is
     refused every time (after that wait, where a pool was asked).
   - **jemalloc's background thread is left running** (below).
   - **Everything else is refused**, naming the thread: torch's intra-op pool (GNU
     OpenMP registers no fork handler; a child of a process whose pool ran can hang in
     its first parallel region), gRPC pollers, Python threads.

   One kind of thread is left running: jemalloc's background purging thread
   (``jemalloc_bg_thd``), started by a library that bundles jemalloc configured with
   ``background_thread:true`` (on the H200 host, importing
   ``transformers.models.llama.modeling_llama`` started one, and every template built
   from a recorded module list was refused). jemalloc makes fork safe itself: its ``pthread_atfork``
   handlers take every allocator lock, the background thread's included, before the
   fork, and in the child (``background_thread_postfork_child``) reinitialise them and
   mark the background threads stopped and disabled, so the engine purges inline and
   never waits on a thread it does not have. Old jemallocs (5.1) skipped some locks in
   those handlers (jemalloc issues #2019, #2402, fixed since): an engine that hangs in
   malloc right after the fork points to one; leave the module that bundles it out with
   --exclude. The thread is recognised by its name: this guards against accidents, not
   against the template's own code, which the operator chose and which runs as the engine. A module that starts any other thread when
   imported cannot be preloaded: the
   supervisor names it and exits; leave it out of ``--preload`` / the record file and
   the engine imports it itself after the fork.
3. **No sockets of its own.** A socket the template opened (a connection made at import)
   would be shared by every engine. Refused, naming the fd; the descriptors the
   supervisor was started with (stdio, even when it is a socket as under journald) are
   the engine's too, as they would be unsupervised. The weightcache client connects in
   the engine, never in the template.
4. **Fresh random state in each child** (:func:`reseed`): Python's ``random``, numpy's
   global RandomState and torch's default generator are seeded from the OS, as in a fresh
   process (torch 2.13 seeds its default generator randomly at start: three fresh
   processes printed three ``torch.initial_seed()`` values on the dev VM), so that engines
   never share a sequence.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterable


class ForkUnsafe(Exception):
    """The template holds something a forked engine cannot own; the message says what."""


def mapped_libraries(maps: str = "/proc/self/maps") -> set[str]:
    with open(maps) as f:
        return {parts[5].rstrip("\n") for parts in (line.split(maxsplit=5) for line in f) if len(parts) == 6 and parts[5].startswith("/")}


# The device files the CUDA driver opens at cuInit (and maps once it has a context).
DRIVER_DEVICES = ("/dev/nvidia",)


def driver_files(libraries: Iterable[str] = ()) -> list[str]:
    """The GPU device files this process holds open or mapped: the CUDA driver was
    initialised here. Cheap (a readlink per fd): asked after every preloaded module, to
    name the one that initialised it."""
    held = []
    for fd in open_fds():
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own fd)
            pass
    return sorted({p for p in [*held, *libraries] if p.startswith(DRIVER_DEVICES)})


def check_cuda(libraries: Iterable[str], loaded_by: str | None = None) -> None:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        raise ForkUnsafe("CUDA is initialised in the template (torch.cuda.is_initialized()): a CUDA context does not "
                         "survive fork. Something preloaded touched the GPU at import; leave it out of --preload, or out "
                         "of the --record file with --exclude MODULE")
    files = driver_files(libraries)
    if files:
        culprit = f"importing {loaded_by} initialised it" if loaded_by else "something preloaded initialised it at import"
        raise ForkUnsafe(f"the CUDA driver is initialised in the template ({files[0]} is open): a CUDA context does not "
                         f"survive fork. {culprit[0].upper() + culprit[1:]}; leave it out of --preload, or out of the "
                         "--record file with --exclude MODULE (or, if it asks torch.cuda.is_available(), set "
                         "PYTORCH_NVML_BASED_CUDA_CHECK=1: torch then asks NVML and leaves CUDA alone)")


def quiesce_openblas(libraries: Iterable[str]) -> int:
    """Stop OpenBLAS thread pools as OpenBLAS's own fork handler does; their next call
    restarts them. Returns how many libraries were asked."""
    n = 0
    for path in libraries:
        if "openblas" in os.path.basename(path).lower():
            lib = ctypes.CDLL(path)  # already loaded: this only finds it
            shutdown = getattr(lib, "blas_thread_shutdown_", None)
            if shutdown is not None:
                shutdown()
                n += 1
    return n


# Native threads that their own library makes safe across fork (Note [fork safety], 2.),
# by the name the library gives them (/proc/self/task/TID/comm).
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def thread_names() -> list[str]:
    """Every thread but this one and the FORK_SAFE_THREADS: Python's by name, native ones
    by tid and comm."""
    me = threading.get_native_id()
    names = {t.native_id: f"{t.name!r} (Python)" for t in threading.enumerate() if t.native_id is not None and t.native_id != me}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me and int(tid) not in names:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                continue  # it ended
            if comm not in FORK_SAFE_THREADS:
                names[int(tid)] = f"tid {tid} {comm!r} (native)"
    return [names[k] for k in sorted(names)]


# How long threads that their library was asked to stop (OpenBLAS's pool) may take to
# leave /proc/self/task (Note [fork safety], 2.). They are normally gone at once (30 of 30
# starts on the dev VM with every core busy); the bound is for a host so loaded that the
# exiting threads wait seconds for a CPU, and is spent only by a start that will be refused.
POOL_STOP_WAIT_S = 5.0


def wait_for_threads(deadline: float) -> list[str]:
    """thread_names(), once it is empty or the monotonic ``deadline`` has passed."""
    while True:
        others = thread_names()
        if not others or time.monotonic() >= deadline:
            return others
        time.sleep(0.002)


def check_threads(started_by: dict[str, int] | None = None, stopping: bool = False) -> None:
    """Refuse other threads. ``stopping``: a pool was just asked to stop (quiesce_openblas),
    so its threads are waited for first, up to POOL_STOP_WAIT_S."""
    others = wait_for_threads(time.monotonic() + POOL_STOP_WAIT_S) if stopping else thread_names()
    if others or threading.active_count() > 1:
        blame = ""
        if started_by:
            blame = "; threads appeared while importing " + ", ".join(f"{m} (+{n})" for m, n in started_by.items())
        raise ForkUnsafe(f"{len(others)} other thread(s) running in the template: {', '.join(others)}{blame}. Forking "
                         "with threads can leave locks held forever in the engine; leave the module that starts them "
                         "out of --preload, or out of the --record file with --exclude MODULE")


def socket_fds(allowed: Iterable[int]) -> list[str]:
    """Sockets open in this process, except ``allowed`` (what it was started with)."""
    keep = set(allowed)
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # listdir's own fd, closed already
        if target.startswith("socket:"):
            out.append(f"fd {fd} ({target})")
    return out


def check_sockets(allowed: Iterable[int], opened_by: str | None = None) -> None:
    found = socket_fds(allowed)
    if found:
        culprit = f"Importing {opened_by} opened one" if opened_by else "Something preloaded connected at import"
        raise ForkUnsafe(f"the template has socket(s) open that every engine would share: {', '.join(found)}. {culprit}; "
                         "leave it out of --preload (or --exclude it from the --record file), or connect in the engine")


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def check_fork_safe(inherited_fds: Iterable[int], started_by: dict[str, int] | None = None, driver_by: str | None = None,
                    socket_by: str | None = None) -> None:
    """Raise :class:`ForkUnsafe` unless this process may fork an engine (Note [fork safety]).
    ``started_by``, ``driver_by`` and ``socket_by`` name the preloaded modules that started
    threads, loaded the CUDA driver or opened a socket, for the message."""
    libraries = mapped_libraries()
    check_cuda(libraries, driver_by)
    stopping = quiesce_openblas(libraries) > 0
    check_threads(started_by, stopping)
    check_sockets(inherited_fds, socket_by)


def reseed() -> None:
    """In the child, right after fork: every global random generator seeded from the OS."""
    import random

    random.seed()  # CPython also does this at fork (os.register_at_fork); said here for the reader
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # the legacy global RandomState; no argument = from the OS
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # the default generator; CUDA's generators are seeded lazily, without CUDA init
