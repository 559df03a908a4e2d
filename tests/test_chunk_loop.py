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

FAKE_LIBCUDA = r"""
#include <string.h>
typedef struct { unsigned long long dst; const void *src; size_t n; } Copy;
static Copy queue[1 << 16];
static int queued, done, recorded[1 << 12];
int copies_waited;  /* copies made because an event or a stream was waited for */
static void upto(int k) {
    for (; done < k; done++) { memcpy((void *)queue[done].dst, queue[done].src, queue[done].n); copies_waited++; }
}
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream) {
    (void)stream; queue[queued++] = (Copy){dst, src, n}; return 0;
}
int cuEventRecord(void *ev, void *stream) { (void)stream; recorded[(long)ev] = queued; return 0; }
int cuEventSynchronize(void *ev) { upto(recorded[(long)ev]); return 0; }
int fake_sync_all(void) { upto(queued); return 0; }
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
def cuStreamWaitEvent(s, ev, flags): return (0,)
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
    ctx, device, gpu_hash = None, "fake", None
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
