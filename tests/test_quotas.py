"""Per-tenant quotas in the pure core (cache/core.py, Note [quotas]) and their config:
a tenant over its byte quota on a device evicts its own unattached models
first, and is refused NO_SPACE naming the quota when they cannot make room; pins are
counted per model; the operator's models count against no quota. The multi-uid tests
through the daemon are in tests/security/test_tenants.py."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightcache.cache import CacheCore, State
from weightcache.cache.eviction import Quota, tenant_keys
from weightcache.config import load_settings
from weightcache.errors import ConfigError, NoSpace

A = ("uid:1000", "gid:100")  # tenant A: uid 1000, in group 100
B = ("uid:2000", "gid:100")  # tenant B: uid 2000, also in group 100


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def make(budget=1000, quotas=(), policy="lru", **tenants):
    core = CacheCore({"cpu": budget}, clock=Clock(), policy=policy)
    core.set_quotas({q.tenant: q for q in quotas})
    for name, who in tenants.items():
        core.register(name, "cpu", tenants=who)
    return core


def loaded(core, name, nbytes):
    plan = core.begin_load(name, nbytes)
    core.finish_load(name)
    return plan


def test_over_quota_a_tenant_evicts_its_own_models_before_older_ones_of_others():
    core = make(quotas=[Quota("uid:1000", {"cpu": 250})], b1=B, a1=A, a2=A, a3=A)
    loaded(core, "b1", 100)  # the least recently used model on the device: LRU alone would take it
    loaded(core, "a1", 100)
    loaded(core, "a2", 100)
    plan = core.begin_load("a3", 100)  # 300 > 250: one of A's own must go, not B's
    assert plan.evict == ("a1",)
    core.finish_load("a3")
    assert core.tenant_bytes("uid:1000", "cpu") == 200
    assert core.entry("b1").state is State.RESIDENT
    core.check_invariants()


def test_the_device_budget_still_takes_any_tenants_models_in_the_policys_order():
    # Within its quota, a tenant's load evicts as before: least recently used first, whoever owns it.
    core = make(budget=300, quotas=[Quota("uid:1000", {"cpu": 1000})], b1=B, a1=A, a2=A, a3=A)
    loaded(core, "b1", 100)
    loaded(core, "a1", 100)
    loaded(core, "a2", 100)
    assert core.begin_load("a3", 100).evict == ("b1",)


def test_over_quota_with_its_own_attached_is_no_space_naming_the_quota():
    core = make(quotas=[Quota("uid:1000", {"cpu": 250})], a1=A, a2=A, a3=A, b1=B)
    loaded(core, "a1", 100)
    loaded(core, "a2", 100)
    core.attach("a1", conn=1)
    core.set_pinned("a2", True)
    loaded(core, "b1", 100)
    with pytest.raises(NoSpace) as err:
        core.begin_load("a3", 100)
    d = err.value.details
    assert (d["quota"], d["quota_bytes"], d["quota_used"]) == ("uid:1000", 250, 200)
    assert 'quotas."uid:1000".bytes' in err.value.message and "uid:1000" in err.value.message
    assert d["fits_ever"] is True  # 100 B pinned of 250: a detach of a1 would make room
    assert core.entry("b1").state is State.RESIDENT and core.entry("a3").state is State.REGISTERED  # nothing moved
    core.check_invariants()
    with pytest.raises(NoSpace) as err:
        core.begin_load("a3", 200)  # 100 pinned + 200 > 250: no detach ever helps
    assert err.value.details["fits_ever"] is False


def test_a_group_quota_counts_every_members_models():
    core = make(quotas=[Quota("gid:100", {"cpu": 250})], a1=A, b1=B, b2=B, c1=("uid:3000",))
    loaded(core, "a1", 100)
    loaded(core, "c1", 100)  # not in the group: not counted, never evicted for it
    loaded(core, "b1", 100)
    assert core.begin_load("b2", 100).evict == ("a1",)  # the group's least recently used
    assert core.tenant_bytes("gid:100", "cpu") == 200  # b1, and b2 LOADING: a loading model counts
    core.finish_load("b2")
    assert core.entry("c1").state is State.RESIDENT


def test_operator_models_count_against_no_quota():
    core = make(quotas=[Quota("uid:1000", {"cpu": 100})], op=(), a1=A)
    loaded(core, "op", 500)
    loaded(core, "a1", 100)
    assert core.tenant_bytes("uid:1000", "cpu") == 100
    assert set(core.tenant_usage()) == {"uid:1000"}


def test_a_model_larger_than_the_quota_never_fits():
    core = make(quotas=[Quota("uid:1000", {"cpu": 100})], a1=A)
    with pytest.raises(NoSpace) as err:
        core.begin_load("a1", 101)
    assert err.value.details["fits_ever"] is False


def test_a_lowered_quota_evicts_nothing_until_the_tenants_next_load():
    core = make(quotas=[Quota("uid:1000", {"cpu": 1000})], a1=A, a2=A, a3=A)
    for n in ("a1", "a2"):
        loaded(core, n, 100)
    core.set_quotas({"uid:1000": Quota("uid:1000", {"cpu": 150})})
    assert core.entry("a1").state is State.RESIDENT and core.tenant_bytes("uid:1000", "cpu") == 200
    assert core.begin_load("a3", 100).evict == ("a1", "a2")  # back under 150 with the new one
    core.check_invariants()


def test_pins_are_counted_per_model_and_refused_beyond_the_quota():
    core = CacheCore({"cpu": 1000}, clock=Clock())
    core.set_quotas({"uid:1000": Quota("uid:1000", pins=1)})
    for n, model in (("tp@0", "tp"), ("tp@1", "tp"), ("other", None)):
        core.register(n, "cpu", tenants=A, model=model)  # the registry says whose rank an entry is
    core.set_pinned("tp@0", True)
    core.set_pinned("tp@1", True)  # another rank of the model already pinned: no new pin
    assert core.tenant_usage()["uid:1000"]["pins"] == 1
    with pytest.raises(NoSpace) as err:
        core.set_pinned("other", True)
    assert err.value.details["quota"] == "uid:1000" and 'quotas."uid:1000".pins = 1' in err.value.message
    assert not core.entry("other").pinned
    with pytest.raises(NoSpace):
        core.register("pinned-at-birth", "cpu", pinned=True, tenants=A)
    assert "pinned-at-birth" not in core.entries
    core.set_pinned("tp@0", False)
    core.set_pinned("tp@1", False)
    core.set_pinned("other", True)


def test_usage_shows_bytes_per_device_pins_and_quota():
    core = make(quotas=[Quota("uid:1000", {"cpu": 500}, pins=2)], a1=A, b1=B)
    loaded(core, "a1", 100)
    loaded(core, "b1", 50)
    usage = core.tenant_usage()
    assert usage["uid:1000"] == {"devices": {"cpu": {"used": 100, "parsing": 0, "quota": 500}}, "pins": 0, "pins_quota": 2}
    assert usage["uid:2000"] == {"devices": {"cpu": {"used": 50, "parsing": 0, "quota": None}}, "pins": 0, "pins_quota": None}


def test_a_parse_is_charged_while_it_runs_and_refused_past_what_cannot_leave():
    core = make(quotas=[Quota("uid:1000", {"cpu": 500})], a1=A, a2=A, a3=A)
    loaded(core, "a1", 100)
    token = core.charge_parse(A, "cpu", 300, "new")
    assert core.tenant_usage()["uid:1000"]["devices"]["cpu"] == {"used": 400, "parsing": 300, "quota": 500}
    # a load sees the parse's bytes: 100 + 300 + 150 is over 500, so a1 (unattached) makes room
    plan = core.begin_load("a2", 150)
    assert plan.evict == ("a1",)
    core.finish_load("a2")
    core.attach("a2", conn=1)  # cannot leave now
    with pytest.raises(NoSpace) as err:  # 150 attached + 300 parsing + 100 > 500
        core.charge_parse(A, "cpu", 100, "other")
    assert err.value.details["quota"] == "uid:1000" and "parsing other" in err.value.message
    assert core.charge_parse(B, "cpu", 10**9, "theirs")  # another tenant, no quota: charged, not refused
    core.release_parse(token)
    assert core.tenant_usage()["uid:1000"]["devices"]["cpu"] == {"used": 150, "parsing": 0, "quota": 500}
    core.release_parse(core.charge_parse(A, "cpu", 350, "fits"))  # 150 + 350: at the quota


def test_tenant_keys_are_the_uid_then_each_group_once():
    assert tenant_keys(1000, [5, 100, 5]) == ("uid:1000", "gid:5", "gid:100")


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["load", "attach", "detach", "evict"]), st.integers(0, 5),
                          st.integers(1, 120)), max_size=40),
       st.integers(100, 400), st.integers(100, 400))
def test_an_admitted_load_leaves_every_tenant_within_its_quota(policy, ops, qa, qg):
    quotas = [Quota("uid:1000", {"cpu": qa}), Quota("gid:100", {"cpu": qg})]
    names = ["a0", "a1", "b0", "b1", "op0", "op1"]
    core = make(budget=500, quotas=quotas, policy=policy, a0=A, a1=A, b0=B, b1=B, op0=(), op1=())
    leases: dict[str, int] = {}
    for op, i, nbytes in ops:
        name = names[i]
        e = core.entry(name)
        if op == "load" and e.state not in (State.LOADING, State.RESIDENT):
            try:
                core.begin_load(name, nbytes)
            except NoSpace:
                core.check_invariants()
                continue
            for q in quotas:
                if q.tenant in e.tenants:
                    assert core.tenant_bytes(q.tenant, "cpu") <= q.nbytes["cpu"], (q.tenant, ops)
            core.finish_load(name)
        elif op == "attach" and e.state is State.RESIDENT and name not in leases:
            leases[name] = core.attach(name, conn=1).id
        elif op == "detach" and name in leases:
            core.detach(leases.pop(name), conn=1)
        elif op == "evict" and e.evictable:
            core.evict(name)
        core.check_invariants()


def _config(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text('[budgets]\ncpu = "1GiB"\n' + text)
    return p


def test_config_quotas_are_keyed_by_tenant_and_validated_naming_the_key(tmp_path):
    s = load_settings(_config(tmp_path, '[quotas."uid:1000"]\nbytes = { cpu = "20MiB" }\npins = 2\n'
                                        '[quotas."gid:root"]\npins = 1\n'))
    assert s.quotas["uid:1000"].bytes == {"cpu": 20 * 2**20} and s.quotas["uid:1000"].pins == 2
    assert s.quotas["gid:0"].pins == 1 and s.quotas["gid:0"].bytes == {}  # a group name resolves to its gid
    for text, said in [
        ('[quotas."user:1000"]\npins = 1\n', "'uid:<uid>' or 'gid:<group name or gid>'"),
        ('[quotas."uid:bob"]\npins = 1\n', "a uid is a number"),
        ('[quotas."gid:no-such-group-here"]\npins = 1\n', "no group named 'no-such-group-here'"),
        ('[quotas."uid:1000"]\nbytes = { "cuda:0" = "1GiB" }\n', "quotas.uid:1000.bytes names device 'cuda:0'"),
        ('[quotas."uid:1000"]\nbytes = { cpu = "lots" }\n', "cpu: not a size: 'lots'"),
        ('[quotas."uid:1000"]\npins = -1\n', "quotas.uid:1000.pins"),
        ('[quotas."uid:1000"]\nbites = { cpu = "1GiB" }\n', "quotas.uid:1000.bites"),
        ('[quotas."uid:1000"]\npins = 1\n[quotas."uid:01000"]\npins = 2\n', "which has a quota already"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_settings(_config(tmp_path, text))
        assert said in str(err.value), (text, str(err.value))


def test_config_model_access_lists(tmp_path):
    s = load_settings(_config(tmp_path, '[[models]]\nname = "m"\npath = "/m.safetensors"\n'
                                        'allowed_uids = [1000]\nallowed_gids = ["root", 7]\n'))
    assert s.models[0].allowed_uids == (1000,) and s.models[0].allowed_gids == (0, 7)
    for text, said in [('allowed_gids = ["no-such-group-here"]', "models.0.allowed_gids"),
                       ("allowed_uids = [-1]", "models.0.allowed_uids"),
                       ('allowed_uids = "1000"', "models.0.allowed_uids")]:
        with pytest.raises(ConfigError) as err:
            load_settings(_config(tmp_path, f'[[models]]\nname = "m"\npath = "/m.safetensors"\n{text}\n'))
        assert said in str(err.value), (text, str(err.value))


def test_a_load_refused_after_choosing_the_tenants_own_victims_moves_nothing():
    # GDSF's clock moves only for victims that leave (Note [invariants], 5): here A's own
    # model would make room under A's quota, but B's attached models leave the device short.
    core = make(budget=300, quotas=[Quota("uid:1000", {"cpu": 150})], policy="gdsf", a1=A, a2=A, b1=B, b2=B)
    for n in ("a1", "b1", "b2"):
        loaded(core, n, 100)
    core.attach("b1", conn=1)
    core.attach("b2", conn=1)
    clock = core.policy.clock("cpu")
    with pytest.raises(NoSpace) as err:
        core.begin_load("a2", 150)
    assert "quota" not in err.value.details  # the device's budget refused it, not the quota
    assert core.policy.clock("cpu") == clock and core.entry("a1").state is State.RESIDENT
    core.check_invariants()
