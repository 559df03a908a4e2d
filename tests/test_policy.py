"""Eviction policies (weightcache/cache/eviction.py): GDSF's choices against LRU's on the same
operations, its clock, its frequencies, the rates it learns, and the config key that picks
it. The invariants under both policies are tests/test_core.py's state machines."""

from typing import get_args

import pytest
from test_core import Clock, loaded

from weightcache.cache import CacheCore, State
from weightcache.cache.core import AGING_USES_PER_MODEL
from weightcache.cache.eviction import CPU_DEFAULTS, GPU_DEFAULTS, POLICIES, LoadRates
from weightcache.config import DaemonConfig, load_settings
from weightcache.errors import ConfigError, NoSpace

GB = 10**9


def gpu(policy: str, budget: int, host: int = 0, names: str = "abcd") -> CacheCore:
    core = CacheCore({"cuda:0": budget}, clock=Clock(), host_budget=host, policy=policy)
    for n in names:
        core.register(n, "cuda:0")
    return core


def use(core: CacheCore, name: str, times: int = 1) -> None:
    for _ in range(times):
        core.detach(core.attach(name, conn=1).id, conn=1)


def test_lru_is_the_default():
    assert CacheCore({"cpu": 1}).policy.name == "lru"
    assert DaemonConfig().eviction_policy == "lru"


@pytest.mark.parametrize(("policy", "victim"), [("lru", "b"), ("gdsf", "a")])
def test_gdsf_evicts_the_model_cheap_to_bring_back_from_the_host_tier(policy, victim):
    # a fits the host tier, b is one byte too big for it: evicted, a comes back at the
    # promotion rate, b from its files. b is the least recently used: LRU takes it.
    core = gpu(policy, budget=8 * GB + 1, host=4 * GB)
    loaded(core, "b", 4 * GB + 1)
    loaded(core, "a", 4 * GB)
    assert core.reload_cost("a") == pytest.approx(GPU_DEFAULTS.overhead_s + 4 * GB / GPU_DEFAULTS.host)
    assert core.reload_cost("b") == pytest.approx(GPU_DEFAULTS.overhead_s + (4 * GB + 1) / GPU_DEFAULTS.files)
    plan = core.begin_load("c", 4 * GB)
    assert plan.evict == (victim,)
    assert plan.step_down.demote == (("a",) if victim == "a" else ())
    core.check_invariants()


@pytest.mark.parametrize(("policy", "victim"), [("lru", "s"), ("gdsf", "B")])
def test_gdsf_evicts_a_large_rarely_used_model_before_a_small_often_used_one(policy, victim):
    core = gpu(policy, budget=10 * GB, names="sBc")
    loaded(core, "s", 1 * GB)
    use(core, "s", 5)
    loaded(core, "B", 8 * GB)
    use(core, "B")  # the most recent: LRU keeps it
    assert core.entry("s").refs == 5 and core.entry("B").refs == 1  # attaches
    if policy == "gdsf":
        assert core.priority("B") < core.priority("s")
    assert core.begin_load("c", 2 * GB).evict == (victim,)
    core.check_invariants()


@pytest.mark.parametrize(("policy", "victim"), [("lru", "a"), ("gdsf", "b")])
def test_gdsf_uses_each_models_measured_time(policy, victim):
    # Same size, same uses, no host tier: a's files are cold (its last load read at the
    # disk's 1.9 GB/s), b's in the page cache. a is older, so LRU takes it.
    core = gpu(policy, budget=8 * GB)
    loaded(core, "a", 4 * GB)
    core.observe_load("a", "files", 4 * GB, 2.1)
    loaded(core, "b", 4 * GB)
    core.observe_load("b", "files", 4 * GB, 0.15)
    assert core.reload_cost("a") == pytest.approx(2.1) and core.reload_cost("b") == pytest.approx(0.15)
    assert core.begin_load("c", 4 * GB).evict == (victim,)


def test_gdsf_ties_go_least_recently_used_first():
    core = gpu("gdsf", budget=3 * GB, names="abcde")
    for n in "abc":
        loaded(core, n, 1 * GB)
    use(core, "a")
    use(core, "b")
    use(core, "c")
    assert core.priority("a") == core.priority("b") == core.priority("c")
    assert core.begin_load("d", 1 * GB).evict == ("a",)
    core.finish_load("d")
    # d's H is above the others' (it was loaded after the clock moved): b, then c
    assert core.begin_load("e", 2 * GB).evict == ("b", "c")
    core.check_invariants()


def test_gdsf_clock_is_the_priority_of_the_last_victim():
    core = gpu("gdsf", budget=2 * GB, names="abcd")
    loaded(core, "a", 1 * GB)
    loaded(core, "b", 1 * GB)
    use(core, "a", 2)
    assert core.policy.clock("cuda:0") == 0.0
    h_a, h_b = core.priority("a"), core.priority("b")
    assert h_b < h_a
    assert core.begin_load("c", 2 * GB).evict == ("b", "a")  # both needed, lowest H first
    assert core.policy.clock("cuda:0") == h_a  # the last victim's
    core.finish_load("c")
    e = core.entry("c")
    assert e.clock_base == core.policy.clock("cuda:0")  # a load takes the clock as its base
    per_use = core.reload_cost("c") / e.nbytes
    assert core.priority("c") == pytest.approx(e.clock_base + 1 * per_use)  # not attached yet: counts once
    use(core, "c")
    assert core.priority("c") == pytest.approx(e.clock_base + 1 * per_use)
    use(core, "c")
    assert core.priority("c") == pytest.approx(e.clock_base + 2 * per_use)


def test_a_model_in_use_while_the_clock_rose_comes_out_of_its_lease_at_the_clock():
    core = gpu("gdsf", budget=2 * GB, names="abc")
    loaded(core, "a", 1 * GB)
    lease = core.attach("a", conn=1)
    loaded(core, "b", 1 * GB)
    core.begin_load("c", 1 * GB)  # b goes: the clock rises past a's H of when it was attached
    assert core.policy.clock("cuda:0") > core.entry("a").clock_base
    core.detach(lease.id, conn=1)
    assert core.entry("a").clock_base == core.policy.clock("cuda:0")


def test_gdsf_ages_a_once_popular_model_as_the_clock_rises():
    core = gpu("gdsf", budget=2 * GB, names=["old"] + [f"m{i}" for i in range(20)])
    loaded(core, "old", 1 * GB)
    use(core, "old", 3)  # frequency 3, then never used again
    loaded(core, "m0", 1 * GB)
    clocks = []
    for i in range(1, 20):
        victims = core.begin_load(f"m{i}", 1 * GB).evict
        core.finish_load(f"m{i}")
        clocks.append(core.policy.clock("cuda:0"))
        if victims == ("old",):
            break
    else:
        pytest.fail("the idle model was never evicted")
    # The newcomers (frequency 1) went first while the clock caught up with old's H.
    assert 3 <= i <= 4
    assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)


def test_gdsf_takes_no_victim_it_does_not_need():
    core = CacheCore({"cpu": 300}, clock=Clock(), policy="gdsf")
    for n in "sbkc":
        core.register(n, "cpu")
    loaded(core, "s", 10)
    loaded(core, "b", 200)
    loaded(core, "k", 90)
    core.attach("k", conn=1)
    core.observe_load("s", "files", 10, 1e-9)  # s is the cheapest of all to bring back
    assert core.priority("s") < core.priority("b")
    plan = core.begin_load("c", 150)
    assert plan.evict == ("b",)  # s came first, but b alone makes room: s is spared
    assert core.policy.clock("cpu") == core.priority("b")
    assert core.entry("s").state is State.RESIDENT
    core.check_invariants()


def test_gdsf_spares_the_most_valuable_of_the_victims_it_does_not_need():
    core = CacheCore({"cpu": 400}, clock=Clock(), policy="gdsf")
    for n, nbytes, seconds in [("x", 50, 50e-9), ("y", 50, 100e-9), ("z", 200, 600e-9), ("k", 100, 1.0)]:
        core.register(n, "cpu")
        loaded(core, n, nbytes)
        core.observe_load(n, "files", nbytes, seconds)  # H = seconds / bytes: x 1e-9, y 2e-9, z 3e-9
    core.attach("k", conn=1)
    core.register("c", "cpu")
    # x, y, z make room for 250; either x or y could then be kept, not both: y, the higher H, is.
    assert core.begin_load("c", 250).evict == ("x", "z")
    assert core.policy.clock("cpu") == pytest.approx(3e-9)


def test_gdsf_never_evicts_attached_or_pinned_models():
    core = gpu("gdsf", budget=2 * GB, names="abc")
    loaded(core, "a", 1 * GB)
    loaded(core, "b", 1 * GB)
    core.observe_load("a", "files", 1 * GB, 1e-3)  # the cheapest, but attached
    core.observe_load("b", "files", 1 * GB, 1e-3)  # the same, but pinned
    core.attach("a", conn=1)
    core.set_pinned("b", True)
    with pytest.raises(NoSpace):
        core.begin_load("c", 1 * GB)
    assert core.policy.clock("cuda:0") == 0.0  # nothing was evicted: the clock did not move
    core.check_invariants()


def test_only_the_policys_victims_move_the_clock():
    clock = Clock()
    core = CacheCore({"cuda:0": 2 * GB}, clock=clock, host_budget=4 * GB, policy="gdsf")
    core.register("a", "cuda:0", keep_alive=5)
    core.register("b", "cuda:0")
    loaded(core, "a", 1 * GB)
    loaded(core, "b", 1 * GB)
    core.evict("b")  # to the host tier: an operator's choice, not the policy's
    core.evict("b")  # out of the host tier
    clock.t += 10
    assert core.expired() == ["a"]
    core.evict("a")
    assert core.policy.clock("cuda:0") == 0.0


def test_gdsf_lowers_a_budget_by_priority():
    core = gpu("gdsf", budget=10 * GB, names="sB")
    loaded(core, "s", 1 * GB)
    use(core, "s", 3)
    loaded(core, "B", 8 * GB)
    assert core.set_budget("cuda:0", 2 * GB).evict == ("B",)  # LRU would have taken s, then B
    core.check_invariants()


def test_frequency_counts_attaches_across_tiers_and_ages_by_halving():
    core = gpu("gdsf", budget=2 * GB, host=2 * GB, names="ab")
    loaded(core, "a", 1 * GB)
    use(core, "a", 3)
    core.touch("a")  # asked for, not attached: not a use
    assert core.entry("a").refs == 3
    core.evict("a")  # to the host tier and back
    loaded(core, "a", 1 * GB)
    core.evict("a")
    core.evict("a")  # out of every tier, and back from the files
    loaded(core, "a", 1 * GB)
    assert core.entry("a").refs == 3  # loads are not uses, and leaving the cache forgets nothing
    # Two models on the device: at 2 x AGING_USES_PER_MODEL attaches every count halves.
    loaded(core, "b", 1 * GB)
    use(core, "b", 2 * AGING_USES_PER_MODEL - 3 - 1)
    assert (core.entry("a").refs, core.entry("b").refs) == (3, 28)
    use(core, "b")
    assert (core.entry("a").refs, core.entry("b").refs) == (1, 14)
    use(core, "b", AGING_USES_PER_MODEL - 1)  # the tally was halved too: the next halving comes sooner
    assert (core.entry("a").refs, core.entry("b").refs) == (1, 29)
    use(core, "b")
    assert (core.entry("a").refs, core.entry("b").refs) == (0, 15)
    assert core.priority("a") == pytest.approx(core.entry("a").clock_base + core.reload_cost("a") / GB)  # counts once


def test_rates_before_any_measurement_come_from_the_benchmarks():
    rates = LoadRates()
    assert rates.rate("cuda:0", "files") == 30e9 and rates.rate("cuda:0", "host") == 47e9
    assert rates.rate("cpu", "files") == 2.15e9
    assert GPU_DEFAULTS.overhead_s == 0.005 and CPU_DEFAULTS.overhead_s == 0.003
    assert rates.cost("cuda:0", "x", "files", 3 * GB) == pytest.approx(0.005 + 0.1)
    assert rates.cost("cpu", "x", "files", 2150 * 10**6) == pytest.approx(CPU_DEFAULTS.overhead_s + 1.0)


def test_rates_learn_per_model_and_per_device():
    rates = LoadRates()
    rates.observe("cuda:0", "a", "files", 3 * GB, 0.5)
    assert rates.last_rate("a", "files") == 6 * GB
    assert rates.cost("cuda:0", "a", "files", 3 * GB) == pytest.approx(0.5)  # its own time, overhead included
    assert rates.last_rate("a", "host") is None
    first = 3 * GB / (0.5 - 0.005)  # the device's rate: the overhead taken out
    assert rates.rate("cuda:0", "files") == pytest.approx(first)
    assert rates.cost("cuda:0", "b", "files", 3 * GB) == pytest.approx(0.005 + 3 * GB / first)
    rates.observe("cuda:0", "b", "files", 6 * GB, 1.0)
    smoothed = first + 0.25 * (6 * GB / 0.995 - first)
    assert rates.rate("cuda:0", "files") == pytest.approx(smoothed)
    assert rates.rate("cuda:1", "files") == 30e9 and rates.rate("cuda:0", "host") == 47e9  # each its own
    # A load shorter than twice the overhead is mostly overhead: it teaches its model only.
    rates.observe("cuda:0", "tiny", "files", 10**6, 0.009)
    assert rates.rate("cuda:0", "files") == pytest.approx(smoothed)
    assert rates.cost("cuda:0", "tiny", "files", 10**6) == pytest.approx(0.009)
    # Nothing to learn from no bytes or no time; a source that does not exist is a bug.
    rates.observe("cuda:0", "z", "files", 0, 1.0)
    rates.observe("cuda:0", "z", "files", GB, 0.0)
    rates.observe("cuda:0", "z", "files", GB, float("nan"))
    assert rates.last_rate("z", "files") is None
    with pytest.raises(ValueError, match="load source"):
        rates.observe("cuda:0", "z", "disk", GB, 1.0)


def test_core_forgets_and_moves_a_models_rates_with_it():
    core = gpu("gdsf", budget=8 * GB, names="ab")
    loaded(core, "a", 4 * GB)
    core.observe_load("a", "files", 4 * GB, 4.0)
    core.rename("a", "a2")
    assert core.reload_cost("a2") == pytest.approx(4.0)
    assert core.rates.last_rate("a2", "files") == 1 * GB and core.rates.last_rate("a", "files") is None
    core.evict("a2")
    core.unregister("a2")
    core.register("a2", "cuda:0")
    loaded(core, "a2", 4 * GB)
    assert core.rates.last_rate("a2", "files") is None  # a new model of that name: only the device's rate is left
    assert core.reload_cost("a2") == pytest.approx(GPU_DEFAULTS.overhead_s + 4 * GB / core.rates.rate("cuda:0", "files"))


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="'lru', 'gdsf'"):
        CacheCore({"cpu": 1}, policy="mru")  # type: ignore[arg-type]


def test_config_key_picks_the_policy_and_names_a_typo(tmp_path, monkeypatch):
    assert get_args(DaemonConfig.model_fields["eviction_policy"].annotation) == POLICIES
    cfg = tmp_path / "c.toml"
    cfg.write_text('[daemon]\neviction_policy = "GDSF"\n')
    assert load_settings(cfg).daemon.eviction_policy == "gdsf"
    cfg.write_text('[daemon]\neviction_policy = "gsdf"\n')
    with pytest.raises(ConfigError, match=r"daemon\.eviction_policy: .*must be 'lru' \(the default\) or 'gdsf', not 'gsdf'"):
        load_settings(cfg)
    monkeypatch.setenv("WEIGHTCACHE_DAEMON__EVICTION_POLICY", "gdsf")
    assert load_settings().daemon.eviction_policy == "gdsf"


# -- replays: GDSF against LRU on the same traces, through the real core ------------------

GiB = 2**30
SMALL_POPULAR = {"m1": 1 * GiB, "m2": 2 * GiB, "m3": 3 * GiB, "m4": 4 * GiB, "m5": 6 * GiB, "m6": 8 * GiB}
BIG_POPULAR = dict(zip(SMALL_POPULAR, list(SMALL_POPULAR.values())[::-1], strict=True))
SCENARIOS = {  # models (most popular first), cuda:0 budget for about half of them, host tier, models whose files are cold
    "small popular, host 8 GiB": (SMALL_POPULAR, 12 * GiB, 8 * GiB, ()),
    "big popular, host 8 GiB": (BIG_POPULAR, 12 * GiB, 8 * GiB, ()),
    "small popular, host 4 GiB": (SMALL_POPULAR, 12 * GiB, 4 * GiB, ()),
    "no host tier, m5 cold": (SMALL_POPULAR, 12 * GiB, 0, ("m5",)),
}


def zipf_trace(names: list[str], kind: str, seed: int, n: int = 6000) -> list[str]:
    """Zipf(1) requests; "shift": the ranks reverse half way; "drift": reshuffled every 1000."""
    import random

    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(names))]
    if kind == "stationary":
        return rng.choices(names, weights, k=n)
    if kind == "shift":
        return rng.choices(names, weights, k=n // 2) + rng.choices(names[::-1], weights, k=n // 2)
    out: list[str] = []
    order = list(names)
    for _ in range(n // 1000):
        rng.shuffle(order)
        out += rng.choices(order, weights, k=1000)
    return out


def replay(policy: str, sizes: dict[str, int], budget: int, host: int, cold: tuple[str, ...], trace: list[str]) -> tuple[float, float]:
    """Each request attaches (loading on a miss) and detaches. A miss costs what the
    defaults say (from the host tier, the files, or cold files at the disk's 1.9 GB/s) and
    is reported to the core as the server would. Returns (hit ratio, seconds of misses)."""
    core = CacheCore({"cuda:0": budget}, clock=Clock(), host_budget=host, policy=policy)
    for n in sizes:
        core.register(n, "cuda:0")
    hits, miss_s = 0, 0.0
    for name in trace:
        e = core.entry(name)
        if e.state is State.RESIDENT:
            hits += 1
            core.touch(name)
        else:
            source = "host" if e.state is State.HOST else "files"
            core.begin_load(name, sizes[name])
            core.finish_load(name)
            rate = GPU_DEFAULTS.host if source == "host" else 1.9e9 if name in cold else GPU_DEFAULTS.files
            seconds = GPU_DEFAULTS.overhead_s + sizes[name] / rate
            core.observe_load(name, source, sizes[name], seconds)
            miss_s += seconds
        core.detach(core.attach(name, conn=1).id, conn=1)
    return hits / len(trace), miss_s


@pytest.mark.parametrize("kind", ["stationary", "shift", "drift"])
@pytest.mark.parametrize("scenario", ["small popular, host 8 GiB", "no host tier, m5 cold"])
def test_gdsf_spends_less_time_on_misses_than_lru(scenario, kind):
    sizes, budget, host, cold = SCENARIOS[scenario]
    lru_s = gdsf_s = 0.0
    for seed in range(2):
        trace = zipf_trace(list(sizes), kind, seed, n=3000)
        lru, gdsf = (replay(p, sizes, budget, host, cold, trace) for p in ("lru", "gdsf"))
        assert gdsf[0] > lru[0]  # more hits
        lru_s, gdsf_s = lru_s + lru[1], gdsf_s + gdsf[1]
    # Deterministic (seeded traces, a pure core). GDSF took 0.76-0.91 of LRU's time here;
    # LRU's order with GDSF's sparing of unneeded victims alone 0.95-0.99.
    assert gdsf_s / lru_s < 0.93


if __name__ == "__main__":  # the table in docs/architecture.md: python tests/test_policy.py
    import statistics

    print("| trace | requests: Zipf(1) | LRU hit ratio | GDSF hit ratio | GDSF miss time / LRU's |")
    print("| --- | --- | --- | --- | --- |")
    for scenario, (sizes, budget, host, cold) in SCENARIOS.items():
        for kind in ("stationary", "shift", "drift"):
            runs = [[replay(p, sizes, budget, host, cold, zipf_trace(list(sizes), kind, seed)) for p in ("lru", "gdsf")]
                    for seed in range(8)]
            hit_lru = statistics.mean(r[0][0] for r in runs)
            hit_gdsf = statistics.mean(r[1][0] for r in runs)
            ratios = [r[1][1] / r[0][1] for r in runs]
            print(f"| {scenario} | {kind} | {hit_lru:.3f} | {hit_gdsf:.3f} | "
                  f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
