"""The CUDA loader's pinned staging pool (backends/pinned.py: StagingPool) without a GPU:
pinning is faked, the counting is real. ``prefill`` pins at start what the loads will
take, a load racing it pins nothing more than both need, a pin that fails is not counted,
and a closing backend stops it."""

from __future__ import annotations

import threading
import time
import types

import pytest
from helpers import with_faked_driver


class NoDriver:
    """Nothing of the driver is called: StagingPool._allocate is replaced. What
    cuda_driver.py reads at import is all it has."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)
    CUmemAllocationHandleType = types.SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)


@pytest.fixture
def pool(monkeypatch):
    with with_faked_driver(monkeypatch, NoDriver(), "weightcache.backends.pinned",
                           (("weightcache.backends", "pinned"), ("weightcache", "cuda_driver"))) as pinned:
        made: list[int] = []
        fail = threading.Event()

        def allocate(self, size):
            time.sleep(0.001)  # long enough for a racing take to come in between
            if fail.is_set():
                fail.clear()
                raise RuntimeError("cuMemHostAlloc failed")
            made.append(size)
            return pinned.Staging(len(made), memoryview(b""), None, None, size)

        monkeypatch.setattr(pinned.StagingPool, "_allocate", allocate)
        yield pinned.StagingPool(None, 0), made, fail


def test_prefill_pins_what_the_loads_then_take(pool):
    p, made, _ = pool
    assert p.prefill(6, 100) == 6
    assert p.prefill(6, 100) == 0  # already there
    held = [p.take(100) for _ in range(6)]
    assert len(made) == 6 and p.created == {100: 6}  # the loads pinned none of their own
    assert len({st.host_ptr for st in held}) == 6
    p.take(200)  # another size is its own
    assert p.created == {100: 6, 200: 1}


def test_a_load_racing_the_prefill_pins_nothing_more_than_both_need(pool):
    p, made, _ = pool
    held: list[object] = []
    lock = threading.Lock()

    def load() -> None:
        st = p.take(100)
        with lock:
            held.append(st)

    loads = [threading.Thread(target=load) for _ in range(4)]
    prefill = threading.Thread(target=p.prefill, args=(6, 100))
    prefill.start()
    for t in loads:
        t.start()
    for t in [prefill, *loads]:
        t.join()
    assert len(held) == 4
    assert p.created == {100: 6} and len(made) == 6


def test_a_pin_that_fails_is_not_counted(pool):
    p, made, fail = pool
    fail.set()
    with pytest.raises(RuntimeError):
        p.take(100)
    assert p.created == {100: 0} and made == []
    fail.set()
    with pytest.raises(RuntimeError):
        p.prefill(3, 100)
    assert p.prefill(3, 100) == 3 and p.created == {100: 3}


def test_the_prefill_stops_once_told(pool):
    p, made, _ = pool
    stop = threading.Event()
    stop.set()
    assert p.prefill(6, 100, stop=stop) == 0 and made == []
