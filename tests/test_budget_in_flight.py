"""The budget is never exceeded, loads in flight included.

The daemon runs several loads at once (a device's fills queue, but admission does not wait
for them: a second request admitted while the first load's bytes are still arriving), so
the promise is about overlap: every load admitted and not yet finished or aborted holds its
bytes against the budget, beside every resident arena. tests/test_core.py's machines finish
each load inside the rule that begins it; here beginning, finishing and aborting a load are
separate steps, so loads overlap in any order, with attaches, pins, evictions and lowered
budgets between them. The budget is checked from the entries themselves, not from the
core's own counters."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weightcache.cache.core import CacheCore
from weightcache.cache.eviction import State
from weightcache.errors import Attached, BadRequest, NoSpace, Pinned

BUDGET = {"cpu": 300, "cuda:0": 300}
HOST = 250


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def held_on(core: CacheCore, device: str) -> int:
    """Bytes the device holds or has promised: resident arenas and loads in flight."""
    return sum(e.nbytes for e in core.entries.values() if e.device == device and e.state in (State.RESIDENT, State.LOADING))


class OverlappingLoads(RuleBasedStateMachine):
    names = st.sampled_from([f"c{i}" for i in range(5)] + [f"g{i}" for i in range(5)])
    sizes = st.integers(1, 200)  # most pairs of loads do not fit one budget together

    def __init__(self) -> None:
        super().__init__()
        self.core = CacheCore(dict(BUDGET), clock=Clock(), host_budget=HOST)
        for i in range(5):
            self.core.register(f"c{i}", "cpu")
            self.core.register(f"g{i}", "cuda:0")
        self.conns = 0

    def _begin(self, name: str, nbytes: int) -> bool:
        e = self.core.entry(name)
        if e.state in (State.LOADING, State.RESIDENT):
            return False
        try:
            self.core.begin_load(name, e.nbytes if e.host_copy else nbytes)
        except NoSpace:
            return False
        return True

    def _in_flight(self) -> list[str]:
        return sorted(e.name for e in self.core.entries.values() if e.state is State.LOADING)

    @rule(name=names, nbytes=sizes)
    def begin(self, name, nbytes):
        """Admit a load and leave it in flight."""
        self._begin(name, nbytes)

    @rule(first=names, second=names, a=sizes, b=sizes)
    def overlap(self, first, second, a, b):
        """A second load admitted before the first completes: both hold their bytes."""
        if self._begin(first, a) and self._begin(second, b):
            assert {first, second} <= set(self._in_flight())
            for device in BUDGET:
                assert held_on(self.core, device) <= self.core.devices[device].budget

    @precondition(lambda self: self._in_flight())
    @rule(data=st.data(), ok=st.booleans())
    def complete(self, data, ok):
        name = data.draw(st.sampled_from(self._in_flight()))
        if ok:
            self.core.finish_load(name)
        else:
            self.core.abort_load(name)

    @rule(name=names)
    def attach(self, name):
        if self.core.entry(name).state is State.RESIDENT:
            self.conns += 1
            self.core.attach(name, self.conns)

    @precondition(lambda self: self.core.leases)
    @rule(data=st.data())
    def detach(self, data):
        lease = data.draw(st.sampled_from(sorted(self.core.leases.values(), key=lambda x: x.id)))
        self.core.detach(lease.id, lease.conn)

    @rule(name=names, pinned=st.booleans())
    def pin(self, name, pinned):
        self.core.set_pinned(name, pinned)

    @rule(name=names)
    def evict(self, name):
        try:
            self.core.evict(name)
        except (Attached, Pinned, BadRequest):
            pass

    @rule(device=st.sampled_from(sorted(BUDGET)), budget=st.integers(150, 300))
    def set_budget(self, device, budget):
        try:
            self.core.set_budget(device, budget)
        except NoSpace:
            pass

    @invariant()
    def within_budget(self):
        for device, acct in self.core.devices.items():
            assert held_on(self.core, device) <= acct.budget, (device, held_on(self.core, device), acct.budget)
        assert sum(e.nbytes for e in self.core.entries.values() if e.host_copy) <= HOST
        self.core.check_invariants()


TestOverlappingLoads = OverlappingLoads.TestCase
TestOverlappingLoads.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_two_loads_in_flight_do_not_share_the_room():
    """The case by hand: two 80-byte loads into a 100-byte budget; the second must wait
    (NoSpace) while the first is still loading, whatever is free of resident arenas."""
    core = CacheCore({"cpu": 100}, clock=Clock())
    core.register("a", "cpu")
    core.register("b", "cpu")
    core.begin_load("a", 80)
    try:
        core.begin_load("b", 80)
    except NoSpace:
        pass
    else:
        raise AssertionError(f"two 80-byte loads in flight in a 100-byte budget: {held_on(core, 'cpu')} bytes held")
    core.finish_load("a")
    assert held_on(core, "cpu") == 80
