"""The CUDA writer's chunk loop in C (backends/staging_loop.c, Note [the chunk loop in C]
in backends/cuda_writer.py) against a stand-in libcuda whose copies are asynchronous: a
copy reads its slot only once an event recorded after it, or its stream, is waited for,
as the copy engine may. A loop, or a writer, that refilled a buffer before waiting for
the copy out of it would land the wrong bytes. The loop is built here from the source
(as the install builds it); the GPU tests run it against the real driver
(tests/test_gpu.py)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CC = shutil.which("cc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to build the chunk loop and the stand-in driver")
ROOT = Path(__file__).resolve().parent.parent

# One queue of copies for every stream, run in order only when an event recorded after a
# copy, or a stream, is waited for. A kernel runs at its launch, after the copies its
# stream was told to wait for (cuStreamWaitEvent) and no others: a launch that did not
# wait for its bytes hashes whatever the arena held. The kernel is the harness's
# ``kernel`` callback (an xxh3_128 of the bytes, as the GPU's). One lock: loader threads
# call in at once.
FAKE_LIBCUDA = r"""
#include <pthread.h>
#include <string.h>
typedef struct { unsigned long long dst; const void *src; size_t n; } Copy;
static Copy queue[1 << 18];
static int queued, done, recorded[1 << 12], waited[1 << 12];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
int copies_waited;  /* copies made because an event or a stream was waited for */
void (*kernel)(unsigned long long data, unsigned long long n, unsigned long long out);
static void upto(int k) {
    for (; done < k; done++) { memcpy((void *)queue[done].dst, queue[done].src, queue[done].n); copies_waited++; }
}
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream) {
    (void)stream; pthread_mutex_lock(&mu); queue[queued++] = (Copy){dst, src, n}; pthread_mutex_unlock(&mu); return 0;
}
int cuEventRecord(void *ev, void *stream) {
    (void)stream; pthread_mutex_lock(&mu); recorded[(long)ev] = queued; pthread_mutex_unlock(&mu); return 0;
}
int cuEventSynchronize(void *ev) { pthread_mutex_lock(&mu); upto(recorded[(long)ev]); pthread_mutex_unlock(&mu); return 0; }
int cuStreamWaitEvent(void *stream, void *ev, unsigned flags) {
    (void)flags; pthread_mutex_lock(&mu);
    if (recorded[(long)ev] > waited[(long)stream]) waited[(long)stream] = recorded[(long)ev];
    pthread_mutex_unlock(&mu); return 0;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **args, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)extra;
    pthread_mutex_lock(&mu); upto(waited[(long)stream]); pthread_mutex_unlock(&mu);
    kernel(*(unsigned long long *)args[0], *(unsigned long long *)args[1], *(unsigned long long *)args[2]);
    return 0;
}
int fake_sync_all(void) { pthread_mutex_lock(&mu); upto(queued); pthread_mutex_unlock(&mu); return 0; }
"""

# The few cuda.bindings.driver calls the writer makes, over the stand-in libcuda (one
# queue of copies for every stream: waiting for any stream waits for all of them, which
# only hides races between streams, never makes one).
FAKE_BINDINGS = r'''
import ctypes, itertools
_lib = ctypes.CDLL("libcuda.so.1")
_lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_ids = itertools.count(100)
class CUresult:
    CUDA_SUCCESS = 0
class CUevent_flags:
    CU_EVENT_DISABLE_TIMING = 2
class Handle(int):
    pass
def cuCtxPushCurrent(ctx): return (0,)
def cuCtxPopCurrent(): return (0, None)
def cuStreamSynchronize(s): _lib.fake_sync_all(); return (0,)
def cuMemcpyHtoDAsync(dst, src, n, s): return (_lib.cuMemcpyHtoDAsync_v2(int(dst), int(src), n, int(s)),)
def cuEventCreate(flags): return (0, Handle(next(_ids)))
def cuEventRecord(ev, s): return (_lib.cuEventRecord(int(ev), int(s)),)
_lib.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
def cuStreamWaitEvent(s, ev, flags): return (_lib.cuStreamWaitEvent(int(s), int(ev), flags),)
def cuGetErrorName(e): return (0, b"CUDA_ERROR_FAKE")
class _Unused:  # what the modules the writer imports name at import time, never called here
    def __getattr__(self, name): return _Unused()
    def __call__(self, *a, **kw): return _Unused()
def __getattr__(name): return _Unused()
'''

LOOP_ALONE = r"""
import ctypes, os, sys
from pathlib import Path
from weightcache.backends.staging_loop import Ring, load_chunk_loop, loop_failed
lib, why = load_chunk_loop(Path(sys.argv[4]))
assert lib is not None, why
path, slot, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = open(path, "rb").read()
staging = ctypes.create_string_buffer(slot * slots)
out = ctypes.create_string_buffer(len(data))
ring = Ring(stream=None, nslots=slots, slot_bytes=slot, buf=ctypes.addressof(staging))
for k in range(slots):
    ring.events[k] = k + 1
fd = os.open(path, os.O_RDONLY)
# Three calls, as a loader thread makes them chunk by chunk: the ring carries on across them.
cuts = [0, len(data) // 3 + 17, 2 * len(data) // 3 - 5, len(data)]
for a, b in zip(cuts, cuts[1:]):
    code = lib.wc_stage_copy(ctypes.byref(ring), fd, a, ctypes.addressof(out) + a, b - a)
    assert code == 0, code
driver = ctypes.CDLL("libcuda.so.1")
driver.fake_sync_all()  # the stream drained, as the writer's finish does
print("same" if out.raw == data else "different")
print("waited", ctypes.c_int.in_dll(driver, "copies_waited").value)
short = lib.wc_stage_copy(ctypes.byref(ring), fd, len(data) - 10, ctypes.addressof(out), 100)
print("short", type(loop_failed(short, "x")).__name__)
bad = lib.wc_stage_copy(ctypes.byref(ring), 987654, 0, ctypes.addressof(out), 100)
print("bad fd", loop_failed(bad, "x"))
"""

# The real VmmWriter over a stand-in backend: each step copies one chunk through the C
# loop ("c"), the Python path ("py"; the loop turned off for that call) or a batch of
# small tensors ("batch"), one thread, as a loader thread does them in turn.
WRITER = r"""
import ctypes, os, sys
from pathlib import Path
from weightcache.backends import staging_loop
from weightcache.backends.cuda_writer import VmmWriter
from weightcache.backends.pinned import Staging
from cuda.bindings import driver as cu
lib, why = staging_loop.load_chunk_loop(Path(sys.argv[1]))
assert lib is not None, why
CH = 8 << 20  # a staging buffer holds 3 slots of the loop

class Pool:  # plain memory stands for pinned buffers; kept across writers, as the daemon keeps them
    def __init__(self):
        self.free, self.keep = [], []
    def take(self, size):
        for i, st in enumerate(self.free):
            if st.size == size:
                return self.free.pop(i)
        buf = ctypes.create_string_buffer(size)
        self.keep.append(buf)
        ptr = ctypes.addressof(buf)
        return Staging(ptr, memoryview((ctypes.c_char * size).from_address(ptr)).cast("B"),
                       cu.Handle(next(cu._ids)), cu.Handle(next(cu._ids)), size)
    def give_back(self, st):
        st.busy = False
        self.free.append(st)

class Arena:
    def __init__(self, n):
        self.buf = ctypes.create_string_buffer(n)
        self.va, self.mapped = ctypes.addressof(self.buf), n

class Backend:
    ctx, device, gpu_hash, loop_tasks = None, "fake", None, False
    def __init__(self):
        self.staging, self.chunk_loop = Pool(), lib
    def grow(self, arena, upto): pass
    def page_windows(self, files): return None

data = os.urandom(8 * CH)
path = Path(sys.argv[2])
path.write_bytes(data)
fd = os.open(path, os.O_RDONLY)
backend = Backend()
for line in sys.argv[3:]:
    depth, steps = line.split(":")
    arena = Arena(len(data))
    w = VmmWriter(backend, arena, CH, depth=int(depth))
    for k, kind in enumerate(steps.split(",")):
        off = k * CH
        w._loop = lib if kind == "c" else None
        if kind == "batch":
            w.write_batch(fd, off, [off, off + CH // 2], [CH // 2, CH // 2])
        else:
            w.write_from_file(fd, off, off, CH)
    w.finish()
    n = len(steps.split(",")) * CH
    print(line, "same" if arena.buf.raw[:n] == data[:n] else "different", w.looped_bytes // CH)
"""


# The reader and the real VmmWriter over the stand-in driver, several threads: a
# checkpoint written by safetensors (big tensors the device hashes, small ones the host
# does, in batches), loaded with the task loop and with chunk-by-chunk staging; each
# prints its fingerprint and whether the arena holds the tensors' bytes.
READER = r"""
import ctypes, os, sys, time
from pathlib import Path
import numpy as np, xxhash
from safetensors.numpy import save_file
from weightcache.backends import staging_loop
from weightcache.backends import cuda_writer
from weightcache.backends.cuda_writer import VmmWriter
from weightcache.backends.pinned import Staging
from weightcache.loader import fingerprint_files
from weightcache.loader.checkpoint import parse_checkpoint
from weightcache.loader.reader import FILE_DIGESTS, read_checkpoint
from weightcache.loader.sources import open_source
from cuda.bindings import driver as cu
lib, why = staging_loop.load_chunk_loop(Path(sys.argv[1]))
assert lib is not None, why
driver = ctypes.CDLL("libcuda.so.1")
KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ulonglong)
slow = []  # seconds each kernel takes ("slow-cancel")
def hash_kernel(data, n, out):  # the GPU's digest layout: high, low, each little-endian (DigestBlock.digest)
    if slow:
        time.sleep(slow[0])
    d = xxhash.xxh3_128_digest(ctypes.string_at(data, n))
    ctypes.memmove(out, d[:8][::-1] + d[8:][::-1], 16)
kernel = KERNEL(hash_kernel)
ctypes.c_void_p.in_dll(driver, "kernel").value = ctypes.cast(kernel, ctypes.c_void_p).value

class Pool:
    def __init__(self):
        self.free, self.keep = [], []
    def take(self, size):
        buf = ctypes.create_string_buffer(size)
        self.keep.append(buf)
        ptr = ctypes.addressof(buf)
        return Staging(ptr, memoryview((ctypes.c_char * size).from_address(ptr)).cast("B"),
                       cu.Handle(next(cu._ids)), cu.Handle(next(cu._ids)), size,
                       hash_streams=[cu.Handle(next(cu._ids)) for _ in range(4)])
    def give_back(self, st):
        st.busy = False

class Block:
    def __init__(self):
        self.buf = ctypes.create_string_buffer(16 * 1024)
        self.ptr = self.dev = ctypes.addressof(self.buf)
        self.used = 0
    def digest(self, slot):
        raw = self.buf.raw[16 * slot : 16 * slot + 16]
        return raw[:8][::-1] + raw[8:][::-1]

class Hasher:
    kernel_handle = 1
    def take_block(self): return Block()
    def give_back(self, block): pass
    def launch(self, stream, data, n, out):
        args = [ctypes.c_ulonglong(data), ctypes.c_ulonglong(n), ctypes.c_ulonglong(out)]
        params = (ctypes.c_void_p * 3)(*(ctypes.addressof(a) for a in args))
        driver.cuLaunchKernel(None, 1, 1, 1, 32, 1, 1, 0, ctypes.c_void_p(int(stream)), params, None)

class Arena:
    def __init__(self, n, mapped):
        self.buf = ctypes.create_string_buffer(n)
        self.va, self.mapped = ctypes.addressof(self.buf), mapped

class Backend:
    ctx, device = None, "fake"
    def __init__(self, loop_tasks):
        self.staging, self.chunk_loop, self.gpu_hash, self.loop_tasks = Pool(), lib, Hasher(), loop_tasks
        self.grown = 0
        self.refuse = False
    def grow(self, arena, upto):
        if self.refuse:  # as a miss whose victims' room never comes (NoSpace)
            raise RuntimeError("no room")
        while arena.mapped < upto:  # in 4 MiB steps, as a miss that waits for its victims' room
            arena.mapped = min(len(arena.buf), arena.mapped + (4 << 20))
            self.grown += 1
    def page_windows(self, files): return None

rng = np.random.default_rng(7)
path = Path(sys.argv[2])
tensors = {f"big.{i}": rng.integers(0, 255, size=n, dtype=np.uint8) for i, n in enumerate([9 << 20, 5 << 20, (20 << 20) + 4096, 1 << 20, 33 << 20])}
tensors.update({f"small.{i}": rng.integers(0, 255, size=1000 + i, dtype=np.uint8) for i in range(40)})
save_file(tensors, str(path))
want = fingerprint_files(path)
for mode in sys.argv[3:]:
    backend = Backend(loop_tasks="chunks" not in mode)  # load_chunk_loop = "tasks" or "c"
    backend.refuse = mode == "refused-lazy"
    # "lazy": the arena mapped as the tasks ask (a miss growing into its victims' room), and
    # each call into the loop ends after one task (its byte budget spent).
    cuda_writer.LOOP_BUDGET = 1 if "lazy" in mode else 256 << 20
    FILE_DIGESTS.clear()  # hashed at every load here, not known from the one before
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        arena = Arena(ckpt.arena_bytes, 0 if "lazy" in mode else ckpt.arena_bytes)
        w = VmmWriter(backend, arena, 8 << 20)
        loops = []
        def task_loop(*a, own=w.task_loop):
            loops.append(own(*a))
            if mode == "badfd":  # the fourth task reads from an fd that is not open
                loops[-1]._arrays[0][3] = 987654
            return loops[-1]
        w.task_loop = task_loop
        if mode == "pyfail":  # a batch of small tensors fails on the Python path
            def write_batch(*a):
                time.sleep(0.05)
                raise RuntimeError("batch failed")
            w.write_batch = write_batch
        slow[:] = [0.1] if mode == "slow-cancel" else []
        def cancelled():  # "slow-cancel": once each of the 4 threads is in a task of the loop
            return mode == "cancel" or (mode == "slow-cancel" and loops[0].table.next >= 4)
        try:
            fp = read_checkpoint(ckpt, opened, w, threads=4, chunk=8 << 20, cancelled=cancelled)
        except Exception as exc:
            print(mode, type(exc).__name__, getattr(exc, "message", exc), loops[0].table.stop,
                  loops[0].table.next < loops[0].ntasks, w.looped_bytes < sum(t.nbytes for t in loops[0]._tasks))
            continue
        driver.fake_sync_all()
        placed = all(arena.buf.raw[t.arena_offset : t.arena_offset + t.nbytes] == tensors[t.name].tobytes()
                     for t in ckpt.tensors)
    loop = loops[0] if loops else None  # not asked for: the reader plans no task loop
    print(mode, fp == want, placed, w.looped_bytes > 0, loop.table.next >= loop.ntasks > 1 if loop else None,
          backend.grown > 0)
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the loop built from the source, a folder with the stand-in libcuda.so.1 and cuda.bindings)."""
    d = tmp_path_factory.mktemp("chunk-loop")
    loop = d / "_staging_loop.so"
    subprocess.run([str(CC), "-O2", "-shared", "-fPIC", "-o", str(loop), str(ROOT / "weightcache/backends/staging_loop.c"),
                    "-ldl", "-lpthread"], check=True)
    (d / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run([str(CC), "-O2", "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "fake.c")], check=True)
    (d / "cuda" / "bindings").mkdir(parents=True)
    (d / "cuda" / "__init__.py").write_text("")
    (d / "cuda" / "bindings" / "__init__.py").write_text("")
    (d / "cuda" / "bindings" / "driver.py").write_text(FAKE_BINDINGS)
    return loop, d


def run(script: str, fake: Path, *args: str) -> list[str]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake), "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"}
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


@pytest.mark.parametrize(("slot", "slots"), [(4096, 3), (4096, 1), (1000, 16)])
def test_the_loop_waits_for_each_slots_copy_before_it_refills_the_slot(built: tuple[Path, Path], tmp_path: Path,
                                                                       slot: int, slots: int) -> None:
    loop, fake = built
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(50_000))
    lines = run(LOOP_ALONE, fake, str(path), str(slot), str(slots), str(loop))
    assert lines[0] == "same", lines
    # One copy a slot's worth of each call (cut as LOOP_ALONE cuts them), each made only
    # when an event after it was waited for.
    cuts = [0, 50_000 // 3 + 17, 2 * 50_000 // 3 - 5, 50_000]
    assert int(lines[1].split()[1]) == sum(-(-(b - a) // slot) for a, b in itertools.pairwise(cuts))
    assert lines[2] == "short CorruptCheckpoint"
    assert "Bad file descriptor" in lines[3]


def test_the_writer_mixes_the_loop_and_the_python_path_on_one_buffer(built: tuple[Path, Path], tmp_path: Path) -> None:
    """A thread's chunks go through the loop or the Python path (chunks the host hashes,
    batches of small tensors) in any order, on one buffer or a ring of them, and a new
    load reuses the buffers: every copy out of a buffer is waited for before it is
    refilled, whichever way filled it."""
    loop, fake = built
    plans = ["1:c,c,c", "1:py,c,py,c", "2:c,py,c,py,py,c", "3:py,py,py,py,c,py,c", "1:c,batch,c", "2:c,batch,c,batch,c",
             "1:batch,c,py,c"]
    lines = run(WRITER, fake, str(loop), str(tmp_path / "f.bin"), *plans)
    assert lines == [f"{plan} same {plan.split(':')[1].split(',').count('c')}" for plan in plans]


def test_a_library_built_from_another_source_is_refused(built: tuple[Path, Path], tmp_path: Path) -> None:
    _loop, fake = built
    src = (ROOT / "weightcache/backends/staging_loop.c").read_text()
    assert "#define WC_MAX_SLOTS 16" in src
    (tmp_path / "old.c").write_text(src.replace("#define WC_MAX_SLOTS 16", "#define WC_MAX_SLOTS 8"))
    old = tmp_path / "_staging_loop.so"
    subprocess.run([str(CC), "-O2", "-shared", "-fPIC", "-o", str(old), str(tmp_path / "old.c"), "-ldl", "-lpthread"],
                   check=True)
    lines = run("import sys; from pathlib import Path; from weightcache.backends.staging_loop import load_chunk_loop; "
                "print(load_chunk_loop(Path(sys.argv[1])))", fake, str(old))
    assert lines == ["(None, '_staging_loop.so was built from another staging_loop.c (rebuild: pip install, or `make native`)')"]


def test_a_threads_tasks_in_one_call_land_hash_and_fail_as_chunk_by_chunk(built: tuple[Path, Path], tmp_path: Path) -> None:
    """The reader hands the loop whole tasks (Note [a thread's tasks in one call]): four
    threads claim them from one table; each task's pieces are hashed by kernels that run
    after its copies and no earlier (the stand-in runs a kernel at its launch, with only the
    copies it was told to wait for done), into the slots handed out beforehand; small
    tensors still go in batches hashed on the host. The bytes and the fingerprint are
    those of the file, as chunk by chunk, also when the arena is mapped only as the load
    asks for it (a miss that grows into its victims' room)."""
    pytest.importorskip("numpy")
    loop, fake = built
    path = tmp_path / "m.safetensors"
    lines = run(READER, fake, str(loop), str(path), "tasks", "chunks", "tasks-lazy", "badfd", "cancel", "refused-lazy",
                "pyfail", "slow-cancel")
    assert lines[:3] == ["tasks True True True True False", "chunks True True True None False",
                         "tasks-lazy True True True True True"]
    # A task that fails stops the others' claims and says which file; a cancel, which the
    # threads see between their calls, stops the loop before its tasks are claimed.
    assert lines[3].startswith(f"badfd LoadFailed {path}: read failed: Bad file descriptor 1 ")
    assert lines[4] == "cancel LoadFailed load cancelled 1 True True"
    # The arena's growth refused (no room ever came), or a failure on the Python path: the
    # loop stops with it.
    assert lines[5].startswith("refused-lazy RuntimeError no room 1 ")
    assert lines[6].startswith("pyfail RuntimeError batch failed 1 ")
    # A cancel while every thread is inside the loop (each task 0.1 s here): the reader's
    # own thread sees it and stops the loop; the tasks under way end, no others start.
    assert lines[7].startswith("slow-cancel LoadFailed load cancelled 1 ") and lines[7].endswith(" True"), lines[7]
