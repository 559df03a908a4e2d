"""The pure cache core: examples, then a hypothesis state machine for the invariants of
core.py's Note [invariants], run under each eviction policy (GDSF's own examples are in
tests/test_policy.py)."""

import contextlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weightcache.cache import CacheCore, State, StepDown
from weightcache.errors import Attached, BadRequest, NoSpace, Pinned, UnknownModel


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0  # every call is a distinct, later instant: LRU order is total
        return self.t


def loaded(core: CacheCore, name: str, nbytes: int):
    plan = core.begin_load(name, nbytes)
    core.finish_load(name)
    return plan


def promoted(core: CacheCore, name: str, nbytes: int) -> None:
    """Load ``name``, demote it, promote it back: resident, its host copy kept."""
    loaded(core, name, nbytes)
    core.evict(name)
    loaded(core, name, nbytes)


def make(budget=200, names="abc", device="cpu", host=0):
    core = CacheCore({device: budget}, clock=Clock(), host_budget=host)
    for n in names:
        core.register(n, device)
    return core


def test_lru_evicts_least_recently_used_first():
    core = make()
    loaded(core, "a", 100)
    loaded(core, "b", 100)
    core.detach(core.attach("a", conn=1).id, conn=1)  # a is now more recent than b
    plan = core.begin_load("c", 100)
    assert plan.evict == ("b",)
    core.finish_load("c")
    assert core.entry("b").state is State.EVICTED and core.entry("a").state is State.RESIDENT
    core.check_invariants()


def test_evicts_no_more_than_needed():
    core = make(budget=300, names="abcd")
    for n in "abc":
        loaded(core, n, 100)
    assert core.begin_load("d", 150).evict == ("a", "b")


def test_attached_and_pinned_models_are_never_victims():
    core = make()
    loaded(core, "a", 100)
    loaded(core, "b", 100)
    core.attach("a", conn=1)
    core.set_pinned("b", True)
    with pytest.raises(NoSpace) as info:
        core.begin_load("c", 100)
    holders = {h["name"]: h for h in info.value.details["holders"]}
    assert holders["a"]["attach_count"] == 1 and holders["b"]["pinned"]
    assert "a (" in info.value.message and "pinned" in info.value.message
    assert info.value.fits_ever  # a detach of "a" would make room
    core.check_invariants()


def test_model_bigger_than_budget_never_fits():
    core = make()
    with pytest.raises(NoSpace) as info:
        core.begin_load("a", 201)
    assert not info.value.fits_ever
    assert core.entry("a").state is State.REGISTERED


def test_abort_load_returns_the_reservation():
    core = make()
    loaded(core, "a", 50)
    before = core.device_summary()
    core.begin_load("b", 100)
    assert core.devices["cpu"].reserved == 100
    core.abort_load("b")
    assert core.device_summary() == before
    assert core.entry("b").state is State.REGISTERED


def test_single_flight_refuses_a_second_begin():
    core = make()
    core.begin_load("a", 10)
    with pytest.raises(BadRequest):
        core.begin_load("a", 10)


def test_leases_count_and_end_with_their_connection():
    core = make()
    loaded(core, "a", 10)
    l1, l2 = core.attach("a", conn=1), core.attach("a", conn=2)
    assert core.entry("a").attach_count == 2
    with pytest.raises(BadRequest):
        core.detach(l1.id, conn=2)  # not yours
    assert [x.id for x in core.drop_connection(1)] == [l1.id]
    assert core.entry("a").attach_count == 1
    core.detach(l2.id, conn=2)
    assert core.entry("a").attach_count == 0
    core.check_invariants()


def test_explicit_evict_refuses_attached_and_pinned():
    core = make()
    loaded(core, "a", 10)
    lease = core.attach("a", conn=1)
    with pytest.raises(Attached):
        core.evict("a")
    core.detach(lease.id, conn=1)
    core.set_pinned("a", True)
    with pytest.raises(Pinned):
        core.evict("a")
    core.evict("a", ignore_pin=True)
    assert core.devices["cpu"].used == 0


def test_keep_alive_expiry():
    clock = Clock()
    core = CacheCore({"cpu": 100}, clock=clock)
    core.register("a", "cpu", keep_alive=5)
    core.register("b", "cpu")
    loaded(core, "a", 10)
    loaded(core, "b", 10)
    assert core.expired() == []
    clock.t += 10
    assert core.expired() == ["a"]  # b has no keep_alive
    core.attach("a", conn=1)
    clock.t += 10
    assert core.expired() == []  # attached models never expire


def test_unknown_and_unregister():
    core = make()
    with pytest.raises(UnknownModel):
        core.attach("zz", conn=1)
    loaded(core, "a", 10)
    lease = core.attach("a", conn=1)
    with pytest.raises(Attached):
        core.unregister("a")
    core.detach(lease.id, conn=1)
    core.unregister("a")
    assert core.devices["cpu"].used == 0
    with pytest.raises(BadRequest):
        core.register("b", "cuda:0")  # no budget for that device


def gpu_core(budget=200, host=150, names="abc"):
    return make(budget, names, device="cuda:0", host=host)


def test_lru_victim_is_demoted_to_the_host_tier_and_promoted_back():
    core = gpu_core()
    loaded(core, "a", 100)
    loaded(core, "b", 100)
    plan = core.begin_load("c", 100)
    assert plan.step_down.demote == ("a",) and not plan.promote
    core.finish_load("c")
    assert core.entry("a").state is State.HOST and core.host.used == 100
    plan = core.begin_load("a", 100)  # comes back from host memory
    assert plan.promote and plan.step_down.demote == ()  # b is the victim, but the host tier is full...
    core.finish_load("a")
    a = core.entry("a")
    assert a.demotions == 1 and a.promotions == 1 and a.state is State.RESIDENT
    assert a.host_copy and core.host.used == 100  # kept (Note [kept host copies])
    core.check_invariants()


def test_a_promoted_model_steps_down_without_a_copy_and_stale_bytes_drop_both_copies():
    core = gpu_core()
    promoted(core, "a", 100)
    step = core.evict("a")  # its bytes are in the host tier already: the arena is only freed
    assert step.release == ("a",) and step.demote == () and step.evict == () and step.drop_host == ()
    assert core.entry("a").state is State.HOST and core.host.used == 100 and core.devices["cuda:0"].used == 0
    loaded(core, "a", 100)
    step = core.evict("a", ignore_pin=True, demote=False)  # its files changed: neither copy may serve again
    assert step.evict == ("a",) and step.drop_host == ("a",) and step.release == ()
    assert core.entry("a").state is State.EVICTED and not core.entry("a").host_copy and core.host.used == 0
    core.check_invariants()


def test_kept_copies_make_room_in_the_host_tier_before_any_host_models_copy():
    core = gpu_core(budget=200, host=200, names="abcd")
    for name in "abc":
        loaded(core, name, 100)  # c's load demotes a
    core.begin_load("a", 100)  # promoted (b, the LRU, demoted to make room); a keeps its copy
    core.finish_load("a")
    assert core.entry("b").state is State.HOST and core.entry("a").host_copy and core.host.used == 200
    step = core.begin_load("d", 100).step_down  # victim c needs host room: a's kept copy goes, not b's
    assert step.demote == ("c",) and step.drop_host == ("a",)
    core.finish_load("d")
    assert core.entry("a").state is State.RESIDENT and not core.entry("a").host_copy
    assert core.entry("b").state is State.HOST and core.entry("c").state is State.HOST
    core.check_invariants()


def shared_with_a_kept_copy() -> CacheCore:
    """a, alone on its files, promoted back (its copy kept); then a second name for the
    same files comes (a reload, an admin's register)."""
    core = CacheCore({"cuda:0": 200}, clock=Clock(), host_budget=150)
    core.register("a", "cuda:0", share="P")
    core.register("b", "cuda:0")
    promoted(core, "a", 100)
    core.register("a2", "cuda:0", share="P")
    return core


@pytest.mark.parametrize("how", ["explicit", "policy"])
def test_a_shared_arena_holds_no_kept_copy(how):
    # A kept copy must not outlive its name (EVICTED with a host copy), its room lost
    # and, after a same-size change of the files, old bytes promoted under the new checkpoint.
    core = shared_with_a_kept_copy()
    assert core.entry("a").host_copy
    assert core.join("a2").drop_host == ("a",)  # shared now: never in the host tier
    assert not core.entry("a").host_copy and core.host.used == 0
    core.check_invariants()
    # explicit: a2 still holds the arena; policy: b's load takes both names
    step = core.evict("a") if how == "explicit" else core.begin_load("b", 150).step_down
    assert step.release == () and step.drop_host == ()
    assert not core.entry("a").host_copy and core.host.used == 0
    core.check_invariants()


def test_a_copy_kept_before_a_second_name_came_goes_when_the_model_steps_down():
    core = shared_with_a_kept_copy()  # a2 registered, not joined: a keeps its copy until...
    step = core.evict("a")  # ...it leaves: a shared arena does not go to the host tier
    assert step.drop_host == ("a",) and step.evict == ("a",) and step.release == ()
    assert core.entry("a").state is State.EVICTED and core.host.used == 0
    core.check_invariants()


def test_a_promotion_that_finds_its_files_shared_now_keeps_no_copy():
    core = CacheCore({"cuda:0": 200}, clock=Clock(), host_budget=150)
    core.register("a", "cuda:0", share="P")
    loaded(core, "a", 100)
    core.evict("a")
    core.begin_load("a", 100)
    core.register("a2", "cuda:0", share="P")  # while the promotion runs
    assert not core.finish_load("a").host_copy and core.host.used == 0  # the server frees it
    core.check_invariants()


def test_no_host_copy_is_dropped_for_a_victim_that_cannot_fit_anyway():
    # v1 must not drop h's copy when it would still not fit and be evicted all the same.
    core = CacheCore({"cuda:0": 300}, clock=Clock(), host_budget=150)
    for n in ("v1", "v2", "h", "c"):
        core.register(n, "cuda:0")
    promoted(core, "v2", 100)
    loaded(core, "h", 50)
    core.evict("h")  # the host tier: v2's kept copy 100 + h 50 = full
    loaded(core, "v1", 100)
    core.touch("v2")  # v1 is the LRU
    step = core.begin_load("c", 300).step_down  # v1 cannot fit beside v2's copy (its way out) and h
    assert step.evict == ("v1", "h") or step.evict == ("v1",)
    assert "h" not in step.drop_host and core.entry("h").state is State.HOST
    assert core.entry("v1").demotions == 0
    core.check_invariants()


def test_a_victim_keeps_its_copy_when_another_victim_needs_host_room():
    core = gpu_core(budget=300, host=100, names="abcx")
    loaded(core, "a", 100)
    core.evict("a")  # a -> host: the host tier is full
    loaded(core, "x", 100)
    loaded(core, "b", 100)
    core.begin_load("a", 100)  # room without victims; a is promoted and keeps its copy
    core.finish_load("a")
    step = core.begin_load("c", 300).step_down  # all three leave, x (the LRU) first
    # a's kept copy is its own way out: x and b may not drop it, so they leave outright
    # and a leaves without a copy (else a would have had to be copied out again).
    assert step.release == ("a",) and step.evict == ("x", "b") and step.drop_host == () and step.demote == ()
    core.check_invariants()


def test_host_tier_is_lru_too_and_never_drops_the_model_being_promoted():
    core = gpu_core(budget=200, host=100, names="abcd")
    loaded(core, "a", 100)
    loaded(core, "b", 100)
    loaded(core, "c", 100)  # a -> host
    assert core.entry("a").state is State.HOST
    plan = core.begin_load("a", 100)  # promote a; victim b cannot go to host (a still holds it)
    assert plan.promote and plan.step_down.evict == ("b",) and plan.step_down.drop_host == ()
    core.finish_load("a")
    assert core.host.used == 100 and core.entry("b").state is State.EVICTED  # a kept its copy
    loaded(core, "d", 100)  # c is now LRU -> host, in the room of a's kept copy
    assert core.entry("c").state is State.HOST and not core.entry("a").host_copy
    core.evict("a")  # a -> host: the host tier drops c (its LRU) to make room
    assert core.entry("a").state is State.HOST and core.entry("c").state is State.EVICTED
    core.check_invariants()


def test_evict_steps_down_one_tier_at_a_time():
    core = gpu_core()
    loaded(core, "a", 100)
    assert core.evict("a").demote == ("a",)
    assert core.evict("a").drop_host == ("a",)
    assert core.entry("a").state is State.EVICTED and core.host.used == 0
    loaded(core, "b", 160)  # bigger than the host tier: straight out
    assert core.evict("b").evict == ("b",)


def test_a_victim_is_never_both_demoted_and_dropped_in_one_step():
    # Found by the state machine: g2 went to the host tier, then made room there for g1.
    core = gpu_core(budget=1000, host=900, names="abc")
    loaded(core, "a", 334)
    loaded(core, "b", 567)
    step = core.begin_load("c", 434).step_down
    assert step.demote == ("b",) and step.evict == ("a",) and step.drop_host == ()
    core.check_invariants()


def test_failed_promotion_keeps_the_host_copy():
    core = gpu_core()
    loaded(core, "a", 100)
    core.evict("a")
    core.begin_load("a", 100)
    core.abort_load("a")
    assert core.entry("a").state is State.HOST and core.host.used == 100
    core.check_invariants()


def test_cpu_models_have_no_tier_below():
    core = CacheCore({"cpu": 200}, clock=Clock(), host_budget=1000)
    core.register("a", "cpu")
    loaded(core, "a", 100)
    assert core.evict("a").evict == ("a",) and core.host.used == 0


def check_victims(core: CacheCore, ranks: dict, victims: tuple[str, ...], need: int, count: int = 0) -> None:
    """Note [invariants], 3, for any policy: the victims make room (``need`` bytes and
    ``count`` places under max_loaded), were evictable, and the highest-ranked one was
    needed; under GDSF none could have been spared.
    ``ranks``: the policy's rank of every evictable model of the device, before the step."""
    sizes = {n: core.entry(n).nbytes for n in ranks}
    assert set(victims) <= set(ranks), "a victim was not evictable"
    if need <= 0 and count <= 0:
        assert not victims
        return
    freed = sum(sizes[v] for v in victims)
    assert freed >= need and len(victims) >= count
    top = max(ranks[v] for v in victims)
    below = [n for n, r in ranks.items() if r < top]
    assert sum(sizes[n] for n in below) < need or len(below) < count, "the highest-ranked victim was not needed"
    if core.policy.name == "gdsf":
        assert all(freed - sizes[v] < need or len(victims) - 1 < count for v in victims), "a victim could have been spared"


class CoreMachine(RuleBasedStateMachine):
    """Random sequences of every operation; the invariants hold after each step."""

    policy = "lru"
    names = st.sampled_from(["m0", "m1", "m2", "m3", "m4", "g0", "g1", "g2", "g3"])
    conns = st.integers(1, 3)

    def __init__(self) -> None:
        super().__init__()
        # CPU models, and GPU models with a host tier below them; budgets a few models fill,
        # so that most loads must evict
        # and a count limit on the CPU that binds before its bytes do, for small models
        self.core = CacheCore({"cpu": 600, "cuda:0": 600}, clock=Clock(), host_budget=500, policy=self.policy,
                              max_loaded={"cpu": 3})
        self.clocks = {dev: 0.0 for dev in self.core.devices}
        for n in ["m0", "m1", "m2", "m3", "m4"]:
            self.core.register(n, "cpu")
        for n in ["g0", "g1", "g2", "g3"]:
            self.core.register(n, "cuda:0")
        self.held: set[str] = set()  # resident and attached or pinned after the last step

    def _before(self, device: str) -> tuple[dict, dict]:
        """Rank and priority of every evictable model on ``device``, before a step."""
        ev = [x for x in self.core.entries.values() if x.device == device and x.evictable]
        return {x.name: self.core.policy.rank(x) for x in ev}, {x.name: self.core.priority(x.name) for x in ev}

    def _check_clock(self, device: str, priorities: dict, victims: tuple[str, ...]) -> None:
        """GDSF's L is the priority of the last victim (never going back); LRU has none."""
        expected = max([self.clocks[device], *(priorities[v] for v in victims)]) if self.core.policy.name == "gdsf" else 0.0
        assert self.core.policy.clock(device) == expected

    @rule(name=names, nbytes=st.integers(1, 700), fail=st.booleans())
    def load(self, name, nbytes, fail):
        e = self.core.entry(name)
        if e.state in (State.LOADING, State.RESIDENT):
            return
        if e.host_copy:
            nbytes = e.nbytes  # a promotion reloads the same bytes
        before = {x.name: (x.state, x.last_used) for x in self.core.entries.values()}
        ranks, priorities = self._before(e.device)
        need = nbytes - self.core.devices[e.device].free
        limit = self.core.max_loaded.get(e.device)
        count = 0 if limit is None else self.core.loaded_on(e.device) + 1 - limit
        try:
            plan = self.core.begin_load(name, nbytes)
        except NoSpace:
            # all the evictable would not do: too few bytes, or too few models
            assert sum(self.core.entry(n).nbytes for n in ranks) < need or len(ranks) < count
            return
        check_victims(self.core, ranks, plan.evict, need, count)
        self._check_clock(e.device, priorities, plan.evict)
        # Victims: evictable before, and each older than every evictable model kept.
        for v in plan.evict:
            assert self.core.entry(v).state in (State.EVICTED, State.HOST)
            assert before[v][0] is State.RESIDENT
            assert self.core.entry(v).device == e.device
        for v in plan.step_down.drop_host:  # a HOST model's copy, or one kept by a resident model
            x = self.core.entry(v)
            assert not x.host_copy
            assert ((before[v][0] is State.HOST and x.state is State.EVICTED)
                    or (before[v][0] is State.RESIDENT and (x.state is State.RESIDENT or v in plan.evict))), v
        for v in plan.step_down.release:  # no copy made: it had kept one
            assert self.core.entry(v).state is State.HOST and self.core.entry(v).host_copy
        assert plan.promote == (before[name][0] is State.HOST)
        kept = [x for x in self.core.entries.values() if x.evictable and x.device == e.device]
        if plan.evict and kept and self.core.policy.name == "lru":
            assert max(before[v][1] for v in plan.evict) < min(x.last_used for x in kept)
        if fail:
            self.core.abort_load(name)
        else:
            self.core.finish_load(name)

    @rule(name=names, nbytes=st.integers(1, 250))
    def load_small(self, name, nbytes):
        """Small models that stay: later loads then need several victims, and GDSF may spare some."""
        self.load(name, nbytes, fail=False)

    @rule(device=st.sampled_from(["cpu", "cuda:0"]), budget=st.integers(300, 600))
    def set_budget(self, device, budget):
        acct = self.core.devices[device]
        need = acct.used + acct.reserved - budget
        ranks, priorities = self._before(device)
        try:
            step = self.core.set_budget(device, budget)
        except NoSpace:
            assert need > 0
            return
        check_victims(self.core, ranks, step.leaving, need)
        self._check_clock(device, priorities, step.leaving)

    @rule(name=names, source=st.sampled_from(["files", "host"]), nbytes=st.integers(0, 700),
          seconds=st.floats(1e-6, 5.0))
    def observe(self, name, source, nbytes, seconds):
        self.core.observe_load(name, source, nbytes, seconds)

    @rule(name=names)
    def touch(self, name):
        if self.core.entry(name).state is State.RESIDENT:
            self.core.touch(name)

    @rule(name=names, conn=conns)
    def attach(self, name, conn):
        if self.core.entry(name).state is State.RESIDENT:
            self.core.attach(name, conn)

    @precondition(lambda self: self.core.leases)
    @rule(data=st.data())
    def detach(self, data):
        lease = data.draw(st.sampled_from(sorted(self.core.leases.values(), key=lambda x: x.id)))
        self.core.detach(lease.id, lease.conn)

    @rule(conn=conns)
    def drop(self, conn):
        self.core.drop_connection(conn)

    @rule(name=names, pinned=st.booleans())
    def pin(self, name, pinned):
        self.core.set_pinned(name, pinned)

    @rule(name=names)
    def evict(self, name):
        e = self.core.entry(name)
        was_attached, was_pinned, was = bool(e.leases), e.pinned, e.state
        try:
            self.core.evict(name)
        except (Attached, Pinned, BadRequest):
            return
        assert was is State.HOST or (not was_attached and not was_pinned)
        assert self.core.policy.clock(e.device) == self.clocks[e.device]  # not the policy's victim: L stays

    @invariant()
    def invariants(self):
        self.core.check_invariants()
        for e in self.core.entries.values():
            assert e.attach_count >= 0
            if e.name in self.held and (e.leases or e.pinned):
                # resident and still attached or pinned: no step may have moved it
                assert e.state is State.RESIDENT, (e.name, e.state)
            if e.leases:
                assert e.state is State.RESIDENT
        self.held = {e.name for e in self.core.entries.values() if e.state is State.RESIDENT and (e.leases or e.pinned)}
        for dev, before in self.clocks.items():
            assert self.core.policy.clock(dev) >= before  # GDSF's L never goes back
            self.clocks[dev] = self.core.policy.clock(dev)


class GDSFMachine(CoreMachine):
    """The same operations and invariants under the cost-aware policy."""

    policy = "gdsf"


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
TestGDSFMachine = GDSFMachine.TestCase
TestGDSFMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_lowering_a_budget_evicts_lru_or_refuses():
    core = make(budget=300, names="abc")
    for n in "abc":
        loaded(core, n, 100)
    core.attach("c", conn=1)
    assert core.set_budget("cpu", 200).evict == ("a",)  # the LRU one goes
    with pytest.raises(NoSpace, match="cannot be evicted"):
        core.set_budget("cpu", 50)  # b could go, c is attached: refused, nothing changed
    assert core.devices["cpu"].budget == 200 and core.entry("b").state is State.RESIDENT
    core.check_invariants()


def test_request_keep_alive_replaces_the_configured_one():
    """Per-request keep_alive (load/attach): 0 expires the model once its last lease
    ends, None never expires it; the configured value is kept to cap tenants with."""
    clock = Clock()
    core = CacheCore({"cpu": 100}, clock=clock)
    core.register("a", "cpu", keep_alive=5)
    loaded(core, "a", 10)
    lease = core.attach("a", conn=1)
    core.set_keep_alive("a", 0)
    assert core.expired() == []  # leased: never expires
    core.detach(lease.id, conn=1)
    assert core.expired() == ["a"]  # at once, no time passed
    core.set_keep_alive("a", None)
    clock.t += 10**6
    assert core.expired() == []
    assert core.entry("a").configured_keep_alive == 5
    with pytest.raises(BadRequest):
        core.set_keep_alive("a", -1)


def test_max_loaded_models_evicts_like_bytes_do():
    """A device's count limit: a load beyond it evicts the LRU model though bytes are
    plentiful; when every model there is held, NoSpace names the limit."""
    core = CacheCore({"cpu": 1000}, clock=Clock(), max_loaded={"cpu": 2})
    for n in "abc":
        core.register(n, "cpu")
    loaded(core, "a", 10)
    loaded(core, "b", 10)
    plan = core.begin_load("c", 10)
    assert plan.evict == ("a",)  # the least recently used, for the count alone
    core.finish_load("c")
    core.check_invariants()
    core.attach("b", conn=1)
    core.set_pinned("c", True)
    with pytest.raises(NoSpace) as full:
        core.begin_load("a", 10)
    assert full.value.details["max_loaded_models"] == 2 and "max_loaded_models" in full.value.message
    assert full.value.fits_ever  # b's lease may end
    core.set_pinned("b", True)
    with pytest.raises(NoSpace) as never:
        core.begin_load("a", 10)
    assert not never.value.fits_ever  # both pinned: no detach helps


def test_set_max_loaded_evicts_down_to_the_count_or_changes_nothing():
    """A lowered count (reload) evicts unattached models in LRU order; one that held
    models exceed raises NoSpace and keeps the old count; None lifts it."""
    core = CacheCore({"cpu": 1000}, clock=Clock())
    for n in "abc":
        core.register(n, "cpu")
        loaded(core, n, 10)
    core.attach("b", conn=1)
    core.attach("c", conn=1)
    with pytest.raises(NoSpace) as held:
        core.set_max_loaded("cpu", 1)
    assert "max_loaded_models.cpu" in held.value.message and "b, c" in held.value.message
    assert core.max_loaded == {} and core.loaded_on("cpu") == 3
    step = core.set_max_loaded("cpu", 2)
    assert step.evict == ("a",) and core.max_loaded == {"cpu": 2}
    core.check_invariants()
    assert core.set_max_loaded("cpu", None).evict == () and core.max_loaded == {}


def test_shared_arenas_count_once_and_leave_with_their_last_name():
    """Note [shared arenas]: two names of one share key hold one arena; the bytes count
    once; one name evicted or unregistered leaves the other's bytes; the policy takes the
    arena only when neither name holds it, and then both names go."""
    core = CacheCore({"cpu": 100}, clock=Clock())
    core.register("a", "cpu", share="k")
    core.register("b", "cpu", share="k")
    core.register("c", "cpu")
    core.register("gpu-ish", "cpu", share="other")  # another key: nothing in common
    loaded(core, "a", 40)
    assert core.resident_sibling("b") == "a" and core.resident_sibling("gpu-ish") is None
    with pytest.raises(BadRequest):
        core.begin_load("b", 40)  # a second copy: refused, it must join
    assert core.join("b") == StepDown()
    core.check_invariants()
    assert core.devices["cpu"].used == 40 and core.loaded_on("cpu") == 1 and core.entry("b").nbytes == 40
    lease = core.attach("b", conn=1)
    assert core.evict("a").evict == ("a",)  # a's name goes; b's lease keeps the bytes
    assert core.devices["cpu"].used == 40 and core.entry("a").state is State.EVICTED
    core.join("a")
    core.check_invariants()
    with pytest.raises(NoSpace):
        core.begin_load("c", 70)  # only the shared arena could make room, and b holds it
    core.detach(lease.id, conn=1)
    plan = core.begin_load("c", 70)
    assert sorted(plan.evict) == ["a", "b"] and core.devices["cpu"].used == 0
    core.finish_load("c")
    core.check_invariants()
    # unregistering one name of a resident arena leaves the bytes with the other
    core.evict("c")
    loaded(core, "b", 40)
    core.join("a")
    core.unregister("b")
    assert core.devices["cpu"].used == 40 and core.siblings("a") == []
    core.unregister("a")
    assert core.devices["cpu"].used == 0
    core.check_invariants()


class SharedArenaMachine(RuleBasedStateMachine):
    """Note [shared arenas] under random operations: names of one share key load once,
    join, leave one by one, are chosen by the policy together, and the invariants (a
    shared arena counted once, one arena per key) hold after every step."""

    names = st.sampled_from(["s0", "s1", "s2", "t0", "t1", "u0", "u1"])
    conns = st.integers(1, 2)

    def __init__(self) -> None:
        super().__init__()
        self.core = CacheCore({"cpu": 500, "cuda:0": 500}, clock=Clock(), host_budget=300, max_loaded={"cpu": 2})
        for n in ("s0", "s1", "s2"):
            self.core.register(n, "cpu", share="k")
        for n in ("t0", "t1"):
            self.core.register(n, "cuda:0", share="k")  # the same key on another device: another arena
        self.core.register("u0", "cpu")
        self.core.register("u1", "cuda:0")

    @rule(name=names, nbytes=st.integers(1, 400), fail=st.booleans())
    def load(self, name, nbytes, fail):
        e = self.core.entry(name)
        # The server never starts a second load of one arena (it joins the sibling's job).
        if e.state in (State.LOADING, State.RESIDENT) or any(x.state is State.LOADING for x in self.core.siblings(name)):
            return
        if self.core.resident_sibling(name):
            held = self.core.devices[e.device].used
            self.core.join(name)
            assert self.core.devices[e.device].used == held  # no second copy
            return
        if e.host_copy:
            nbytes = e.nbytes
        try:
            plan = self.core.begin_load(name, nbytes)
        except NoSpace:
            return
        for v in plan.evict:  # a shared arena leaves under every name on it
            ve = self.core.entry(v)
            assert all(x.state is not State.RESIDENT for x in self.core.siblings(v)), v
            assert ve.state in (State.EVICTED, State.HOST)
        if fail:
            self.core.abort_load(name)
        else:
            self.core.finish_load(name)

    @rule(name=names, conn=conns)
    def attach(self, name, conn):
        if self.core.entry(name).state is State.RESIDENT:
            self.core.attach(name, conn)

    @rule(conn=conns)
    def drop(self, conn):
        self.core.drop_connection(conn)

    @rule(name=names, pinned=st.booleans())
    def pin(self, name, pinned):
        self.core.set_pinned(name, pinned)

    @rule(name=names)
    def evict(self, name):
        e = self.core.entry(name)
        if e.state is State.HOST or (e.state is State.RESIDENT and not e.leases and not e.pinned):
            held = self.core.devices[e.device].used
            others = any(x.state is State.RESIDENT for x in self.core.siblings(name))
            self.core.evict(name)
            if others:
                assert self.core.devices[e.device].used == held  # a sibling keeps the bytes

    @rule(name=names)
    def reregister(self, name):
        e = self.core.entry(name)
        if e.leases or e.state is State.LOADING:
            return
        device, share = e.device, e.share
        self.core.unregister(name)
        self.core.register(name, device, share=None if share is None else "k")

    @rule(budget=st.integers(200, 500), device=st.sampled_from(["cpu", "cuda:0"]))
    def set_budget(self, budget, device):
        with contextlib.suppress(NoSpace):
            self.core.set_budget(device, budget)

    @invariant()
    def invariants(self):
        self.core.check_invariants()


TestSharedArenaMachine = SharedArenaMachine.TestCase
TestSharedArenaMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
