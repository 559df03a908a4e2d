"""The host pool's range allocator."""

from hypothesis import given
from hypothesis import strategies as st

from weightcache.backends.firstfit import FirstFit


def test_first_fit_and_merging():
    ff = FirstFit(300)
    a, b, c = ff.alloc(100), ff.alloc(100), ff.alloc(100)
    assert (a, b, c) == (0, 100, 200) and ff.alloc(1) is None
    ff.free(a, 100)
    ff.free(c, 100)
    assert ff.free_bytes == 200 and ff.alloc(150) is None  # fragmented: no 150 in one piece
    ff.free(b, 100)
    assert ff.alloc(300) == 0  # merged back into one range


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 64)), max_size=60))
def test_never_overlaps_and_accounts_exactly(ops):
    ff = FirstFit(256)
    held: list[tuple[int, int]] = []
    for do_alloc, n in ops:
        if do_alloc or not held:
            off = ff.alloc(n)
            if off is not None:
                assert all(off + n <= o or o + m <= off for o, m in held)
                assert off >= 0 and off + n <= 256
                held.append((off, n))
        else:
            ff.free(*held.pop(n % len(held)))
        assert ff.free_bytes == 256 - sum(m for _, m in held)
