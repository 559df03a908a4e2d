"""Import a CUDA VMM arena from its fds and wrap it as a torch tensor.

The driver calls go through libcuda.py (ctypes), not cuda-bindings: importing
cuda-bindings cost an engine 15.5-16 ms on its restart path (issue 13).

Read-only by default (``CU_MEM_ACCESS_FLAGS_PROT_READ``): a kernel that writes to it
faults in this process only ("illegal memory access"); the daemon's bytes stay intact.
See client/mapping.py's Note [lifetime] for when the range is unmapped.

Note [first attach]
-------------------
What the first GPU attach in a process did once, and what became of it:

- ``import cuda.bindings.driver`` (15.5-16 ms on the H200): gone; ctypes is already
  imported by torch, and libcuda.so.1 already loaded by torch's CUDA init.
- cuda-bindings' first driver call resolved its whole table of entry points: gone; the
  binding looks up the 21 symbols it uses (18 for an attach) once, at the first attach (dlsym, microseconds).
- ``cuInit`` and, on every attach, ``cuDeviceGetCount`` plus ``cuDeviceGet`` and
  ``cuDeviceGetUuid`` for each GPU, twice over (to find the reply's GPU by UUID):
  now once per process (the UUID table is kept: CUDA_VISIBLE_DEVICES cannot change
  once the driver is initialised).
- ``cuDevicePrimaryCtxRetain``: once per device per process (it was already).
What is left per attach is the work itself: one import and one map per chunk, one
reserve and one set-access for the range, and the tensor views.

Note [views while access is set]
--------------------------------
``cuMemSetAccess`` is most of an attach's driver time (0.59 of 0.87 ms for 10 chunks of
9.15 GiB on an H100), and the tensor views are most of the rest of its work (0.48 ms for
183 tensors in a fresh engine). Neither needs the other: a view is a pointer, sizes and
strides, and torch reads nothing through it when making it (``torch.as_tensor`` asks the
driver which device the pointer is on, which it answers once the range is mapped; measured
on the H100). So the views are made on a thread of their own while the caller sets the
access:

- the thread is started while the daemon answers the attach request (``start_spare``,
  called by mapping.py's ``prepare_attach``), makes torch's first view calls on a scrap
  tensor (a thread's first views cost more: its thread-local state), and waits, parked
  on a lock: started in the attach itself it cost 0.27 ms there on the H100 host
  (Thread.start waits for the new thread to run; a process's first thread is the
  slowest to start);
- the caller reserves, imports and maps with the context current, makes the slab, hands
  the thread the slab and the table, and calls ``cuMemSetAccess`` straight away, which
  lets go of the GIL for the call: the thread takes it and makes the views meanwhile;
- nothing that lets go of the GIL may come between the hand-over and that call: a
  thread that needs the GIL back while the other computes waits up to a switch interval
  (5 ms) for it, so the caller must be inside the driver, not before it, when the views
  begin. When the call returns the caller waits for the views (the thread holds the GIL
  until they are made, or a switch interval), then takes them.
  Session 23 had the roles the other way round: the access on the thread, the views on
  the caller, which had to wait until the thread was inside the driver before it could
  start them; that hand-over was 0.31 ms from the range handed on to the first view on
  the H200;
- :func:`map_vmm` returns the views once both are done, and raises the driver's error
  (after the thread is done with the range) if setting access failed, or the views' if
  the table did not fit.

Nothing can read the range before access is set: the tensors leave :func:`map_vmm` only
after ``cuMemSetAccess`` returned. The call runs in the caller's thread, which holds the
range's :class:`VmmMapping` throughout, so the range cannot be unmapped under it.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..protocol.arena import VmmArenaDesc
from .libcuda import CudaError, Driver, driver

DEINITIALIZED = "CUDA_ERROR_DEINITIALIZED"  # cuGetErrorName of CUresult 4

if TYPE_CHECKING:  # mapping.py's tensor_views, handed in: mapping.py imports this module, not the reverse
    MakeViews = Callable[[torch.Tensor, Iterable[Any]], dict[str, torch.Tensor]]


class VmmMapping:
    """Owns one mapped range. torch keeps this object alive for as long as any tensor
    made from its ``__cuda_array_interface__`` lives; when it is collected, the range is
    synchronized and unmapped. ``ctx`` is the device's primary context (libcuda's handle):
    attach maps imported memory here, publish.py its own allocation."""

    def __init__(self, va: int, nbytes: int, ordinal: int, ctx: int) -> None:
        self.va, self.nbytes, self.ordinal, self._ctx = va, nbytes, ordinal, ctx
        # Kept here, not looked up at collection: at interpreter exit module globals may be gone.
        self._driver: Driver = driver()
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (va, False), "version": 3,
                                         "strides": None}

    def __del__(self) -> None:
        if not self.va:
            return
        va, self.va = self.va, 0
        try:
            with self._driver.current(self._ctx):
                self._driver.unmap(va, self.nbytes)
        except CudaError as exc:
            # At interpreter exit the driver may be torn down first; the process is ending
            # and its mappings with it. Anything else is a real failure: let it be reported.
            if exc.details.get("result") != DEINITIALIZED:
                raise


class ViewThread:
    """A thread that makes one attach's tensor views while the caller sets the range's
    access (Note [views while access is set]). It starts parked and is given its work by
    :meth:`make_views`; one is started ahead of need (:func:`start_spare`). ``device``
    ("cuda:N"): the GPU whose views it will make, on which it makes its first view calls
    (None: on the CPU)."""

    def __init__(self, device: str | None = None) -> None:
        self._device = device
        self._go = threading.Lock()  # released to hand over the work (or no work: end)
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._job: tuple[MakeViews, torch.Tensor, Iterable[Any]] | None = None
        self._views: dict[str, torch.Tensor] | None = None
        self._error: BaseException | None = None
        # _thread, not threading.Thread: Thread.start waits until the new thread runs,
        # which in a fresh process cost the caller 0.35-0.52 ms (0.10-0.15 ms for later
        # threads) on the 2-core VM; this one starts without waiting for it.
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        try:
            # torch's first view calls on this thread, made while the daemon answers and
            # before parking: a fresh thread's first 183 views took 0.28-0.38 ms against
            # 0.18-0.22 once it had made one (2-core VM), and for the process's first
            # attach these are its first view calls too (mapping.py's prepare_views). On
            # the GPU, for its device: the thread's CUDA state is set up here, not while
            # the caller is inside cuMemSetAccess (session 24's H100: views made on a
            # thread warmed on the CPU took 0.62-1.43 ms there, 0.59 on the caller).
            with contextlib.suppress(Exception):  # only a head start: the views say what is wrong, if anything
                scrap = torch.empty(0 if self._device else 8, dtype=torch.uint8, device=self._device)
                scrap.view(torch.bfloat16).as_strided((scrap.numel() // 2,), (1,), 0)
            self._go.acquire()
            job, self._job = self._job, None
            if job is not None:
                make_views, slab, table = job
                self._views = make_views(slab, table)
        except BaseException as exc:  # handed to the caller by views()
            self._error = exc
        finally:
            self._done.release()

    def make_views(self, make_views: MakeViews, slab: torch.Tensor, table: Iterable[Any]) -> None:
        """Hand the thread its work, ``make_views(slab, table)``, and return at once: it
        needs the GIL to begin, which the caller's next driver call lets go of."""
        self._job = (make_views, slab, table)
        self._go.release()

    def abandon(self) -> None:
        """Let a thread that was given no work end."""
        with contextlib.suppress(RuntimeError):  # released already
            self._go.release()

    def views(self) -> dict[str, torch.Tensor]:
        """The views, once made; the error that stopped them, raised."""
        with self._done:
            pass
        if self._error is not None:
            raise self._error
        assert self._views is not None
        return self._views


_spare: ViewThread | None = None
_spare_lock = threading.Lock()


def start_spare(device: str | None) -> None:
    """Start a parked :class:`ViewThread` for the next GPU attach, unless one is
    waiting already. The attach calls this while the daemon answers its request, so that
    starting a thread is not on the way from the reply to usable tensors."""
    global _spare
    with _spare_lock:
        if _spare is None:
            try:
                _spare = ViewThread(device)
            except RuntimeError:  # no thread to be had now: the map starts one, or says why it cannot
                pass


def _take_spare(device: str | None) -> ViewThread:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    return spare if spare is not None else ViewThread(device)


def _forget_spare() -> None:
    global _spare, _spare_lock
    _spare = None  # a fork's child has no thread behind it,
    _spare_lock = threading.Lock()  # and no thread to release a lock held at the fork


os.register_at_fork(after_in_child=_forget_spare)


def map_vmm(arena: VmmArenaDesc, fds: list[int], make_views: MakeViews, table: Iterable[Any], *,
            read_only: bool = True) -> dict[str, torch.Tensor]:
    """fds (closed here, whatever happens) + the reply's arena description and tensor
    table -> the tensors, ``make_views`` of the whole range mapped on the GPU the arena
    names, readable: the views are made while access is set (Note [views while access is
    set])."""
    try:
        sizes = arena.chunks
        if len(fds) != len(sizes):
            raise CudaError(f"arena has {len(sizes)} chunks but {len(fds)} fds arrived")
        drv = driver()
        ordinal = drv.ordinal_of(arena.device_uuid)
        torch.cuda.init()  # torch and we share the primary context (cuda_driver's Note [contexts]); a no-op once initialised
        ctx = drv.primary_context(ordinal)
        with drv.current(ctx):
            va = drv.import_and_map(fds, sizes)
    finally:
        for fd in fds:
            os.close(fd)
    vmm = VmmMapping(va, sum(sizes), ordinal, ctx)  # owns the range from here: unmapped when collected
    slab = torch.as_tensor(vmm, device=f"cuda:{ordinal}")
    views = _take_spare(f"cuda:{ordinal}")
    with drv.current(ctx):
        try:
            views.make_views(make_views, slab, table)
        except BaseException:
            views.abandon()  # interrupted before the hand-over: the thread must not stay parked
            raise
        try:  # nothing between the hand-over and this driver call lets go of the GIL
            drv.set_access(va, vmm.nbytes, ordinal, read_only=read_only)
        except BaseException:
            with contextlib.suppress(BaseException):
                views.views()  # the thread is done with the range before it may be unmapped
            raise
    return views.views()
