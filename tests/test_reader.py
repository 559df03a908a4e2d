"""Reading a checkpoint from its open fds: O_DIRECT reads (and the page-cache residency probe
that decides when to use them), whole loads into a CPU arena, and changes noticed mid-load."""

import fcntl
import mmap
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightcache.backends.cpu import CpuBackend
from weightcache.errors import CorruptCheckpoint
from weightcache.loader import Progress, fingerprint_files, open_source, parse_checkpoint, read_checkpoint
from weightcache.loader.preads import DIRECT_ALIGN, pread_direct, pread_full, resident_fraction
from weightcache.loader.reader import open_for_reading


class DirectWriter:
    direct_io = True
    serves_files = False
    device_hash_min = None


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "blob.bin"
    data = os.urandom(3 * 2**20 + 123)
    p.write_bytes(data)
    os.sync()
    return p, data


def drop(path):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_pread_direct_at_unaligned_offsets(data_file):
    path, data = data_file
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    buf = memoryview(mmap.mmap(-1, 2**20 + 2 * DIRECT_ALIGN))  # page-aligned, as pinned buffers are
    try:
        for offset, n in [(0, 4096), (1, 100), (4095, 2), (12345, 2**20), (len(data) - 77, 77)]:
            skew = pread_direct(fd, buf, offset, n)
            assert bytes(buf[skew : skew + n]) == data[offset : offset + n], (offset, n)
    finally:
        os.close(fd)


def test_residency_probe_and_the_auto_choice(data_file):
    path, _ = data_file
    fd = os.open(path, os.O_RDONLY)
    size = path.stat().st_size
    try:
        # Warm, and held mapped while the probe looks: on a busy VM reclaim (this one's
        # DAMON pages out unmapped file pages) took pages between a plain read and the
        # probe, and "auto" then chose O_DIRECT (a failure seen under load).
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as held:
            assert len(bytes(held)) == size
            assert resident_fraction(fd, size) >= 0.9
            rfd, direct, why = open_for_reading(fd, size, DirectWriter(), "auto")
            assert rfd == fd and not direct and "page cache" in why
        drop(path)
        cold = resident_fraction(fd, size)
        if cold >= 0.5:
            pytest.skip("posix_fadvise(DONTNEED) did not drop the pages here")
        # Looking does not read: the RWF_NOWAIT probe this replaced started readahead of
        # each page it missed, so 50 ms later this file was 100% warm and "auto" read it
        # buffered (a CI failure).
        time.sleep(0.1)
        assert resident_fraction(fd, size) <= cold
        rfd, direct, why = open_for_reading(fd, size, DirectWriter(), "auto")
        if direct:
            assert rfd != fd
            os.close(rfd)
        else:
            assert rfd == fd and "refused" in why
        rfd, direct, why = open_for_reading(fd, size, DirectWriter(), "off")
        assert rfd == fd and not direct and why == "buffered"
    finally:
        os.close(fd)


def test_o_direct_reopens_the_same_inode_not_the_path(data_file, tmp_path):
    """The O_DIRECT fd comes from /proc/self/fd/N: a file renamed over the path after the
    open does not reach it."""
    path, data = data_file
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    fd = os.open(path, os.O_RDONLY)
    try:
        other = tmp_path / "other.bin"
        other.write_bytes(os.urandom(len(data)))
        os.replace(other, path)  # the path now names another file of the same size
        rfd, direct, why = open_for_reading(fd, len(data), DirectWriter(), "on")
        assert direct, why
        try:
            assert rfd != fd and os.path.samestat(os.fstat(rfd), os.fstat(fd))
            assert os.fstat(rfd).st_ino != os.stat(path).st_ino
            assert fcntl.fcntl(rfd, fcntl.F_GETFL) & os.O_DIRECT
            buf = memoryview(mmap.mmap(-1, 2**20 + 2 * DIRECT_ALIGN))
            skew = pread_direct(rfd, buf, 1000, 2**20)
            assert bytes(buf[skew : skew + 2**20]) == data[1000 : 1000 + 2**20]
        finally:
            os.close(rfd)
    finally:
        os.close(fd)


class BytesArena:
    """A real ArenaWriter that takes O_DIRECT fds: it reads through a page-aligned bounce
    buffer (as the CUDA backend's pinned buffers do) into a bytearray."""

    direct_io = True
    serves_files = False
    device_hash_min = None

    def __init__(self, nbytes: int) -> None:
        self.data = bytearray(nbytes)
        self.direct_calls = 0
        self.lock = threading.Lock()

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen=None) -> None:
        if direct:
            with self.lock:
                self.direct_calls += 1
            buf = mmap.mmap(-1, nbytes + 2 * DIRECT_ALIGN)
            with memoryview(buf) as view:
                skew = pread_direct(fd, view, file_offset, nbytes)
                self.data[arena_offset : arena_offset + nbytes] = view[skew : skew + nbytes]
            buf.close()
        else:
            with memoryview(self.data)[arena_offset : arena_offset + nbytes] as dst:
                pread_full(fd, dst, file_offset)
        if seen is not None:
            with memoryview(self.data)[arena_offset : arena_offset + nbytes] as done:
                seen(done)

    def finish(self) -> None:
        pass


def expected_arena(ckpt, files: list[bytes]) -> bytes:
    out = bytearray(ckpt.arena_bytes)
    for t in ckpt.tensors:
        out[t.arena_offset : t.arena_offset + t.nbytes] = files[t.file][t.file_offset : t.file_offset + t.nbytes]
    return bytes(out)


def cpu_load(ckpt, opened, **kw) -> bytes:
    backend = CpuBackend("cpu")
    arena = backend.allocate(ckpt.arena_bytes, "t")
    try:
        read_checkpoint(ckpt, opened, backend.writer(arena, 65536), threads=4, chunk=65536, **kw)
        backend.seal(arena)
        return os.pread(arena.fd, ckpt.arena_bytes, 0)
    finally:
        backend.free(arena)


def test_read_checkpoint_reads_every_tensor_from_the_open_fds(ckpts):
    with open_source(ckpts["sharded"]) as opened:
        ckpt = parse_checkpoint(opened)
        files = [Path(f.path).read_bytes() for f in ckpt.files]
        progress = Progress(ckpt.data_bytes)
        assert cpu_load(ckpt, opened, progress=progress) == expected_arena(ckpt, files)
        assert progress.done == ckpt.data_bytes
        for f in opened.files:
            os.fstat(f.fd)  # read_checkpoint left the source's fds open: their owner closes them


@pytest.mark.parametrize("mode", ["on", "off"])
def test_read_checkpoint_with_o_direct_and_buffered(ckpts, mode):
    with open_source(ckpts["a"]) as opened:
        ckpt = parse_checkpoint(opened)
        writer = BytesArena(ckpt.arena_bytes)
        before = len(os.listdir("/proc/self/fd"))
        logged: list[str] = []
        fp = read_checkpoint(ckpt, opened, writer, threads=3, chunk=1 << 20, direct_io=mode, log=logged.append)
        assert bytes(writer.data) == expected_arena(ckpt, [Path(ckpts["a"]).read_bytes()])
        assert fp == fingerprint_files(ckpts["a"])  # O_DIRECT or not, the same bytes hash the same
        assert len(os.listdir("/proc/self/fd")) == before  # the O_DIRECT fd was closed again
        if mode == "off":
            assert writer.direct_calls == 0 and logged == [f"{ckpts['a']}: buffered"]
        elif "refused" in logged[0]:
            pytest.skip(f"no O_DIRECT here: {logged[0]}")
        else:
            assert logged == [f"{ckpts['a']}: O_DIRECT"] and writer.direct_calls > 0


class AppendingWriter(BytesArena):
    """Changes the file in place (same inode, new size and mtime) while the load runs."""

    def __init__(self, nbytes: int, path: Path) -> None:
        super().__init__(nbytes)
        self.path = path

    def write_from_file(self, fd: int, file_offset: int, arena_offset: int, nbytes: int, direct: bool = False,
                        seen=None) -> None:
        with self.lock, open(self.path, "ab") as f:
            f.write(b"\0")
        super().write_from_file(fd, file_offset, arena_offset, nbytes, direct, seen)


def test_a_file_changed_in_place_is_refused(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(p))
    with open_source(p) as opened:
        ckpt = parse_checkpoint(opened)
        with pytest.raises(CorruptCheckpoint, match="changed on disk while it was loading"):
            read_checkpoint(ckpt, opened, AppendingWriter(ckpt.arena_bytes, p), threads=1, chunk=1024, direct_io="off")
        with pytest.raises(CorruptCheckpoint, match="changed on disk before it was loaded"):
            cpu_load(ckpt, opened)


def test_read_checkpoint_needs_the_source_it_was_parsed_from(ckpts):
    with open_source(ckpts["sharded"]) as opened:
        ckpt = parse_checkpoint(opened)
    with pytest.raises(ValueError, match="closed"):
        cpu_load(ckpt, opened)
    with open_source(ckpts["a"]) as other, pytest.raises(ValueError, match="not the open source"):
        cpu_load(ckpt, other)


class NiceRecorder:
    """Reads nothing: records the niceness of each loader thread that writes."""

    direct_io = False
    serves_files = False  # the ArenaWriter protocol (loader/reader.py)
    device_hash_min = None

    def __init__(self) -> None:
        self.nices: set[int] = set()

    def write_from_file(self, fd, file_offset, arena_offset, nbytes, direct=False, seen=None) -> None:
        self.nices.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        if seen is not None:
            seen(memoryview(bytes(nbytes)))

    def finish(self) -> None:
        pass


def test_loader_threads_are_niced_only_for_big_tensors_in_bulk(tmp_path, monkeypatch):
    """A niced thread running Python holds the GIL while the kernel runs others (reader.py,
    loader_nice): a small load, or one of many small tensors, keeps the loop's priority."""
    import weightcache.loader.reader as reader

    base = os.getpriority(os.PRIO_PROCESS, 0)
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.zeros(1024, dtype=torch.uint8) for i in range(8)}, str(path))  # 8 KiB, 1 KiB a tensor
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        for min_bytes, per_tensor, niced in [(64 * 2**20, 2**20, False), (1, 2048, False), (1, 1024, True)]:
            monkeypatch.setattr(reader, "NICE_MIN_BYTES", min_bytes)
            monkeypatch.setattr(reader, "NICE_MIN_BYTES_PER_TENSOR", per_tensor)
            w = NiceRecorder()
            read_checkpoint(ckpt, opened, w, threads=2, chunk=4096, nice=19, content_hash=False)
            assert w.nices == ({19} if niced and base < 19 else {base}), (min_bytes, per_tensor, w.nices)
