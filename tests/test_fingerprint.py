"""The content fingerprint (loader/reader.py, Note [content fingerprint]): it covers the
tensors' bytes, is the same whatever the file layout, chunk size or thread count, and the
same whichever arena the bytes went to (a CPU file arena, a memfd)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightcache import Client
from weightcache.backends.cpu import CpuBackend
from weightcache.backends.page_cache import populate_supported
from weightcache.loader import fingerprint_files, open_source, parse_checkpoint, read_checkpoint
from weightcache.loader.reader import FILE_DIGESTS, HASH_BLOCK, TaskHasher, fingerprint, plan_tasks


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        # more than two hash pieces, so pieces, tasks and chunks all cut it
        "big": torch.randn(HASH_BLOCK // 4 * 2 + 12345, generator=g),
        "w": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "b": torch.randn(7, generator=g),
        "empty": torch.zeros(0),
        "i": torch.arange(1000, dtype=torch.int64),
    }


def rewrite_values_in_place(path: Path) -> None:
    """Same header, same size, same inode: only tensor bytes change (as an in-place fine-tune would)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 8)
        last = f.read(8)
        f.seek(size - 8)
        f.write(bytes(b ^ 0xFF for b in last))
    assert path.stat().st_size == size


def in_process(path: Path, backend: CpuBackend, *, threads: int = 2, chunk: int = 1 << 20) -> tuple[str | None, str]:
    """Load as the daemon does (bind, read, seal, free): the fingerprint and the arena kind."""
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
        arena = backend.allocate(ckpt.arena_bytes, "t")
        try:
            backend.bind_files(arena, ckpt, opened)
            fp = read_checkpoint(ckpt, opened, backend.writer(arena, chunk), threads=threads, chunk=chunk)
            backend.seal(arena)
            return fp, arena.kind
        finally:
            backend.free(arena)


def test_rewriting_values_in_place_changes_the_fingerprint(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(tensors(), str(p))
    before = fingerprint_files(p)
    layout = parse_layout(p)
    rewrite_values_in_place(p)
    assert parse_layout(p) == layout  # the headers alone cannot tell
    assert fingerprint_files(p) != before


def parse_layout(p: Path) -> str:
    with open_source(p) as opened:
        return parse_checkpoint(opened).layout


def test_two_checkpoints_of_the_same_shapes_differ(tmp_path):
    a, b = tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors"
    for seed, p in enumerate((a, b)):
        p.parent.mkdir()
        save_file(tensors(seed), str(p))
    assert parse_layout(a) == parse_layout(b)  # the old, header-only fingerprint: one for both
    assert fingerprint_files(a) != fingerprint_files(b)


def test_the_same_tensors_in_another_layout_chunking_or_thread_count_hash_the_same(tmp_path):
    t = tensors()
    one = tmp_path / "one.safetensors"
    save_file(t, str(one), metadata={"format": "pt"})
    # the same tensors in another order and split over two files of a directory
    (tmp_path / "split").mkdir()
    save_file({"i": t["i"], "big": t["big"]}, str(tmp_path / "split" / "m-00001.safetensors"))
    save_file({"b": t["b"], "empty": t["empty"], "w": t["w"]}, str(tmp_path / "split" / "m-00002.safetensors"))
    want = fingerprint_files(one)
    assert len(want) == 32 and int(want, 16) >= 0
    assert fingerprint_files(tmp_path / "split") == want
    for threads, chunk in ((1, 4096), (3, 65536 + 17), (4, HASH_BLOCK), (2, 3 * HASH_BLOCK + 4096)):
        assert fingerprint_files(one, threads=threads, chunk=chunk) == want, (threads, chunk)
    # a name, a dtype or a shape is part of what a tensor is
    renamed = dict(t)
    renamed["w2"] = renamed.pop("w")
    save_file(renamed, str(tmp_path / "renamed.safetensors"))
    reshaped = {**t, "w": t["w"].reshape(33, 64)}
    save_file(reshaped, str(tmp_path / "reshaped.safetensors"))
    assert len({want, fingerprint_files(tmp_path / "renamed.safetensors"), fingerprint_files(tmp_path / "reshaped.safetensors")}) == 3


def test_tasks_hold_whole_pieces_and_cover_every_byte(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(tensors(), str(p))
    with open_source(p) as opened:
        ckpt = parse_checkpoint(opened)
    for chunk in (4096, HASH_BLOCK, 5 * HASH_BLOCK):
        tasks = plan_tasks(ckpt, chunk)
        assert sum(task.nbytes for task in tasks) == ckpt.data_bytes
        assert all(task.nbytes == sum(piece.nbytes for piece in task.pieces) <= max(chunk, HASH_BLOCK) for task in tasks)
        assert all(piece.nbytes <= HASH_BLOCK for task in tasks for piece in task.pieces)
    # a hasher fed the same bytes in any cut gives the same digests
    task = plan_tasks(ckpt, HASH_BLOCK * 4)[0]
    data = os.urandom(task.nbytes)
    whole: dict = {}
    TaskHasher(task, whole)(memoryview(data))
    cut: dict = {}
    h = TaskHasher(task, cut)
    for off in range(0, len(data), 1_000_003):
        h(memoryview(data)[off : off + 1_000_003])
    assert whole == cut and len(whole) == len(task.pieces)


@pytest.mark.skipif(not populate_supported(), reason="page-cache arenas need MADV_POPULATE_READ (Linux >= 5.14)")
def test_file_arenas_and_memfd_arenas_agree_and_file_digests_are_reused_until_the_file_changes(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(tensors(), str(p))
    os.chmod(p, 0o644)
    want = fingerprint_files(p)
    FILE_DIGESTS.clear()
    assert in_process(p, CpuBackend("cpu", page_cache=False)) == (want, "memfd")
    # chunks of several hash slices and pieces (the memfd writer reads and hashes 1 MiB at a time)
    assert in_process(p, CpuBackend("cpu", page_cache=False), threads=3, chunk=HASH_BLOCK + 4096) == (want, "memfd")
    assert FILE_DIGESTS.get(identity(p)) is not None  # only this uid can change it: kept for the next load
    FILE_DIGESTS.clear()
    fp, kind = in_process(p, CpuBackend("cpu"))
    if kind != "file":
        pytest.skip("this file system's files are not served from the page cache here")
    assert fp == want
    kept = FILE_DIGESTS.get(identity(p))
    assert kept is not None
    # loaded again unchanged: the digests come from the cache (poisoned here to prove it)
    FILE_DIGESTS.put(identity(p), {off: b"\0" * 16 for off in kept})
    assert in_process(p, CpuBackend("cpu"))[0] != want
    FILE_DIGESTS.put(identity(p), kept)
    assert in_process(p, CpuBackend("cpu"), threads=1, chunk=4096)[0] == want
    # rewritten in place: its identity moved (mtime, ctime), so it is hashed again
    rewrite_values_in_place(p)
    assert in_process(p, CpuBackend("cpu"))[0] == fingerprint_files(p) != want


@pytest.mark.parametrize("how", ["group-writable", "a peer's fds"])
def test_digests_of_files_others_could_change_unseen_are_never_kept(tmp_path, how):
    """A copy of a file that someone besides root and the daemon's uid could rewrite (its
    mode, or a peer that sent its own fds and may keep a writable mapping) is hashed at
    every load: a stale cache entry would give old digests to new bytes."""
    from weightcache.loader.sources import adopt_fds

    p = tmp_path / "m.safetensors"
    save_file(tensors(), str(p))
    os.chmod(p, 0o664 if how == "group-writable" else 0o644)
    want = fingerprint_files(p)
    FILE_DIGESTS.clear()
    backend = CpuBackend("cpu", page_cache=False)
    if how == "group-writable":
        assert in_process(p, backend) == (want, "memfd")
    else:
        with adopt_fds("peer", [p.name], [os.open(p, os.O_RDONLY)]) as opened:
            ckpt = parse_checkpoint(opened)
            arena = backend.allocate(ckpt.arena_bytes, "t")
            try:
                assert read_checkpoint(ckpt, opened, backend.writer(arena, 1 << 20), threads=2, chunk=1 << 20) == want
            finally:
                backend.free(arena)
    assert FILE_DIGESTS.get(identity(p)) is None


def identity(p: Path) -> tuple[int, int, int, int, int]:
    st = p.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


async def test_the_daemon_reports_the_content_fingerprint_and_an_in_place_rewrite_changes_it(start_daemon, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(tensors(0), str(a))
    save_file(tensors(1), str(b))  # same shapes, other values
    os.chmod(a, 0o644)
    d = start_daemon(budget="200MiB", models={"a": a, "b": b})
    async with Client(d.socket) as c:
        assert {m["name"]: m["fingerprint"] for m in await c.models()} == {"a": None, "b": None}  # not loaded: not known
        async with c.attach("a") as ma, c.attach("b") as mb:
            assert ma.fingerprint == fingerprint_files(a) and mb.fingerprint == fingerprint_files(b)
            assert ma.fingerprint != mb.fingerprint
            listed = {m["name"]: m["fingerprint"] for m in await c.models()}
            assert listed == {"a": ma.fingerprint, "b": mb.fingerprint}
            old = ma.fingerprint
        rewrite_values_in_place(a)
        async with c.attach("a") as ma2:  # nobody attached: the changed file is loaded again
            assert ma2.fingerprint == fingerprint_files(a) != old


def test_pieces_left_to_the_device_are_counted_not_hashed_and_say_where_they_are():
    """A writer that hashes big pieces on its GPU (backends/cuda_hash.py) gets each one,
    once its last byte has passed, with its offset in the task; hashing those bytes there
    gives the digests a hasher on the host alone gives. Pieces not 16-byte aligned in the
    arena stay on the host."""
    import xxhash

    from weightcache.loader.reader import Piece, Task

    pieces = (Piece(0, 0, HASH_BLOCK), Piece(0, 1, 5008), Piece(1, 0, 304), Piece(2, 0, HASH_BLOCK // 2 + 3))
    data = os.urandom(sum(p.nbytes for p in pieces))
    for arena_offset, device_pieces in ((256, {(0, 0), (0, 1), (2, 0)}), (8, set())):
        task = Task(0, 0, arena_offset, len(data), pieces)
        host_only: dict = {}
        TaskHasher(task, host_only)(memoryview(data))
        split: dict = {}
        h = TaskHasher(task, split, device_min=4096)
        for off in range(0, len(data), 3_000_017):  # chunks that cut pieces
            h(memoryview(data)[off : off + 3_000_017])
        done = h.take_device_done()
        assert h.take_device_done() == []  # taken once
        assert {(p.tensor, p.index) for p, _ in done} == device_pieces
        assert not device_pieces & set(split)  # not hashed on the host
        for piece, start in done:
            split[(piece.tensor, piece.index)] = xxhash.xxh3_128_digest(data[start : start + piece.nbytes])
        assert split == host_only


def test_device_only_says_which_chunks_the_host_need_not_read():
    """A writer may copy a chunk without the host reading it (page-cache windows,
    backends/page_windows.py) only where every byte of it belongs to a piece the device
    hashes; fed unread bytes of that length, the hasher gives the digests it gives from
    the real bytes."""
    import xxhash

    from weightcache.loader.reader import Piece, Task

    big, small = HASH_BLOCK, 304
    pieces = (Piece(0, 0, big), Piece(0, 1, big), Piece(1, 0, small), Piece(2, 0, big))
    data = os.urandom(sum(p.nbytes for p in pieces))
    task = Task(0, 0, 256, len(data), pieces)
    h = TaskHasher(task, {}, device_min=4096)
    assert h.device_only(2 * big)  # the two first pieces
    assert not h.device_only(2 * big + 1)  # one byte of the small piece, hashed on the host
    out: dict = {}
    h = TaskHasher(task, out, device_min=4096)
    h(memoryview(bytes(big // 2)))  # unread bytes: counted, not hashed
    assert h.device_only(big // 2 + big)
    assert not h.device_only(big // 2 + big + small)
    h(memoryview(bytes(big // 2 + big)))
    assert not h.device_only(1)  # the small piece is next
    h(memoryview(data)[2 * big : 2 * big + small])
    assert h.device_only(big) and not h.device_only(big + 1)  # nothing past the task
    h(memoryview(bytes(big)))
    for piece, start in h.take_device_done():
        out[(piece.tensor, piece.index)] = xxhash.xxh3_128_digest(data[start : start + piece.nbytes])
    whole: dict = {}
    TaskHasher(task, whole)(memoryview(data))
    assert out == whole
    assert not TaskHasher(task, {}).device_only(1)  # no device hash: every byte is the host's
    assert not TaskHasher(Task(0, 0, 8, len(data), pieces), {}, device_min=4096).device_only(1)  # unaligned: the host's


class _DeviceHashingWriter:
    """A writer that, like the CUDA one, hashes big pieces "on its device" (here: from its
    own copy of the arena, at finish) when the reader's plan says so (a TaskHasher
    ``on_device``); records whether it ever was."""

    direct_io = False
    serves_files = False
    device_hash_min = 4096

    def __init__(self, nbytes: int) -> None:
        self.arena = bytearray(nbytes)
        self.asked = False
        self._todo: list = []

    def write_from_file(self, fd, file_offset, arena_offset, nbytes, direct=False, seen=None):
        with memoryview(self.arena)[arena_offset : arena_offset + nbytes] as dst:
            n = os.preadv(fd, [dst], file_offset)
            assert n == nbytes
            if seen is not None:
                seen(dst)
        if seen is not None and seen.on_device:
            self.asked = True
            self._todo += [(seen, piece, start) for piece, start in seen.take_device_done()]

    def finish(self) -> None:
        import xxhash

        for seen, piece, start in self._todo:
            at = seen.task.arena_offset + start
            seen.out[(piece.tensor, piece.index)] = xxhash.xxh3_128_digest(bytes(self.arena[at : at + piece.nbytes]))
        self._todo.clear()


def test_only_files_that_cannot_change_unseen_are_hashed_on_the_device(tmp_path):
    """The reader offers a writer's device hash (the GPU's, backends/cuda_hash.py) only for
    files only root or the daemon's uid can change: hashed once per version. A file
    another uid could write is hashed at every load, on the host, so a tenant's loads
    cannot take GPU time from the engines of others. The fingerprint is the same either way."""
    p = tmp_path / "m.safetensors"
    save_file(tensors(), str(p))
    want = fingerprint_files(p)
    for mode, on_device in ((0o644, True), (0o664, False)):
        os.chmod(p, mode)
        FILE_DIGESTS.clear()
        with open_source(p) as opened:
            ckpt = parse_checkpoint(opened)
            w = _DeviceHashingWriter(ckpt.arena_bytes)
            assert read_checkpoint(ckpt, opened, w, threads=2, chunk=1 << 20) == want
        assert w.asked is on_device, oct(mode)


class _UnreadWriter(_DeviceHashingWriter):
    """As the CUDA writer with page-cache windows: told by ``begin`` which files it may copy
    without reading them, it copies every chunk that ``device_only`` allows from the file
    to its arena behind the hasher's back, and feeds the hasher zeros instead."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.offered: list[tuple[int, int]] | None = None
        self.unread = 0

    def begin(self, files):
        self.offered = list(files)

    def write_from_file(self, fd, file_offset, arena_offset, nbytes, direct=False, seen=None):
        if fd in dict(self.offered or ()) and (seen is None or seen.device_only(nbytes)):
            with memoryview(self.arena)[arena_offset : arena_offset + nbytes] as dst:
                assert os.preadv(fd, [dst], file_offset) == nbytes
            if seen is not None:
                seen(memoryview(bytes(nbytes)))
                self._todo += [(seen, piece, start) for piece, start in seen.take_device_done()]
            self.unread += nbytes
            return
        super().write_from_file(fd, file_offset, arena_offset, nbytes, direct, seen)


def test_the_files_a_writer_may_copy_unread_are_those_hashed_on_its_device_or_not_at_all(tmp_path):
    """The reader offers a writer with ``begin`` (the CUDA one's page-cache windows) the
    files whose bytes the host need not read: those the device hashes (files that cannot
    change unseen) and, with the hash off, every file. The chunks it copies without
    reading them, the hasher fed zeros for them, leave the fingerprint as it is."""
    p = tmp_path / "m.safetensors"
    save_file(tensors(), str(p))
    want = fingerprint_files(p)
    for mode, content_hash, offered in ((0o644, True, True), (0o664, True, False), (0o664, False, True)):
        os.chmod(p, mode)
        FILE_DIGESTS.clear()
        with open_source(p) as opened:
            ckpt = parse_checkpoint(opened)
            w = _UnreadWriter(ckpt.arena_bytes)
            got = read_checkpoint(ckpt, opened, w, threads=2, chunk=1 << 20, content_hash=content_hash)
            assert w.offered == ([(opened.files[0].fd, ckpt.files[0].size)] if offered else []), (oct(mode), content_hash)
        assert got == (want if content_hash else None)
        assert (w.unread > 0) is offered, (oct(mode), content_hash)
        with open_source(p) as opened:  # the arena holds the file's tensors whichever way they came
            ckpt = parse_checkpoint(opened)
            for t in ckpt.tensors:
                assert bytes(w.arena[t.arena_offset : t.arena_offset + t.nbytes]) == os.pread(
                    opened.files[0].fd, t.nbytes, t.file_offset), t.name


def test_a_tables_fingerprint_rows_hash_as_the_rows_they_were_made_from(tmp_path):
    """The fingerprint from a TensorTable's own (made with the table, in name order) is the
    definition's, hashed from rows: names out of file order, non-ASCII, empty and
    scalar shapes, a tensor of several pieces."""
    import dataclasses

    from weightcache.loader.reader import EMPTY_DIGEST, read_digests

    t = {"zeta": torch.zeros(3), "alpha": torch.ones(2, 5), "é": torch.zeros(0), "b": torch.tensor(7.0), **tensors(3)}
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))
    with open_source(path) as opened:
        ckpt = parse_checkpoint(opened)
    names = [r.name for r in ckpt.tensors]
    assert names != sorted(names)  # file order is not name order: the table's name order is what is tested
    pieces = {(i, k): bytes([i, k]) * 8 for i, r in enumerate(ckpt.tensors) for k in range(-(-r.nbytes // HASH_BLOCK))}
    digests = read_digests(ckpt, pieces, {}, "test")
    assert digests[names.index("é")] == EMPTY_DIGEST
    rows = dataclasses.replace(ckpt, tensors=tuple(ckpt.tensors))
    assert fingerprint(ckpt, digests) == fingerprint(rows, dict(enumerate(digests)))
    with pytest.raises(RuntimeError, match="did not report the bytes of 1 tensor"):
        read_digests(ckpt, {k: v for k, v in pieces.items() if k[0] != names.index("zeta")}, {}, "test")
