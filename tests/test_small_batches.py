"""Small tensors read and hashed in batches (Note [small tensors in batches], loader/reader.py):
the same arena bytes, tensor digests and fingerprint as one task a tensor, and the plan's shape."""

import os
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from weightcache.backends.cpu import CpuBackend
from weightcache.backends.page_cache import PageCacheWriter, populate_supported
from weightcache.errors import CorruptCheckpoint
from weightcache.loader import fingerprint_files, open_source, parse_checkpoint, read_checkpoint
from weightcache.loader.preads import pread_scattered
from weightcache.loader.reader import (
    BATCH_TENSORS,
    FILE_DIGESTS,
    HASH_BLOCK,
    SMALL_TENSOR,
    Batch,
    Task,
    plan_tasks,
    plan_work,
)


def many_small(path: Path, n: int = 3000) -> Path:
    """``n`` tensors of 0-300 bytes (1, 3 and 8 bytes most), a few over SMALL_TENSOR, in
    several dtypes: runs broken by the arena's padding, and some tensors of no bytes."""
    g = torch.Generator().manual_seed(7)
    sizes = [0, 1, 3, 8, 1, 256, 300, 1]
    tensors = {}
    for i in range(n):
        nb = sizes[i % len(sizes)]
        tensors[f"layer.{i:05d}.w"] = torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g)
    tensors["big.a"] = torch.randn(SMALL_TENSOR // 4 + 5, generator=g)  # just over: a task
    tensors["big.b"] = torch.randn(3, 70_001, generator=g).to(torch.bfloat16)
    tensors["mid.f64"] = torch.randn(8, generator=g, dtype=torch.float64)
    save_file(tensors, str(path))
    return path


class OneTaskEach:
    """The memfd writer without write_batch: the reader plans one task a tensor (the old path)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.direct_io, self.serves_files, self.device_hash_min = inner.direct_io, inner.serves_files, inner.device_hash_min

    def write_from_file(self, *a, **kw) -> None:
        self.inner.write_from_file(*a, **kw)

    def finish(self) -> None:
        self.inner.finish()


def load(path: Path, batched: bool, threads: int = 3, chunk: int = 65536,
         page_cache: bool = False) -> tuple[str, bytes, dict]:
    """(fingerprint, arena bytes, the digests kept for the file) of one load into a memfd,
    or with ``page_cache`` into a file arena (its bytes: the file's)."""
    FILE_DIGESTS.clear()
    backend = CpuBackend("cpu", page_cache=page_cache)
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        arena = backend.allocate(ckpt.arena_bytes, "t")
        try:
            if page_cache:
                backend.bind_files(arena, ckpt, opened)
                assert arena.files is not None, arena.fallback
            writer = backend.writer(arena, chunk)
            assert isinstance(writer, PageCacheWriter) == page_cache
            fp = read_checkpoint(ckpt, opened, writer if batched else OneTaskEach(writer), threads=threads, chunk=chunk, nice=0)
            backend.seal(arena)
            data = path.read_bytes() if page_cache else os.pread(arena.fd, ckpt.arena_bytes, 0)
        finally:
            backend.free(arena)
        st = os.fstat(opened.files[0].fd)
        kept = FILE_DIGESTS.get((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)) or {}
    FILE_DIGESTS.clear()
    assert fp is not None
    return fp, data, dict(kept)


def spec_fingerprint(path: Path) -> str:
    """Note [content fingerprint] written out from the file's bytes, independently of the loader."""
    raw = path.read_bytes()
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
    h = xxhash.xxh3_128()
    for t in sorted(ckpt.tensors, key=lambda t: t.name):
        b = raw[t.file_offset : t.file_offset + t.nbytes]
        pieces = b"".join(xxhash.xxh3_128_digest(b[o : o + HASH_BLOCK]) for o in range(0, len(b), HASH_BLOCK))
        h.update(f"{t.name}\0{t.dtype}\0{','.join(map(str, t.shape))}\0".encode())
        h.update(xxhash.xxh3_128_digest(pieces))
    return h.hexdigest()


def test_batches_give_the_old_paths_bytes_digests_and_fingerprint(tmp_path):
    path = many_small(tmp_path / "m.safetensors")
    new, old = load(path, batched=True), load(path, batched=False)
    assert new[0] == old[0] == spec_fingerprint(path) == fingerprint_files(path)
    assert new[1] == old[1]  # every tensor in its place, padding untouched
    assert new[2] == old[2]  # the digests kept by file identity (empty where the file is not trusted)
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
    raw = path.read_bytes()
    for t in ckpt.tensors:
        assert new[1][t.arena_offset : t.arena_offset + t.nbytes] == raw[t.file_offset : t.file_offset + t.nbytes]


@pytest.mark.skipif(not populate_supported(), reason="file arenas need MADV_POPULATE_READ (Linux >= 5.14)")
def test_a_file_arena_populates_and_hashes_batches_as_one_task_a_tensor_does(tmp_path, monkeypatch):
    # The CPU path of trusted (operator) files: a batch is one populate of its file range,
    # hashed from the mapping; the digests it keeps by file identity are the old path's.
    path = many_small(tmp_path / "m.safetensors")
    calls = []
    write_batch = PageCacheWriter.write_batch
    monkeypatch.setattr(PageCacheWriter, "write_batch", lambda self, *a: calls.append(a[3]) or write_batch(self, *a))
    new, old = load(path, batched=True, page_cache=True), load(path, batched=False, page_cache=True)
    assert sum(map(len, calls)) > 2000  # the small tensors went in batches
    assert new[0] == old[0] == spec_fingerprint(path)
    assert new[2] == old[2] and new[2]  # trusted file: digests kept, the same ones


@pytest.mark.skipif(not populate_supported(), reason="file arenas need MADV_POPULATE_READ (Linux >= 5.14)")
def test_a_file_arena_batch_past_a_truncated_end_is_a_corrupt_checkpoint(tmp_path):
    path = many_small(tmp_path / "m.safetensors", 20000)
    backend = CpuBackend("cpu")
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        last = [w for w in plan_work(ckpt, 65536) if isinstance(w, Batch)][-1]
        arena = backend.allocate(ckpt.arena_bytes, "t")
        try:
            backend.bind_files(arena, ckpt, opened)
            assert arena.files is not None, arena.fallback
            writer = backend.writer(arena, 65536)
            os.truncate(path, (last.file_offset // 4096 - 1) * 4096)  # the batch's pages now past the end
            with pytest.raises(CorruptCheckpoint, match="truncated"):
                writer.write_batch(opened.files[0].fd, last.file_offset, last.arena_offsets, last.sizes,
                                   lambda views: None)
            writer.finish()
        finally:
            backend.free(arena)


@pytest.mark.parametrize("threads,chunk", [(1, 4096), (4, 65536), (2, 16 * 2**20)])
def test_the_fingerprint_does_not_depend_on_threads_or_chunk(tmp_path, threads, chunk):
    path = many_small(tmp_path / "m.safetensors", 1200)
    assert load(path, True, threads, chunk)[0] == load(path, False, threads, chunk)[0] == spec_fingerprint(path)


def test_the_plan_batches_small_tensors_and_keeps_tasks_for_big_ones(tmp_path):
    path = many_small(tmp_path / "m.safetensors", 5000)
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
    work = plan_work(ckpt, 65536)
    batches = [w for w in work if isinstance(w, Batch)]
    tasks = [w for w in work if isinstance(w, Task)]
    nonempty = [i for i, t in enumerate(ckpt.tensors) if t.nbytes]
    small = {i for i in nonempty if ckpt.tensors[i].nbytes <= SMALL_TENSOR}
    # every small tensor in exactly one batch, each batch back to back in the file, within its bounds
    assert sorted(i for b in batches for i in b.tensors) == sorted(small)
    for b in batches:
        assert 0 < len(b.tensors) <= BATCH_TENSORS and b.nbytes == sum(b.sizes) <= 65536
        offs = [ckpt.tensors[i].file_offset for i in b.tensors]
        assert offs[0] == b.file_offset and all(o + s == n for o, s, n in zip(offs, b.sizes, offs[1:], strict=False))
        assert b.arena_offsets == [ckpt.tensors[i].arena_offset for i in b.tensors]
        # in the arena in order, spanning at most a chunk: a staging buffer holds the span
        assert all(a + s <= n for a, s, n in zip(b.arena_offsets, b.sizes, b.arena_offsets[1:], strict=False))
        assert b.arena_offsets[-1] + b.sizes[-1] - b.arena_offsets[0] <= 65536
    # ~5000 one-tensor tasks before; batches cut where BATCH_TENSORS, or a chunk of the
    # arena (each tensor 256-byte aligned there), is full
    padded = sum(-(-ckpt.tensors[i].nbytes // 256) * 256 for i in small)
    assert len(batches) <= -(-len(small) // BATCH_TENSORS) + -(-padded // 65536) + 2
    # the big tensors as plan_tasks made them
    big = [t for t in plan_tasks(ckpt, 65536) if any(ckpt.tensors[p.tensor].nbytes > SMALL_TENSOR for p in t.pieces)]
    assert tasks == big


def test_a_file_cut_short_under_a_batch_is_a_corrupt_checkpoint(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(bytes(range(100)))
    fd = os.open(p, os.O_RDONLY)
    try:
        bufs = [bytearray(n) for n in (10, 1, 30)]
        views = [memoryview(b) for b in bufs]
        pread_scattered(fd, views, 50)
        assert b"".join(bufs) == bytes(range(50, 91))
        with pytest.raises(CorruptCheckpoint):
            pread_scattered(fd, [memoryview(bytearray(n)) for n in (40, 20)], 50)  # 10 bytes past the end
    finally:
        os.close(fd)


def test_more_buffers_than_one_preadv_takes(tmp_path):
    p = tmp_path / "long.bin"
    data = os.urandom(3 * BATCH_TENSORS + 7)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        bufs = [bytearray(1) for _ in range(len(data) - 3)]
        pread_scattered(fd, [memoryview(b) for b in bufs], 3)
        assert b"".join(bufs) == data[3:]
    finally:
        os.close(fd)


def test_a_failed_batch_releases_its_views_of_the_mapping(tmp_path):
    path = many_small(tmp_path / "m.safetensors", 2000)
    backend = CpuBackend("cpu", page_cache=False)
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        batch = next(w for w in plan_work(ckpt, 65536) if isinstance(w, Batch))
        arena = backend.allocate(ckpt.arena_bytes, "t")
        try:
            writer = backend.writer(arena, 65536)
            size = path.stat().st_size
            with pytest.raises(CorruptCheckpoint):  # read from past the file's end: a short read
                writer.write_batch(opened.files[0].fd, size - 2, batch.arena_offsets, batch.sizes, None)
            writer.finish()
        finally:
            backend.free(arena)  # a view kept alive would pin the mapping: BufferError here


def test_no_batch_is_longer_than_the_chunk(tmp_path):
    # _HashingWriter reads a batch through its buffer of one chunk: a tensor of 5000 bytes
    # with chunk = 4096 is a task, not a batch it could not hold.
    p = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.full((n,), i, dtype=torch.uint8) for i, n in enumerate([5000, 1, 4096, 3, 4000, 97])}, str(p))
    with open_source(p) as opened:
        ckpt = parse_checkpoint(opened)
    work = plan_work(ckpt, 4096)
    assert all(w.nbytes <= 4096 and w.arena_offsets[-1] + w.sizes[-1] - w.arena_offsets[0] <= 4096
               for w in work if isinstance(w, Batch))
    assert {ckpt.tensors[w.pieces[0].tensor].nbytes for w in work if isinstance(w, Task)} == {5000}
    assert load(p, True, 2, 4096)[0] == load(p, False, 2, 4096)[0] == spec_fingerprint(p)
    assert fingerprint_files(p, threads=2, chunk=4096) == spec_fingerprint(p)


@pytest.mark.gpu
def test_a_vmm_arena_gets_batches_bit_exact_and_zero_padded(tmp_path, monkeypatch):
    """The CUDA writer stages a batch's arena span and copies it at once: every tensor in
    its place, the fingerprint and kept digests the old path's, and the padding between
    a batch's tensors zero though the staging buffers last held other bytes (another
    load's, maybe another tenant's)."""
    from helpers import skip_without_cuda

    skip_without_cuda()
    from cuda.bindings import driver as cu

    from weightcache import cuda_driver as drv
    from weightcache.backends.cuda import CudaBackend
    from weightcache.backends.cuda_writer import VmmWriter
    from weightcache.loader.preads import DIRECT_ALIGN

    path = many_small(tmp_path / "m.safetensors")
    raw = path.read_bytes()
    chunk, threads = 65536, 3
    calls = []
    write_batch = VmmWriter.write_batch
    monkeypatch.setattr(VmmWriter, "write_batch", lambda self, *a: calls.append(a[3]) or write_batch(self, *a))
    backend = CudaBackend("cuda:0")
    try:
        got = {}
        for batched in (True, False):
            dirty = [backend.staging.take(chunk + 2 * DIRECT_ALIGN) for _ in range(threads)]
            for st in dirty:
                st.view[:] = b"\xab" * st.size
                backend.staging.give_back(st)
            FILE_DIGESTS.clear()
            with open_source(path) as opened:
                ckpt = parse_checkpoint(opened)
                arena = backend.allocate(backend.capacity(ckpt.arena_bytes), "t")
                try:
                    writer = backend.writer(arena, chunk)
                    fp = read_checkpoint(ckpt, opened, writer if batched else OneTaskEach(writer), threads=threads,
                                         chunk=chunk, nice=0)
                    backend.seal(arena)
                    host = torch.empty(ckpt.arena_bytes, dtype=torch.uint8)
                    with drv.current(backend.ctx):
                        drv.check(cu.cuMemcpyDtoH(host.data_ptr(), arena.va, ckpt.arena_bytes))
                finally:
                    backend.free(arena)
                st = os.fstat(opened.files[0].fd)
            kept = dict(FILE_DIGESTS.get((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)) or {})
            got[batched] = fp, host.numpy().tobytes(), kept
    finally:
        FILE_DIGESTS.clear()
        backend.close()
    assert sum(map(len, calls)) > 2000  # the small tensors went in batches
    (fp, data, kept), (old_fp, old_data, old_kept) = got[True], got[False]
    assert fp == old_fp == spec_fingerprint(path)
    assert kept == old_kept
    for t in ckpt.tensors:
        want = raw[t.file_offset : t.file_offset + t.nbytes]
        assert data[t.arena_offset : t.arena_offset + t.nbytes] == want == old_data[t.arena_offset : t.arena_offset + t.nbytes]
    for b in (w for w in plan_work(ckpt, chunk) if isinstance(w, Batch)):
        base = b.arena_offsets[0]
        span = bytearray(b.arena_offsets[-1] + b.sizes[-1] - base)
        for ao, nb, fo in zip(b.arena_offsets, b.sizes, (ckpt.tensors[i].file_offset for i in b.tensors), strict=True):
            span[ao - base : ao - base + nb] = raw[fo : fo + nb]
        assert data[base : base + len(span)] == span, f"batch at {base}: padding not zero or a tensor misplaced"
