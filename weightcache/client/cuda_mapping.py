"""Import a CUDA VMM arena from its fds and wrap it as a torch tensor.

Read-only by default (``CU_MEM_ACCESS_FLAGS_PROT_READ``): a kernel that writes to it
faults in this process only ("illegal memory access"); the daemon's bytes stay intact.
See client/mapping.py's Note [lifetime] for when the range is unmapped.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from cuda.bindings import driver as cu

from .. import cuda_driver as drv


class VmmMapping:
    """Owns one mapped range. torch keeps this object alive for as long as any tensor
    made from its ``__cuda_array_interface__`` lives; when it is collected, the range is
    synchronized and unmapped."""

    def __init__(self, va: int, nbytes: int, ordinal: int, ctx: Any) -> None:
        self.va, self.nbytes, self.ordinal, self._ctx = va, nbytes, ordinal, ctx
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (va, False), "version": 3,
                                         "strides": None}

    def __del__(self) -> None:
        if self.va:
            with drv.current(self._ctx):
                drv.unmap(self.va, self.nbytes)
            self.va = 0


def map_vmm(arena: dict[str, Any], fds: list[int], *, read_only: bool = True) -> torch.Tensor:
    """fds (closed here) + the reply's arena description -> a uint8 tensor on the GPU."""
    try:
        sizes = [int(s) for s in arena["chunks"]]  # inside the try: a bad description still closes the fds
        if len(fds) != len(sizes):
            raise drv.CudaError(f"arena has {len(sizes)} chunks but {len(fds)} fds arrived")
        ordinal = drv.ordinal_of(f"cuda:{arena['device_uuid']}")
        torch.cuda.init()  # torch and we share the primary context (cuda_driver's Note [contexts])
        ctx = drv.primary_context(ordinal)
        handles = []
        with drv.current(ctx):
            try:
                for fd in fds:
                    handles.append(drv.check(cu.cuMemImportFromShareableHandle(fd, drv.FD_HANDLE)))
                va = drv.map_chunks(handles, sizes, ordinal, read_only=read_only)
            finally:
                # The mapping holds the memory now; the handles are no longer needed.
                for h in handles:
                    cu.cuMemRelease(h)
    finally:
        for fd in fds:
            os.close(fd)
    return torch.as_tensor(VmmMapping(va, sum(sizes), ordinal, ctx), device=f"cuda:{ordinal}")
