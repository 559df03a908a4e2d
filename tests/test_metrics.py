"""The Prometheus endpoint: /metrics only, removed models' series go, error
replies counted by code and op."""

import struct
import urllib.error
import urllib.request

import pytest

from weightcache import Client
from weightcache.errors import WeightcacheError
from weightcache.tools.spawn import free_port


def scrape(port: int, path: str = "/metrics") -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode()


def series(body: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line and not line.startswith("#")}


async def test_only_metrics_is_served(start_daemon):
    port = free_port()
    start_daemon(extra_daemon={"metrics_listen": f"127.0.0.1:{port}"})
    assert "weightcache_ready 1.0" in scrape(port)
    for path in ("/", "/metricsx", "/metrics/", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as info:
            scrape(port, path)
        assert info.value.code == 404, path


async def test_removed_models_series_go(start_daemon, ckpts):
    port = free_port()
    d = start_daemon(budget="40MiB", models={"a": ckpts["a"], "b": ckpts["b"]}, extra_daemon={"metrics_listen": f"127.0.0.1:{port}"})
    async with Client(d.socket) as c:
        await c.load("a")
        await c.load("b")
        before = series(scrape(port))
        assert before['weightcache_last_load_bytes_per_second{model="b"}'] > 0
        assert before['weightcache_model_state{model="b",state="resident"}'] == 1
        head = d.config.read_text().split("[[models]]")[0]
        d.config.write_text(head + f'[[models]]\nname = "a"\npath = "{ckpts["a"]}"\n')
        assert (await c.reload())["removed"] == ["b"]
        after = series(scrape(port))
    assert not [k for k in after if 'model="b"' in k], [k for k in after if 'model="b"' in k]
    assert after['weightcache_last_load_bytes_per_second{model="a"}'] > 0


@pytest.mark.parametrize("all_models", [False, True])
async def test_models_only_some_peers_may_use_are_labelled_only_when_asked(start_daemon, ckpts, all_models):
    """Any local user can read the port: a model with allowed_uids is not named there
    unless the operator sets metrics_all_models (docs/deployment.md, "Tenants")."""
    port = free_port()
    d = start_daemon(budget="40MiB", models={"open": ckpts["a"], "restricted": ckpts["b"]}, restricted={"allowed_uids": [1234]},
                     extra_daemon={"metrics_listen": f"127.0.0.1:{port}", "metrics_all_models": all_models})
    async with Client(d.socket) as c:
        await c.load("open")
        await c.load("restricted")
    got = series(scrape(port))
    assert got['weightcache_model_state{model="open",state="resident"}'] == 1
    named = [k for k in got if 'model="restricted"' in k]
    assert bool(named) is all_models, named
    assert got['weightcache_device_used_bytes{device="cpu"}'] > 9 * 2**20  # both models: its bytes still count there


async def test_error_replies_are_counted_by_code_and_op(start_daemon, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")  # no JSON header: not a safetensors file
    port = free_port()
    d = start_daemon(models={"bad": bad}, extra_daemon={"metrics_listen": f"127.0.0.1:{port}"})
    codes = []
    async with Client(d.socket) as c:
        for name in ("bad", "bad", "nope"):
            with pytest.raises(WeightcacheError) as info:
                await c.load(name)
            codes.append(info.value.code)
    assert codes == ["CORRUPT_CHECKPOINT", "CORRUPT_CHECKPOINT", "UNKNOWN_MODEL"]
    raw = d.raw()
    assert raw.call({"id": 1, "op": "no-such-op-" + "x" * 40})["error"]["code"] == "UNKNOWN_OP"
    raw.close()
    got = {k: v for k, v in series(scrape(port)).items() if k.startswith("weightcache_errors_total")}
    assert series(scrape(port))["weightcache_failed_loads_total"] == 2  # both corrupt loads
    assert series(scrape(port))["weightcache_kept_copy_demotions_total"] == 0  # every daemon-wide counter is a series
    assert got == {'weightcache_errors_total{code="CORRUPT_CHECKPOINT",op="load"}': 2,
                   'weightcache_errors_total{code="UNKNOWN_MODEL",op="load"}': 1,
                   'weightcache_errors_total{code="UNKNOWN_OP",op="other"}': 1}  # a peer's op name is no label


async def test_half_sent_scrapes_cannot_pile_up_threads(start_daemon):
    """Any local user reaches the port: one could park 250 threads in the daemon with
    requests it never finished. At most MAX_SCRAPES (4) are served at once."""
    import os
    import socket
    import time

    port = free_port()
    d = start_daemon(extra_daemon={"metrics_listen": f"127.0.0.1:{port}"})
    scrape(port)

    def threads() -> int:
        return len(os.listdir(f"/proc/{d.proc.pid}/task"))

    base = threads()
    held = []
    for _ in range(30):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        held.append(s)
        time.sleep(0.01)  # one slow client after another, each taken in by the server before the next
    time.sleep(0.3)  # time for the threads a server that gave each slow client one would start
    assert threads() <= base + 4, (base, threads())
    for s in held:
        s.close()
    for _ in range(50):  # the parked handlers see EOF and give their slots back
        try:
            assert "weightcache_ready 1.0" in scrape(port)
            break
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    else:
        pytest.fail("the metrics endpoint did not recover once the slow clients went")
