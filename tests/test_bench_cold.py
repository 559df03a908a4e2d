"""A cold run must start cold: drop_page_cache refuses when the file's pages cannot be
dropped (a process maps them), instead of letting a warm read pass for a cold one."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from weightcache.tools.bench_measure import drop_page_cache, page_cache_bytes, warm_page_cache


def _file(tmp_path: Path, nbytes: int = 8 << 20) -> Path:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(nbytes))
    os.sync()
    return path


def test_an_unmapped_file_is_dropped(tmp_path: Path) -> None:
    path = _file(tmp_path)
    warm_page_cache(path)
    # The precondition, asserted while a mapping holds every page: unmapped file pages can
    # be reclaimed at any moment (the CI VM's DAMON pages them out), so a plain read left
    # the residency check racing reclaim.
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))  # every page faulted in and mapped
        assert page_cache_bytes(path) == path.stat().st_size
    drop_page_cache(path)  # unmapped now: nothing keeps the pages
    assert page_cache_bytes(path) <= 0.05 * path.stat().st_size


def test_a_mapped_file_is_refused(tmp_path: Path) -> None:
    path = _file(tmp_path)
    drop_page_cache(path)
    if page_cache_bytes(path) > 0.05 * path.stat().st_size:
        pytest.skip("this file system keeps the pages whatever DONTNEED says (tmpfs)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        m.madvise(mmap.MADV_WILLNEED)
        sum(m[i] for i in range(0, len(m), mmap.PAGESIZE))  # every page faulted in and mapped
        with pytest.raises(RuntimeError, match="stay in the page cache"):
            drop_page_cache(path)
        drop_page_cache(path, check=False)  # the loop that waits for an unmap asks without the check
    drop_page_cache(path)  # unmapped: dropped, no error
