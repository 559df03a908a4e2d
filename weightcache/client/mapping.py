"""Turn the fds and tensor table of an attach reply into torch tensors, zero-copy, and
hand them out as an :class:`AttachedModel`. This is where the client needs torch: client.py
imports this module at the first ``attach``, not before.

Note [lifetime]
---------------
Every tensor is a view of one slab tensor that wraps the whole mapped arena, or, for a
``file`` arena (the daemon serves the checkpoint files' own page cache), the whole mapped
file the tensor lies in. The slab holds the mapping (a Python ``mmap`` for memfd and file
arenas); the mapping is unmapped when the last view is garbage collected, never earlier.
The daemon's memory is reference counted by the kernel (memfd, and a mapped file's inode
and pages) or driver (VMM), so a mapping stays valid even if the daemon evicts the model;
the lease is what keeps the daemon from evicting it while you use it.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import stat
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import BadRequest
from ..protocol.arena import AttachReply, FileArenaDesc, MemfdArenaDesc, VmmArenaDesc
from .core import close_fds

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}


class Layouts(dict[tuple[Any, ...], tuple[torch.dtype, int, int, tuple[int, ...]]]):
    """(dtype name, *shape) -> (dtype, itemsize, nbytes, contiguous strides), worked out
    once per distinct key of one tensor table: a model's layers repeat a handful of
    shapes, and per tensor this was a fifth of building its view (measured below)."""

    def __missing__(self, key: tuple[Any, ...]) -> tuple[torch.dtype, int, int, tuple[int, ...]]:
        dtype = TORCH_DTYPES.get(key[0])
        if dtype is None:
            raise BadRequest(f"unknown dtype {key[0]!r} in the tensor table"[:200])
        shape = key[1:]
        strides = [1] * len(shape)
        for i in range(len(shape) - 1, 0, -1):
            strides[i - 1] = strides[i] * shape[i]
        value = self[key] = (dtype, dtype.itemsize, math.prod(shape) * dtype.itemsize, tuple(strides))
        return value


def map_memfd(fd: int, nbytes: int) -> torch.Tensor:
    """Map a sealed memfd (or a file) read-only and wrap it as a uint8 tensor (closes ``fd``)."""
    try:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point. A write through
        # these tensors faults (SIGSEGV) in this process; the daemon's bytes are sealed.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


def map_files(arena: FileArenaDesc, fds: list[int]) -> list[torch.Tensor]:
    """A ``file`` arena's fds (one read-only regular file each) -> one uint8 tensor per
    file over its first ``arena.files[i]`` bytes. Takes the fds: each is closed here,
    whether this returns or raises (the mappings keep the files)."""
    slabs: list[torch.Tensor] = []
    pending = list(fds)
    try:
        if len(arena.files) != len(fds):
            raise BadRequest(f"file arena: 'files' lists {len(arena.files)} sizes for {len(fds)} fds")
        for fd, size in zip(fds, arena.files, strict=True):
            st = os.fstat(fd)
            # Past a file's end a mapping raises SIGBUS, not an error: refuse a short file here.
            if not stat.S_ISREG(st.st_mode) or st.st_size < size:
                raise BadRequest(f"file arena: fd {fd} is not a regular file of at least {size} bytes")
            pending.remove(fd)
            slabs.append(map_memfd(fd, size))
    finally:
        close_fds(pending)
    return slabs


def file_tensor_views(slabs: list[torch.Tensor], arena: FileArenaDesc, table: list[list[Any]]) -> dict[str, torch.Tensor]:
    """[name, dtype, shape, offset, nbytes] rows of a ``file`` arena -> views of the mapped
    files (no copies). ``offset`` is in the arena; the segment that holds it says which
    file, and where in it."""
    if not slabs:
        raise BadRequest("file arena without files")
    segs = arena.segment_list()
    starts = [s[2] for s in segs]
    end = 0
    for f, fo, ao, n in segs:
        if f >= len(slabs) or fo + n > slabs[f].numel() or ao < end:
            raise BadRequest(f"file arena: segment {(f, fo, ao, n)} is outside its file or out of order")
        end = ao + n
    out = {}
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    layouts = Layouts()
    for name, dtype_name, shape, offset, nbytes in table:
        dtype, itemsize, want, strides = layouts[(dtype_name, *shape)]
        if nbytes:
            i = bisect.bisect_right(starts, offset) - 1
            f, fo, ao, n = segs[i] if i >= 0 else (0, 0, 0, 0)
        else:
            f, fo, ao, n = 0, 0, offset, 0  # an empty tensor: any place will do
        at = fo + offset - ao
        if want != nbytes or offset + nbytes > ao + n or at < 0 or at % itemsize:
            raise BadRequest(f"tensor {name!r}: {dtype_name}{list(shape)} at offset {offset} ({nbytes} bytes) "
                             "lies in no segment of the file arena")
        base = typed.get((f, dtype))
        if base is None:
            size = slabs[f].numel()
            base = typed[(f, dtype)] = slabs[f][: size - size % itemsize].view(dtype)
        out[name] = base.as_strided(shape, strides, at // itemsize)
    return out


def map_arena(arena: MemfdArenaDesc | VmmArenaDesc, fds: list[int]) -> torch.Tensor:
    """A memfd or VMM arena + its fds -> one uint8 tensor over the whole arena. Takes the
    fds: each is closed exactly once, here or by the mapper it is handed to, whether this
    returns or raises (the mapping keeps the memory)."""
    if isinstance(arena, VmmArenaDesc):
        from .cuda_mapping import map_vmm

        return map_vmm(arena, fds, read_only=not arena.writable)  # closes them
    if len(fds) != 1:
        close_fds(fds)
        raise BadRequest(f"memfd arena needs 1 fd, got {len(fds)}")
    return map_memfd(fds[0], arena.nbytes)  # closes it


def tensor_views(slab: torch.Tensor, table: list[list[Any]]) -> dict[str, torch.Tensor]:
    """[name, dtype, shape, offset, nbytes] rows -> views of ``slab`` (no copies).

    One ``as_strided`` per tensor on a per-dtype view of the slab: slicing, then viewing
    as the dtype, then reshaping costs three tensor ops per tensor, and for a few hundred
    tensors that was most of an attach (1.1 vs 0.45 ms for 291 tensors on the CPU). The
    ``as_strided`` (a new tensor) is most of what is left: ~1.2 of 1.7 us per tensor for
    200 bf16 tensors on the 2-core VM; the rest, the Python around it, went from ~0.5 to
    ~0.2 us with :class:`Layouts` (scripts in issue 13's report).
    """
    out = {}
    typed: dict[torch.dtype, torch.Tensor] = {}
    size = slab.numel()
    layouts = Layouts()
    for name, dtype_name, shape, offset, nbytes in table:
        dtype, itemsize, want, strides = layouts[(dtype_name, *shape)]
        if offset % itemsize or want != nbytes or offset + nbytes > size:
            raise BadRequest(f"tensor {name!r}: {dtype_name}{list(shape)} does not fit at offset {offset} "
                             f"({nbytes} bytes) of a {size}-byte arena")
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = slab[: size - size % itemsize].view(dtype)
        out[name] = base.as_strided(shape, strides, offset // itemsize)
    return out


class AttachedModel(Mapping[str, torch.Tensor]):
    """A read-only mapping of tensor name -> tensor, backed by the daemon's arena.

    >>> async with client.attach("qwen-7b") as m:   # doctest: +SKIP
    ...     logits = model_forward(m["lm_head.weight"], ...)
    """

    def __init__(self, name: str, lease: int, fingerprint: str, device: str, tensors: dict[str, torch.Tensor],
                 source: str = "resident", arena_kind: str | None = None, waited_s: float = 0.0) -> None:
        self.name = name
        self.lease = lease
        self.fingerprint = fingerprint
        self.device = device
        # Where the daemon got the bytes for this attach: "resident" (a hit), "host" (it
        # waited for a promotion from the host tier) or "files" (for a load from disk).
        self.source = source
        # Seconds the daemon waited (within the attach's ``wait_s``) for room that other
        # models held, attached or loading; part of the attach's time no load accounts for.
        self.waited_s = waited_s
        # How the bytes are mapped: "file" (the checkpoint files' page cache, on CPU),
        # "memfd" (a sealed copy, on CPU) or "cuda_vmm".
        self.arena_kind = arena_kind
        self._tensors = tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def __repr__(self) -> str:
        return f"AttachedModel({self.name!r}, lease={self.lease}, tensors={len(self)}, device={self.device!r})"


def attached_model(name: str, reply: AttachReply) -> AttachedModel:
    """A parsed attach reply (its fds taken, as by :func:`map_arena` and :func:`map_files`)
    -> the model's tensors. The lease stays the caller's to end."""
    arena = reply.arena
    if isinstance(arena, FileArenaDesc):
        tensors = file_tensor_views(map_files(arena, reply.fds), arena, reply.tensors)
    else:
        tensors = tensor_views(map_arena(arena, reply.fds), reply.tensors)
    return AttachedModel(name, reply.lease, reply.fingerprint, reply.device, tensors,
                         source=reply.source, arena_kind=arena.kind, waited_s=reply.waited_s)
