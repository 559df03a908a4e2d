"""Automatic placement (cache/placement.py, Note [placement]): examples, then hypothesis
properties over any number of fake devices. The core is device-name agnostic, so GPUs
here are just names with budgets: nothing assumes two of them, or any CUDA."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.cache import CacheCore
from weightcache.cache.placement import DeviceView, Placement, Victim, place, place_ranks, views


def dev(name, budget=100, used=0, reserved=0, **kw):
    return DeviceView(device=name, budget=budget, used=used, reserved=reserved, **kw)


def test_prefers_the_device_where_it_is_resident_even_when_another_is_emptier():
    p = place([dev("cuda:0"), dev("cuda:1", used=90, replica="resident")], nbytes=10)
    assert (p.device, p.reason) == ("cuda:1", "resident")


def test_prefers_joining_a_load_in_flight_over_free_budget():
    p = place([dev("cuda:0"), dev("cuda:1", reserved=10, replica="loading")], nbytes=10)
    assert (p.device, p.reason) == ("cuda:1", "loading")


def test_free_budget_goes_to_the_device_with_the_most_free():
    p = place([dev("cuda:0", used=50), dev("cuda:1", used=20), dev("cuda:2", used=70)], nbytes=10)
    assert (p.device, p.reason) == ("cuda:1", "free")


def test_a_host_copy_wins_among_devices_with_free_budget():
    p = place([dev("cuda:0"), dev("cuda:1", used=50, replica="host")], nbytes=10)
    assert (p.device, p.reason) == ("cuda:1", "free")


def test_real_free_memory_counts():
    """Budget free but the GPU held by other processes (an engine's KV cache): not free."""
    p = place([dev("cuda:0", free_memory=5), dev("cuda:1", used=50, free_memory=1000)], nbytes=10)
    assert (p.device, p.reason) == ("cuda:1", "free")


def test_max_loaded_models_is_respected():
    p = place([dev("cuda:0", max_loaded=1, loaded=1), dev("cuda:1", used=50, loaded=3)], nbytes=10)
    assert p.device == "cuda:1"


def test_evicts_the_fewest_bytes_then_the_oldest():
    a = dev("cuda:0", used=100, evictable=(Victim("a", 80, 1.0),))
    b = dev("cuda:1", used=100, evictable=(Victim("b", 30, 5.0), Victim("c", 70, 2.0)))
    p = place([a, b], nbytes=30)
    assert (p.device, p.reason, p.evicts, p.evict_bytes) == ("cuda:1", "evicts", ("c",), 70)  # LRU takes c first there
    same = [dev("cuda:0", used=100, evictable=(Victim("new", 40, 9.0),)),
            dev("cuda:1", used=100, evictable=(Victim("old", 40, 3.0),))]
    assert place(same, nbytes=40).device == "cuda:1"  # equal bytes: the older victim


def test_no_room_anywhere_names_the_device_that_could_ever_hold_it():
    p = place([dev("cuda:0", used=100, pinned_bytes=100), dev("cuda:1", used=100, pinned_bytes=20)], nbytes=50)
    assert (p.device, p.fits, p.reason) == ("cuda:1", False, "no room")
    assert "no device has room" in p.describe()


def test_tp_ranks_get_distinct_devices_and_keep_the_ones_they_have():
    rank0 = [dev("cuda:0"), dev("cuda:1"), dev("cuda:2")]
    rank1 = [dev("cuda:0"), dev("cuda:1"), dev("cuda:2", replica="resident")]
    ps = place_ranks([rank0, rank1], [10, 10])
    assert ps[1].device == "cuda:2" and ps[0].device != "cuda:2"


def test_tp_needs_as_many_devices_as_ranks():
    with pytest.raises(ValueError, match="2 ranks need as many devices"):
        place_ranks([[dev("cuda:0")], [dev("cuda:0")]], [1, 1])


def test_views_read_the_core():
    core = CacheCore({"cuda:0": 100, "cuda:1": 100}, max_loaded={"cuda:1": 2})
    for n, d in [("m@cuda:0", "cuda:0"), ("m@cuda:1", "cuda:1"), ("x", "cuda:0"), ("y", "cuda:0")]:
        core.register(n, d)
    for n, size in [("x", 40), ("y", 30)]:
        core.begin_load(n, size)
        core.finish_load(n)
    core.set_pinned("y", True)
    v0, v1 = views(core, {"cuda:0": "m@cuda:0", "cuda:1": "m@cuda:1"}, {"cuda:0": 1000, "cuda:1": None})
    assert (v0.used, v0.loaded, v0.pinned_bytes, v0.free_memory) == (70, 2, 30, 1000)
    assert [x.name for x in v0.evictable] == ["x"]
    assert (v1.max_loaded, v1.replica, v1.free_memory) == (2, "absent", None)
    core.begin_load("m@cuda:1", 10)
    assert views(core, {"cuda:1": "m@cuda:1"}, {})[0].replica == "loading"


def test_a_device_within_the_tenants_quota_wins_over_more_free_budget():
    # cuda:0 has the most free budget, but the tenant may add only 5 bytes there
    p = place([dev("cuda:0", quota_free=5), dev("cuda:1", used=60, quota_free=50)], nbytes=10)
    assert (p.device, p.reason) == ("cuda:1", "free")
    # within the quota nowhere: the budget rules decide (the load evicts the tenant's own, or is refused)
    p = place([dev("cuda:0", quota_free=5), dev("cuda:1", used=60, quota_free=0)], nbytes=10)
    assert (p.device, p.reason) == ("cuda:0", "free")
    # a device within the quota where room must be made beats free budget over the quota
    p = place([dev("cuda:0", quota_free=0), dev("cuda:1", used=95, quota_free=20,
                                                   evictable=(Victim("old", 10, 1.0),))], nbytes=10)
    assert (p.device, p.reason, p.evicts) == ("cuda:1", "evicts", ("old",))


def test_views_give_the_tenants_quota_room_per_device():
    from weightcache.cache.eviction import Quota

    core = CacheCore({"cuda:0": 100, "cuda:1": 100})
    core.set_quotas({"uid:7": Quota("uid:7", nbytes={"cuda:0": 30})})
    for n, d in [("m@cuda:0", "cuda:0"), ("m@cuda:1", "cuda:1"), ("x", "cuda:0")]:
        core.register(n, d, tenants=("uid:7",))
    core.begin_load("x", 20)
    core.finish_load("x")
    v0, v1 = views(core, {"cuda:0": "m@cuda:0", "cuda:1": "m@cuda:1"}, {})
    assert (v0.quota_free, v1.quota_free) == (10, None)  # 30 less x's 20; no quota on cuda:1


# -- properties ----------------------------------------------------------------------

@st.composite
def device_views(draw, n_min=1, n_max=6):
    n = draw(st.integers(n_min, n_max))
    out = []
    for i in range(n):
        budget = draw(st.integers(1, 200))
        victims = tuple(Victim(f"v{i}.{j}", draw(st.integers(1, 80)), float(draw(st.integers(0, 50))))
                        for j in range(draw(st.integers(0, 4))))
        evictable_bytes = sum(v.nbytes for v in victims)
        pinned = draw(st.integers(0, 60))
        used = evictable_bytes + pinned  # resident bytes: the evictable ones and the pinned ones
        if used > budget:
            budget = used + draw(st.integers(0, 50))
        reserved = draw(st.integers(0, budget - used))
        loaded = len(victims) + (pinned > 0) + (reserved > 0)
        out.append(DeviceView(
            device=f"cuda:{i}", budget=budget, used=used, reserved=reserved,
            replica=draw(st.sampled_from(["absent", "absent", "host", "resident", "loading"])),
            replica_last_used=float(draw(st.integers(0, 50))),
            free_memory=draw(st.one_of(st.none(), st.integers(0, 300))),
            max_loaded=draw(st.one_of(st.none(), st.integers(1, 6))), loaded=loaded,
            evictable=victims, pinned_bytes=pinned,
        ))
    return out


def fits_after(v: DeviceView, p, nbytes: int) -> bool:
    victims = [x for x in v.evictable if x.name in p.evicts]
    freed = sum(x.nbytes for x in victims)
    count_ok = v.max_loaded is None or v.loaded - len(victims) + 1 <= v.max_loaded
    real_ok = v.free_memory is None or v.free_memory + freed >= nbytes
    return v.used + v.reserved - freed + nbytes <= v.budget and count_ok and real_ok


@settings(max_examples=400, deadline=None)
@given(device_views(), st.integers(0, 150))
def test_property_a_placement_that_fits_never_exceeds_a_budget(vs, nbytes):
    p = place(vs, nbytes)
    v = next(x for x in vs if x.device == p.device)
    if any(x.replica in ("resident", "loading") for x in vs):
        return  # already there: no bytes move (next property)
    if p.fits:
        assert fits_after(v, p, nbytes), (p, v)
        assert set(p.evicts) <= {x.name for x in v.evictable}  # only unattached, unpinned models
    else:  # said not to fit: no device would have, even evicting all it may
        for w in vs:
            assert not fits_after(w, Placement(w.device, "evicts", evicts=tuple(x.name for x in w.evictable)), nbytes)


@settings(max_examples=300, deadline=None)
@given(device_views(), st.integers(0, 150))
def test_property_residency_is_preferred(vs, nbytes):
    p = place(vs, nbytes)
    if any(v.replica == "resident" for v in vs):
        assert p.reason == "resident" and next(v for v in vs if v.device == p.device).replica == "resident"
    elif any(v.replica == "loading" for v in vs):
        assert p.reason == "loading"
    elif p.reason == "evicts":  # evicting only where no device had free room
        assert not any(fits_after(v, Placement(v.device, "free"), nbytes) for v in vs)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6).flatmap(lambda r: st.tuples(st.just(r), device_views(n_min=r, n_max=8))), st.data())
def test_property_tp_ranks_get_distinct_devices(r_vs, data):
    ranks, vs = r_vs
    per_rank = [[DeviceView(**{**v.__dict__, "replica": data.draw(st.sampled_from(["absent", "resident"]))}) for v in vs]
                for _ in range(ranks)]
    ps = place_ranks(per_rank, [data.draw(st.integers(0, 100)) for _ in range(ranks)])
    assert len({p.device for p in ps}) == ranks
    for i, p in enumerate(ps):  # a rank resident on a device no other rank took keeps it
        mine = {v.device for v in per_rank[i] if v.replica == "resident"}
        taken = {q.device for j, q in enumerate(ps) if j != i}
        if mine - taken:
            assert p.device in mine, (i, p, mine, taken)
