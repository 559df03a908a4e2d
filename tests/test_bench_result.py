"""The bench's typed result writes exactly the JSON that docs/bench-*.json hold (tooling
and the docs read those files): same keys, same order, same values."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from weightcache.tools.bench_result import (
    AttachFigures,
    BenchResult,
    ControlPlaneFigures,
    DiskCeiling,
    Environment,
    HostTierFigures,
    LoaderFigures,
    LoadFileFigures,
    PeerLoaderFigures,
    RestartFigures,
    RestartTimes,
    StatusLatency,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"


def typed(r: dict[str, Any]) -> BenchResult:
    """The records a bench run with the figures of ``r`` builds."""
    return BenchResult(
        env=Environment(device=r["device"], checkpoint_bytes=r["checkpoint_bytes"], tensors=r["tensors"], python=r["python"],
                        torch=r["torch"], cpus=r["cpus"], host=r["host"], gpu=r.get("gpu")),
        load_file=LoadFileFigures(warm_s=r["load_file_warm_s"], touch_warm_s=r["load_file_touch_warm_s"], cold_s=r["load_file_cold_s"]),
        disk_ceiling=DiskCeiling(gbps=r.get("disk_ceiling_GBps"), error=r.get("disk_ceiling_error")),
        fastsafetensors=PeerLoaderFigures(warm_s=r.get("fastsafetensors_warm_s"), cold_s=r.get("fastsafetensors_cold_s"),
                                          error=r.get("fastsafetensors_error")),
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
    )


@pytest.mark.parametrize("name", ["bench-cpu.json", "bench-h200.json"])
def test_to_json_writes_the_published_keys_in_order(name):
    text = (DOCS / name).read_text()
    r = json.loads(text)
    out = typed(r).as_dict()
    # The derived figure is recomputed from the medians: equal up to float rounding.
    assert out.pop("restart_cache_minus_floor_ms") == pytest.approx(r.pop("restart_cache_minus_floor_ms"))
    assert list(out) == list(r)
    assert out == r
    assert json.loads(typed(json.loads(text)).to_json()).keys() == json.loads(text).keys()


def test_optional_figures_keep_their_absent_or_null_rule():
    base = typed(json.loads((DOCS / "bench-cpu.json").read_text()))
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
