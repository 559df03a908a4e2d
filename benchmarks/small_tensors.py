#!/usr/bin/env python3
"""Loads of a file of many small tensors, batched (Note [small tensors in batches],
loader/reader.py) and one task a tensor, side by side in one run, into each arena kind
this host has: a memfd, the page cache (file arenas) and, with a GPU, a VMM arena.

The file is a tenant's attack (the abuse stress's ``tinybomb``) as safetensors.torch.save_file writes it:
``--tensors`` one-byte tensors. Each row is the median of ``--repeats`` loads from a warm
page cache (read_checkpoint with the content hash, as a fill does): wall seconds and the
process's CPU seconds (the GIL the other tenants wait for).

    python -m benchmarks small-tensors --out results/small-tensors.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from weightcache.backends.base import Backend
from weightcache.backends.cpu import CpuBackend
from weightcache.loader import open_source, parse_checkpoint, read_checkpoint
from weightcache.loader.reader import FILE_DIGESTS

RESULTS = Path(__file__).resolve().parent.parent / "results"  # where every tool writes by default


class OneTaskEach:
    """A writer without write_batch: the reader plans one task a tensor (the old path)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.direct_io, self.serves_files, self.device_hash_min = inner.direct_io, inner.serves_files, inner.device_hash_min

    def write_from_file(self, *a: Any, **kw: Any) -> None:
        self.inner.write_from_file(*a, **kw)

    def finish(self) -> None:
        self.inner.finish()


def one_load(backend: Backend, path: Path, batched: bool, threads: int, chunk: int) -> tuple[float, float, str]:
    FILE_DIGESTS.clear()  # hashed at every load, as a tenant's (untrusted) files are
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "bench")
        try:
            if getattr(backend, "page_cache", False):
                backend.bind_files(arena, ckpt, opened)  # type: ignore[attr-defined]
                if arena.files is None:
                    raise SystemExit(f"no file arena: {arena.fallback}")
            writer = backend.writer(arena, chunk)
            w, c = time.perf_counter(), time.process_time()
            fp = read_checkpoint(ckpt, opened, writer if batched else OneTaskEach(writer), threads=threads, chunk=chunk, nice=0)
            backend.seal(arena)
            wall, cpu = time.perf_counter() - w, time.process_time() - c
        finally:
            backend.free(arena)
    assert fp is not None
    return wall, cpu, fp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "small-tensors.json")
    args = ap.parse_args()
    chunk = args.chunk_mib << 20
    backends: dict[str, Backend] = {"memfd": CpuBackend("cpu", page_cache=False), "page_cache": CpuBackend("cpu", page_cache=True)}
    if torch.cuda.is_available():
        from weightcache.backends.cuda import CudaBackend

        backends["vmm"] = CudaBackend("cuda:0")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tiny.safetensors"
        g = torch.Generator().manual_seed(0)
        save_file({f"t{i:06d}": torch.randint(0, 256, (1,), dtype=torch.uint8, generator=g) for i in range(args.tensors)}, str(path))
        for kind, backend in backends.items():
            fps = set()
            for batched in (True, False):
                one_load(backend, path, batched, args.threads, chunk)  # warm: page cache, staging buffers
                runs = [one_load(backend, path, batched, args.threads, chunk) for _ in range(args.repeats)]
                fps |= {fp for *_, fp in runs}
                rows.append({"arena": kind, "batched": batched, "wall_s": statistics.median(r[0] for r in runs),
                             "cpu_s": statistics.median(r[1] for r in runs)})
                print(json.dumps(rows[-1]), flush=True)
            if len(fps) != 1:
                raise SystemExit(f"{kind}: fingerprints differ between the paths: {fps}")
            backend.close()
    result = {"tensors": args.tensors, "threads": args.threads, "chunk_mib": args.chunk_mib, "repeats": args.repeats,
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
