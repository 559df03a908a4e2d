"""The published store ([published] dir): published models survive a daemon restart, are
checked byte by byte when read back, and are bounded by a budget and per-tenant quotas
(server/store.py, Note [published store])."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import NOBODY, as_uid, root_only, skip_without_cuda
from test_publish import processed

from weightcache import Client, tenant_fingerprint
from weightcache.config import load_settings
from weightcache.errors import ConfigError, CorruptCheckpoint, LoadFailed, UnknownModel
from weightcache.tools.spawn import DaemonProcess, config_text

OTHER = 65533  # a second tenant (setuid takes any uid)


def write_store_config(path: Path, sock: str, store: Path, budget: str = "16MiB", quotas: dict[str, str] | None = None,
                       daemon: dict[str, Any] | None = None, budgets: dict[str, str] | None = None) -> Path:
    text = config_text(sock, {"cpu": "32MiB", **(budgets or {})}, [],
                       {"log_level": "debug", "shutdown_grace_s": 2, **(daemon or {})})
    text += f'\n[published]\ndir = "{store}"\nbudget = "{budget}"\n'
    for tenant, q in (quotas or {}).items():
        text += f'\n[quotas."{tenant}"]\npublished = "{q}"\n'
    path.write_text(text)
    return path


class Store:
    """A store directory and the config of the daemons that use it, started one at a time."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.dir = tmp_path / "published"
        self.sockdir = tempfile.mkdtemp(prefix="wcs-", dir="/tmp")
        os.chmod(self.sockdir, 0o755)
        self.socket = os.path.join(self.sockdir, "d.sock")
        self.log = tmp_path / "daemon.log"
        self.config = write_store_config(tmp_path / "d.toml", self.socket, self.dir, **config)
        self.proc: DaemonProcess | None = None

    @contextlib.contextmanager
    def daemon(self) -> Iterator[Store]:
        self.proc = DaemonProcess(self.config, self.socket, self.log).start()
        try:
            yield self
        finally:
            assert self.proc.stop() == 0, self.log.read_text()[-3000:]
            self.proc = None

    def log_text(self) -> str:
        return self.log.read_text()

    def blobs(self) -> list[Path]:
        return sorted((self.dir / "blobs").iterdir())

    def records(self) -> list[Path]:
        return sorted((self.dir / "records").iterdir())


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path)
    yield s
    if s.proc is not None:
        s.proc.stop()
    assert "Traceback" not in s.log_text()


def attach_in_fresh_process(socket: str, name: str, out: Path) -> str:
    """Attach ``name`` from a new process; its tensors saved to ``out``; the fingerprint it saw."""
    code = ("import sys, torch; from weightcache import SyncClient\n"
            "with SyncClient(sys.argv[1]) as c, c.attach(sys.argv[2]) as w:\n"
            "    torch.save({k: v.clone() for k, v in w.items()}, sys.argv[3]); print(w.fingerprint)\n")
    r = subprocess.run([sys.executable, "-c", code, socket, name, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], v) and a[k].dtype == v.dtype for k, v in b.items())


async def model(c: Client, name: str) -> dict[str, Any] | None:
    return next((m for m in await c.models() if m["name"] == name), None)


def test_a_published_model_survives_a_restart(store: Store, tmp_path: Path) -> None:
    mine = processed()
    with store.daemon():
        async def publish() -> dict[str, Any]:
            async with Client(store.socket) as c:
                return await c.publish("q8", mine, fingerprint="src-abc+int8-v1")

        m = asyncio.run(publish())
        assert m["on_disk"] is True and m["store_note"] is None
    assert len(store.blobs()) == 1 and len(store.records()) == 1
    with store.daemon():
        async def listed() -> dict[str, Any] | None:
            async with Client(store.socket) as c:
                return await model(c, "q8")

        m = asyncio.run(listed())
        assert m is not None and m["state"] == "registered" and m["origin"] == "publish" and m["on_disk"]
        assert m["fingerprint"] == tenant_fingerprint("src-abc+int8-v1", os.geteuid())
        seen = attach_in_fresh_process(store.socket, "q8", tmp_path / "seen.pt")
        assert seen == tenant_fingerprint("src-abc+int8-v1", os.geteuid())
        assert same(torch.load(tmp_path / "seen.pt"), mine)
        assert "read back from the published store q8" in store.log_text()
        cli = subprocess.run([sys.executable, "-m", "weightcache", "--socket", store.socket, "models"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "published, on disk" in cli.stdout, cli.stdout + cli.stderr


def test_the_same_bytes_are_stored_once_and_go_with_their_last_name(store: Store) -> None:
    with store.daemon():
        async def go() -> None:
            async with Client(store.socket) as c:
                await c.publish("a", processed(), fingerprint="one")
                await c.publish("b", processed(), fingerprint="two")  # other name, other key, same tensors
                assert len(store.blobs()) == 1 and len(store.records()) == 2
                await c.unregister("a")
                assert len(store.blobs()) == 1 and len(store.records()) == 1  # b still names it
                await c.publish("b", processed(1), fingerprint="three", replace=True)
                assert len(store.blobs()) == 1 and len(store.records()) == 1  # the replaced bytes went
                await c.unregister("b")
                assert store.blobs() == [] and store.records() == []

        asyncio.run(go())


def record_of(store: Store, name: str) -> tuple[Path, dict[str, Any]]:
    """The record file of ``name`` and what it says."""
    for r in store.records():
        rec = json.loads(r.read_bytes())
        if rec["name"] == name:
            return r, rec
    raise AssertionError(f"no record of {name}")


def blob_of(store: Store, name: str) -> Path:
    return store.dir / "blobs" / f"{record_of(store, name)[1]['content']}.safetensors"


def publish_two(store: Store) -> None:
    with store.daemon():
        async def publish() -> None:
            async with Client(store.socket) as c:
                await c.publish("q8", processed(), fingerprint="x")
                await c.publish("other", processed(2), fingerprint="y")

        asyncio.run(publish())


def test_a_damaged_file_is_refused_removed_and_the_daemon_serves(store: Store) -> None:
    publish_two(store)
    damaged = blob_of(store, "q8")
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # one bit of the last tensor's last byte, same size
    damaged.write_bytes(bytes(data))
    with store.daemon():
        async def go() -> None:
            async with Client(store.socket) as c:
                with pytest.raises(CorruptCheckpoint, match=r"its copy on disk is damaged.*publish it again"):
                    async with c.attach("q8"):
                        pass
                async with c.attach("other") as w:  # the daemon serves on, the other file is whole
                    assert same({k: v.clone() for k, v in w.items()}, processed(2))
                m = await model(c, "q8")
                assert m is not None and not m["on_disk"] and m["last_error"]["code"] == "CORRUPT_CHECKPOINT"
                with pytest.raises(LoadFailed, match="publish it again"):  # never served from the bad file
                    await c.load("q8")

        asyncio.run(go())
    assert not damaged.exists() and len(store.blobs()) == 1 and len(store.records()) == 1
    assert "is damaged" in store.log_text() and "never served" in store.log_text()


def test_a_truncated_file_or_record_is_removed_at_start(store: Store) -> None:
    publish_two(store)
    cut = blob_of(store, "q8")
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 100)
    record, _ = record_of(store, "other")
    record.write_bytes(record.read_bytes()[:40])
    with store.daemon():
        async def go() -> None:
            async with Client(store.socket) as c:
                assert await c.models() == []
                with pytest.raises(UnknownModel):
                    await c.load("q8")
                assert (await c.status())["leases"] == 0  # serving

        asyncio.run(go())
    text = store.log_text()
    assert "truncated or replaced" in text and "not a JSON record" in text and "no record names it" in text
    assert store.records() == [] and store.blobs() == []


def test_the_budget_removes_the_least_recently_used_unattached_files(tmp_path: Path) -> None:
    one = 131_072 + 1024 + 2048 + 8 + 400  # processed(): its tensors and a header of a few hundred bytes
    store = Store(tmp_path, budget=str(3 * one))  # three fit, four do not
    with store.daemon():
        async def go() -> dict[str, bool]:
            async with Client(store.socket) as c:
                for i in range(3):
                    m = await c.publish(f"p{i}", processed(i), fingerprint=str(i))
                    assert m["on_disk"], m
                async with c.attach("p0"):  # p0 is the oldest, but attached: never a victim
                    await c.publish("p3", processed(3), fingerprint="3")
                    on_disk = {m["name"]: m["on_disk"] for m in await c.models()}
                huge = await c.publish("huge", {"big": torch.zeros(4096, 256, dtype=torch.int8)}, fingerprint="h")
                assert not huge["on_disk"] and "published.budget" in huge["store_note"], huge  # in memory only
                return on_disk

        on_disk = asyncio.run(go())
    assert on_disk == {"p0": True, "p1": False, "p2": True, "p3": True}
    assert "least recently used, to make room for 'p3'" in store.log_text()
    assert len(store.blobs()) == 3


def test_store_config_errors_are_clear(tmp_path: Path) -> None:
    def settings(body: str) -> Any:
        p = tmp_path / "c.toml"
        p.write_text(f'[daemon]\nsocket = "/tmp/x.sock"\n\n[published]\n{body}\n')
        return load_settings(p)

    with pytest.raises(ConfigError, match="dirr"):
        settings(f'dirr = "{tmp_path}"\nbudget = "1GiB"')
    with pytest.raises(ConfigError, match="relative"):
        settings('dir = "store"\nbudget = "1GiB"')
    with pytest.raises(ConfigError, match=r"without published\.budget"):
        settings(f'dir = "{tmp_path}"')
    assert settings("").published.dir is None  # off by default


@pytest.mark.parametrize("case", ["file", "group-writable", "no-parent", "foreign-owner"])
def test_a_store_directory_the_daemon_cannot_use_stops_the_start(tmp_path: Path, case: str) -> None:
    store = Store(tmp_path)
    if case == "foreign-owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the directory to another uid")
        store.dir.mkdir(mode=0o700)
        os.chown(store.dir, NOBODY, NOBODY)
        expected = f"owned by uid {NOBODY}"
    elif case == "file":
        store.dir.write_text("not a directory")
        expected = "is not a directory"
    elif case == "group-writable":
        store.dir.mkdir()
        os.chmod(store.dir, 0o775)
        expected = "writable by its group or others"
    else:
        store.config.write_text(store.config.read_text().replace(str(store.dir), str(tmp_path / "a" / "b")))
        expected = "nor does its parent"
    proc = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(store.config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "published.dir" in proc.stderr + proc.stdout and expected in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_missing_store_directory_is_made_for_the_daemon_alone(store: Store) -> None:
    with store.daemon():
        assert store.dir.is_dir() and store.dir.stat().st_mode & 0o777 == 0o700


def test_a_tmp_file_left_by_a_cut_write_is_removed(store: Store) -> None:
    with store.daemon():
        pass
    (store.dir / "tmp" / "blob.1.2").write_bytes(b"half a file")
    with store.daemon():
        assert list((store.dir / "tmp").iterdir()) == []
    assert "left by a write that did not finish" in store.log_text()


# -- tenants ------------------------------------------------------------------------------
MULTI = {"socket_mode": 0o666, "allowed_uids": [0, NOBODY, OTHER]}


def _publish_as(path: str, name: str, tensors: dict[str, torch.Tensor], fingerprint: str) -> dict[str, Any]:
    """In a forked child: the tensors are made by the parent (torch's thread pools do not
    survive a fork: a child that ran torch.randn after the parent had hung)."""
    async def go() -> dict[str, Any]:
        async with Client(path) as c:
            return await c.publish(name, tensors, fingerprint=fingerprint)

    return asyncio.run(go())


def _models_as(path: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with Client(path) as c:
            return {m["name"]: m for m in await c.models()}

    return asyncio.run(go())


def _attach_as(path: str, name: str) -> str:
    async def go() -> str:
        async with Client(path) as c:
            try:
                async with c.attach(name):
                    return "attached"
            except Exception as exc:
                return f"{getattr(exc, 'code', '')}: {exc}"

    return asyncio.run(go())


@root_only
def test_a_tenants_quota_bounds_what_it_keeps_and_others_cannot_reach_it(tmp_path: Path) -> None:
    one = 131_072 + 1024 + 2048 + 8 + 400
    store = Store(tmp_path, quotas={f"uid:{NOBODY}": str(2 * one)}, daemon=MULTI)
    with store.daemon():
        for i in range(3):  # two fit its quota: the third removes its own least recently used
            t = processed(i)
            m = as_uid(NOBODY, lambda i=i, t=t: _publish_as(store.socket, f"n{i}", t, f"fp{i}"))
            assert m.get("on_disk") is True, m
        big = {"big": torch.zeros(4096, 256, dtype=torch.int8)}  # 1 MiB, over its quota
        too_big = as_uid(NOBODY, lambda: _publish_as(store.socket, "huge", big, "fp9"))
        assert too_big["on_disk"] is False and f'quotas."uid:{NOBODY}".published' in too_big["store_note"], too_big
        assert "huge" in _models_as(store.socket)  # published in memory all the same
    assert len(store.blobs()) == 2
    with store.daemon():
        seen = _models_as(store.socket)  # root: an administrator sees them all
        assert {n for n, m in seen.items() if m["on_disk"]} == {"n1", "n2"} and seen["n2"]["owner"] == NOBODY
        assert seen["n2"]["allowed_uids"] == [NOBODY]  # private to its owner, as when it was published
        assert as_uid(OTHER, lambda: sorted(_models_as(store.socket))) == []
        assert "PERMISSION_DENIED" in as_uid(OTHER, lambda: _attach_as(store.socket, "n2"))
        assert as_uid(NOBODY, lambda: _attach_as(store.socket, "n2")) == "attached"
    assert "n0 not kept" not in store.log_text() and "removed n0" in store.log_text()


@root_only
def test_store_files_someone_else_could_write_are_ignored(store: Store) -> None:
    with store.daemon():
        async def publish() -> None:
            async with Client(store.socket) as c:
                await c.publish("mine", processed(), fingerprint="x")
                await c.publish("theirs", processed(1), fingerprint="y")

        asyncio.run(publish())
    for r in store.records():
        if b'"theirs"' in r.read_bytes():
            os.chown(r, NOBODY, NOBODY)  # a record another uid could have written
    with store.daemon():
        async def names() -> list[str]:
            async with Client(store.socket) as c:
                return sorted(m["name"] for m in await c.models())

        assert asyncio.run(names()) == ["mine"]
    assert f"is owned by uid {NOBODY}" in store.log_text() and "ignored" in store.log_text()
    assert len(store.records()) == 2  # left alone: not the daemon's to remove


def test_a_second_daemon_on_the_same_store_does_not_start(store: Store, tmp_path: Path) -> None:
    other = write_store_config(tmp_path / "other.toml", os.path.join(store.sockdir, "o.sock"), store.dir)
    with store.daemon():
        proc = subprocess.run([sys.executable, "-m", "weightcache", "serve", "--config", str(other)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "in use by another daemon" in proc.stderr + proc.stdout, proc.stderr


def test_reload_applies_a_lowered_budget_and_reports_a_new_directory(store: Store) -> None:
    one = 131_072 + 1024 + 2048 + 8 + 400
    with store.daemon():
        async def go() -> None:
            async with Client(store.socket) as c:
                for i in range(3):
                    await c.publish(f"p{i}", processed(i), fingerprint=str(i))
                st = (await c.status())["published"]
                assert st["models"] == 3 and st["dir"] == str(store.dir) and st["budget"] == 16 * 2**20
                store.config.write_text(store.config.read_text().replace('budget = "16MiB"', f'budget = "{2 * one}"'))
                report = await c.reload()
                assert report["failed"] == [], report
                assert {m["name"]: m["on_disk"] for m in await c.models()} == {"p0": False, "p1": True, "p2": True}
                store.config.write_text(store.config.read_text().replace(str(store.dir), str(store.dir) + "2"))
                report = await c.reload()
                assert any(line.startswith("published.dir: changed") for line in report["failed"]), report

        asyncio.run(go())
    assert len(store.blobs()) == 2


@pytest.mark.gpu
def test_a_gpu_publish_survives_a_restart(tmp_path: Path) -> None:
    """The CUDA backend's read of a published arena (CudaBackend.reading), end to end."""
    skip_without_cuda()
    mine = {k: v.cuda() for k, v in processed().items()}
    store = Store(tmp_path, budgets={"cuda:0": "256MiB"})
    with store.daemon():
        async def publish() -> dict[str, Any]:
            async with Client(store.socket) as c:
                return await c.publish("q8", mine, fingerprint="gpu")

        assert asyncio.run(publish())["on_disk"]
    with store.daemon():
        async def attach() -> bool:
            async with Client(store.socket) as c, c.attach("q8", device="cuda:0") as w:
                return same({k: v.clone() for k, v in w.items()}, mine)

        assert asyncio.run(attach())


def test_concurrent_publishes_are_all_kept_and_all_come_back(store: Store) -> None:
    with store.daemon():
        async def publish() -> list[bool]:
            async with Client(store.socket) as a, Client(store.socket) as b:
                got = await asyncio.gather(*(c.publish(f"p{i}", processed(i), fingerprint=str(i))
                                             for i, c in enumerate([a, b, a, b])))
                return [m["on_disk"] for m in got]

        assert asyncio.run(publish()) == [True] * 4
    assert len(store.blobs()) == 4 and len(store.records()) == 4 and list((store.dir / "tmp").iterdir()) == []
    with store.daemon():
        async def back() -> dict[str, str]:
            async with Client(store.socket) as c:
                for i in range(4):
                    async with c.attach(f"p{i}") as w:
                        assert same({k: v.clone() for k, v in w.items()}, processed(i))
                return {m["name"]: m["source"] for m in await c.models()}

        assert asyncio.run(back()) == {f"p{i}": "disk" for i in range(4)}


@root_only
def test_a_restart_registers_no_more_of_a_tenants_models_than_max_models_per_uid(tmp_path: Path) -> None:
    store = Store(tmp_path, daemon=MULTI)
    with store.daemon():
        for i in range(2):
            t = processed(i)
            assert as_uid(NOBODY, lambda i=i, t=t: _publish_as(store.socket, f"n{i}", t, f"fp{i}"))["on_disk"]
    store.config.write_text(store.config.read_text().replace("[daemon]\n", "[daemon]\nmax_models_per_uid = 1\n"))
    with store.daemon():
        assert sorted(_models_as(store.socket)) == ["n1"]  # the most recently published
    assert f"'n0' not registered: uid {NOBODY} has max_models_per_uid=1" in store.log_text()
    assert len(store.records()) == 2  # kept on disk all the same
