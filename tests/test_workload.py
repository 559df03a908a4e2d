"""``weightcache workload``: the trace format and generator, the byte check, and the whole
benchmark run small on the CPU backend (real daemon, real engine processes): once as it
should pass, once with a daemon serving a corrupted copy of a model, which must fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weightcache.cli import main as cli_main
from weightcache.config import DaemonConfig
from weightcache.tools import workload_run
from weightcache.tools.workload import run_workload, workload_config
from weightcache.tools.workload_engine import differences, file_sums, model_sums, tensor_sum
from weightcache.tools.workload_trace import read_trace, write_trace, zipf_trace

MIB = 2**20
# Both policies once the daemon has the setting; LRU alone on a daemon that predates it.
POLICIES = "lru,gdsf" if "eviction_policy" in DaemonConfig.model_fields else "lru"


def small(tmp_path: Path, **over: object):
    opts: dict = dict(engines=3, models=None, model_sizes="2MiB,2MiB,3MiB", device="cpu", budget_models=1.5, budget=None,
                      host_budget=None, duration=1.0, zipf=1.1, seed=3, hold="0-0.1", gap="0-0.05", trace=None, policies=POLICIES,
                      tensors=10, kill_every=None, cold=False, wait_s=10.0, reps=1, drain_s=None, mem_slack="512MiB",
                      workdir=str(tmp_path / "work"), out=str(tmp_path / "out.json"))
    opts.update(over)
    return workload_config(**opts)


# ---------------------------------------------------------------------------- traces
def test_zipf_trace_is_deterministic_and_skewed(tmp_path: Path) -> None:
    models = {"a": 1, "b": 2, "c": 3, "d": 4}
    t1 = zipf_trace(models, 4, 60, 1.1, seed=5)
    assert t1.events == zipf_trace(models, 4, 60, 1.1, seed=5).events
    assert t1.events != zipf_trace(models, 4, 60, 1.1, seed=6).events
    assert {e.engine for e in t1.events} == {0, 1, 2, 3}
    assert all(0 <= e.t < 60 and 0 <= e.hold <= 0.4 for e in t1.events)
    counts = {m: sum(e.model == m for e in t1.events) for m in models}
    popularity = t1.generator["popularity"]
    top = max(popularity, key=popularity.get)
    assert counts[top] == max(counts.values()) and counts[top] > 0.35 * len(t1.events)

    path = tmp_path / "t.jsonl"
    write_trace(t1, path)
    back = read_trace(path)
    assert back.events == t1.events and back.models == models and back.engines == 4 and back.generator["seed"] == 5


def test_trace_without_header_and_malformed_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"t": 0.5, "engine": 2, "model": "x", "hold": 0.1}\n\n{"t": 0.1, "engine": 0, "model": "y", "hold": 0}\n')
    t = read_trace(p)
    assert [e.model for e in t.events] == ["y", "x"] and t.engines == 3 and t.models == {}
    assert [e.model for e in t.for_engine(2)] == ["x"]
    p.write_text('{"t": 0.5, "engine": 0, "model": "x", "hold": 0.1}\n{"t": 1, "engine": 0, "model": "x"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: 'hold'"):
        read_trace(p)


def test_write_trace_from_the_cli_replays_the_same_events(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    assert cli_main(["workload", "--write-trace", str(out), "--models", "1,2,4", "--engines", "2", "--duration", "5",
                     "--zipf", "0.8", "--seed", "9"]) == 0
    t = read_trace(out)
    assert t.models == {"m0": 2**30, "m1": 2**31, "m2": 2**32}
    assert t.events == zipf_trace(t.models, 2, 5, 0.8, seed=9).events
    assert cli_main(["workload", "--write-trace", str(out), "--models", "1", "--host-budget", "1GiB"]) == 2  # CPU has no host tier


# ------------------------------------------------------------------------ byte check
def test_sums_see_one_changed_byte_and_odd_sizes() -> None:
    a = {"w": torch.arange(37, dtype=torch.uint8).view(torch.uint8), "v": torch.randn(5, 3).to(torch.bfloat16)}
    ref = model_sums(a)
    assert differences(ref, model_sums(a)) == []
    b = {k: t.clone() for k, t in a.items()}
    b["w"][36] += 1  # in the tail that is not a whole int32
    assert differences(ref, model_sums(b)) == [f"w: bytes differ (sum {int(tensor_sum(b['w']))} attached, {ref['w'][2]} in the files)"]
    c = {"w": a["w"][:36], "v": a["v"]}
    assert differences(ref, model_sums(c))[0].startswith("w: uint8[36] attached")
    assert differences(ref, model_sums({"v": a["v"]})) == ["w: missing"]
    # A tensor at an offset that is not a multiple of 4 (a page-cache arena maps the files
    # as they are) sums as its own copy does, as the files' tensors do.
    unaligned = torch.randint(0, 256, (4099,), dtype=torch.uint8)[2:4098].view(torch.bfloat16)
    assert unaligned.storage_offset() == 1
    assert int(tensor_sum(unaligned)) == int(tensor_sum(unaligned.clone()))


# --------------------------------------------------------------------- the benchmark
def test_workload_smoke_on_cpu(tmp_path: Path) -> None:
    cfg = small(tmp_path, kill_every="0.5-0.5")  # one SIGKILL per policy, half way through the trace
    assert run_workload(cfg) == 0
    r = json.loads((tmp_path / "out.json").read_text())
    assert r["failures"] == []
    assert list(r["policies"]) == POLICIES.split(",")
    budget = r["config"]["budget_bytes"]
    assert 1.4 * 2 * MIB < budget < 1.6 * 3 * MIB
    for name, p in r["policies"].items():
        assert p["mismatches"] == 0 and p["leases_after"] == 0, name
        ev = p["events"]
        # The killed engine's replacement ran the rest of its slot: only the event it was in is lost.
        assert p["kills"] == 1 and ev["lost_in_flight"] <= 1 and ev["not_run"] == ev["skipped_late"] == 0
        assert ev["ended"] + ev["lost_in_flight"] == ev["in_trace"] == r["trace"]["events"] > 10
        assert p["attaches"] + sum(ev["errors"].values()) == ev["ended"]
        # Room for 1.5 models and three engines: some attaches hit, some must load.
        assert p["hits"] > 0 and p["misses"].get("page cache", 0) > 0, p["misses"]
        assert p["hits"] + sum(p["misses"].values()) == p["attaches"]
        assert p["counters"]["evictions"] > 0 and p["counters"]["loads"] >= 3
        assert p["latency_ms"]["hit"]["n"] == p["hits"] and p["latency_ms"]["hit"]["p50"] > 0
        assert p["verify_ms"]["n"] == p["attaches"]  # every attach's bytes were checked
        assert p["peak"]["cpu"]["budget"] == budget and 2 * MIB <= p["peak"]["cpu"]["used_reserved"] <= budget
        assert p["status_samples"] > 10
        iso = p["isolated"]
        assert set(iso) == {str(2 * MIB), str(3 * MIB)} and all(x["page_cache_GBps"] > 0 for x in iso.values())
        rates = p["miss_rates"]["page cache"]
        assert rates["median_GBps"] > 0 and rates["median_vs_isolated"] > 0
        # The daemon's own account of the workload's loads, read from its log.
        fills = p["daemon_fills"]
        assert sum(f["n"] for f in fills.values() if f["verb"] == "loaded") == p["counters"]["loads"]
        assert all(f["median_GBps"] > 0 and f["vs_isolated"] > 0 and "fill" in f["median_phases_ms"] for f in fills.values())
    if (tmp_path / "out.png").exists():  # matplotlib is optional
        assert (tmp_path / "out.png").stat().st_size > 1000


def test_workload_fails_when_the_daemon_serves_wrong_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's m0 is a copy of m0's file with one data byte changed: same names,
    shapes and fingerprint inputs, so only the engines' byte check can see it."""
    trace = tmp_path / "only-m0.jsonl"
    trace.write_text("".join(f'{{"t": {t}, "engine": 0, "model": "m0", "hold": 0}}\n' for t in (0.0, 0.1, 0.2)))
    cfg = small(tmp_path, policies="lru", model_sizes="1MiB,1MiB", trace=str(trace))
    original = workload_run.daemon_config

    def corrupted(cfg, prep, policy, socket):  # type: ignore[no-untyped-def]
        path = prep.files["m0"]
        bad = path.with_name("m0-corrupt.safetensors")
        data = bytearray(path.read_bytes())
        data[-1000] ^= 0x10
        bad.write_bytes(bytes(data))
        assert file_sums(str(bad)) != prep.refs["m0"]["tensors"]
        return original(cfg, prep, policy, socket).replace(str(path), str(bad))

    monkeypatch.setattr(workload_run, "daemon_config", corrupted)
    assert run_workload(cfg) == 1
    r = json.loads((tmp_path / "out.json").read_text())
    p = r["policies"]["lru"]
    assert p["mismatches"] == 1 and p["leases_after"] == 0
    assert any("wrong bytes" in f and "bytes differ" in f for f in r["failures"]), r["failures"]
