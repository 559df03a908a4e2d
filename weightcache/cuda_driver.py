"""Thin helpers over the CUDA driver API (``cuda-bindings``) for the daemon's VMM backend.
Imported only when a CUDA device is used. The client makes its driver calls (an attach's
imports, a publish's allocations) through ctypes instead (client/libcuda.py).

Note [contexts]
---------------
Everything runs in the device's *primary* context, the one torch uses, so a range the
client maps here is a valid pointer for torch in the same process. Calls are wrapped in
``current(ctx)`` (push/pop) because they come from many threads: the event loop's
executor, loader threads, the sync client's loop thread, and finalizers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from cuda.bindings import driver as cu

from .errors import WeightcacheError

FD_HANDLE = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class CudaError(WeightcacheError):
    """A driver call failed; ``details["result"]`` is the CUresult name."""

    code = "INTERNAL"


def check(res: Any) -> Any:
    """Unpack a cuda-bindings return tuple, raising CudaError on failure."""
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(err)
        raise CudaError(f"CUDA driver call failed: {name}", result=name)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


_init_lock = threading.Lock()
_initialized = False
_contexts: dict[int, Any] = {}


def init() -> None:
    global _initialized
    with _init_lock:
        if not _initialized:
            check(cu.cuInit(0))
            _initialized = True


def device_uuid(ordinal: int) -> str:
    """``GPU-xxxxxxxx-xxxx-...``, the form nvidia-smi prints: the same in every process,
    whatever CUDA_VISIBLE_DEVICES says, so it is what names a GPU on the wire."""
    init()
    dev = check(cu.cuDeviceGet(ordinal))
    get = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    raw = bytes(check(get(dev)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_count() -> int:
    init()
    return int(check(cu.cuDeviceGetCount()))


def ordinal_of(device: str) -> int:
    """This process's ordinal for ``cuda:N`` or ``cuda:GPU-<uuid>``."""
    ident = device.split(":", 1)[1]
    if ident.isdigit():
        n = int(ident)
        if n >= device_count():
            raise WeightcacheError(f"{device}: this process sees only {device_count()} CUDA device(s)", device=device)
        return n
    for n in range(device_count()):
        if device_uuid(n).lower() == ident.lower():
            return n
    raise WeightcacheError(f"{device}: no visible CUDA device has that UUID (check CUDA_VISIBLE_DEVICES)", device=device)


def primary_context(ordinal: int) -> Any:
    init()
    with _init_lock:
        if ordinal not in _contexts:
            _contexts[ordinal] = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(ordinal))))
        return _contexts[ordinal]


@contextlib.contextmanager
def current(ctx: Any) -> Iterator[None]:
    check(cu.cuCtxPushCurrent(ctx))
    try:
        yield
    finally:
        check(cu.cuCtxPopCurrent())


def total_memory(ordinal: int) -> int:
    init()
    return int(check(cu.cuDeviceTotalMem(check(cu.cuDeviceGet(ordinal)))))


def can_access_peer(ordinal: int, peer: int) -> bool:
    """Whether GPU ``ordinal`` can read GPU ``peer``'s memory directly (NVLink or PCIe P2P)."""
    init()
    return bool(check(cu.cuDeviceCanAccessPeer(check(cu.cuDeviceGet(ordinal)), check(cu.cuDeviceGet(peer)))))


def free_memory(ctx: Any) -> int:
    with current(ctx):
        free, _total = check(cu.cuMemGetInfo())
    return int(free)


def allocation_prop(ordinal: int) -> Any:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = FD_HANDLE
    return prop


def granularity(ordinal: int) -> int:
    init()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(check(cu.cuMemGetAllocationGranularity(allocation_prop(ordinal), flag)))


def map_chunks(handles: list[Any], sizes: list[int], ordinal: int, *, read_only: bool) -> int:
    """Reserve one VA range, map the chunks back to back, set access. Returns the base
    address. On failure everything done so far is undone. Needs a current context."""
    total = sum(sizes)
    va = int(check(cu.cuMemAddressReserve(total, 0, 0, 0)))
    mapped = 0
    try:
        for h, s in zip(handles, sizes, strict=True):
            check(cu.cuMemMap(va + mapped, s, 0, h, 0))
            mapped += s
        set_access(va, total, ordinal, read_only=read_only)
    except BaseException:
        if mapped:
            cu.cuMemUnmap(va, mapped)
        cu.cuMemAddressFree(va, total)
        raise
    return va


def set_access(va: int, total: int, ordinal: int, *, read_only: bool) -> None:
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ if read_only
                  else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    check(cu.cuMemSetAccess(va, total, [desc], 1))


def unmap(va: int, total: int) -> None:
    """Synchronize, then unmap and free the VA range (needs a current context)."""
    check(cu.cuCtxSynchronize())
    check(cu.cuMemUnmap(va, total))
    check(cu.cuMemAddressFree(va, total))
