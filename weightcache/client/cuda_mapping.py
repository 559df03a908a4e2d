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
"""

from __future__ import annotations

import os

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


def map_vmm(arena: VmmArenaDesc, fds: list[int], *, read_only: bool = True) -> torch.Tensor:
    """fds (closed here, whatever happens) + the reply's arena description -> a uint8
    tensor over the whole range on the GPU the arena names."""
    try:
        sizes = arena.chunks
        if len(fds) != len(sizes):
            raise CudaError(f"arena has {len(sizes)} chunks but {len(fds)} fds arrived")
        drv = driver()
        ordinal = drv.ordinal_of(arena.device_uuid)
        torch.cuda.init()  # torch and we share the primary context (cuda_driver's Note [contexts]); a no-op once initialised
        ctx = drv.primary_context(ordinal)
        with drv.current(ctx):
            va = drv.import_and_map(fds, sizes, ordinal, read_only=read_only)
    finally:
        for fd in fds:
            os.close(fd)
    mapping = VmmMapping(va, sum(sizes), ordinal, ctx)  # owns the range from here: unmapped when collected
    return torch.as_tensor(mapping, device=f"cuda:{ordinal}")
