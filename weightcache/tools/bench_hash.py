"""What the content fingerprint costs the loader (loader/reader.py, Note [content
fingerprint]): the daemon's own loader (``read_checkpoint`` into a backend's arena, as a
load fills one) with the hash on and off, alternating, page cache warm, in one process.

The product always hashes; ``content_hash=False`` exists for this measurement only.
Arenas, per device:

- ``cpu``: a memfd (every byte copied, and hashed as it is copied), and a file arena
  (the page cache populated, then a hash pass over the mapping) both the first time
  and with the file's digests already kept (a reload after eviction);
- ``cuda:N``: VMM memory filled through the pinned staging buffers, each piece hashed
  on the GPU once copied (backends/cuda_hash.py), and the same with the hash on the host
  ("vmm, host hash": from the staging buffers, what a GPU without the kernel does).

``weightcache bench`` runs it as its "content hash" rows; ``python -m
weightcache.tools.bench_hash --out FILE.json`` runs it alone. It also checks that xxh3
releases the GIL: a Python loop keeps its pace while another thread hashes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from ..backends import Backend
from ..loader import open_source, parse_checkpoint, read_checkpoint
from ..loader.reader import FILE_DIGESTS
from .bench_measure import warm_page_cache
from .bench_result import ContentHashFigures, Spread

# "on" is a first load (no digests kept); "on, digests kept" a reload of a file that only
# the daemon's uid can change, whose digests it kept (Note [content fingerprint]).
VARIANTS_CPU = (("memfd", "off"), ("memfd", "on"), ("memfd", "on, digests kept"), ("file", "off"), ("file", "on"),
                ("file", "on, digests kept"))
VARIANTS_CUDA = (("vmm", "off"), ("vmm", "on"), ("vmm", "on, digests kept"), ("vmm, host hash", "on"))


def _backend(device: str, arena: str) -> Backend:
    if device.startswith("cuda"):
        from ..backends.cuda import CudaBackend

        backend = CudaBackend(device, hash_on_gpu=arena == "vmm")
        if arena == "vmm" and backend.gpu_hash is None:
            raise RuntimeError(f"{device}: the content hash cannot run on this GPU: {backend.gpu_hash_unavailable}")
        return backend
    from ..backends.cpu import CpuBackend

    return CpuBackend(device, page_cache=arena == "file")


def load_once(path: Path, backend: Backend, threads: int, chunk: int, content_hash: bool) -> tuple[float, str]:
    """One load as the daemon fills an arena (allocate, bind, read, seal), then free it.
    Returns the seconds from allocate to sealed, and the arena's kind."""
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        t0 = time.perf_counter()
        arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "bench-hash")
        try:
            backend.bind_files(arena, ckpt, opened)
            read_checkpoint(ckpt, opened, backend.writer(arena, chunk), threads=threads, chunk=chunk, nice=0,
                            content_hash=content_hash)
            backend.seal(arena)
            dt = time.perf_counter() - t0
            return dt, str(getattr(arena, "kind", backend.kind))
        finally:
            backend.free(arena)


def _pace(work: Callable[[], object], seconds: float = 0.5) -> float:
    """A Python loop's iterations while ``work`` runs over and over in another thread,
    over its iterations alone."""

    def spin() -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    alone = spin()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    t = threading.Thread(target=loop)
    t.start()
    try:
        time.sleep(0.02)
        busy = spin()
    finally:
        stop.set()
        t.join()
    return busy / alone


def measure_content_hash(path: Path, device: str, *, reps: int = 5, threads: int = 8, chunk: int = 16 << 20,
                         log: Callable[[str], None] = lambda _m: None) -> ContentHashFigures:
    """Every variant ``reps`` times, interleaved (a variant's runs spread over the whole
    measurement, so drift in the shared host's load falls on all of them alike), after
    one uncounted warm-up round that also warms the page cache."""
    variants = VARIANTS_CUDA if device.startswith("cuda") else VARIANTS_CPU
    backends = {arena: _backend(device, arena) for arena, _ in variants}
    runs: dict[str, list[float]] = {f"{a}, {h}": [] for a, h in variants}
    kinds: dict[str, str] = {}
    # A memfd load drops the file's pages once copied (POSIX_FADV_DONTNEED): the page
    # cache is warmed again after one, so every load here starts from a warm page cache.
    # Only then: reading 9 GiB back through Python took seconds per load on the H200.
    dropped = True
    for rep in range(reps + 1):
        order = variants if rep % 2 else variants[::-1]
        for arena, hashing in order:
            key = f"{arena}, {hashing}"
            if hashing == "on":
                FILE_DIGESTS.clear()  # a first load: every byte is hashed
            elif hashing == "on, digests kept":
                load_once(path, backends[arena], threads, chunk, True)  # keeps the file's digests
                dropped = dropped or arena == "memfd"
            if dropped:
                warm_page_cache(path)
            dt, kind = load_once(path, backends[arena], threads, chunk, hashing != "off")
            dropped = arena == "memfd"
            kinds[key] = kind
            if rep:
                runs[key].append(dt)
                log(f"{key}: {dt * 1e3:.1f} ms")
    for b in backends.values():
        b.close()
    buf = memoryview(bytearray(os.urandom(1 << 20)) * 64)
    t0 = time.perf_counter()
    for _ in range(8):
        xxhash.xxh3_128_digest(buf)
    gbps = 8 * len(buf) / (time.perf_counter() - t0) / 1e9
    return ContentHashFigures(
        device=device, nbytes=path.stat().st_size, threads=threads, chunk=chunk,
        runs={k: Spread(tuple(v)) for k, v in runs.items()}, kinds=kinds,
        gil_pace=_pace(lambda: xxhash.xxh3_128_digest(buf)), gil_pace_copy=_pace(lambda: bytes(buf)), xxh3_GBps=gbps,
    )


def describe(f: ContentHashFigures) -> list[str]:
    """The figures as lines, for the bench's table and this module's own output."""
    lines = []
    for key, sp in f.runs.items():
        arena = key.split(",")[0]
        off = f.runs.get(f"{arena}, off")
        rel = f"  {sp.p50 / off.p50:.2f}x of hash off" if off is not None and sp is not off else ""
        lines.append(f"loader, {key} (arena {f.kinds.get(key, '?')}): p50 {sp.p50 * 1e3:.1f} ms "
                     f"[{min(sp.runs) * 1e3:.1f}-{max(sp.runs) * 1e3:.1f}], {f.nbytes / sp.p50 / 1e9:.2f} GB/s{rel}")
    lines.append(f"xxh3-128, one thread: {f.xxh3_GBps:.1f} GB/s; a Python loop's pace while another thread hashes: "
                 f"{f.gil_pace:.2f} of alone (while it copies with bytes(), holding the GIL: {f.gil_pace_copy:.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightcache.tools.bench_hash", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--workdir", default="/tmp/wc-bench-hash")
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args(argv)
    if args.device.startswith("cuda"):
        try:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no GPU")
        except Exception as exc:
            print(f"--device {args.device} needs CUDA: {exc}", file=sys.stderr)
            return 2
    from .synth import kept_checkpoint

    # Mode 0644 (write_checkpoint's): readable by all, not writable by others, as a file
    # arena on the CPU needs and as a file the daemon hashes once per version.
    path = kept_checkpoint(Path(args.workdir) / f"hash-{args.size_gib:g}g.safetensors", int(args.size_gib * 2**30),
                           args.tensors)
    figs = measure_content_hash(path, args.device, reps=args.reps, threads=args.threads, chunk=args.chunk_mib << 20,
                                log=lambda m: print(m, file=sys.stderr))
    for line in describe(figs):
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(figs.as_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
