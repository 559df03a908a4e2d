"""The page-cache windows of a CUDA load (backends/page_windows.py), with the driver's
registration faked: where the registrar stops against the staged front, how a chunk is cut
at window ends, what a refused registration leaves, what the release undoes. Runs without
a GPU (and with one: the driver calls are replaced either way); tests/test_gpu.py loads
through the real thing."""

from __future__ import annotations

import mmap
import os
import threading
import types

import pytest
from helpers import with_faked_driver

W = 16 * mmap.PAGESIZE  # a window
NWIN = 10


class FakeDriver:
    """cuMemHostRegister / cuMemHostUnregister, recorded; a registration may wait for a
    gate, and ``refuse`` says which windows' addresses fail."""

    CUDA_SUCCESS = 0
    CU_MEMHOSTREGISTER_READ_ONLY = 8

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.gate: threading.Event | None = None
        self.refuse: set[int] = set()
        self.CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
        self.CUmemAllocationHandleType = types.SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)

    def cuMemHostRegister(self, addr: int, n: int, flags: int):
        assert flags == self.CU_MEMHOSTREGISTER_READ_ONLY
        if self.gate is not None:
            assert self.gate.wait(10)
        if addr in self.refuse:
            return (1,)
        self.registered.append((addr, n))
        return (0,)

    def cuMemHostUnregister(self, addr: int):
        self.unregistered.append(addr)
        return (0,)

    def cuGetErrorName(self, err: int):
        return (0, b"CUDA_ERROR_INVALID_VALUE")


@pytest.fixture
def pw(monkeypatch):
    """The module, its driver calls faked (cuda-bindings itself faked where it is absent)."""
    fake = FakeDriver()
    with with_faked_driver(monkeypatch, fake, "weightcache.backends.page_windows",
                           (("weightcache.backends", "page_windows"), ("weightcache", "cuda_driver"))) as mod:
        yield mod, fake


@pytest.fixture
def cached_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(NWIN * W - 123))  # the last window short, its last page partial
    fd = os.open(path, os.O_RDONLY)
    yield fd, path.stat().st_size
    os.close(fd)


def test_every_window_is_registered_when_nothing_is_staged_and_chunks_are_cut_at_window_ends(pw, cached_file):
    mod, fake = pw
    fd, size = cached_file
    windows = mod.PageWindows(None, [(fd, size)], window=W)
    windows._thread.join()
    assert windows.mapped_bytes == size and windows.refused == 0
    assert [n for _a, n in fake.registered] == [-(-(size - (NWIN - 1) * W) // mmap.PAGESIZE) * mmap.PAGESIZE] + [W] * (NWIN - 1)
    base = min(a for a, _n in fake.registered)
    assert windows.sources(fd, W - 10, 20) == [(base + W - 10, 10), (base + W, 10)]
    assert windows.sources(fd, 3 * W, W) == [(base + 3 * W, W)]
    assert windows.sources(fd, size - 5, 10) is None  # past the file's end: staged, and its short read says why
    assert windows.sources(fd + 1000, 0, 10) is None  # a file it was not given
    windows.release()
    assert sorted(fake.unregistered) == sorted(a for a, _n in fake.registered)
    assert windows.sources(fd, 0, 10) is None  # released: every chunk staged


def test_the_registrar_stops_a_window_short_of_the_staged_front(pw, cached_file):
    """Registered from the end backwards; once the loader threads staged up to window 5,
    the registrar stops before window 6 (a chunk beside it is being staged), and a chunk
    of an unregistered window moves the front on."""
    mod, fake = pw
    fd, size = cached_file
    fake.gate = threading.Event()
    windows = mod.PageWindows(None, [(fd, size)], window=W)  # the registrar waits inside its first registration
    windows.staged(fd, 0, 5 * W + 1)  # windows 0..5
    fake.gate.set()
    windows._thread.join()
    base = min(a for a, _n in fake.registered)
    assert sorted((a - base) // W for a, _n in fake.registered) == [0, 1, 2]  # relative to window 7: 7, 8, 9
    first = (NWIN - 3) * W
    assert windows.sources(fd, first, W) == [(base, W)]
    assert windows.sources(fd, first - W, W) is None  # window 6: not registered, staged
    windows.release()


def test_a_refused_window_stops_the_registrar_and_the_rest_is_staged(pw, cached_file):
    """The driver refuses a window (the file was truncated under it): nothing more is
    registered, and every chunk not registered yet takes the staging path."""
    mod, fake = pw
    fd, size = cached_file
    fake.gate = threading.Event()
    windows = mod.PageWindows(None, [(fd, size)], window=W)
    addr = windows._order[0].addr
    fake.refuse = {addr + (NWIN - 2) * W}  # the second window it tries
    fake.gate.set()
    windows._thread.join()
    assert windows.refused == 1 and [a - addr for a, _n in fake.registered] == [(NWIN - 1) * W]
    assert windows.sources(fd, (NWIN - 2) * W, 10) is None
    assert windows.sources(fd, (NWIN - 1) * W, 10) == [(addr + (NWIN - 1) * W, 10)]
    windows.release()
    assert fake.unregistered == [addr + (NWIN - 1) * W]


def test_no_window_for_files_it_may_not_map(pw, tmp_path):
    mod, fake = pw
    empty = tmp_path / "e.bin"
    empty.write_bytes(b"")
    fd = os.open(empty, os.O_RDONLY)
    try:
        windows = mod.PageWindows(None, [(fd, 0)], window=W)
        assert not windows and windows._thread is None and fake.registered == []
        with pytest.raises(ValueError, match="multiple of"):
            mod.PageWindows(None, [(fd, 0)], window=W + 1)
    finally:
        os.close(fd)
