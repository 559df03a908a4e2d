"""The Prometheus endpoint, built from a snapshot the daemon hands out.

Metrics are read when Prometheus scrapes, so nothing is counted twice; only request
latencies are observed as they happen. The collector never holds the daemon: it calls a
function that returns a ``Snapshot`` of plain values. That function runs in the HTTP
server's thread, so it only copies containers (atomic under the GIL).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("weightcache.daemon")

MODEL_COUNTERS = ("loads", "evictions", "demotions", "promotions")


@dataclass(frozen=True)
class ModelFigures:
    name: str
    device: str
    state: str
    nbytes: int
    attach_count: int
    counters: dict[str, int]  # MODEL_COUNTERS


@dataclass(frozen=True)
class Snapshot:
    devices: dict[str, dict[str, int]]  # device (and "host") -> budget, used, reserved
    models: list[ModelFigures]
    last_load_rate: dict[str, float]  # model -> bytes/s of its last load
    connections: int
    leases: int
    ready: bool
    failed_preloads: list[str]
    counters: dict[str, int]  # daemon-wide: server/loads.py COUNTERS


class Metrics:
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram("weightcache_request_seconds", "Time to answer a request, by op", ["op"],
                                  registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 120))
        self.registry.register(_SnapshotCollector(snapshot))

    def observe(self, op: str, started: float) -> None:
        self.requests.labels(op=op).observe(time.monotonic() - started)

    def serve(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        log.info("metrics on http://%s/metrics", listen)


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        dev = {k: GaugeMetricFamily(f"weightcache_device_{k}_bytes", f"Per device: {k} bytes", labels=["device"])
               for k in ("budget", "used", "reserved")}
        for name, acct in snap.devices.items():
            for k in dev:
                dev[k].add_metric([name], acct[k])
        yield from dev.values()
        state = GaugeMetricFamily("weightcache_model_state", "1 for the state a model is in", labels=["model", "state"])
        size = GaugeMetricFamily("weightcache_model_bytes", "Arena size", labels=["model", "device"])
        attached = GaugeMetricFamily("weightcache_model_attach_count", "Live leases", labels=["model"])
        counters = {k: CounterMetricFamily(f"weightcache_model_{k}", f"Per model: {k}", labels=["model"])
                    for k in MODEL_COUNTERS}
        for m in snap.models:
            state.add_metric([m.name, m.state], 1)
            size.add_metric([m.name, m.device], m.nbytes)
            attached.add_metric([m.name], m.attach_count)
            for k, fam in counters.items():
                fam.add_metric([m.name], m.counters[k])
        yield from (state, size, attached, *counters.values())
        rate = GaugeMetricFamily("weightcache_last_load_bytes_per_second", "Rate of each model's last load", labels=["model"])
        for name, bps in snap.last_load_rate.items():
            rate.add_metric([name], bps)
        yield rate
        for k, v in snap.counters.items():
            yield CounterMetricFamily(f"weightcache_{k}", f"Since the daemon started: {k.replace('_', ' ')}", value=v)
        yield GaugeMetricFamily("weightcache_connections", "Open client connections", value=snap.connections)
        yield GaugeMetricFamily("weightcache_leases", "Live leases", value=snap.leases)
        yield GaugeMetricFamily("weightcache_ready", "1 when serving with every preload resident (the health op)",
                                value=int(snap.ready))
        failed = GaugeMetricFamily("weightcache_preload_failed", "1 for each model whose preload failed", labels=["model"])
        for name in snap.failed_preloads:
            failed.add_metric([name], 1)
        yield failed
