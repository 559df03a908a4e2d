"""Import a CUDA VMM arena from its fds and wrap it as a torch tensor.

The driver calls go through libcuda.py (ctypes), not cuda-bindings: importing
cuda-bindings cost an engine 15.5-16 ms on its restart path.

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
on the H100). So the access is set on a thread of its own, and the views are made in the
meantime:

- the thread is started while the daemon answers the attach request (``start_spare``,
  called by mapping.py's ``prepare_attach``), and waits, parked on a lock: started in
  the attach itself it cost 0.27 ms there on the H100 host (Thread.start waits for the
  new thread to run; a process's first thread is the slowest to start);
- the calling thread reserves, imports and maps, and hands the thread the range; the
  thread makes the context current, says so, and calls ``cuMemSetAccess``, which lets
  go of the GIL for the call; the caller then makes the slab tensor and the views;
- the caller waits for that "in the call" before making views: a thread that needs the
  GIL back while the other computes waits up to a switch interval (5 ms) for it, so
  the thread must be inside the driver, not before it, when the views begin;
- :func:`map_vmm` returns the slab and a ``wait``; :func:`attached_model` (mapping.py)
  calls it after the views and before handing out any tensor, and it raises the
  driver's error if setting access failed (the range is then unmapped with the slab).

Nothing can read the range before access is set: the tensors leave the client only after
``wait``.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import threading
from collections.abc import Callable

import torch

from ..protocol.arena import VmmArenaDesc
from .libcuda import CudaError, Driver, driver

DEINITIALIZED = "CUDA_ERROR_DEINITIALIZED"  # cuGetErrorName of CUresult 4


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


class AccessThread:
    """A thread that sets one VMM range's access while the caller makes views (Note
    [views while access is set]). It starts parked and is given its range by
    :meth:`set_access`; one is started ahead of need (:func:`start_spare`). The thread
    holds the range's :class:`VmmMapping` until its call is over, so that the range is
    never unmapped under it, whatever becomes of the caller (a KeyboardInterrupt while it
    waits: unmapped, the range could be reserved by another attach before the call ran,
    and given this one's access)."""

    def __init__(self) -> None:
        self._go = threading.Lock()  # released to hand over the range (or no range: end)
        self._go.acquire()
        self._calling = threading.Lock()  # released by the thread as it enters the driver call
        self._calling.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._job: tuple[Driver, int, VmmMapping, bool] | None = None
        self.error: BaseException | None = None
        # _thread, not threading.Thread: Thread.start waits until the new thread runs,
        # which in a fresh process cost the caller 0.35-0.52 ms (0.10-0.15 ms for later
        # threads) on the 2-core VM; this one starts without waiting for it.
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        entered = False
        try:
            self._go.acquire()
            job, self._job = self._job, None
            if job is None:
                return
            drv, ctx, mapping, read_only = job  # held until the call is over
            with drv.current(ctx):
                entered = True
                self._calling.release()
                drv.set_access(mapping.va, mapping.nbytes, mapping.ordinal, read_only=read_only)
        except BaseException as exc:  # handed to the caller by wait()
            self.error = exc
        finally:
            if not entered:
                self._calling.release()
            self._done.release()

    def set_access(self, drv: Driver, ctx: int, mapping: VmmMapping, read_only: bool) -> None:
        """Hand the thread its range; return once it is inside the driver call (or done)."""
        self._job = (drv, ctx, mapping, read_only)
        try:
            self._go.release()
            self._calling.acquire()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Let the thread end without a range if it has not taken one (the hand-over was
        interrupted); if it has, it finishes its call holding the range."""
        self._job = None
        with contextlib.suppress(RuntimeError):  # released already
            self._go.release()

    def wait(self) -> None:
        """Return once access is set; raise the driver's error if it could not be."""
        with self._done:
            pass
        if self.error is not None:
            raise self.error


_spare: AccessThread | None = None
_spare_lock = threading.Lock()


def start_spare() -> None:
    """Start a parked :class:`AccessThread` for the next GPU attach, unless one is
    waiting already. The attach calls this while the daemon answers its request, so that
    starting a thread is not on the way from the reply to usable tensors."""
    global _spare
    with _spare_lock:
        if _spare is None:
            try:
                _spare = AccessThread()
            except RuntimeError:  # no thread to be had now: the map starts one, or says why it cannot
                pass


def _take_spare() -> AccessThread:
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    return spare if spare is not None else AccessThread()


def _forget_spare() -> None:
    global _spare, _spare_lock
    _spare = None  # a fork's child has no thread behind it,
    _spare_lock = threading.Lock()  # and no thread to release a lock held at the fork


os.register_at_fork(after_in_child=_forget_spare)


def map_vmm(arena: VmmArenaDesc, fds: list[int], *, read_only: bool = True,
            owners: list[object] | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """fds (closed here, whatever happens) + the reply's arena description -> a uint8
    tensor over the whole range on the GPU the arena names, and the ``wait`` to call
    before anything reads it: access is set meanwhile (Note [views while access is set]).
    The range's :class:`VmmMapping`, which torch keeps alive for as long as any tensor
    of the range lives, is appended to ``owners`` (the lease's owner: mapping.py's Note
    [lifetime]); the access thread holds it too until its call is over."""
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
    mapping = VmmMapping(va, sum(sizes), ordinal, ctx)  # owns the range from here: unmapped when collected
    if owners is not None:
        owners.append(mapping)
    access = _take_spare()
    try:
        access.set_access(drv, ctx, mapping, read_only)
    except BaseException:
        access.abandon()  # interrupted before the hand-over began: the thread must not stay parked
        raise
    return torch.as_tensor(mapping, device=f"cuda:{ordinal}"), access.wait
