"""O_DIRECT reads and the page-cache residency probe that decides when to use them."""

import mmap
import os

import pytest

from weightcache.loader.reader import DIRECT_ALIGN, open_for_reading, pread_direct, resident_fraction


class DirectWriter:
    direct_io = True


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
    path.read_bytes()  # warm
    fd = os.open(path, os.O_RDONLY)
    assert resident_fraction(fd, path.stat().st_size) == 1.0
    os.close(fd)
    fd, direct, why = open_for_reading(str(path), DirectWriter(), "auto")
    os.close(fd)
    assert not direct and "page cache" in why
    drop(path)
    fd = os.open(path, os.O_RDONLY)
    cold = resident_fraction(fd, path.stat().st_size)
    os.close(fd)
    if cold >= 0.5:
        pytest.skip("posix_fadvise(DONTNEED) did not drop the pages here")
    fd, direct, why = open_for_reading(str(path), DirectWriter(), "auto")
    os.close(fd)
    assert direct or "refused" in why
    fd, direct, why = open_for_reading(str(path), DirectWriter(), "off")
    os.close(fd)
    assert not direct and why == "buffered"
