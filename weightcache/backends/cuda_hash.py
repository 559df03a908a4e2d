"""The content hash's pieces hashed on the GPU, after their bytes are copied there.

Why on the GPU: hashing on the host cost the first load of a file from a warm page cache
1.4-1.6x on the H200 (docs/benchmarks.md, "Content fingerprint"). Hashing each slice
right after ``preadv`` wrote it ran at ~13.6 GB/s per thread there, the rate of xxh3-128
over memory (12 GB/s over 1 GiB), not over cache (63 GB/s over a cached 1 MiB;
measured on that host): the hash reads the bytes back from host memory, which the load
itself is bound by (8 threads of memmove reached 62 GB/s). On the GPU the bytes are read from HBM by a kernel that runs
while the next chunks are copied, and the host does nothing more.

The kernel computes exactly XXH3_128bits (seed 0, default secret) of one piece longer
than 240 bytes (xxhash's "hashLong" path: 1024-byte blocks of 16 stripes, 8 lanes), so
the fingerprint is the same whichever backend loads a checkpoint (Note [content
fingerprint] in loader/reader.py); tests/test_gpu.py checks it against the ``xxhash``
package. One warp per piece: lanes i and i+8, i+16, i+24 each hold accumulator i&7 (the
same work, so no lane diverges), all 32 lanes prefetch the piece into shared memory with
``cp.async`` (a ring of NSTAGE stages of 4 KiB, up to NSTAGE - 1 in flight, so one warp
is not bound by memory latency), and lane 0 writes the digest to pinned host memory the host reads after the
load's streams are synchronized.

Pieces of at most ``DEVICE_MIN`` bytes, or not 16-byte aligned in the arena (never, as
arenas place tensors at 256-byte offsets), are hashed on the host as before: a launch
costs more than hashing them there.

Only files that cannot change unseen are hashed here (the reader decides,
loader/reader.py): the kernels share the GPU with the engines' by time slicing, and an
engine computing bf16 matmuls kept 0.56 of its rate during such a load on the H200
(0.98 during a load without the hash, 1.01 with the hash on the host;
python -m benchmarks hash-contention). Those files are hashed once per version; a peer's files are
hashed at every load, and that must not take GPU time from the other tenants' engines.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import time
from typing import Any

from cuda.bindings import driver as cu

from .. import cuda_driver as drv

DEVICE_MIN = 256 * 1024  # smaller pieces are hashed on the host
DIGEST_SLOTS = 4096  # digests per pinned block (16 bytes each)
# Hash streams per loader thread, taken in turn: a piece's kernel (one warp) runs beside
# those of the thread's earlier pieces rather than after them.
HASH_STREAMS = 4

_SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

#define STAGE 4096
#define NSTAGE 8

__constant__ unsigned char kSecret[192] = {
  0xb8,0xfe,0x6c,0x39,0x23,0xa4,0x4b,0xbe,0x7c,0x01,0x81,0x2c,0xf7,0x21,0xad,0x1c,
  0xde,0xd4,0x6d,0xe9,0x83,0x90,0x97,0xdb,0x72,0x40,0xa4,0xa4,0xb7,0xb3,0x67,0x1f,
  0xcb,0x79,0xe6,0x4e,0xcc,0xc0,0xe5,0x78,0x82,0x5a,0xd0,0x7d,0xcc,0xff,0x72,0x21,
  0xb8,0x08,0x46,0x74,0xf7,0x43,0x24,0x8e,0xe0,0x35,0x90,0xe6,0x81,0x3a,0x26,0x4c,
  0x3c,0x28,0x52,0xbb,0x91,0xc3,0x00,0xcb,0x88,0xd0,0x65,0x8b,0x1b,0x53,0x2e,0xa3,
  0x71,0x64,0x48,0x97,0xa2,0x0d,0xf9,0x4e,0x38,0x19,0xef,0x46,0xa9,0xde,0xac,0xd8,
  0xa8,0xfa,0x76,0x3f,0xe3,0x9c,0x34,0x3f,0xf9,0xdc,0xbb,0xc7,0xc7,0x0b,0x4f,0x1d,
  0x8a,0x51,0xe0,0x4b,0xcd,0xb4,0x59,0x31,0xc8,0x9f,0x7e,0xc9,0xd9,0x78,0x73,0x64,
  0xea,0xc5,0xac,0x83,0x34,0xd3,0xeb,0xc3,0xc5,0x81,0xa0,0xff,0xfa,0x13,0x63,0xeb,
  0x17,0x0d,0xdd,0x51,0xb7,0xf0,0xda,0x49,0xd3,0x16,0x55,0x26,0x29,0xd4,0x68,0x9e,
  0x2b,0x16,0xbe,0x58,0x7d,0x47,0xa1,0xfc,0x8f,0xf8,0xb8,0xd1,0x7a,0xd0,0x31,0xce,
  0x45,0xcb,0x3a,0x8f,0x95,0x16,0x04,0x28,0xaf,0xd7,0xfb,0xca,0xbb,0x4b,0x40,0x7e};

__device__ __forceinline__ u64 rd64(const unsigned char* p) {  // little-endian, any alignment
  u64 v = 0;
#pragma unroll
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

__device__ __forceinline__ u64 mul_fold(u64 a, u64 b) { return (a * b) ^ __umul64hi(a, b); }

__device__ __forceinline__ u64 avalanche(u64 h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  return h ^ (h >> 32);
}

__device__ __forceinline__ u64 stripe(u64 acc, u64 v, u64 key) {
  // acc[i] += v[i ^ 1] + lo32(v[i] ^ key) * hi32(v[i] ^ key)
  const u64 k = v ^ key;
  return acc + __shfl_xor_sync(0xffffffffu, v, 1) + (u64)(u32)k * (k >> 32);
}

__device__ __forceinline__ void issue(const unsigned char* data, u64 body, u64 st, unsigned char* ring, int lane) {
  const u64 base = st * STAGE;
  unsigned char* slot = ring + (st % NSTAGE) * STAGE;
#pragma unroll
  for (int r = 0; r < STAGE / (32 * 16); ++r) {
    const u64 off = (u64)(r * 32 + lane) * 16;
    if (base + off < body) {
      u32 s;
      asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(slot + off));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(data + base + off) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// One piece, by one warp (lane = threadIdx.x), through ``ring``: NSTAGE * STAGE bytes of shared memory.
__device__ __forceinline__ void hash_long(const unsigned char* data, u64 len, u64* out, unsigned char* ring) {
  const int lane = threadIdx.x;
  const int i = lane & 7;
  u64 key[16];
#pragma unroll
  for (int s = 0; s < 16; ++s) key[s] = rd64(kSecret + 8 * s + 8 * i);
  const u64 scramble = rd64(kSecret + 128 + 8 * i);
  const u64 init[8] = {0xC2B2AE3DULL, 0x9E3779B185EBCA87ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                       0x85EBCA77C2B2AE63ULL, 0x85EBCA77ULL, 0x27D4EB2F165667C5ULL, 0x9E3779B1ULL};
  u64 acc = init[i];

  const u64 nb = (len - 1) / 1024;  // full blocks, each followed by a scramble
  const u64 body = nb * 1024;
  const u64 nstages = (body + STAGE - 1) / STAGE;
  for (u64 st = 0; st < NSTAGE - 1; ++st) issue(data, body, st, ring, lane);
  for (u64 st = 0; st < nstages; ++st) {
    issue(data, body, st + NSTAGE - 1, ring, lane);
    asm volatile("cp.async.wait_group %0;" :: "n"(NSTAGE - 1) : "memory");
    __syncwarp();
    const u64* words = (const u64*)(ring + (st % NSTAGE) * STAGE);
    const u64 blocks = min((u64)(STAGE / 1024), nb - st * (STAGE / 1024));
    for (u64 b = 0; b < blocks; ++b) {
#pragma unroll
      for (int s = 0; s < 16; ++s) acc = stripe(acc, words[b * 128 + 8 * s + i], key[s]);
      acc ^= acc >> 47;
      acc ^= scramble;
      acc *= 0x9E3779B1ULL;
    }
    __syncwarp();  // every lane is done with this slot before it is refilled
  }
  asm volatile("cp.async.wait_all;" ::: "memory");

  // The last, partial block's whole stripes (no scramble), then the last 64 bytes.
  const u64 ns = ((len - 1) - body) / 64;
  const u64* tail = (const u64*)(data + body);
#pragma unroll
  for (int s = 0; s < 16; ++s)
    if (s < ns) acc = stripe(acc, tail[8 * s + i], key[s]);
  acc = stripe(acc, rd64(data + len - 64 + 8 * i), rd64(kSecret + 121 + 8 * i));

  u64 a[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] = __shfl_sync(0xffffffffu, acc, k);
  if (lane == 0) {
    u64 lo = len * 0x9E3779B185EBCA87ULL, hi = ~(len * 0xC2B2AE3D27D4EB4FULL);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      lo += mul_fold(a[2 * k] ^ rd64(kSecret + 11 + 16 * k), a[2 * k + 1] ^ rd64(kSecret + 19 + 16 * k));
      hi += mul_fold(a[2 * k] ^ rd64(kSecret + 117 + 16 * k), a[2 * k + 1] ^ rd64(kSecret + 125 + 16 * k));
    }
    out[0] = avalanche(hi);
    out[1] = avalanche(lo);
  }
}

extern "C" __global__ void __launch_bounds__(32) xxh3_128_long(const unsigned char* data, u64 len, u64* out) {
  __shared__ __align__(16) unsigned char ring[NSTAGE * STAGE];
  hash_long(data, len, out, ring);
}

// Many pieces in one launch, one block (one warp) each: pieces[3 * blockIdx.x ...] is a
// piece's device address, length and digest's address.
extern "C" __global__ void __launch_bounds__(32) xxh3_128_many(const u64* pieces) {
  __shared__ __align__(16) unsigned char ring[NSTAGE * STAGE];
  const u64* p = pieces + 3 * (u64)blockIdx.x;
  hash_long((const unsigned char*)p[0], p[1], (u64*)p[2], ring);
}
"""

_cubin_lock = threading.Lock()
_cubins: dict[tuple[int, int], bytes] = {}  # compute capability -> CUBIN


class HashUnavailable(RuntimeError):
    """This device or installation cannot hash on the GPU; the message says why."""


def _compile(major: int, minor: int) -> bytes:
    """The kernel as a CUBIN for sm_<major><minor>, compiled once per compute capability
    by NVRTC. A CUBIN, not PTX: a driver older than the NVRTC cannot JIT its PTX, while a
    CUBIN runs on any driver of the same CUDA major version."""
    from cuda.bindings import nvrtc

    with _cubin_lock:
        if (major, minor) in _cubins:
            return _cubins[(major, minor)]

        def ok(res: Any) -> Any:
            err, *rest = res
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise HashUnavailable(f"NVRTC: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
            return rest[0] if rest else None

        prog = ok(nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"xxh3_128.cu", 0, [], []))
        try:
            opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
            err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                size = ok(nvrtc.nvrtcGetProgramLogSize(prog))
                log = b" " * size
                ok(nvrtc.nvrtcGetProgramLog(prog, log))
                raise HashUnavailable(f"NVRTC could not compile the hash kernel: {log.decode(errors='replace').strip()}")
            size = ok(nvrtc.nvrtcGetCUBINSize(prog))
            cubin = b" " * size
            ok(nvrtc.nvrtcGetCUBIN(prog, cubin))
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
        _cubins[(major, minor)] = cubin
        return cubin


class DigestBlock:
    """Pinned host memory the kernels write digests into (two u64 per piece: high, low)."""

    def __init__(self) -> None:
        self.ptr = int(drv.check(cu.cuMemHostAlloc(DIGEST_SLOTS * 16, cu.CU_MEMHOSTALLOC_DEVICEMAP)))
        self.dev = int(drv.check(cu.cuMemHostGetDevicePointer(self.ptr, 0)))
        self.used = 0

    def digest(self, slot: int) -> bytes:
        """The canonical XXH128 digest (big-endian high, then low), as ``xxhash`` gives it."""
        hi, lo = struct.unpack_from("<QQ", (ctypes.c_char * 16).from_address(self.ptr + 16 * slot))
        return struct.pack(">QQ", hi, lo)


class PieceTable:
    """Pinned host memory the GPU reads a launch's pieces from: three u64 a piece (device
    address, length, digest's device address). Made in the context; freed by ``free``."""

    def __init__(self, pieces: list[tuple[int, int, int]]) -> None:
        self.ptr = int(drv.check(cu.cuMemHostAlloc(max(1, len(pieces)) * 24, cu.CU_MEMHOSTALLOC_DEVICEMAP)))
        try:
            (ctypes.c_uint64 * (3 * len(pieces))).from_address(self.ptr)[:] = [x for piece in pieces for x in piece]
            self.arg = ctypes.c_uint64(int(drv.check(cu.cuMemHostGetDevicePointer(self.ptr, 0))))
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            drv.check(cu.cuMemFreeHost(ptr))


class GpuHasher:
    """One device's hash kernel and the pinned blocks its digests go to. The streams the
    kernels run on are the loader threads' (backends/pinned.py, Staging.hash_streams).
    ``compile_s`` says what setting it up cost (NVRTC and the module load)."""

    def __init__(self, ctx: Any, ordinal: int) -> None:
        t0 = time.perf_counter()
        dev = drv.check(cu.cuDeviceGet(ordinal))
        attr = cu.CUdevice_attribute
        major = int(drv.check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)))
        minor = int(drv.check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)))
        if major < 8:  # cp.async
            raise HashUnavailable(f"compute capability {major}.{minor}: the hash kernel needs 8.0 or newer")
        try:
            cubin = _compile(major, minor)
        except HashUnavailable:
            raise
        except (ImportError, RuntimeError) as exc:  # cuda.bindings.nvrtc, or libnvrtc not found
            raise HashUnavailable(f"NVRTC is not usable: {exc}") from None
        self._ctx = ctx
        self._image = ctypes.create_string_buffer(cubin)
        with drv.current(ctx):
            try:
                self._module = drv.check(cu.cuModuleLoadData(ctypes.addressof(self._image)))
            except drv.CudaError as exc:  # e.g. NVRTC of a newer CUDA major version than the driver
                raise HashUnavailable(f"the driver refused the hash kernel: {exc.message}") from None
            self._kernel = drv.check(cu.cuModuleGetFunction(self._module, b"xxh3_128_long"))
            self._many = drv.check(cu.cuModuleGetFunction(self._module, b"xxh3_128_many"))
        self._lock = threading.Lock()
        self._blocks: list[DigestBlock] = []
        self.compile_s = time.perf_counter() - t0

    def take_block(self) -> DigestBlock:
        with self._lock:
            if self._blocks:
                return self._blocks.pop()
        with drv.current(self._ctx):
            return DigestBlock()

    def give_back(self, block: DigestBlock) -> None:
        block.used = 0
        with self._lock:
            self._blocks.append(block)

    def launch(self, stream: Any, data: int, nbytes: int, out: int) -> None:
        """Hash ``nbytes`` (> 240) at device address ``data`` (16-byte aligned) into the
        16 bytes at device address ``out``, on ``stream``. Called in the context."""
        args = (ctypes.c_uint64(data), ctypes.c_uint64(nbytes), ctypes.c_uint64(out))
        params = (ctypes.c_void_p * 3)(*(ctypes.addressof(a) for a in args))
        drv.check(cu.cuLaunchKernel(self._kernel, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(params), 0))

    @property
    def kernel_handle(self) -> int:
        """The one-piece kernel's CUfunction, for the C loop's launches (staging_loop.c)."""
        return int(self._kernel)

    def launch_many(self, stream: Any, pieces: list[tuple[int, int, int]]) -> PieceTable:
        """Hash every ``(data, nbytes, out)`` piece (as :meth:`launch` takes one) in one
        launch on ``stream``, a block each, so that they run across the whole GPU at once
        rather than a warp a stream (Note [one launch for many pieces]). The table it
        returns is read by the kernel: free it once ``stream`` is synchronized. Called in
        the context."""
        table = PieceTable(pieces)
        try:
            params = (ctypes.c_void_p * 1)(ctypes.addressof(table.arg))
            drv.check(cu.cuLaunchKernel(self._many, len(pieces), 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(params), 0))
        except BaseException:
            table.free()
            raise
        return table

    def close(self) -> None:
        """Called once every load of the device has finished (their streams synchronized)."""
        with drv.current(self._ctx):
            try:
                for b in self._blocks:
                    drv.check(cu.cuMemFreeHost(b.ptr))
            finally:
                self._blocks.clear()
                drv.check(cu.cuModuleUnload(self._module))
