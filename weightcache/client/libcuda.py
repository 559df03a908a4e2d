"""The CUDA driver calls an engine's attach (and publish) makes, through ``ctypes`` on libcuda.so.1.

The daemon uses cuda-bindings (weightcache/cuda_driver.py); the client does not, because
an engine pays for every import on its restart path: ``import cuda.bindings.driver``
took 15.5-16 ms in a fresh engine process on the H200, and its first call
resolves its whole table of driver entry points. This module imports only ``ctypes``
(which torch has imported already), loads the library at the first GPU attach (an engine
with CUDA initialised has it loaded: dlopen then only finds it), and looks up the 21
symbols it uses, once: an attach's imports and maps, and publish's allocations and
exports (client/publish.py; cuda_driver.py did those before, and the client imported
cuda-bindings for them).

Note [symbols]
--------------
cuda.h maps some API names to versioned symbols (``#define cuCtxPushCurrent
cuCtxPushCurrent_v2``); ctypes sees the library's symbols, so those are the names used
here: ``cuCtxPushCurrent_v2``, ``cuCtxPopCurrent_v2``, and ``cuDeviceGetUuid_v2`` where
the driver has it (11.4+; ``cuDeviceGetUuid`` before). The VMM calls
(``cuMemAddressReserve``, ``cuMemMap``, ``cuMemImportFromShareableHandle``, ``cuMemCreate``,
``cuMemExportToShareableHandle``, ``cuMemGetAllocationGranularity``, ...),
``cuDevicePrimaryCtxRetain`` and ``cuCtxSynchronize`` have no versioned symbol. Types as
in cuda.h on 64-bit Linux: CUresult, CUdevice and the enums are ``int``; CUdeviceptr and
CUmemGenericAllocationHandle are ``unsigned long long``; CUcontext is a pointer. A POSIX
fd is passed to cuMemImportFromShareableHandle as the pointer *value*
``(void *)(uintptr_t)fd``, not as a pointer to an int; cuMemExportToShareableHandle
writes one through an ``int *``. ``CUmemAllocationProp`` is cuda.h's 32-byte struct
(type, requested handle types, location, a Windows-only pointer, the allocFlags bytes).

Note [no ctypes types]
----------------------
No ``ctypes.Structure`` and no ``ctypes.POINTER`` type is made here: each is a new class,
and the five structs and eight pointer types this module made cost a fresh engine ~0.2
ms of its ~0.4 ms import (2-core VM), inside the span from the import to
usable tensors. Every pointer parameter is declared ``void *`` (``ctypes.c_void_p``
takes ``byref`` of a scalar, a ``create_string_buffer`` and ``bytes``), the structs the
driver reads (CUmemAccessDesc, CUmemAllocationProp) are ``struct``-packed bytes, and the
one it writes (CUuuid) is a 16-byte buffer. Their layouts are checked against a C
compiler's reading of cuda.h's declarations (tests/test_client_libcuda.py).

Every CUresult is checked: a failure raises :class:`CudaError` naming the call and the
driver's name and text for the result (cuGetErrorName / cuGetErrorString). A library
that cannot be loaded raises :class:`DriverNotFound`. ``$WEIGHTCACHE_LIBCUDA`` names
another library (a driver outside the loader's path; the tests' stand-in).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import WeightcacheError

LIBRARY = "libcuda.so.1"
LIBRARY_ENV = "WEIGHTCACHE_LIBCUDA"

CUDA_SUCCESS = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3

_CUresult = ctypes.c_int
_CUdevice = ctypes.c_int
_CUcontext = ctypes.c_void_p
_CUdeviceptr = ctypes.c_ulonglong
_CUhandle = ctypes.c_ulonglong  # CUmemGenericAllocationHandle
_size_t = ctypes.c_size_t
# Every pointer parameter is a void *, and the two structs the calls read are packed with
# ``struct`` (Note [no ctypes types]).
_ptr = ctypes.c_void_p
# CUmemAccessDesc: CUmemLocation {CUmemLocationType type; int id;}, CUmemAccess_flags flags.
ACCESS_DESC = struct.Struct("=iii")
# CUmemAllocationProp: CUmemAllocationType type; CUmemAllocationHandleType requestedHandleTypes;
# CUmemLocation location; void *win32HandleMetaData; struct {unsigned char compressionType,
# gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4];} allocFlags: 32 bytes,
# zero but for the type, the handle type and the location, as cuda.h's users memset it.
ALLOCATION_PROP = struct.Struct("=iiiiQBBH4x")
UUID_BYTES = 16  # CUuuid {char bytes[16];}

# name -> (argtypes); every one returns CUresult. The names are the library's symbols (Note [symbols]).
_SIGNATURES: dict[str, list[Any]] = {
    "cuGetErrorName": [_CUresult, _ptr],
    "cuGetErrorString": [_CUresult, _ptr],
    "cuInit": [ctypes.c_uint],
    "cuDriverGetVersion": [_ptr],
    "cuDeviceGetCount": [_ptr],
    "cuDeviceGet": [_ptr, ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_ptr, _CUdevice],
    "cuCtxPushCurrent_v2": [_CUcontext],
    "cuCtxPopCurrent_v2": [_ptr],
    "cuCtxSynchronize": [],
    "cuMemImportFromShareableHandle": [_ptr, ctypes.c_void_p, ctypes.c_int],
    "cuMemAddressReserve": [_ptr, _size_t, _size_t, _CUdeviceptr, ctypes.c_ulonglong],
    "cuMemMap": [_CUdeviceptr, _size_t, _size_t, _CUhandle, ctypes.c_ulonglong],
    "cuMemSetAccess": [_CUdeviceptr, _size_t, _ptr, _size_t],
    "cuMemUnmap": [_CUdeviceptr, _size_t],
    "cuMemAddressFree": [_CUdeviceptr, _size_t],
    "cuMemRelease": [_CUhandle],
    # publish's own memory (client/publish.py): allocate, export
    "cuMemGetAllocationGranularity": [_ptr, _ptr, ctypes.c_int],
    "cuMemCreate": [_ptr, _size_t, _ptr, ctypes.c_ulonglong],
    "cuMemExportToShareableHandle": [ctypes.c_void_p, _CUhandle, ctypes.c_int, ctypes.c_ulonglong],
}
_UUID_SYMBOLS = ("cuDeviceGetUuid_v2", "cuDeviceGetUuid")  # the first the library has
_UUID_ARGTYPES = [_ptr, _CUdevice]


class CudaError(WeightcacheError):
    """A CUDA driver call made by the client failed, or the driver is missing.
    ``details``: ``call`` (the driver function) and ``result`` (its CUresult name) for a
    failed call; ``device`` for a GPU this process cannot see."""

    code = "INTERNAL"


class DriverNotFound(CudaError):
    """libcuda.so.1 (or ``$WEIGHTCACHE_LIBCUDA``) cannot be loaded, or is not a CUDA driver
    this client can use. ``details["library"]`` names what was tried."""


class Driver:
    """One loaded libcuda: its functions with their ctypes signatures, and what this
    process looked up once (device UUIDs, primary contexts). Get it with :func:`driver`."""

    def __init__(self, lib: ctypes.CDLL, library: str) -> None:
        self.library = library
        self._fn: dict[str, Any] = {}
        missing = [name for name in (*_SIGNATURES, _UUID_SYMBOLS[-1]) if not hasattr(lib, name)]
        if missing:
            raise DriverNotFound(f"{library} has no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: it is not a "
                                 "CUDA driver, or one too old for VMM attach (CUDA 10.2+ driver needed)", library=library)
        for name, argtypes in _SIGNATURES.items():
            self._fn[name] = _bind(lib, name, argtypes)
        uuid_name = next(n for n in _UUID_SYMBOLS if hasattr(lib, n))  # _v2 where the driver has it
        self._fn["uuid"] = _bind(lib, uuid_name, _UUID_ARGTYPES)
        self._lock = threading.Lock()
        self._uuids: list[str] | None = None  # by ordinal, as this process numbers the GPUs
        self._contexts: dict[int, int] = {}
        self.check(self._fn["cuInit"](0), "cuInit")  # cheap once torch (or anyone) has initialised CUDA

    # -- errors -------------------------------------------------------------------------
    def error_name(self, result: int) -> tuple[str, str]:
        """The driver's name and text for a CUresult (``"CUresult 999"`` if it has none)."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self._fn["cuGetErrorName"](result, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUresult {result}", "unknown error"
        if self._fn["cuGetErrorString"](result, ctypes.byref(text)) != CUDA_SUCCESS or not text.value:
            return name.value.decode(errors="replace"), ""
        return name.value.decode(errors="replace"), text.value.decode(errors="replace")

    def check(self, result: int, call: str) -> None:
        """Raise CudaError if ``result`` (what ``call`` returned) is not CUDA_SUCCESS."""
        if result != CUDA_SUCCESS:
            name, text = self.error_name(result)
            raise CudaError(f"CUDA driver call {call} failed: {name}" + (f" ({text})" if text else ""), call=call, result=name)

    def _call(self, name: str, *args: Any) -> None:
        self.check(self._fn[name](*args), name)

    # -- devices ------------------------------------------------------------------------
    def version(self) -> int:
        """The driver's CUDA version, e.g. 12040 for 12.4."""
        v = ctypes.c_int()
        self._call("cuDriverGetVersion", ctypes.byref(v))
        return v.value

    def device_uuids(self) -> list[str]:
        """Every visible GPU's UUID (``GPU-xxxxxxxx-xxxx-...``, as nvidia-smi prints it), by
        this process's ordinal. Looked up once: CUDA_VISIBLE_DEVICES cannot change after
        the driver is initialised."""
        with self._lock:
            if self._uuids is None:
                count = ctypes.c_int()
                self._call("cuDeviceGetCount", ctypes.byref(count))
                uuids = []
                for ordinal in range(count.value):
                    dev, raw = _CUdevice(), ctypes.create_string_buffer(UUID_BYTES)
                    self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
                    self.check(self._fn["uuid"](raw, dev), "cuDeviceGetUuid")
                    h = raw.raw.hex()  # .raw, not .value: .value ends at the first NUL
                    uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}")
                self._uuids = uuids
            return self._uuids

    def device_uuid(self, ordinal: int) -> str:
        """The UUID of ``cuda:<ordinal>`` in this process's numbering: what names it on the wire."""
        uuids = self.device_uuids()
        if not 0 <= ordinal < len(uuids):
            raise CudaError(f"cuda:{ordinal}: this process sees {len(uuids)} CUDA device(s)", device=f"cuda:{ordinal}")
        return uuids[ordinal]

    def ordinal_of(self, uuid: str) -> int:
        """This process's ordinal for the GPU named ``GPU-<uuid>``."""
        uuids = [u.lower() for u in self.device_uuids()]
        try:
            return uuids.index(uuid.lower())
        except ValueError:
            raise CudaError(f"cuda:{uuid}: no CUDA device this process can see has that UUID (check CUDA_VISIBLE_DEVICES; "
                            f"visible: {self.device_uuids()})", device=f"cuda:{uuid}") from None

    def primary_context(self, ordinal: int) -> int:
        """The device's primary context (the one torch uses), retained once per process."""
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev, handle = _CUdevice(), _CUcontext()
                self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), dev)
                ctx = self._contexts[ordinal] = int(handle.value or 0)
            return ctx

    @contextlib.contextmanager
    def current(self, ctx: int) -> Iterator[None]:
        """``ctx`` current on this thread for the block (push/pop: calls come from the event
        loop's thread, the sync client's, and finalizers)."""
        self._call("cuCtxPushCurrent_v2", ctx)
        try:
            yield
        finally:
            popped = _CUcontext()
            self._call("cuCtxPopCurrent_v2", ctypes.byref(popped))

    # -- VMM ----------------------------------------------------------------------------
    def import_and_map(self, fds: list[int], sizes: list[int]) -> int:
        """Import one VMM allocation per fd and map them back to back in one reserved range;
        return the range's base address. No access is set yet: :meth:`set_access` does
        that, and until then nothing may read the range (cuda_mapping.py's Note [views
        while access is set]). Needs a current context (:meth:`current`). The fds stay the
        caller's to close; the imported handles are released here (the mapping keeps the
        memory). On failure everything done so far is undone."""
        if len(fds) != len(sizes):
            raise CudaError(f"{len(fds)} fds for {len(sizes)} chunks")
        handles: list[int] = []
        try:
            for fd in fds:
                h = _CUhandle()
                self._call("cuMemImportFromShareableHandle", ctypes.byref(h), fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                handles.append(h.value)
            return self._map(handles, sizes)
        finally:
            for h_value in handles:
                self._fn["cuMemRelease"](h_value)

    def set_access(self, va: int, total: int, ordinal: int, *, read_only: bool) -> None:
        """Let device ``ordinal`` read (or read and write) the mapped range ``[va, va +
        total)``. Needs a current context. Most of an attach's driver time: 0.59 of 0.87 ms
        for 10 chunks of 9.15 GiB on an H100."""
        desc = ACCESS_DESC.pack(CU_MEM_LOCATION_TYPE_DEVICE, ordinal,
                                CU_MEM_ACCESS_FLAGS_PROT_READ if read_only else CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self._call("cuMemSetAccess", va, total, desc, 1)

    def granularity(self, ordinal: int) -> int:
        """The recommended granularity of an exportable allocation on ``ordinal``."""
        g = _size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(g), _exportable(ordinal),
                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return g.value

    def create_exported(self, sizes: list[int], ordinal: int) -> tuple[int, list[int]]:
        """Allocate one chunk per size on ``ordinal`` (exportable as POSIX fds; sizes that
        are multiples of :meth:`granularity`), map them back to back read-write in one
        reserved range, and export each as an fd: ``(base address, fds)``, the fds the
        caller's to close. Needs a current context. The handles are released here (the
        mapping and the fds keep the memory). On failure everything done so far is undone."""
        prop = _exportable(ordinal)
        handles: list[int] = []
        fds: list[int] = []
        try:
            for size in sizes:
                h = _CUhandle()
                self._call("cuMemCreate", ctypes.byref(h), size, prop, 0)
                handles.append(h.value)
            va = self._map(handles, sizes)
            try:
                self.set_access(va, sum(sizes), ordinal, read_only=False)
                for h_value in handles:
                    fd = ctypes.c_int(-1)
                    self._call("cuMemExportToShareableHandle", ctypes.byref(fd), h_value,
                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
                    fds.append(fd.value)
            except BaseException:
                for fd_value in fds:
                    os.close(fd_value)
                self._fn["cuMemUnmap"](va, sum(sizes))  # best effort: the first error is the one to report
                self._fn["cuMemAddressFree"](va, sum(sizes))
                raise
        finally:
            for h_value in handles:
                self._fn["cuMemRelease"](h_value)
        return va, fds

    def _map(self, handles: list[int], sizes: list[int]) -> int:
        """Reserve one range and map the handles back to back; the base address. On
        failure the range is unmapped and freed (the handles stay the caller's)."""
        total = sum(sizes)
        base = _CUdeviceptr()
        self._call("cuMemAddressReserve", ctypes.byref(base), total, 0, 0, 0)
        va, mapped = base.value, 0
        try:
            for h_value, size in zip(handles, sizes, strict=True):
                self._call("cuMemMap", va + mapped, size, 0, h_value, 0)
                mapped += size
        except BaseException:
            if mapped:
                self._fn["cuMemUnmap"](va, mapped)  # best effort: the first error is the one to report
            self._fn["cuMemAddressFree"](va, total)
            raise
        return va

    def unmap(self, va: int, total: int) -> None:
        """Synchronize the current context, then unmap and free the range (needs a current
        context): no kernel still reads it when it goes."""
        self._call("cuCtxSynchronize")
        self._call("cuMemUnmap", va, total)
        self._call("cuMemAddressFree", va, total)


def _exportable(ordinal: int) -> bytes:
    """What the daemon's arenas are too, as a CUmemAllocationProp: pinned device memory on
    ``ordinal`` that can be exported as a POSIX fd."""
    return ALLOCATION_PROP.pack(CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                CU_MEM_LOCATION_TYPE_DEVICE, ordinal, 0, 0, 0, 0)


def _bind(lib: ctypes.CDLL, name: str, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name)
    fn.restype = _CUresult
    fn.argtypes = argtypes
    return fn


def load(library: str | None = None) -> Driver:
    """Load ``library`` (default ``$WEIGHTCACHE_LIBCUDA``, else libcuda.so.1), bind the
    calls and ``cuInit``. Not cached: :func:`driver` is the one to call."""
    library = library or os.environ.get(LIBRARY_ENV) or LIBRARY
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        raise DriverNotFound(f"cannot load the CUDA driver library {library} ({exc}): attaching a GPU model needs the NVIDIA "
                             f"driver in this process's environment (in a container: the GPU runtime's driver mounts; "
                             f"${LIBRARY_ENV} names the library if it is outside the loader's path)", library=library) from None
    return Driver(lib, library)


_driver: Driver | None = None
_load_lock = threading.Lock()


def driver() -> Driver:
    """The process's driver, loaded at the first call; a failure is raised each time and
    not remembered."""
    global _driver
    d = _driver
    if d is None:
        with _load_lock:
            if _driver is None:
                _driver = load()
            d = _driver
    return d
