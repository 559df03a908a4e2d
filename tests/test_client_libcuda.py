"""The client's ctypes binding to the CUDA driver (weightcache/client/libcuda.py), without a GPU.

Three ways in:

- the real loader pointed at libraries that are not a driver (a missing file, libc):
  the errors an engine without the NVIDIA driver sees;
- a stand-in libcuda compiled here from C (skipped without a C compiler) that declares
  every function with cuda.h's own types, records the arguments it receives and fails
  on request: it checks what no GPU-less test otherwise could, that the ctypes
  signatures and struct layouts put the right bytes where the driver reads them, and
  that failures are named and undone;
- an attach of a GPU arena from a stand-in daemon with the driver missing: a clear
  error, every fd closed, the lease given back.
"""

from __future__ import annotations

import array
import ctypes
import gc
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import is_open

from weightcache import Client
from weightcache.client import cuda_mapping, libcuda
from weightcache.client.libcuda import CudaError, DriverNotFound
from weightcache.protocol import FrameDecoder, decode_payload, encode_frame
from weightcache.protocol.arena import AttachReply, VmmArenaDesc

MIB = 2**20

# A stand-in for libcuda.so.1: cuda.h's types and prototypes for the calls the client
# makes, each appending what it received to a log and returning CUDA_SUCCESS unless
# fake_fail() named it (then it returns the given CUresult on the n-th call).
FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stddef.h>
#include <fcntl.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUuuid_st { char bytes[16]; } CUuuid;
typedef enum { CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1, CU_MEM_HANDLE_TYPE_MAX_ = 0x7FFFFFFF } CUmemAllocationHandleType;
typedef enum { CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_LOCATION_TYPE_MAX_ = 0x7FFFFFFF } CUmemLocationType;
typedef enum { CU_MEM_ACCESS_FLAGS_PROT_READ = 1, CU_MEM_ACCESS_FLAGS_PROT_MAX_ = 0x7FFFFFFF } CUmemAccess_flags;
typedef struct CUmemLocation_st { CUmemLocationType type; int id; } CUmemLocation;
typedef struct CUmemAccessDesc_st { CUmemLocation location; CUmemAccess_flags flags; } CUmemAccessDesc;
typedef enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1, CU_MEM_ALLOCATION_TYPE_MAX_ = 0x7FFFFFFF } CUmemAllocationType;
typedef enum { CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1, CU_MEM_ALLOC_GRANULARITY_MAX_ = 0x7FFFFFFF } CUmemAllocationGranularity_flags;
typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType; unsigned char gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;

static char log_buf[1 << 16];
static size_t log_len;
static char fail_name[64];
static int fail_result, fail_on, calls;
static CUcontext current;

#define LOG(...) (log_len += snprintf(log_buf + log_len, sizeof log_buf - log_len, __VA_ARGS__))

const char *fake_log(void) { return log_buf; }
static unsigned long long created;
void fake_reset(void) { log_len = 0; log_buf[0] = 0; fail_name[0] = 0; calls = 0; created = 0; }
void fake_fail(const char *name, int result, int on_call) {
    snprintf(fail_name, sizeof fail_name, "%s", name); fail_result = result; fail_on = on_call; calls = 0;
}
static CUresult outcome(const char *name) {
    if (fail_name[0] && strcmp(name, fail_name) == 0 && ++calls == fail_on) { LOG("FAIL %s\n", name); return fail_result; }
    return 0;
}

CUresult cuGetErrorName(CUresult e, const char **s) {
    switch (e) {
    case 1: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
    case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
    case 4: *s = "CUDA_ERROR_DEINITIALIZED"; return 0;
    case 100: *s = "CUDA_ERROR_NO_DEVICE"; return 0;
    default: *s = NULL; return 1;
    }
}
CUresult cuGetErrorString(CUresult e, const char **s) {
    switch (e) {
    case 1: *s = "invalid argument"; return 0;
    case 2: *s = "out of memory"; return 0;
    case 4: *s = "driver shutting down"; return 0;
    case 100: *s = "no CUDA-capable device is detected"; return 0;
    default: *s = NULL; return 1;
    }
}
CUresult cuInit(unsigned int flags) { LOG("cuInit %u\n", flags); return outcome("cuInit"); }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGetCount(int *n) { LOG("cuDeviceGetCount\n"); *n = 2; return outcome("cuDeviceGetCount"); }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal > 1) return 101;
    *d = 10 + ordinal; return 0;
}
#ifndef NO_UUID_V2
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) {
    LOG("cuDeviceGetUuid_v2 %d\n", d);
    for (int i = 0; i < 16; i++) u->bytes[i] = (char)(i == 0 ? 0 : 0xa0 + i + 16 * (d - 10));  /* a NUL first */
    return 0;
}
#endif
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
    LOG("cuDeviceGetUuid %d\n", d);
    for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0x10 * (d - 10) + i);
    return 0;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    LOG("retain %d\n", d); *c = (CUcontext)(uintptr_t)(0xc0de0000 + d); return 0;
}
CUresult cuCtxPushCurrent_v2(CUcontext c) { LOG("push %#lx\n", (unsigned long)(uintptr_t)c); current = c; return 0; }
CUresult cuCtxPopCurrent_v2(CUcontext *c) { LOG("pop\n"); *c = current; current = NULL; return 0; }
CUresult cuCtxSynchronize(void) { LOG("sync\n"); return outcome("cuCtxSynchronize"); }
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, CUmemAllocationHandleType t) {
    int fd = (int)(intptr_t)os;
    LOG("import fd=%d type=%d\n", fd, (int)t);
    CUresult r = outcome("cuMemImportFromShareableHandle");
    if (!r) *h = 0xabc000000000ULL + (unsigned long long)fd;
    return r;
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    LOG("reserve size=%zu align=%zu addr=%llu flags=%llu\n", size, align, addr, flags);
    CUresult r = outcome("cuMemAddressReserve");
    if (!r) *p = 0x7f0000000000ULL;
    return r;
}
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h, unsigned long long flags) {
    LOG("map %#llx size=%zu off=%zu handle=%#llx flags=%llu\n", p, size, off, h, flags);
    return outcome("cuMemMap");
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *d, size_t n) {
    LOG("access %#llx size=%zu type=%d id=%d flags=%d count=%zu\n", p, size, (int)d->location.type, d->location.id, (int)d->flags, n);
    return outcome("cuMemSetAccess");
}
CUresult cuMemUnmap(CUdeviceptr p, size_t size) { LOG("unmap %#llx size=%zu\n", p, size); return outcome("cuMemUnmap"); }
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) { LOG("free %#llx size=%zu\n", p, size); return 0; }
CUresult cuMemRelease(CUmemGenericAllocationHandle h) { LOG("release %#llx\n", h); return 0; }
static void log_prop(const char *what, const CUmemAllocationProp *p) {
    LOG("%s type=%d handles=%d loc=%d id=%d win32=%p flags=%d,%d,%d size=%zu\n", what, (int)p->type, (int)p->requestedHandleTypes,
        (int)p->location.type, p->location.id, p->win32HandleMetaData, p->allocFlags.compressionType,
        p->allocFlags.gpuDirectRDMACapable, p->allocFlags.usage, sizeof *p);
}
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, CUmemAllocationGranularity_flags option) {
    log_prop("granularity", p); LOG("option=%d\n", (int)option);
    *g = 2 << 20; return outcome("cuMemGetAllocationGranularity");
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *p, unsigned long long flags) {
    log_prop("create", p); LOG("size=%zu flags=%llu\n", size, flags);
    CUresult r = outcome("cuMemCreate");
    if (!r) *h = 0xdef000000000ULL + created++;
    return r;
}
/* What a C compiler makes of cuda.h's structs, for the client's packed copies of them. */
void fake_layout(size_t *o) {
    o[0] = sizeof(CUmemAccessDesc); o[1] = offsetof(CUmemAccessDesc, location.id); o[2] = offsetof(CUmemAccessDesc, flags);
    o[3] = sizeof(CUmemAllocationProp); o[4] = offsetof(CUmemAllocationProp, location);
    o[5] = offsetof(CUmemAllocationProp, win32HandleMetaData); o[6] = offsetof(CUmemAllocationProp, allocFlags);
    o[7] = offsetof(CUmemAllocationProp, allocFlags.usage); o[8] = sizeof(CUuuid);
}
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, CUmemAllocationHandleType t, unsigned long long flags) {
    LOG("export %#llx type=%d flags=%llu\n", h, (int)t, flags);
    CUresult r = outcome("cuMemExportToShareableHandle");
    if (!r) *(int *)out = open("/dev/null", O_RDONLY | O_CLOEXEC);  /* a real fd: the caller must close it */
    return r;
}
"""

VA = 0x7F0000000000


def build(tmp: Path, name: str, *defines: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler for the stand-in libcuda")
    src = tmp / "fake_libcuda.c"
    src.write_text(FAKE_LIBCUDA)
    out = tmp / name
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", *defines, "-o", str(out), str(src)], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("libcuda"), "libcuda-fake.so.1")


class Fake:
    """The stand-in library, loaded twice: as the client loads it (``drv``) and as the
    test drives it (its log and its failures)."""

    def __init__(self, path: Path) -> None:
        self.ctl = ctypes.CDLL(str(path))
        self.ctl.fake_log.restype = ctypes.c_char_p
        self.ctl.fake_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        self.ctl.fake_reset()
        self.drv = libcuda.load(str(path))

    def log(self) -> list[str]:
        return (self.ctl.fake_log() or b"").decode().splitlines()

    def fail(self, name: str, result: int, on_call: int = 1) -> None:
        self.ctl.fake_fail(name.encode(), result, on_call)

    def reset(self) -> None:
        self.ctl.fake_reset()


@pytest.fixture
def fake(fake_lib: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fake]:
    f = Fake(fake_lib)
    assert f.log() == ["cuInit 0"]
    f.reset()
    monkeypatch.setattr(libcuda, "_driver", f.drv)  # what driver() returns
    yield f
    f.reset()


def test_packed_structs_are_laid_out_as_a_c_compiler_reads_cuda_h(fake):
    # Note [no ctypes types]: the structs are struct-packed; the stand-in, compiled from
    # cuda.h's declarations, says where each field is.
    got = (ctypes.c_size_t * 9)()
    fake.ctl.fake_layout(got)
    desc, prop = libcuda.ACCESS_DESC, libcuda.ALLOCATION_PROP
    assert list(got) == [desc.size, struct.calcsize("=i"), struct.calcsize("=ii"),
                         prop.size, struct.calcsize("=ii"), struct.calcsize("=iiii"), struct.calcsize("=iiiiQ"),
                         struct.calcsize("=iiiiQBB"), libcuda.UUID_BYTES]
    assert (desc.size, prop.size) == (12, 32)


# -- no driver ----------------------------------------------------------------------------


def test_a_missing_driver_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "libcuda.so.1")
    with pytest.raises(DriverNotFound) as info:
        libcuda.load(missing)
    assert info.value.details["library"] == missing
    assert missing in info.value.message and "NVIDIA driver" in info.value.message and libcuda.LIBRARY_ENV in info.value.message
    assert isinstance(info.value, CudaError)


def test_the_env_var_names_the_library_and_a_failure_is_not_remembered(tmp_path, monkeypatch, fake_lib):
    monkeypatch.setattr(libcuda, "_driver", None)
    monkeypatch.setenv(libcuda.LIBRARY_ENV, str(tmp_path / "nowhere" / "libcuda.so.1"))
    for _ in range(2):
        with pytest.raises(DriverNotFound, match=r"nowhere/libcuda\.so\.1"):
            libcuda.driver()
    monkeypatch.setenv(libcuda.LIBRARY_ENV, str(fake_lib))  # then it is there: loaded, and kept
    d = libcuda.driver()
    assert d.library == str(fake_lib) and libcuda.driver() is d


def test_a_library_that_is_not_a_cuda_driver_is_refused():
    with pytest.raises(DriverNotFound, match=r"libc\.so\.6 has no cuGetErrorName, cuGetErrorString, cuInit \.\.\.: it is not a CUDA driver"):
        libcuda.load("libc.so.6")


# -- the calls, through the stand-in --------------------------------------------------------


def test_import_and_map_passes_what_cuda_h_declares(fake):
    drv = fake.drv
    ctx = drv.primary_context(1)
    with drv.current(ctx):
        va = drv.import_and_map([7, 9], [2 * MIB, 4 * MIB])
    assert va == VA
    assert fake.log() == [
        "retain 11",
        "push 0xc0de000b",
        "import fd=7 type=1", "import fd=9 type=1",  # the fd as the pointer's value, the POSIX-fd handle type
        f"reserve size={6 * MIB} align=0 addr=0 flags=0",
        f"map {VA:#x} size={2 * MIB} off=0 handle=0xabc000000007 flags=0",
        f"map {VA + 2 * MIB:#x} size={4 * MIB} off=0 handle=0xabc000000009 flags=0",
        "release 0xabc000000007", "release 0xabc000000009",  # the mapping keeps the memory
        "pop",  # no access yet: set_access sets it
    ]
    fake.reset()
    assert drv.primary_context(1) == ctx and fake.log() == []  # retained once
    with drv.current(ctx):
        drv.set_access(va, 6 * MIB, 1, read_only=True)
        drv.set_access(va, 2 * MIB, 1, read_only=False)
        drv.unmap(va, 6 * MIB)
    assert fake.log() == ["push 0xc0de000b",
                          f"access {VA:#x} size={6 * MIB} type=1 id=1 flags=1 count=1",  # device 1, PROT_READ
                          f"access {VA:#x} size={2 * MIB} type=1 id=1 flags=3 count=1",  # PROT_READWRITE
                          "sync", f"unmap {VA:#x} size={6 * MIB}", f"free {VA:#x} size={6 * MIB}", "pop"]


PROP = "type=1 handles=1 loc=1 id=1 win32=(nil) flags=0,0,0 size=32"  # pinned, POSIX fd, device 1, the rest zero


def test_create_exported_allocates_maps_and_exports_as_cuda_h_declares(fake):
    drv = fake.drv
    assert drv.granularity(1) == 2 * MIB
    assert fake.log() == [f"granularity {PROP}", "option=1"]  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    fake.reset()
    with drv.current(drv.primary_context(1)):
        va, fds = drv.create_exported([2 * MIB, 4 * MIB], 1)
    try:
        assert va == VA and len(fds) == 2 and all(is_open(fd) for fd in fds)
        assert fake.log()[2:] == [
            f"create {PROP}", f"size={2 * MIB} flags=0", f"create {PROP}", f"size={4 * MIB} flags=0",
            f"reserve size={6 * MIB} align=0 addr=0 flags=0",
            f"map {VA:#x} size={2 * MIB} off=0 handle=0xdef000000000 flags=0",
            f"map {VA + 2 * MIB:#x} size={4 * MIB} off=0 handle=0xdef000000001 flags=0",
            f"access {VA:#x} size={6 * MIB} type=1 id=1 flags=3 count=1",  # the engine writes it: PROT_READWRITE
            "export 0xdef000000000 type=1 flags=0", "export 0xdef000000001 type=1 flags=0",  # POSIX fds
            "release 0xdef000000000", "release 0xdef000000001",  # the mapping and the fds keep the memory
            "pop",
        ]
    finally:
        for fd in fds:
            os.close(fd)


def test_a_failed_export_closes_what_it_exported_and_undoes_the_mapping(fake):
    before = set(os.listdir("/proc/self/fd"))
    fake.fail("cuMemExportToShareableHandle", 2, on_call=2)
    with pytest.raises(CudaError, match="cuMemExportToShareableHandle failed"), fake.drv.current(fake.drv.primary_context(0)):
        fake.drv.create_exported([2 * MIB, 2 * MIB], 0)
    log = fake.log()
    assert log[log.index("FAIL cuMemExportToShareableHandle") + 1 :] == [
        f"unmap {VA:#x} size={4 * MIB}", f"free {VA:#x} size={4 * MIB}",
        "release 0xdef000000000", "release 0xdef000000001", "pop"]
    assert set(os.listdir("/proc/self/fd")) == before  # the first chunk's fd was closed


@pytest.mark.parametrize(("failing", "undo"), [
    ("cuMemImportFromShareableHandle", ["release 0xabc000000007"]),  # the second import fails
    ("cuMemMap", [f"unmap {VA:#x} size={2 * MIB}", f"free {VA:#x} size={6 * MIB}",
                  "release 0xabc000000007", "release 0xabc000000009"]),
])
def test_a_failed_call_is_named_and_what_was_done_is_undone(fake, failing, undo):
    fake.fail(failing, 2, on_call=2)
    with pytest.raises(CudaError) as info, fake.drv.current(fake.drv.primary_context(0)):
        fake.drv.import_and_map([7, 9], [2 * MIB, 4 * MIB])
    assert info.value.message == f"CUDA driver call {failing} failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
    assert info.value.details == {"call": failing, "result": "CUDA_ERROR_OUT_OF_MEMORY"}
    log = fake.log()
    assert log[log.index(f"FAIL {failing}") + 1 :] == [*undo, "pop"]


def test_an_unknown_result_is_still_named(fake):
    fake.fail("cuMemAddressReserve", 999)
    with pytest.raises(CudaError, match=r"cuMemAddressReserve failed: CUresult 999"), fake.drv.current(0):
        fake.drv.import_and_map([5], [2 * MIB])
    assert fake.log()[-2:] == ["release 0xabc000000005", "pop"]


def test_cuinit_failure_is_raised_at_load(fake_lib, fake):
    fake.fail("cuInit", 100)
    with pytest.raises(CudaError, match=r"cuInit failed: CUDA_ERROR_NO_DEVICE \(no CUDA-capable device is detected\)"):
        libcuda.load(str(fake_lib))


def test_devices_by_uuid_looked_up_once(fake):
    drv = fake.drv
    uuids = drv.device_uuids()
    # The first byte is NUL: a c_char array would have cut the UUID there.
    assert uuids == ["GPU-00a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf", "GPU-00b1b2b3-b4b5-b6b7-b8b9-babbbcbdbebf"]
    assert drv.device_uuid(1) == uuids[1] and drv.ordinal_of(uuids[1].upper()) == 1
    assert fake.log() == ["cuDeviceGetCount", "cuDeviceGetUuid_v2 10", "cuDeviceGetUuid_v2 11"]  # and never again
    with pytest.raises(CudaError, match=r"cuda:2: this process sees 2 CUDA device\(s\)") as info:
        drv.device_uuid(2)
    assert info.value.details == {"device": "cuda:2"}
    with pytest.raises(CudaError, match=r"no CUDA device this process can see has that UUID \(check CUDA_VISIBLE_DEVICES"):
        drv.ordinal_of("GPU-00000000-0000-0000-0000-000000000000")
    assert fake.log() == ["cuDeviceGetCount", "cuDeviceGetUuid_v2 10", "cuDeviceGetUuid_v2 11"]


def test_a_driver_without_the_v2_uuid_call_uses_the_first(tmp_path):
    old = libcuda.load(str(build(tmp_path, "libcuda-old.so.1", "-DNO_UUID_V2")))
    assert old.device_uuid(0) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_a_mapping_is_unmapped_when_collected_and_errors_at_exit_are_quiet(fake, monkeypatch):
    reported: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    ctx = fake.drv.primary_context(0)
    fake.reset()
    m = cuda_mapping.VmmMapping(VA, 6 * MIB, 0, ctx)
    assert m.__cuda_array_interface__["data"] == (VA, False)
    del m
    gc.collect()
    assert fake.log() == ["push 0xc0de000a", "sync", f"unmap {VA:#x} size={6 * MIB}", f"free {VA:#x} size={6 * MIB}", "pop"]
    assert reported == []
    fake.fail("cuCtxSynchronize", 4)  # the driver went first at interpreter exit: nothing to report
    del_one = cuda_mapping.VmmMapping(VA, MIB, 0, ctx)
    del del_one
    gc.collect()
    assert reported == []
    fake.fail("cuMemUnmap", 1)  # anything else is reported
    del_two = cuda_mapping.VmmMapping(VA, MIB, 0, ctx)
    del del_two
    gc.collect()
    assert len(reported) == 1 and isinstance(reported[0], CudaError) and "cuMemUnmap failed" in str(reported[0])


def memfds(n: int) -> list[int]:
    return [os.memfd_create(f"chunk{i}", os.MFD_CLOEXEC) for i in range(n)]


@pytest.mark.parametrize("failing", ["count", "uuid", "import"])
def test_map_vmm_closes_every_fd_whatever_fails(fake, monkeypatch, failing):
    import torch

    monkeypatch.setattr(torch.cuda, "init", lambda: None)  # a CPU build of torch has no CUDA to init
    uuid = fake.drv.device_uuid(0)
    fds = memfds(2)
    arena = VmmArenaDesc(4 * MIB, [2 * MIB, 2 * MIB], uuid)
    if failing == "count":
        arena.chunks = [4 * MIB]
    elif failing == "uuid":
        arena.device_uuid = "GPU-00000000-0000-0000-0000-000000000000"
    else:
        fake.fail("cuMemImportFromShareableHandle", 1, on_call=2)
    with pytest.raises(CudaError, match={"count": "1 chunks but 2 fds", "uuid": "has that UUID",
                                         "import": "cuMemImportFromShareableHandle failed: CUDA_ERROR_INVALID_VALUE"}[failing]):
        cuda_mapping.map_vmm(arena, fds)
    assert not any(is_open(fd) for fd in fds)
    if failing == "import":
        assert fake.log()[-2:] == [f"release {0xABC000000000 + fds[0]:#x}", "pop"]


def _vmm_reply(fake: Fake, fds: list[int]) -> AttachReply:
    arena = VmmArenaDesc(4 * MIB, [2 * MIB, 2 * MIB], fake.drv.device_uuid(0))
    return AttachReply(7, "f", f"cuda:{arena.device_uuid}", arena, iter([["w", "U8", [16], 0, 16], ["b", "BF16", [4], 16, 8]]),
                       fds, "resident", 0.0)


class _Owned(bytearray):
    """Bytes that keep their owner alive, as torch's tensor over a __cuda_array_interface__ does."""

    owner: object


@pytest.fixture
def cpu_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU build of torch has no CUDA: the slab over the range is a CPU tensor here,
    which keeps the mapping alive as the GPU one does."""
    import torch

    def as_tensor(obj: cuda_mapping.VmmMapping, device: str | None = None) -> torch.Tensor:
        buf = _Owned(obj.nbytes)
        buf.owner = obj
        return torch.frombuffer(buf, dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch, "as_tensor", as_tensor)


def test_views_are_made_while_access_is_set_and_none_leaves_before(fake, monkeypatch, cpu_slab):
    # Note [views while access is set]: cuMemSetAccess on a thread of its own, the views
    # made meanwhile, and the tensors handed out only once it has returned.
    from weightcache.client import mapping

    in_call, views_made, order = threading.Event(), threading.Event(), []
    set_access, tensor_views = libcuda.Driver.set_access, mapping.tensor_views

    def held_set_access(self: libcuda.Driver, *args: Any, **kwargs: Any) -> None:
        in_call.set()
        assert views_made.wait(10)  # a caller that waited for the access before its views would time out here
        set_access(self, *args, **kwargs)
        order.append("access set")

    def noted_views(*args: Any) -> Any:
        assert in_call.is_set()
        out = tensor_views(*args)
        order.append("views made")
        views_made.set()
        return out

    monkeypatch.setattr(libcuda.Driver, "set_access", held_set_access)
    monkeypatch.setattr(mapping, "tensor_views", noted_views)
    fds = memfds(2)
    model = mapping.attached_model("m", _vmm_reply(fake, fds))
    assert order == ["views made", "access set"]
    assert sorted(model) == ["b", "w"] and model["b"].shape == (4,) and not any(is_open(fd) for fd in fds)
    log = fake.log()
    assert not any(line.startswith("unmap") for line in log)  # the tensors hold the range
    assert f"access {VA:#x} size={4 * MIB} type=1 id=0 flags=1 count=1" in log
    # the access thread made the context current for its call, and let it go
    assert log[log.index(f"access {VA:#x} size={4 * MIB} type=1 id=0 flags=1 count=1") - 1:][:3] == [
        "push 0xc0de000a", f"access {VA:#x} size={4 * MIB} type=1 id=0 flags=1 count=1", "pop"]


def test_the_access_thread_is_started_while_the_daemon_answers_and_used_by_the_map(fake, monkeypatch, cpu_slab):
    # Note [views while access is set]: prepare_attach (the attach's while_waiting) starts
    # one parked thread in an engine with CUDA up; the map hands it the range, and starts
    # no thread of its own.
    import _thread

    import torch

    from weightcache.client import mapping

    monkeypatch.setattr(cuda_mapping, "_spare", None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    started: list[object] = []
    start = _thread.start_new_thread
    monkeypatch.setattr(_thread, "start_new_thread", lambda fn, args: started.append(fn) or start(fn, args))
    mapping.prepare_attach()
    mapping.prepare_attach()  # one spare at a time
    assert len(started) == 1 and cuda_mapping._spare is not None
    model = mapping.attached_model("m", _vmm_reply(fake, memfds(2)))
    assert len(started) == 1 and cuda_mapping._spare is None  # taken, not replaced until the next attach's wait
    assert f"access {VA:#x} size={4 * MIB} type=1 id=0 flags=1 count=1" in fake.log() and len(model) == 2


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_spare_access_thread_is_not_inherited_by_a_fork_nor_needed_to_attach(monkeypatch):
    import _thread

    monkeypatch.setattr(cuda_mapping, "_spare", None)
    cuda_mapping.start_spare()
    assert cuda_mapping._spare is not None
    pid = os.fork()
    if pid == 0:  # the child has no thread behind the parent's spare: it must start its own
        os._exit(0 if cuda_mapping._spare is None and not cuda_mapping._spare_lock.locked() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    def no_thread(*args: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(cuda_mapping, "_spare", None)
    monkeypatch.setattr(_thread, "start_new_thread", no_thread)
    cuda_mapping.start_spare()  # only a head start: the attach goes on, and its map says why if it has no thread either
    assert cuda_mapping._spare is None


def test_an_interrupted_wait_leaves_the_range_mapped_until_the_access_call_is_over(fake, monkeypatch, cpu_slab):
    # A KeyboardInterrupt while the caller waits for the access thread drops the tensors;
    # the thread holds the range until its call is over, so that the range is not
    # unmapped (and perhaps reserved by another attach) before the call ran on it.
    from weightcache.client import mapping

    in_call, release = threading.Event(), threading.Event()
    set_access = libcuda.Driver.set_access

    def slow_set_access(self: libcuda.Driver, *args: Any, **kwargs: Any) -> None:
        in_call.set()
        assert release.wait(10)
        set_access(self, *args, **kwargs)

    def interrupted(self: cuda_mapping.AccessThread) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(libcuda.Driver, "set_access", slow_set_access)
    monkeypatch.setattr(cuda_mapping.AccessThread, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mapping.attached_model("m", _vmm_reply(fake, memfds(2)))
    assert in_call.wait(10)
    gc.collect()
    assert not any(line.startswith("unmap") for line in fake.log())  # the thread still holds the range
    release.set()
    for _ in range(1000):  # the thread lets the range go as its call ends
        gc.collect()
        if any(line.startswith("unmap") for line in fake.log()):
            break
        time.sleep(0.01)
    log = fake.log()
    access = next(i for i, line in enumerate(log) if line.startswith("access"))
    assert access < next(i for i, line in enumerate(log) if line.startswith("unmap"))


def test_an_interrupted_hand_over_leaves_no_thread_waiting_for_good(fake):
    class Interrupted:  # the caller's wait for "in the call" interrupted
        def acquire(self) -> None:
            raise KeyboardInterrupt

        def release(self) -> None:
            pass

    access = cuda_mapping.AccessThread()
    access._calling = Interrupted()  # type: ignore[assignment]
    ctx = fake.drv.primary_context(0)
    with pytest.raises(KeyboardInterrupt):
        access.set_access(fake.drv, ctx, cuda_mapping.VmmMapping(VA, 2 * MIB, 0, ctx), True)
    waiter = threading.Thread(target=access.wait, daemon=True)  # it ends, with the range or without
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive()


def test_access_that_cannot_be_set_is_raised_and_the_range_unmapped(fake, cpu_slab):
    from weightcache.client import mapping

    fake.fail("cuMemSetAccess", 2)
    with pytest.raises(CudaError, match=r"cuMemSetAccess failed: CUDA_ERROR_OUT_OF_MEMORY"):
        mapping.attached_model("m", _vmm_reply(fake, memfds(2)))
    gc.collect()
    log = fake.log()
    assert log.count("FAIL cuMemSetAccess") == 1
    assert log[-3:] == [f"unmap {VA:#x} size={4 * MIB}", f"free {VA:#x} size={4 * MIB}", "pop"]


# -- an attach with no driver at all ---------------------------------------------------------


class GpuArenaDaemon:
    """Answers hello, answers attach with a cuda_vmm arena on the GPU named ``device_uuid``
    whose two chunks are memfds, not VMM allocations (SCM_RIGHTS on the reply's first
    byte, as the daemon sends them), and records detaches. tests/test_gpu_client.py uses
    it too."""

    def __init__(self, device_uuid: str = "GPU-00000000-0000-0000-0000-000000000001") -> None:
        self.device_uuid = device_uuid
        self.dir = tempfile.mkdtemp(prefix="wc-", dir="/tmp")
        self.path = os.path.join(self.dir, "gpu.sock")
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(4)
        self.detached: list[int] = []
        self.sent_inodes: list[tuple[int, int]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.srv.accept()
        decoder = FrameDecoder(1 << 20)
        with conn:
            while data := conn.recv(1 << 16):
                for frame in decoder.feed(data):
                    req = decode_payload(frame)
                    base: dict[str, Any] = {"id": req["id"], "ok": True}
                    if req["op"] == "hello":
                        conn.sendall(encode_frame({**base, "protocol": 1, "server": "fake"}))
                    elif req["op"] == "attach":
                        fds = memfds(2)
                        self.sent_inodes = [(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in fds]
                        reply = {**base, "lease": 7, "model": req["name"], "rank": None, "fingerprint": "f", "fds": 2,
                                 "device": f"cuda:{self.device_uuid}",
                                 "arena": {"kind": "cuda_vmm", "nbytes": 4 * MIB, "chunks": [2 * MIB, 2 * MIB],
                                           "device_uuid": self.device_uuid},
                                 "tensors": [["w", "U8", [16], 0, 16]]}
                        conn.sendmsg([encode_frame(reply)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                        for fd in fds:
                            os.close(fd)
                    elif req["op"] == "detach":
                        self.detached.append(req["lease"])
                        conn.sendall(encode_frame({**base, "lease": req["lease"], "model": "m"}))

    def close(self) -> None:
        self.srv.close()
        self.thread.join(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def open_inodes() -> set[tuple[int, int]]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


async def test_attaching_a_gpu_model_without_the_driver_says_so_and_leaks_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(libcuda, "_driver", None)
    monkeypatch.setenv(libcuda.LIBRARY_ENV, str(tmp_path / "libcuda.so.1"))  # not there, on any host
    d = GpuArenaDaemon()
    try:
        async with Client(d.path) as c:
            with pytest.raises(DriverNotFound, match="cannot load the CUDA driver library"):
                async with c.attach("m"):
                    pytest.fail("attached without a driver")
        assert d.detached == [7]  # the lease was given back (the attach waited for the detach's reply)
        assert d.sent_inodes and not set(d.sent_inodes) & open_inodes()  # and the fds it got were closed
    finally:
        d.close()
