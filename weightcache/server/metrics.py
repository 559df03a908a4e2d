"""The Prometheus endpoint, built from a snapshot the daemon hands out.

Metrics are read when Prometheus scrapes, so nothing is counted twice; only request
latencies and error replies are counted as they happen. The collector never holds the
daemon: it calls a function that returns a ``Snapshot`` of plain values. That function
runs in the HTTP server's thread, so it only copies containers (atomic under the GIL).
Per-model series come from the models registered now: a removed model's series go with it.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
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
    counters: dict[str, int]  # daemon-wide: server/residency/stats.py COUNTERS
    # where fills' bytes came from ("files", "host", "peer", "neighbour", "publish") -> (bytes, seconds)
    filled: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)


class Metrics:
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram("weightcache_request_seconds", "Time to answer a request, by op", ["op"],
                                  registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30, 120))
        # Labels are bounded: codes are the daemon's own, ops are known ops or "other"
        # (a peer's made-up op name must not add series), "connection" for errors about
        # the connection itself (refused, dropped).
        self.errors = Counter("weightcache_errors", "Error replies sent, by error code and op", ["code", "op"],
                              registry=self.registry)
        # server/loop_watch.py: how late a 10 ms timer on the loop fires, what every request waits first
        self.loop_lag = Histogram("weightcache_loop_lag_seconds", "How late the event loop ran a timer",
                                  registry=self.registry,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
        self.registry.register(_SnapshotCollector(snapshot))
        self._server: WSGIServer | None = None

    def observe(self, op: str, started: float) -> None:
        self.requests.labels(op=op).observe(time.monotonic() - started)

    def count_error(self, code: str, op: str) -> None:
        self.errors.labels(code=code, op=op).inc()

    def bind(self, listen: str) -> None:
        """Claim the port now, before the daemon binds its socket, so that a busy port stops
        the start with nothing left behind. ValueError for a malformed address, OSError
        when the port cannot be had."""
        if self._server is not None:
            return
        host, sep, port = listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{listen!r} is not host:port")
        host = host.strip("[]") or "127.0.0.1"  # [::1]:9464 for IPv6
        family, _, _, _, sockaddr = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (_ThreadingWSGIServer,), {"address_family": family})
        self._server = make_server(str(sockaddr[0]), int(port), _only_metrics(make_wsgi_app(self.registry)), server_class,
                                   handler_class=_QuietHandler)

    def serve(self, listen: str) -> None:
        self.bind(listen)
        assert self._server is not None
        threading.Thread(target=self._server.serve_forever, name="wc-metrics", daemon=True).start()
        log.info("metrics on http://%s/metrics", listen)


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most MAX_SCRAPES at once: any local user can reach a TCP
    port, and one such user parked 250 threads in the daemon in under a minute with
    half-sent requests. Connections beyond the limit are closed at once."""

    daemon_threads = True  # a slow scraper never holds up the daemon's exit
    MAX_SCRAPES = 4

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.MAX_SCRAPES)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _QuietHandler(WSGIRequestHandler):
    timeout = 5  # seconds a scraper may take to send its request: a silent one is dropped

    def log_message(self, format: str, *args: Any) -> None:  # one stderr line per scrape otherwise
        pass


def _only_metrics(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """/metrics, and 404 elsewhere (prometheus_client's own server answers every path,
    which hides a mistyped scrape path and answers scanners)."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"weightcache serves its metrics at /metrics only\n"]
        return app(environ, start_response)

    return wrapped


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        names = {m.name for m in snap.models}
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
            if name in names:  # a removed model's last rate is not shown (nor a publish's staging entry)
                rate.add_metric([name], bps)
        yield rate
        for k, v in snap.counters.items():
            yield CounterMetricFamily(f"weightcache_{k}", f"Since the daemon started: {k.replace('_', ' ')}", value=v)
        filled = CounterMetricFamily("weightcache_filled_bytes", "Bytes of the fills that made models resident, by source",
                                     labels=["source"])
        took = CounterMetricFamily("weightcache_filled_seconds", "Seconds those fills took, by source", labels=["source"])
        for source, (nbytes, seconds) in sorted(snap.filled.items()):
            filled.add_metric([source], nbytes)
            took.add_metric([source], seconds)
        yield from (filled, took)
        yield GaugeMetricFamily("weightcache_connections", "Open client connections", value=snap.connections)
        yield GaugeMetricFamily("weightcache_leases", "Live leases", value=snap.leases)
        yield GaugeMetricFamily("weightcache_ready", "1 when serving with every preload resident (the health op)",
                                value=int(snap.ready))
        failed = GaugeMetricFamily("weightcache_preload_failed", "1 for each model whose preload failed", labels=["model"])
        for name in snap.failed_preloads:
            failed.add_metric([name], 1)
        yield failed
