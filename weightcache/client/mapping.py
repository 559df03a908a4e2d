"""Turn the fds and tensor table of an attach reply into torch tensors, zero-copy, and
hand them out as an :class:`AttachedModel`. This is where the client needs torch: connection.py
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

The lease is owned by the same objects that own the mapping: ``attached_model`` hands
the :class:`Lease` the mapped objects (the ``mmap`` of each memfd or file, the
``VmmMapping`` of a GPU range), and the lease ends when the last of them is collected, that is when no tensor view of them is left, or earlier at the
attach block's exit or the connection's end. So an attach whose context manager was
dropped unexited (``w = c.attach("m").__enter__()``) holds its lease, seen in ``ps``
and counted in the budget, for exactly as long as the engine can read ``w``; the lease
keeps its client's connection open meanwhile. A tensor copied out (``.clone()``,
``.to(device)``) does not hold it.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import stat
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from ..errors import BadRequest
from ..protocol.arena import AttachReply, FileArenaDesc, MemfdArenaDesc, VmmArenaDesc
from .core import ClientCore, close_fds

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}


def _contiguous_strides(shape: list[int]) -> list[int] | tuple[int, ...]:
    """The strides of a C-contiguous tensor of ``shape``, in elements."""
    n = len(shape)
    if n == 2:  # most of a model's tensors
        return (shape[1], 1)
    if n == 1:
        return (1,)
    strides = [1] * n
    for i in range(n - 1, 0, -1):
        strides[i - 1] = strides[i] * shape[i]
    return strides


class _Dtypes(dict[str, tuple[torch.dtype, int, dict[int, torch.Tensor]]]):
    """dtype name -> (dtype, itemsize, {file index: that file's slab viewed as dtype}),
    for one tensor table, looked up per tensor by the name alone. It replaced a cache keyed
    by a tuple (dtype name, *shape) built per tensor, plus a (file, dtype) tuple per tensor
    for the base: with those, 200 rows of a file arena took 1.03-1.11 ms p50 warm, now
    0.68-0.76, of which the 200 ``as_strided`` alone are 0.48-0.65 (2-core VM)."""

    def __missing__(self, name: str) -> tuple[torch.dtype, int, dict[int, torch.Tensor]]:
        dtype = TORCH_DTYPES.get(name)
        if dtype is None:
            raise BadRequest(f"unknown dtype {name!r} in the tensor table"[:200])
        value = self[name] = (dtype, dtype.itemsize, {})
        return value


def _typed(slab: torch.Tensor, dtype: torch.dtype, itemsize: int) -> torch.Tensor:
    """``slab`` (uint8) viewed as ``dtype``, past its last whole element cut off."""
    size = slab.numel()
    return (slab if size % itemsize == 0 else slab[: size - size % itemsize]).view(dtype)


_views_prepared = False


def prepare_views() -> None:
    """Make torch's first calls of what :func:`map_memfd` and the views use (frombuffer,
    a dtype view, as_strided) on a scrap buffer, once per process. The attach calls it
    while the daemon answers (``while_waiting``): in a fresh engine on the 2-core VM this
    took 0.28 ms and made the real mapping and first view 0.30 -> 0.09 ms (p50 of 9),
    work that then falls in a wait rather than after it."""
    global _views_prepared
    if _views_prepared:
        return
    _views_prepared = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # as map_memfd does (its read-only mmap makes torch warn)
        scrap = torch.frombuffer(bytearray(8), dtype=torch.uint8)
    scrap.view(torch.bfloat16).as_strided((2, 1), (1, 1), 0)


def prepare_attach(gpu: bool = True) -> None:
    """What an attach does while the daemon answers it (``while_waiting``): torch's
    first view calls (:func:`prepare_views`), and for an attach that may be a GPU's
    (``gpu``: any device but "cpu" asked for, or none) in an engine with CUDA up, the thread that
    will set the range's access (cuda_mapping.py's Note [views while access is set])."""
    if gpu and torch.cuda.is_initialized():
        from .cuda_mapping import start_spare

        start_spare()
    prepare_views()


def map_memfd(fd: int, nbytes: int, owners: list[object] | None = None) -> torch.Tensor:
    """Map a sealed memfd (or a file) read-only and wrap it as a uint8 tensor (closes ``fd``).
    The ``mmap``, which the tensor's storage keeps alive, is appended to ``owners``."""
    try:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    if owners is not None:
        owners.append(mapping)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point. A write through
        # these tensors faults (SIGSEGV) in this process; the daemon's bytes are sealed.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


def map_files(arena: FileArenaDesc, fds: list[int], owners: list[object] | None = None) -> list[torch.Tensor]:
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
            slabs.append(map_memfd(fd, size, owners))
    finally:
        close_fds(pending)
    return slabs


def file_tensor_views(slabs: list[torch.Tensor], arena: FileArenaDesc, table: Iterable[list[Any]]) -> dict[str, torch.Tensor]:
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
    dtypes = _Dtypes()
    f = fo = ao = 0
    seg_end = -1  # the segment found last (rows come in offset order): [ao, seg_end) -> file f at fo
    for name, dtype_name, shape, offset, nbytes in table:
        dtype, itemsize, bases = dtypes[dtype_name]
        if not nbytes:
            at, fi, end = 0, 0, offset  # an empty tensor: any place will do
        else:
            if not ao <= offset < seg_end:
                i = bisect.bisect_right(starts, offset) - 1
                f, fo, ao, n = segs[i] if i >= 0 else (0, 0, 0, 0)
                seg_end = ao + n
            at, fi, end = fo + offset - ao, f, seg_end
        if math.prod(shape) * itemsize != nbytes or offset + nbytes > end or at < 0 or at % itemsize:
            raise BadRequest(f"tensor {name!r}: {dtype_name}{list(shape)} at offset {offset} ({nbytes} bytes) "
                             "lies in no segment of the file arena")
        base = bases.get(fi)
        if base is None:
            base = bases[fi] = _typed(slabs[fi], dtype, itemsize)
        out[name] = base.as_strided(shape, _contiguous_strides(shape), at // itemsize)
    return out


def _usable() -> None:
    """A memfd's mapping is readable as made: nothing to wait for."""


def map_arena(arena: MemfdArenaDesc | VmmArenaDesc, fds: list[int],
              owners: list[object] | None = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """A memfd or VMM arena + its fds -> one uint8 tensor over the whole arena, and the
    ``wait`` to call after making views of it and before anything reads them (a VMM
    range's access is set meanwhile: cuda_mapping.py's Note [views while access is
    set]). Takes the fds: each is closed exactly once, here or by the mapper it is handed
    to, whether this returns or raises (the mapping keeps the memory). The object that
    owns the mapping (kept alive by the slab's storage) is appended to ``owners``."""
    if isinstance(arena, VmmArenaDesc):
        from .cuda_mapping import map_vmm

        return map_vmm(arena, fds, read_only=not arena.writable, owners=owners)  # closes them
    if len(fds) != 1:
        close_fds(fds)
        raise BadRequest(f"memfd arena needs 1 fd, got {len(fds)}")
    return map_memfd(fds[0], arena.nbytes, owners), _usable  # closes it


def tensor_views(slab: torch.Tensor, table: Iterable[list[Any]]) -> dict[str, torch.Tensor]:
    """[name, dtype, shape, offset, nbytes] rows -> views of ``slab`` (no copies).

    One ``as_strided`` per tensor on a per-dtype view of the slab: slicing, then viewing
    as the dtype, then reshaping costs three tensor ops per tensor, and for a few hundred
    tensors that was most of an attach (1.1 vs 0.45 ms for 291 tensors on the CPU). The
    ``as_strided`` (a new tensor) is most of what is left; the Python
    around it is a dtype lookup by name (:class:`_Dtypes`) and the strides.
    """
    out = {}
    size = slab.numel()
    dtypes = _Dtypes()
    for name, dtype_name, shape, offset, nbytes in table:
        dtype, itemsize, bases = dtypes[dtype_name]
        if offset % itemsize or math.prod(shape) * itemsize != nbytes or offset + nbytes > size:
            raise BadRequest(f"tensor {name!r}: {dtype_name}{list(shape)} does not fit at offset {offset} "
                             f"({nbytes} bytes) of a {size}-byte arena")
        base = bases.get(0)
        if base is None:
            base = bases[0] = _typed(slab, dtype, itemsize)
        out[name] = base.as_strided(shape, _contiguous_strides(shape), offset // itemsize)
    return out


class LeaseConnection(Protocol):
    """What a :class:`Lease` needs of its connection (connection.py's ``ConnectionBase``)."""

    core: ClientCore

    def _lease_gone(self, lease: int, epoch: int) -> None: ...

    async def _end_lease(self, lease: int) -> None: ...


class Lease:
    """One attach's lease, owned by the memory it maps (Note [lifetime]).

    It ends once, at the first of: :meth:`end` (the attach block's exit), the last of
    its mappings collected (:meth:`own`: every tensor view of them gone), or the end of
    the connection that granted it (the daemon ends it then; nothing is sent). Until
    then it keeps its connection, and so the client, alive: a client or context manager
    dropped while its tensors are in use neither ends the lease nor closes the
    connection under them. A forked child's copies of the mappings end nothing: the
    lease, and the connection's stream, are the parent's."""

    __slots__ = ("_conn", "_epoch", "_left", "_lock", "_pid", "ended", "id")

    def __init__(self, lease_id: int, conn: LeaseConnection) -> None:
        self.id = lease_id
        self._conn = conn
        self._epoch = conn.core.epoch
        self._left: set[int] = set()  # the ids of the mappings still alive
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.ended = False

    def own(self, mappings: list[object]) -> None:
        """End the lease when the last of ``mappings`` (each an object that the tensors'
        storage keeps alive: an ``mmap``, a ``VmmMapping``) is collected."""
        for m in mappings:
            self._left.add(id(m))
            fin = weakref.finalize(m, self._mapping_gone, id(m))
            fin.atexit = False  # at exit the connection closes, and the daemon ends the lease with it

    def _mapping_gone(self, key: int) -> None:
        # From a finalizer: any thread, any moment (even inside this client's own calls).
        self._left.discard(key)
        if not self._left and os.getpid() == self._pid and self._take():
            self._conn._lease_gone(self.id, self._epoch)

    def _take(self) -> bool:
        """Whether this call ends the lease: it had not ended, and its connection is still up."""
        with self._lock:
            if self.ended:
                return False
            self.ended = True
        return self._conn.core.epoch == self._epoch and self._conn.core.connected

    async def end(self) -> None:
        """Detach now (the attach block's exit). A lease already ended, or of a connection
        that ended (Note [reconnecting] in core.py), sends nothing."""
        if self._take():
            await self._conn._end_lease(self.id)


class AttachedModel(Mapping[str, torch.Tensor]):
    """A read-only mapping of tensor name -> tensor, backed by the daemon's arena.

    >>> async with client.attach("qwen-7b") as m:   # doctest: +SKIP
    ...     logits = model_forward(m["lm_head.weight"], ...)
    """

    def __init__(self, name: str, lease: int, fingerprint: str, device: str, tensors: dict[str, torch.Tensor],
                 source: str = "resident", arena_kind: str | None = None, waited_s: float = 0.0,
                 owner: Lease | None = None) -> None:
        self.name = name
        self.lease = lease  # the lease's number in the daemon (``ps``)
        self._lease = owner  # the lease itself, owned by the mapping (Note [lifetime]); None if it is not the client's
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
        # The bytes the daemon's budget counts for it, as `models` and `ps` show them (the
        # arena, padded, and what the daemon holds for the checkpoint); None from a daemon
        # that does not say. ``nbytes`` is the tensors' own sum.
        self.budget_bytes: int | None = None
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


def attached_model(name: str, reply: AttachReply, lease: Lease | None = None) -> AttachedModel:
    """A parsed attach reply (its fds taken, as by :func:`map_arena` and :func:`map_files`)
    -> the model's tensors. ``lease``, if given, is then owned by the mapping (Note
    [lifetime]); if this raises, it stays the caller's to end."""
    arena = reply.arena
    owners: list[object] = []
    if isinstance(arena, FileArenaDesc):
        tensors = file_tensor_views(map_files(arena, reply.fds, owners), arena, reply.tensors)
    else:
        slab, wait = map_arena(arena, reply.fds, owners)
        try:
            tensors = tensor_views(slab, reply.tensors)
        finally:
            wait()  # no tensor leaves before the range is readable (and a failure to make it so is raised)
    if lease is not None:
        lease.own(owners)
    return AttachedModel(name, reply.lease, reply.fingerprint, reply.device, tensors,
                         source=reply.source, arena_kind=arena.kind, waited_s=reply.waited_s, owner=lease)
