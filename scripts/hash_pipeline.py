"""Where the content hash's cost goes in a CUDA load from a warm page cache (issue 14).

tools/bench_hash.py measured the first load of a 9.15 GiB file at 1.6x the load without
the hash on the H200 (docs/benchmarks.md). This script runs the daemon's own loader
(``read_checkpoint`` into a VMM arena) with writers that differ only in how a loader
thread arranges its read, its hash and its host-to-device copy, side by side in one
process, interleaved, so the arrangement can be chosen by measurement:

- ``read 16M``: one ``preadv`` per 16 MiB chunk (the loader without the hash);
- ``read 1M``: the chunk read in 1 MiB slices, nothing hashed (what slicing alone costs);
- ``read+hash 1M``: each 1 MiB slice hashed as soon as it is read (bytes still in cache);
- ``read, copy, hash 16M``: the whole chunk read, its copy to the GPU started, then the
  chunk hashed from memory while the copy runs;
- ``... hash thread``: as the previous, the hash handed to a helper thread per loader
  thread, so the loader thread reads its next chunk meanwhile.

each with 1 or 2 (3 with a hash thread) pinned staging buffers per thread: with one, a
thread waits for its previous copy before it reads again. Plus the host's raw rates:
xxh3-128 over a cached 1 MiB and over 1 GiB, and memmove with 1 and N threads.

    python3 scripts/hash_pipeline.py --device cuda:0 --size-gib 9.15 --tensors 183 --threads 8,16 --out r.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash
from cuda.bindings import driver as cu

from weightcache import cuda_driver as drv
from weightcache.backends.cuda import CudaBackend
from weightcache.backends.cuda_writer import VmmWriter
from weightcache.loader import open_source, parse_checkpoint, read_checkpoint
from weightcache.loader.content import FILE_DIGESTS
from weightcache.loader.preads import pread_full
from weightcache.tools.bench_measure import warm_page_cache
from weightcache.tools.synth import kept_checkpoint

SLICE = 1 << 20
FINGERPRINTS: set[str | None] = set()  # every hashing variant's, to check they agree


class VariantWriter(VmmWriter):
    """``VmmWriter`` with a choice of read/hash arrangement and staging buffers per thread."""

    def __init__(self, backend: CudaBackend, arena, chunk: int, mode: str, buffers: int, hash_thread: bool) -> None:
        super().__init__(backend, arena, chunk)
        self.mode, self.buffers, self.hash_thread = mode, buffers, hash_thread
        self._helpers: list[ThreadPoolExecutor] = []

    def _ring(self):
        loc = self._local
        if getattr(loc, "ring", None) is None:
            loc.ring = [self._b.staging.take(self._size) for _ in range(self.buffers)]
            loc.pending = [None] * self.buffers  # the hash future reading each buffer
            loc.next = 0
            if self.hash_thread:
                loc.helper = ThreadPoolExecutor(1)
                with self._lock:
                    self._helpers.append(loc.helper)
            with self._lock:
                self._all.extend(loc.ring)
        return loc

    def write_from_file(self, fd, file_offset, arena_offset, nbytes, direct=False, seen=None):
        with drv.current(self._b.ctx):
            loc = self._ring()
            i = loc.next
            loc.next = (i + 1) % self.buffers
            st = loc.ring[i]
            if loc.pending[i] is not None:
                loc.pending[i].result()
                loc.pending[i] = None
            if st.busy:
                drv.check(cu.cuStreamSynchronize(st.stream))
            with st.view[:nbytes] as dst:
                if self.mode in ("16M", "after"):
                    pread_full(fd, dst, file_offset)
                else:  # 1 MiB slices, each hashed at once when hashing
                    for off in range(0, nbytes, SLICE):
                        with dst[off : off + SLICE] as part:
                            pread_full(fd, part, file_offset + off)
                            if seen is not None:
                                seen(part)
            if self._arena.mapped < arena_offset + nbytes:
                self._b.grow(self._arena, arena_offset + nbytes)
            drv.check(cu.cuMemcpyHtoDAsync(self._arena.va + arena_offset, st.host_ptr, nbytes, st.stream))
            st.busy = True
            if self.hash_thread:
                # read_checkpoint checks the pieces' digests before finish(), so this
                # variant hashes for itself (the same xxh3 work) and loads with
                # content_hash=False; finish() waits for the helpers.
                view = st.view[:nbytes]

                def run(v=view) -> None:
                    with v:
                        xxhash.xxh3_128_digest(v)

                loc.pending[i] = loc.helper.submit(run)
            elif seen is not None and self.mode == "after":
                with st.view[:nbytes] as view:
                    seen(view)

    def finish(self) -> None:
        for h in self._helpers:
            h.shutdown(wait=True)
        self._helpers.clear()
        super().finish()


VARIANTS = [  # name, mode, hash, buffers, hash thread
    ("read 16M, no hash, 1 buf", "16M", False, 1, False),
    ("read 16M, no hash, 2 bufs", "16M", False, 2, False),
    ("read 1M, no hash, 1 buf", "1M", False, 1, False),
    ("read+hash 1M, 1 buf (main)", "1M", True, 1, False),
    ("read+hash 1M, 2 bufs", "1M", True, 2, False),
    ("read, copy, hash 16M, 1 buf", "after", True, 1, False),
    ("read, copy, hash 16M, 2 bufs", "after", True, 2, False),
    ("read, copy, hash 16M, hash thread, 3 bufs", "after", True, 3, True),
]


def load_once(path: Path, backend: CudaBackend, threads: int, chunk: int, variant) -> float:
    _, mode, hashing, buffers, hash_thread = variant
    FILE_DIGESTS.clear()
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        t0 = time.perf_counter()
        arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "hash-pipeline")
        try:
            w = VariantWriter(backend, arena, chunk, mode, buffers, hash_thread)
            fp = read_checkpoint(ckpt, opened, w, threads=threads, chunk=chunk, nice=0,
                                 content_hash=hashing and not hash_thread)
            backend.seal(arena)
            dt = time.perf_counter() - t0
        finally:
            backend.free(arena)
    if hashing and not hash_thread:
        FINGERPRINTS.add(fp)
    return dt



def raw_rates(threads: int) -> dict[str, float]:
    out = {}
    small = bytearray(os.urandom(SLICE))
    t0 = time.perf_counter()
    for _ in range(2000):
        xxhash.xxh3_128_digest(small)
    out["xxh3_cached_1MiB_GBps"] = 2000 * SLICE / (time.perf_counter() - t0) / 1e9
    big = bytearray(os.urandom(SLICE)) * 1024
    t0 = time.perf_counter()
    for _ in range(3):
        xxhash.xxh3_128_digest(big)
    out["xxh3_1GiB_GBps"] = 3 * len(big) / (time.perf_counter() - t0) / 1e9
    src = (ctypes.c_char * len(big)).from_buffer(big)
    for n in (1, threads):
        dsts = [bytearray(len(big)) for _ in range(n)]
        for d in dsts:  # fault the pages in first
            ctypes.memmove((ctypes.c_char * len(d)).from_buffer(d), src, len(d))
        def copy(d) -> None:
            ctypes.memmove((ctypes.c_char * len(d)).from_buffer(d), src, len(d))
        ths = [threading.Thread(target=copy, args=(d,)) for d in dsts]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        out[f"memmove_{n}_threads_GBps"] = n * len(big) / (time.perf_counter() - t0) / 1e9
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--size-gib", type=float, default=9.15)
    p.add_argument("--tensors", type=int, default=183)
    p.add_argument("--threads", default="8,16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/wc-hash-pipeline")
    p.add_argument("--out")
    a = p.parse_args()
    path = kept_checkpoint(Path(a.workdir) / f"hash-{a.size_gib:g}g.safetensors", int(a.size_gib * 2**30), a.tensors)
    warm_page_cache(path)
    backend = CudaBackend(a.device)
    result: dict = {"nbytes": path.stat().st_size, "runs": {}}
    for threads in (int(t) for t in a.threads.split(",")):
        runs: dict[str, list[float]] = {v[0]: [] for v in VARIANTS}
        for rep in range(a.reps + 1):
            for v in VARIANTS if rep % 2 else VARIANTS[::-1]:
                dt = load_once(path, backend, threads, 16 << 20, v)
                if rep:
                    runs[v[0]].append(dt)
        base = sorted(runs[VARIANTS[0][0]])[len(runs[VARIANTS[0][0]]) // 2]
        for name, xs in runs.items():
            med = sorted(xs)[len(xs) // 2]
            print(f"t{threads:<3} {name:<44} p50 {med * 1e3:6.1f} ms [{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f}] "
                  f"{result['nbytes'] / med / 1e9:5.1f} GB/s  {med / base:.2f}x", flush=True)
        result["runs"][threads] = runs
    backend.close()
    result["fingerprints_agree"] = len(FINGERPRINTS) == 1
    print("fingerprints agree across variants:", result["fingerprints_agree"])
    result["raw"] = raw_rates(max(int(t) for t in a.threads.split(",")) // 2)
    for k, v in result["raw"].items():
        print(f"{k}: {v:.1f}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
