"""The host pool's extent allocator: a host copy may be several pieces, so any free
bytes can take a demotion (a first-fit pool failed demotions with room left)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.backends.extents import ExtentAllocator


def test_fragmented_free_space_still_takes_a_copy():
    pool = ExtentAllocator(300)
    a, b, c = pool.alloc(100), pool.alloc(100), pool.alloc(100)
    assert (a, b, c) == ([(0, 100)], [(100, 100)], [(200, 100)]) and pool.alloc(1) is None
    pool.free(a)
    pool.free(c)
    assert pool.free_extents == 2
    assert pool.alloc(150) == [(0, 100), (200, 50)]  # first fit would have failed here
    assert pool.free_bytes == 50


def test_freeing_merges_neighbours_and_refuses_double_free():
    pool = ExtentAllocator(300)
    a, b = pool.alloc(100), pool.alloc(100)
    pool.free(a)
    pool.free(b)
    assert pool.free_extents == 1 and pool.alloc(300) == [(0, 300)]
    pool.free([(0, 300)])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([(50, 10)])
    with pytest.raises(ValueError):
        pool.alloc(0)


# Random demote/promote/free sequences: "alloc" is a demotion (a host copy made), "free"
# is a promotion or a dropped copy. Sizes are in units of 2 MiB, the VMM granularity.
@settings(deadline=None)  # a loaded CI machine stretches an example past the 200 ms default
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 96)), max_size=80))
def test_accounting_holds_under_random_demote_promote_free(ops):
    size = 256
    pool = ExtentAllocator(size)
    held: list[list[tuple[int, int]]] = []
    for do_alloc, n in ops:
        if do_alloc or not held:
            free_before = pool.free_bytes
            got = pool.alloc(n)
            assert (got is not None) == (free_before >= n)  # never refused while there is room
            if got is not None:
                assert sum(length for _, length in got) == n
                mine = sorted(got)
                assert all(o >= 0 and length > 0 and o + length <= size for o, length in mine)
                taken = sorted(e for copy in held for e in copy)
                for o, length in mine:  # disjoint from every copy still held, and from each other
                    assert all(o + length <= p or p + m <= o for p, m in taken + [e for e in mine if e != (o, length)])
                held.append(got)
        else:
            pool.free(held.pop(n % len(held)))
        assert pool.free_bytes == size - sum(length for copy in held for _, length in copy)
    for copy in held:
        pool.free(copy)
    assert pool.free_bytes == size and pool.free_extents == 1


@settings(deadline=None)  # a loaded CI machine stretches an example past the 200 ms default
@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_split_by_chunks_covers_every_byte_once(piece_lens, chunk_sizes):
    from weightcache.backends.extents import split_by_chunks

    total = min(sum(piece_lens), sum(chunk_sizes))
    chunks = []
    for size in chunk_sizes:  # chunks adding up to exactly what the pieces hold
        if sum(chunks) < total:
            chunks.append(min(size, total - sum(chunks)))
    pieces, base, left = [], 1000, total
    for length in piece_lens:
        if left:
            pieces.append((base, min(length, left)))
            base += 10_000  # pieces are far apart in the pool
            left -= pieces[-1][1]
    segments = split_by_chunks(pieces, chunks)
    offsets = []
    for c, segs in enumerate(segments):
        start = sum(chunks[:c])
        assert sum(n for _, _, n in segs) == chunks[c] and all(start <= off < start + chunks[c] for _, off, _ in segs)
        offsets += [(off, n, ptr) for ptr, off, n in segs]
    # Arena offsets tile [0, total) in order, and map to the pieces' bytes in order.
    flat = [(ptr, length) for ptr, length in pieces]
    pos, k, used = 0, 0, 0
    for off, n, ptr in offsets:
        assert off == pos and ptr == flat[k][0] + used
        pos += n
        used += n
        if used == flat[k][1]:
            k, used = k + 1, 0
    assert pos == total
