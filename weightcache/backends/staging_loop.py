"""The ctypes binding of the CUDA writer's chunk loop in C (staging_loop.c; why it is C:
cuda_writer.py, Note [the chunk loop in C]). Imports nothing of CUDA: the C side
dlopens the driver, and a host without one learns so from ``load_chunk_loop``."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..errors import CorruptCheckpoint

LOOP_SLOT = 2 << 20  # bytes a slot of the C loop (Note [the chunk loop in C])
LOOP_SLOTS = 3  # slots in flight a thread
MAX_SLOTS = 16  # staging_loop.c's WC_MAX_SLOTS
MAX_HASH_STREAMS = 8  # staging_loop.c's WC_MAX_HASH_STREAMS
_SHORT = -1000000  # staging_loop.c's WC_SHORT: the file ended first
MORE = -1000001  # WC_MORE: wc_stage_tasks spent its byte budget, tasks are left
NEED_ROOM = -1000002  # WC_NEED_ROOM: the task at *at ends past the arena's mapped bytes
STOPPED = -1000003  # WC_STOPPED: the table's stop is set (another thread's task failed)
_NO_DRIVER = 999999  # staging_loop.c's WC_NO_DRIVER


class Ring(ctypes.Structure):
    """staging_loop.c's wc_ring: one thread's slots in its staging buffer."""

    _fields_ = [("stream", ctypes.c_void_p), ("events", ctypes.c_void_p * MAX_SLOTS),
                ("busy", ctypes.c_int * MAX_SLOTS), ("next", ctypes.c_int), ("nslots", ctypes.c_int),
                ("slot_bytes", ctypes.c_size_t), ("buf", ctypes.c_void_p),
                ("copied", ctypes.c_void_p), ("hash_streams", ctypes.c_void_p * MAX_HASH_STREAMS),
                ("nhash", ctypes.c_int), ("next_hash", ctypes.c_int)]


class Tasks(ctypes.Structure):
    """staging_loop.c's wc_tasks: a load's tasks, which its loader threads claim in turn."""

    _fields_ = [("ntasks", ctypes.c_longlong), ("next", ctypes.c_longlong), ("stop", ctypes.c_int),
                ("mapped", ctypes.c_ulonglong), ("base", ctypes.c_ulonglong),
                ("fd", ctypes.POINTER(ctypes.c_int)), ("file_offset", ctypes.POINTER(ctypes.c_longlong)),
                ("arena_offset", ctypes.POINTER(ctypes.c_ulonglong)), ("nbytes", ctypes.POINTER(ctypes.c_ulonglong)),
                ("first_piece", ctypes.POINTER(ctypes.c_longlong)),
                ("piece_offset", ctypes.POINTER(ctypes.c_ulonglong)),
                ("piece_nbytes", ctypes.POINTER(ctypes.c_ulonglong)),
                ("piece_out", ctypes.POINTER(ctypes.c_ulonglong)), ("kernel", ctypes.c_void_p)]


def load_chunk_loop(path: Path | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """The C chunk loop (Note [the chunk loop in C]) built beside this file, or at
    ``path``; or None and why not."""
    if path is None:
        found = list(Path(__file__).parent.glob("_staging_loop*.so"))  # the install's, or `make native`'s
        if not found:
            return None, "not built (pip install builds it where a C compiler is found; `make native` in a checkout)"
        path = max(found, key=lambda p: p.stat().st_mtime)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"{path.name} does not load: {exc}"
    lib.wc_stage_abi.restype = ctypes.c_size_t
    if lib.wc_stage_abi() != ctypes.sizeof(Ring) * 4096 + ctypes.sizeof(Tasks):
        return None, f"{path.name} was built from another staging_loop.c (rebuild: pip install, or `make native`)"
    lib.wc_stage_copy.argtypes = [ctypes.POINTER(Ring), ctypes.c_int, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_size_t]
    lib.wc_stage_copy.restype = ctypes.c_int
    lib.wc_stage_tasks.argtypes = [ctypes.POINTER(Ring), ctypes.POINTER(Tasks), ctypes.c_longlong, ctypes.c_ulonglong,
                                   ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_longlong)]
    lib.wc_stage_tasks.restype = ctypes.c_int
    lib.wc_stage_init.restype = ctypes.c_int
    if not lib.wc_stage_init():
        return None, "libcuda.so.1 or its copy calls were not found"
    return lib, None


def loop_failed(code: int, what: str) -> Exception:
    if code == _SHORT:
        return CorruptCheckpoint(f"file ended while reading {what} (truncated?)", reason="truncated")
    if code < 0:
        return OSError(-code, os.strerror(-code), f"pread of {what}")
    from cuda.bindings import driver as cu  # a driver's failure: cuda-bindings is there

    from ..cuda_driver import CudaError

    if code == _NO_DRIVER:
        return CudaError("the chunk loop found no CUDA driver", result="CUDA_ERROR_NO_DEVICE")
    try:
        err, name = cu.cuGetErrorName(cu.CUresult(code))
        named = name.decode() if err == cu.CUresult.CUDA_SUCCESS and isinstance(name, bytes) else str(code)
    except ValueError:  # a code this cuda-bindings does not know
        named = str(code)
    return CudaError(f"CUDA driver call failed in the chunk loop: {named}", result=named)
