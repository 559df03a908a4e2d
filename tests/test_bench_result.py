"""The bench's typed result writes exactly the JSON that results/bench-*.json hold (tooling
and the docs read those files): same keys, same order, same values. The rows added later
(runai-model-streamer, ready to compute, fresh-process attach) keep to the same rules, and
a small bench runs end to end against a real daemon."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from weightcache.tools.bench import BenchConfig, run_bench
from weightcache.tools.bench_measure import INSTANTTENSOR_BACKENDS
from weightcache.tools.bench_result import (
    AttachFigures,
    BenchResult,
    ContentHashFigures,
    ControlPlaneFigures,
    DiskCeiling,
    Environment,
    FreshAttachFigures,
    HostTierFigures,
    LoaderFigures,
    LoadFileFigures,
    PeerLoaderFigures,
    ReadyToComputeFigures,
    RestartFigures,
    RestartTimes,
    Spread,
    StatusLatency,
)
from weightcache.tools.restart import time_fresh_attach

RESULTS = Path(__file__).resolve().parent.parent / "results"
PUBLISHED = ["bench-cpu-2026-12-02.json", "bench-h200-2026-12-03.json"]


def peer(r: dict[str, Any], name: str) -> PeerLoaderFigures | None:
    if not any(k.startswith(f"{name}_") for k in r):
        return None
    return PeerLoaderFigures(warm_s=r.get(f"{name}_warm_s"), cold_s=r.get(f"{name}_cold_s"), error=r.get(f"{name}_error"),
                             version=r.get(f"{name}_version"), name=name)


def typed(r: dict[str, Any]) -> BenchResult:
    """The records a bench run with the figures of ``r`` builds."""
    return BenchResult(
        env=Environment(device=r["device"], checkpoint_bytes=r["checkpoint_bytes"], tensors=r["tensors"], python=r["python"],
                        torch=r["torch"], cpus=r["cpus"], host=r["host"], gpu=r.get("gpu"), load_avg_1m=r.get("load_avg_1m"),
                        checkpoint=r.get("checkpoint"), files=r.get("files")),
        load_file=LoadFileFigures(warm_s=r["load_file_warm_s"], touch_warm_s=r["load_file_touch_warm_s"], cold_s=r["load_file_cold_s"]),
        disk_ceiling=DiskCeiling(gbps=r.get("disk_ceiling_GBps"), error=r.get("disk_ceiling_error")),
        fastsafetensors=peer(r, "fastsafetensors") or PeerLoaderFigures(),
        runai_streamer=peer(r, "runai_streamer"),
        instanttensor=tuple(p for b in INSTANTTENSOR_BACKENDS if (p := peer(r, f"instanttensor_{b}")) is not None),
        ready=ReadyToComputeFigures.from_dict(r["ready_to_compute"]) if "ready_to_compute" in r else None,
        fresh_attach=FreshAttachFigures.from_dict(r["fresh_attach"]) if "fresh_attach" in r else None,
        content_hash=ContentHashFigures.from_dict(r["content_hash"]) if "content_hash" in r else None,
        loader=LoaderFigures(warm_s=r["loader_warm_s"], cold_s=r["loader_cold_s"]),
        attach=AttachFigures(n=r["attach_n"], p50_ms=r["attach_p50_ms"], p99_ms=r["attach_p99_ms"], touch_s=r["attach_touch_s"]),
        host_tier=HostTierFigures(demote_s=r["host_demote_s"], promote_s=r["host_promote_s"]) if "host_demote_s" in r else None,
        restart=RestartFigures(
            floor=RestartTimes(ready_s=r["restart_floor_s"], weights_s=r["restart_floor_weights_s"]),
            disk=RestartTimes(ready_s=r["restart_disk_s"], weights_s=r["restart_disk_weights_s"]),
            cache=RestartTimes(ready_s=r["restart_cache_s"], weights_s=r["restart_cache_weights_s"]),
            checksums_equal=r["restart_checksums_equal"],
            attached_client_extra_device_bytes=r["attached_client_extra_device_bytes"]),
        control_plane=ControlPlaneFigures(status_during_load=StatusLatency(**r["status_during_load"]), big_bytes=r["big_bytes"]),
        notes=tuple(r.get("notes", ())),
    )


@pytest.mark.parametrize("name", PUBLISHED)
def test_to_json_writes_the_published_keys_in_order(name):
    text = (RESULTS / name).read_text()
    r = json.loads(text)
    out = typed(r).as_dict()
    # The derived figure is recomputed from the medians: equal up to float rounding.
    assert out.pop("restart_cache_minus_floor_ms") == pytest.approx(r.pop("restart_cache_minus_floor_ms"))
    assert list(out) == list(r)
    assert out == r
    assert json.loads(typed(json.loads(text)).to_json()).keys() == json.loads(text).keys()


def test_optional_figures_keep_their_absent_or_null_rule():
    base = typed(json.loads((RESULTS / "bench-cpu-2026-12-02.json").read_text()))
    assert "disk_ceiling_GBps" in base.as_dict()
    # no cold runs: no disk ceiling key; a peer loader that worked has a null cold median
    d = replace(base, disk_ceiling=DiskCeiling(), fastsafetensors=PeerLoaderFigures(warm_s=1.0)).as_dict()
    assert "disk_ceiling_GBps" not in d and "disk_ceiling_error" not in d
    assert d["fastsafetensors_warm_s"] == 1.0 and d["fastsafetensors_cold_s"] is None and "fastsafetensors_error" not in d
    # the peer loader failed in its cold step: its warm figure and the error, no cold key
    d = replace(base, fastsafetensors=PeerLoaderFigures(warm_s=1.0, error="OSError: x")).as_dict()
    assert d["fastsafetensors_warm_s"] == 1.0 and "fastsafetensors_cold_s" not in d and d["fastsafetensors_error"] == "OSError: x"
    # it failed at once: the error only
    d = replace(base, fastsafetensors=PeerLoaderFigures(error="ImportError: y")).as_dict()
    assert [k for k in d if k.startswith("fastsafetensors")] == ["fastsafetensors_error"]
    # CPU: no gpu key, no host-tier keys; the extra device bytes stay (null)
    assert "gpu" not in d and "host_demote_s" not in d and d["attached_client_extra_device_bytes"] is None


def new_rows(base: BenchResult) -> BenchResult:
    return replace(
        base,
        fastsafetensors=PeerLoaderFigures(warm_s=0.7, cold_s=1.0),
        runai_streamer=PeerLoaderFigures(warm_s=0.5, cold_s=0.9, version="0.17.0", name="runai_streamer"),
        instanttensor=(PeerLoaderFigures(warm_s=0.3, cold_s=8.0, version="0.2.2", name="instanttensor_default"),
                       PeerLoaderFigures(warm_s=0.26, cold_s=7.0, version="0.2.2", name="instanttensor_buffered"),
                       PeerLoaderFigures(warm_s=0.24, error="RuntimeError: x", version="0.2.2", name="instanttensor_mmap")),
        ready=ReadyToComputeFigures(attach_s=Spread((0.1, 0.3, 0.2)), load_file_s=Spread((0.6, 0.4, 0.5)), read="max per tensor"),
        # per process, connect + first attach = 11, 11, 2: the median is 11, while the sum of
        # the two medians would be 1 + 1 = 2
        fresh_attach=FreshAttachFigures(import_client_ms=Spread((3.0, 4.0, 5.0)), connect_ms=Spread((1.0, 10.0, 1.0)),
                                        first_attach_ms=Spread((10.0, 1.0, 1.0)), second_attach_ms=Spread((0.5, 0.7, 0.6)),
                                        lazy_imports=("cuda", "weightcache.client.mapping"),
                                        load_file_ms=Spread((6.0, 5.0, 7.0)), cuda_ipc_ms=Spread((17.0, 16.0, 18.0))))


def test_new_rows_sit_beside_their_kin_and_read_back():
    base = typed(json.loads((RESULTS / "bench-cpu-2026-12-02.json").read_text()))
    d = new_rows(base).as_dict()
    keys = list(d)
    # runai's keys right after the other peer loader's, ready to compute after attach, fresh before the restarts
    assert keys[keys.index("fastsafetensors_cold_s") + 1:][:3] == ["runai_streamer_version", "runai_streamer_warm_s", "runai_streamer_cold_s"]
    # InstantTensor's backends after runai, before the daemon's loader; a failed cold step keeps the warm figure
    assert keys[keys.index("runai_streamer_cold_s") + 1:][:3] == ["instanttensor_default_version", "instanttensor_default_warm_s",
                                                                  "instanttensor_default_cold_s"]
    assert keys[keys.index("instanttensor_mmap_error") + 1] == "loader_warm_s"
    assert "instanttensor_mmap_cold_s" not in d and d["instanttensor_mmap_warm_s"] == 0.24
    assert keys[keys.index("attach_touch_s") + 1] == "ready_to_compute"
    assert keys[keys.index("restart_floor_s") - 1] == "fresh_attach"
    assert (d["runai_streamer_warm_s"], d["runai_streamer_cold_s"], d["runai_streamer_version"]) == (0.5, 0.9, "0.17.0")
    # the JSON the bench writes reads back into the same records
    assert typed(json.loads(new_rows(base).to_json())) == new_rows(base)


def test_fresh_process_headline_is_per_process_beside_its_anchors():
    d = new_rows(typed(json.loads((RESULTS / "bench-cpu-2026-12-02.json").read_text()))).as_dict()["fresh_attach"]
    # per process, import + connect + first attach = 14, 15, 7: the median is 14
    assert d["import_to_tensors_ms"]["p50"] == 14.0 and d["import_to_tensors_ms"]["runs"] == [14.0, 15.0, 7.0]
    assert d["load_file_ms"]["p50"] == 6.0 and d["cuda_ipc_ms"]["p50"] == 17.0
    older = FreshAttachFigures.from_dict({k: v for k, v in d.items() if k not in ("load_file_ms", "cuda_ipc_ms")})
    assert "import_to_tensors_ms" not in older.as_dict()["fresh_attach"]  # runs before the anchors keep their keys


def test_ready_to_compute_is_medians_and_their_ratio():
    d = new_rows(typed(json.loads((RESULTS / "bench-cpu-2026-12-02.json").read_text()))).as_dict()["ready_to_compute"]
    assert d["reps"] == 3 and d["read"] == "max per tensor"
    assert d["attach_s"] == {"p50": 0.2, "min": 0.1, "max": 0.3, "runs": [0.1, 0.3, 0.2]}
    assert d["load_file_s"]["p50"] == 0.5
    assert d["ratio_load_file_over_attach"] == pytest.approx(2.5)  # > 1: attach is ready sooner
    assert Spread((4.0, 1.0, 2.0, 3.0)).p50 == 2.5
    with pytest.raises(ValueError):
        Spread(())


def test_fresh_attach_connect_to_tensors_is_per_process():
    d = new_rows(typed(json.loads((RESULTS / "bench-cpu-2026-12-02.json").read_text()))).as_dict()["fresh_attach"]
    assert d["n"] == 3
    assert d["connect_to_tensors_ms"] == {"p50": 11.0, "min": 2.0, "max": 11.0, "runs": [11.0, 11.0, 2.0]}
    assert d["import_client_ms"]["p50"] == 4.0 and d["second_attach_ms"]["max"] == 0.7
    assert d["lazy_imports"] == ["cuda", "weightcache.client.mapping"]
    with pytest.raises(ValueError):  # a phase missing for one process is a bug, not a shorter median
        _ = FreshAttachFigures(Spread((1.0,)), Spread((1.0, 2.0)), Spread((1.0,)), Spread((1.0,))).connect_to_tensors_ms


def test_an_operators_checkpoint_and_skipped_rows_are_in_the_json_only_when_there():
    """--checkpoint: the path and its file count beside the environment, why the
    page cache was refused beside the arena, and the rows that did not run; a generated
    checkpoint's JSON keeps exactly its old keys."""
    base = typed(json.loads((RESULTS / "bench-cpu-2026-12-02.json").read_text()))
    assert not {"checkpoint", "files", "notes"} & base.as_dict().keys()
    ready = ReadyToComputeFigures(attach_s=Spread((0.1,)), load_file_s=Spread((0.2,)), read="max", resident_ratio=1.0, arena="memfd",
                                  arena_note="/m/a.safetensors is on nfs4, where the bytes can change behind the page cache")
    mine = replace(base, env=replace(base.env, checkpoint="/m", files=3), ready=ready, notes=("cold rows skipped: tmpfs",))
    d = mine.as_dict()
    assert (d["checkpoint"], d["files"], d["notes"]) == ("/m", 3, ["cold rows skipped: tmpfs"])
    assert d["ready_to_compute"]["arena_note"].startswith("/m/a.safetensors is on nfs4")
    assert "arena_note" not in replace(ready, arena_note=None).as_dict()["ready_to_compute"]
    assert typed(json.loads(mine.to_json())) == mine


def test_a_peer_loader_that_is_absent_or_fails_says_so():
    assert PeerLoaderFigures(error="ModuleNotFoundError: x", name="runai_streamer").as_dict() == {"runai_streamer_error": "ModuleNotFoundError: x"}
    # installed but failing on this host: the version, and why
    d = PeerLoaderFigures(error="OSError: y", version="0.17.0", name="runai_streamer").as_dict()
    assert d == {"runai_streamer_version": "0.17.0", "runai_streamer_error": "OSError: y"}


def test_a_fresh_engine_times_its_attach(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    f = time_fresh_attach(model="a", socket=d.socket)
    assert f.tensors == 40
    assert 0 < f.import_client_ms < 10_000 and 0 < f.connect_ms < 10_000 and 0 < f.first_attach_ms < 10_000 and f.second_attach_ms > 0
    assert f.connect_to_tensors_ms == f.connect_ms + f.first_attach_ms


def test_bench_runs_end_to_end_small(tmp_path, capsys):
    """Every row on the CPU backend, tiny; a peer loader that is not installed is skipped
    with its reason, one that is installed is measured."""
    out = tmp_path / "bench.json"
    cfg = BenchConfig(size_gib=16 / 1024, tensors=20, device="cpu", attaches=5, reps=1, cold_reps=1, restarts=1, big_gib=32 / 1024,
                      workdir=str(tmp_path), out=str(out), ready_reps=3, fresh=2)
    assert run_bench(cfg) == 0
    r = json.loads(out.read_text())
    assert r["ready_to_compute"]["reps"] == 3 and r["load_file_touch_warm_s"] == r["ready_to_compute"]["load_file_s"]["p50"]
    assert r["attach_touch_s"] == r["ready_to_compute"]["attach_s"]["p50"]
    assert r["fresh_attach"]["n"] == 2 and r["fresh_attach"]["first_attach_ms"]["p50"] > 0
    ch = r["content_hash"]  # the loader with and without the content hash, side by side
    assert list(ch["runs"]) == ["memfd, off", "memfd, on", "memfd, on, digests kept", "file, off", "file, on", "file, on, digests kept"]
    assert all(len(v["runs"]) == 3 and v["p50"] > 0 for v in ch["runs"].values()) and ch["kinds"]["memfd, on"] == "memfd"
    assert set(ch["ratio_on_over_off"]) == {"memfd", "file"}
    printed = capsys.readouterr()
    assert "s  engine restarts..." in printed.out  # it says where it is as it goes
    for name, dist in (("fastsafetensors", "fastsafetensors"), ("runai_streamer", "runai-model-streamer")):
        if f"{name}_error" in r:
            assert f"{dist}: skipped" in printed.out + printed.err
        else:
            assert r[f"{name}_warm_s"] > 0 and r[f"{name}_cold_s"] > 0 and r[f"{name}_version"]
    for b in INSTANTTENSOR_BACKENDS:  # no CPU target: each backend's row says why, no figure
        assert r[f"instanttensor_{b}_error"].startswith("no CPU target") and f"instanttensor_{b}_warm_s" not in r
    assert typed(r).as_dict().keys() == r.keys()
