"""Pack an engine's tensors into shareable memory for ``publish``: a sealed memfd for CPU
tensors, a VMM allocation exported as fds for CUDA tensors (through the client's ctypes
driver binding, client/libcuda.py: no cuda-bindings in an engine). Same layout as an
arena (256-byte-aligned offsets, the daemon's seals and VMM chunk sizes: protocol/arena.py),
same description as an attach reply's ``arena``. Imports torch: connection.py imports it at
the first publish."""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgpack
import torch

from ..protocol import pymsgpack
from ..protocol.arena import ARENA_ALIGN, MEMFD_SEALS, MemfdArenaDesc, TensorRow, VmmArenaDesc, chunk_sizes
from ..units import capacity, round_up
from .mapping import TORCH_DTYPES

SAFETENSORS_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class Packed:
    """What a publish request carries, and how to let go of it afterwards."""

    fds: list[int]
    arena: MemfdArenaDesc | VmmArenaDesc  # as in an attach reply (``to_wire`` for the request)
    table: list[TensorRow]
    device: str  # the wire's name for the device: "cpu" or "cuda:<uuid>"
    release: Callable[[], None]  # closes the fds and frees this process's copy; call after the reply


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorRow], int]:
    """The tensor table of an arena holding ``tensors`` in order, and its size in bytes."""
    table, cursor = [], 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be published")
        cursor = round_up(cursor, ARENA_ALIGN)
        nbytes = t.numel() * t.element_size()
        table.append(TensorRow(name, SAFETENSORS_NAMES[t.dtype], list(t.shape), cursor, nbytes))
        cursor += nbytes
    return table, cursor


def wire_rows(table: list[TensorRow]) -> pymsgpack.Packed:
    """The request's tensor table, packed by the msgpack package: this module is imported
    only to publish, where msgpack's import pays for itself (a 600,000-row table packed in
    0.32 s against 5.8 s in the client's own codec, protocol/pymsgpack.py)."""
    return pymsgpack.Packed(msgpack.packb(table, use_bin_type=True))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def pack(tensors: Mapping[str, torch.Tensor]) -> Packed:
    """Copy ``tensors`` (all on one device) into memory the daemon can take.

    >>> packed = pack({"w": torch.ones(4)})
    >>> packed.device, packed.arena.to_wire(), packed.table
    ('cpu', {'kind': 'memfd', 'nbytes': 4096}, [TensorRow('w', 'F32', [4], 0, 16)])
    >>> packed.release()
    """
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"publish tensors from one device at a time, not {sorted(map(str, devices))}")
    table, size = layout(tensors)
    (device,) = devices
    if device.type == "cpu":
        return _pack_memfd(tensors, table, size)
    if device.type == "cuda":
        return _pack_vmm(tensors, table, size, device.index if device.index is not None else torch.cuda.current_device())
    raise ValueError(f"cannot publish tensors on {device}")


def _pack_memfd(tensors: Mapping[str, torch.Tensor], table: list[TensorRow], size: int) -> Packed:
    size = capacity(size, mmap.PAGESIZE)
    fd = os.memfd_create("weightcache-publish", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            for t, row in zip(tensors.values(), table, strict=True):
                if row.nbytes:
                    m[row.offset : row.offset + row.nbytes] = _bytes_of(t).numpy().tobytes()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, MEMFD_SEALS)  # the daemon refuses memory we could still change
    except BaseException:
        os.close(fd)
        raise
    return Packed([fd], MemfdArenaDesc(size), table, "cpu", lambda: os.close(fd))


def _pack_vmm(tensors: Mapping[str, torch.Tensor], table: list[TensorRow], size: int, ordinal: int) -> Packed:
    from .cuda_mapping import VmmMapping
    from .libcuda import driver

    drv = driver()
    torch.cuda.init()  # torch and we share the primary context (cuda_driver's Note [contexts])
    ctx = drv.primary_context(ordinal)
    gran = drv.granularity(ordinal)
    total = capacity(size, gran)
    sizes = chunk_sizes(total, gran)  # ~1 GiB chunks like the daemon's arenas
    with drv.current(ctx):
        va, fds = drv.create_exported(sizes, ordinal)
    try:
        slab = torch.as_tensor(VmmMapping(va, total, ordinal, ctx), device=f"cuda:{ordinal}")  # unmapped when collected
        for t, row in zip(tensors.values(), table, strict=True):
            if row.nbytes:
                slab[row.offset : row.offset + row.nbytes].copy_(_bytes_of(t))
        torch.cuda.synchronize(ordinal)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    uuid = drv.device_uuid(ordinal)

    def release() -> None:
        nonlocal slab
        for fd in fds:
            os.close(fd)
        del slab  # unmaps; the daemon has its own copy by now

    return Packed(fds, VmmArenaDesc(total, sizes, uuid), table, f"cuda:{uuid}", release)
