"""Operations glue: systemd readiness, JSON logs, and the Prometheus endpoint.

Metrics are read from the daemon's state when Prometheus scrapes (a custom collector),
so nothing is counted twice; only request latencies are observed as they happen.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("weightcache.daemon")


def sd_notify(message: str) -> bool:
    """Tell systemd (Type=notify units) about our state: "READY=1", "STOPPING=1". The
    protocol is one datagram to $NOTIFY_SOCKET; no libsystemd needed. False when not
    under systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path  # '@' = abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers. (Ten lines here rather than one more
    dependency.)"""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class Metrics:
    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram("weightcache_request_seconds", "Time to answer a request, by op", ["op"],
                                  registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 120))
        self.registry.register(_StateCollector(daemon))

    def observe(self, op: str, started: float) -> None:
        self.requests.labels(op=op).observe(time.monotonic() - started)

    def serve(self, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        log.info("metrics on http://%s/metrics", listen)


class _StateCollector(Collector):
    """Reads the daemon at scrape time. Runs in the HTTP server's thread: it only reads,
    copying containers first (list() of a dict is atomic under the GIL)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def collect(self) -> Iterator[Any]:
        core = self.d.core
        if core is None:
            return
        dev = {k: GaugeMetricFamily(f"weightcache_device_{k}_bytes", f"Per device: {k} bytes", labels=["device"])
               for k in ("budget", "used", "reserved")}
        for name, acct in list(core.devices.items()) + ([("host", core.host)] if core.host.budget else []):
            for k in dev:
                dev[k].add_metric([name], getattr(acct, k))
        yield from dev.values()
        state = GaugeMetricFamily("weightcache_model_state", "1 for the state a model is in", labels=["model", "state"])
        size = GaugeMetricFamily("weightcache_model_bytes", "Arena size", labels=["model", "device"])
        attached = GaugeMetricFamily("weightcache_model_attach_count", "Live leases", labels=["model"])
        counters = {k: CounterMetricFamily(f"weightcache_model_{k}", f"Per model: {k}", labels=["model"])
                    for k in ("loads", "evictions", "demotions", "promotions")}
        for e in list(core.entries.values()):
            state.add_metric([e.name, str(e.state)], 1)
            size.add_metric([e.name, e.device], e.nbytes)
            attached.add_metric([e.name], e.attach_count)
            for k, fam in counters.items():
                fam.add_metric([e.name], getattr(e, k))
        yield from (state, size, attached, *counters.values())
        rate = GaugeMetricFamily("weightcache_last_load_bytes_per_second", "Rate of each model's last load", labels=["model"])
        for name, bps in list(self.d.last_load_rate.items()):
            rate.add_metric([name], bps)
        yield rate
        yield GaugeMetricFamily("weightcache_connections", "Open client connections", value=len(self.d.conns))
        yield GaugeMetricFamily("weightcache_leases", "Live leases", value=len(core.leases))
        health = self.d.health()
        yield GaugeMetricFamily("weightcache_ready", "1 when serving with every preload resident (the health op)",
                                value=int(health["ready"]))
        failed = GaugeMetricFamily("weightcache_preload_failed", "1 for each model whose preload failed", labels=["model"])
        for name in health["failed_preloads"]:
            failed.add_metric([name], 1)
        yield failed
