"""The NIXL agent of one daemon: memory registration, metadata, and reads from a peer.

NIXL (the ``nixl`` package, optional: ``pip install weightcache[peers]``) moves the bytes;
UCX under it picks the transport: RDMA where the NICs have it, CUDA IPC or NVLink between
GPUs of one host, shared memory (CMA, ``process_vm_readv``) between processes of one host,
TCP otherwise. On the 2-core CI VM, with no UCX settings, two daemons on loopback read
through ``cma/memory`` (UCX_PROTO_INFO=y shows it); docs/benchmarks.md has the rates.

Only NIXL's own serialized agent metadata (its C++ serializer: addresses, rkeys, the
workers' addresses) crosses the wire, inside the peers' msgpack frames; NIXL's pickle-
based descriptor helpers (get_serialized_descs) are not used, nor its metadata listener.

Note [reads and the arena's lifetime]
-------------------------------------
A read writes into this daemon's arena from the transport's threads (UCX's progress
thread, or the kernel on CMA). So ``read`` returns only once no request is in flight:
every handle it posted has completed or been released (which aborts it), and the local
registration is gone, before the caller may free the arena. The same on the serving
side: a peer's registration is removed before the arena's view is released.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger("weightcache.peers")

POLL_S = 0.0005  # between polls of a transfer's state: a busy poll took a core from the copy on the 2-core VM


class TransferFailed(Exception):
    """A read from a peer did not complete (the transport's error, a timeout, cancelled)."""


def _import_api() -> ModuleType:
    """nixl's Python API. The ``nixl`` meta package picks its CUDA 12 or 13 build from the
    CUDA stack already imported, and imports torch to ask when none is (1.8 s on the CI
    VM): a daemon without a GPU backend takes whichever build is installed directly."""
    builds = ("nixl_cu12._api", "nixl_cu13._api")  # CI installs nixl-cu12 alone (the Makefile's NIXL)
    cuda_loaded = "torch" in sys.modules or "cuda.bindings" in sys.modules
    for name in ("nixl._api", *builds) if cuda_loaded else (*builds, "nixl._api"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError("no module named nixl (pip install 'weightcache[peers]')")


def unavailable() -> str | None:
    """Why NIXL cannot be used here, or None when it can be imported."""
    try:
        _import_api()
    except Exception as exc:  # an ImportError, or a bundled library that does not load
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass(frozen=True)
class Extent:
    """Bytes to read: ``nbytes`` at the remote ``src`` into the local ``dst``."""

    dst: int
    src: int
    nbytes: int


class Transport:
    """One NIXL agent (UCX backend) for the daemon's life. Its methods block: call them
    from threads. NIXL's strict thread-sync mode guards the agent across them."""

    def __init__(self, name: str | None = None) -> None:
        # A NIXL READ between GPU buffers of one host is UCX's cuda_ipc get, which UCX
        # turns off on GPUs without active NVLink (openucx/ucx #7566, for all-to-all
        # collectives), leaving loopback TCP: 0.5 GB/s against 416 with it on, on one
        # H200 (docs/benchmarks.md). NIXL's own UCX plugin turns it on since
        # ai-dynamo/nixl #2208; here for the builds before that. An operator's setting wins.
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
        api = _import_api()
        self._api = api
        self.name = name or f"weightcache-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        # No progress thread: NIXL's polls without pause (pthrDelay 0), ~45% of a core for
        # an idle agent on the CI VM; without it 0. Reads progress in ``read``'s polls,
        # a lend in ``progress`` (Lender: while it lends, for transports that need the
        # lender's side to act, TCP).
        conf = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                     sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = api.nixl_agent(self.name, conf)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL started without its UCX backend (plugins: {self.agent.get_plugin_list()})")
        # One read at a time: a peer's metadata changes with every lend (it carries that
        # lend's registration), and NIXL holds one metadata per remote agent name.
        self._reading = threading.Lock()

    # -- memory ---------------------------------------------------------------------
    def register(self, regions: Sequence[tuple[int, int]], memory: str, device_id: int = 0) -> Any:
        """Register (addr, nbytes) regions; returns what ``deregister`` takes."""
        return self.agent.register_memory([(a, n, device_id, "") for a, n in regions], memory)

    def deregister(self, handle: Any) -> None:
        self.agent.deregister_memory(handle)

    def progress(self, stop: threading.Event, every_s: float = 0.001) -> None:
        """Make the agent progress until ``stop`` is set (a lend's thread): a read over TCP
        is served by the lender's own worker (UCX's rma_am), which runs only when polled."""
        while not stop.wait(every_s):
            self.agent.get_new_notifs()

    def metadata(self) -> bytes:
        """This agent's metadata (taken after a registration: it carries the keys a peer
        needs to read what was registered)."""
        return bytes(self.agent.get_agent_metadata())

    # -- reading from a peer ----------------------------------------------------------
    def read(self, remote_md: bytes, extents: Sequence[Extent], memory: str, device_id: int, remote_memory: str,
             remote_device_id: int, *, window: int, on_done: Callable[[int, int], None],
             stop: Callable[[], str | None], deadline: float, stall_s: float = 5.0,
             pace: Callable[[int, int], None] = lambda _n, _dst: None,
             ready: Callable[[int], bool] = lambda _k: True) -> None:
        """Read every extent (one request each) from
        the peer whose metadata is ``remote_md``, keeping up to ``window`` requests in
        flight. ``on_done(dst, nbytes)`` is called, in this thread, as each extent's
        bytes are in place. ``stop()`` returning a reason (the peer's control
        connection closed, the load was cancelled), the ``deadline`` passing, or no
        request completing for ``stall_s`` while some are in flight, ends it with
        TransferFailed. Returns only with no request in flight (Note [reads and the
        arena's lifetime]). ``pace(nbytes, dst)`` is called before each read is posted (it
        may wait: the target's pages reserved, a fill's rate cap). ``ready(k)`` says
        whether extent ``k`` may be posted yet (its target is free again: a ring's slot
        copied out); while it may not, the reads in flight are polled."""
        if not extents:
            return
        with self._reading:
            try:
                self._read(remote_md, extents, memory, device_id, remote_memory, remote_device_id, window=window,
                           on_done=on_done, stop=stop, deadline=deadline, stall_s=stall_s, pace=pace, ready=ready)
            except TransferFailed:
                raise
            except Exception as exc:  # NIXL's own (nixlRemoteDisconnectError: the lender died)
                raise TransferFailed(f"{type(exc).__name__}: {exc}") from None

    def _read(self, remote_md: bytes, extents: Sequence[Extent], memory: str, device_id: int, remote_memory: str,
              remote_device_id: int, *, window: int, on_done: Callable[[int, int], None],
              stop: Callable[[], str | None], deadline: float, stall_s: float, pace: Callable[[int, int], None],
              ready: Callable[[int], bool]) -> None:
        remote = self._add_remote(remote_md)
        lo, hi = min(e.dst for e in extents), max(e.dst + e.nbytes for e in extents)
        local_reg = self.register([(lo, hi - lo)], memory, device_id)
        inflight: list[tuple[Any, Extent]] = []
        try:
            todo = list(reversed(extents))
            # When a read last completed, or was posted with none in flight: the time a
            # stall is counted from (time spent in ``pace`` is this side's, not a stall).
            moved = time.monotonic()
            while todo or inflight:
                while todo and len(inflight) < window and ready(len(extents) - len(todo)):
                    e = todo.pop()
                    pace(e.nbytes, e.dst)
                    if not inflight:
                        moved = time.monotonic()
                    local = self.agent.get_xfer_descs([(e.dst, e.nbytes, device_id)], memory)
                    far = self.agent.get_xfer_descs([(e.src, e.nbytes, remote_device_id)], remote_memory)
                    h = self.agent.initialize_xfer("READ", local, far, remote)
                    inflight.append((h, e))
                    if self.agent.transfer(h) == "ERR":
                        raise TransferFailed(f"posting a read of {e.nbytes} bytes failed")
                progressed = False
                for item in list(inflight):
                    h, e = item
                    state = self.agent.check_xfer_state(h)
                    if state == "ERR":
                        raise TransferFailed(f"a read of {e.nbytes} bytes failed in the transport")
                    if state == "DONE":
                        inflight.remove(item)
                        self.agent.release_xfer_handle(h)
                        on_done(e.dst, e.nbytes)
                        progressed = True
                        moved = time.monotonic()
                if not progressed:
                    why = stop()
                    if why is not None:
                        raise TransferFailed(why)
                    now = time.monotonic()
                    if now > deadline:
                        raise TransferFailed("timed out")
                    if inflight and now - moved > stall_s:
                        raise TransferFailed(f"stalled: no read completed for {stall_s:g} s")
                    time.sleep(POLL_S)
        finally:
            for h, _ in inflight:  # releasing a request still in flight aborts it
                try:
                    self.agent.release_xfer_handle(h)
                except Exception as exc:
                    log.warning("releasing an unfinished NIXL read: %s", exc)
                    self._wait_released(h)
            self.deregister(local_reg)
            self._drop_remote(remote)

    def _wait_released(self, h: Any) -> None:
        """A request NIXL would not abort: wait until it ends on its own (it writes into the
        arena until then), up to a minute, then give up loudly."""
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if self.agent.check_xfer_state(h) != "PROC":
                    self.agent.release_xfer_handle(h)
                    return
            except Exception:
                return
            time.sleep(0.01)
        log.error("a NIXL read did not end within 60 s of being abandoned")

    def _add_remote(self, md: bytes) -> str:
        name = self.agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else str(name)

    def _drop_remote(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # a peer that died: its endpoint may be gone already
            log.debug("removing NIXL peer %s: %s", name, exc)
