"""Reload keeps what it can: a policy change (keep_alive, pin, preload) applies
in place to a resident model; a changed path that does not open or parse keeps the old
model and fails the reload; models peers registered survive reloads and SIGHUP; a config
model whose file is bad shows its reason in `models` from the start."""

import asyncio
import signal

import pytest
from conftest import eventually
from helpers import states

from weightcache import Client
from weightcache.cli import main
from weightcache.errors import WeightcacheError


async def test_policy_change_keeps_the_model_resident_and_a_runtime_pin(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.load("a")
        await c.pin("a")  # a runtime pin: the file's pin (false) did not change, so it stays
        d.config.write_text(d.config.read_text().replace(f'path = "{ckpts["a"]}"', f'path = "{ckpts["a"]}"\nkeep_alive = "1h"'))
        report = await c.reload()
        assert report["updated"] == ["a"] and not report["changed"] and not report["failed"]
        (m,) = await c.models()
        assert (m["state"], m["pinned"], m["keep_alive"]) == ("resident", True, 3600.0)
        # pin = true in the file, then false again: the file's change applies
        d.config.write_text(d.config.read_text().replace('keep_alive = "1h"', "pin = false\nkeep_alive = \"1h\"\npreload = true"))
        assert (await c.reload())["updated"] == ["a"]  # preload; pin = false is the default: not a change
        assert [(m["state"], m["pinned"]) for m in await c.models()] == [("resident", True)]
        d.config.write_text(d.config.read_text().replace("pin = false", "pin = true"))
        assert (await c.reload())["updated"] == ["a"]
        await c.unpin("a")
        d.config.write_text(d.config.read_text().replace("pin = true", "pin = false"))
        assert (await c.reload())["updated"] == ["a"]
        (m,) = await c.models()
        assert (m["state"], m["pinned"]) == ("resident", False)


async def test_a_bad_path_or_format_keeps_the_resident_model_and_fails(start_daemon, ckpts, tmp_path):
    d = start_daemon(models={"a": ckpts["a"]})
    pickle = tmp_path / "model.bin"
    pickle.write_bytes(b"PK\x03\x04" + b"\x80\x02" * 64)  # a torch .bin is a zip of pickles
    good = d.config.read_text()
    async with Client(d.socket) as c:
        await c.load("a")
        for bad in (str(ckpts["a"]) + "x", str(pickle)):
            d.config.write_text(good.replace(str(ckpts["a"]), bad))
            report = await c.reload()
            assert len(report["failed"]) == 1 and report["failed"][0].startswith("a: "), report
            assert not report["changed"] and not report["removed"]
            (m,) = await c.models()
            assert (m["state"], m["path"]) == ("resident", str(ckpts["a"]))
        # fixed: the next reload applies the change
        d.config.write_text(good.replace(str(ckpts["a"]), str(ckpts["b"])))
        assert (await c.reload())["changed"] == ["a"]


def test_cli_reload_exits_non_zero_when_a_change_fails(start_daemon, ckpts, capsys):
    d = start_daemon(models={"a": ckpts["a"]})
    assert main(["--socket", d.socket, "reload"]) == 0
    d.config.write_text(d.config.read_text().replace(str(ckpts["a"]), "/nonexistent/a.safetensors"))
    capsys.readouterr()
    assert main(["--socket", d.socket, "reload"]) == 1
    assert "failed: a: " in capsys.readouterr().out


async def test_registered_models_survive_reload_and_sighup(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    async with Client(d.socket) as c:
        await c.register("late", ckpts["tiny"])
        head = d.config.read_text().split("[[models]]")[0]
        d.config.write_text(head)  # the config drops a; late was never in it
        report = await c.reload()
        assert report["removed"] == ["a"]
        assert [m["name"] for m in await c.models()] == ["late"]
        d.config.write_text(head + f'[[models]]\nname = "b"\npath = "{ckpts["b"]}"\n')
        d.proc.send_signal(signal.SIGHUP)

        async def late_and_b() -> bool:
            return sorted(m["name"] for m in await c.models()) == ["b", "late"]

        await eventually(late_and_b)
        # the config comes to name it: the operator's model replaces the peer's
        d.config.write_text(d.config.read_text() + f'[[models]]\nname = "late"\npath = "{ckpts["a"]}"\n')
        assert (await c.reload())["displaced"] == ["late"]
        assert {m["name"]: m["origin"] for m in await c.models()}["late"] == "config"


async def test_bad_config_models_show_their_error_from_the_start(start_daemon, ckpts, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    d = start_daemon(models={"a": ckpts["a"], "gone": tmp_path / "gone.safetensors", "junk": junk})
    async with Client(d.socket) as c:

        async def errors() -> dict[str, str]:
            return {m["name"]: (m["last_error"] or {}).get("message", "") for m in await c.models()}

        await eventually(lambda: _both(errors))
        got = await errors()
        assert got["a"] == "" and "gone.safetensors" in got["gone"] and got["junk"].startswith("junk: ")
        assert {m["name"]: m["state"] for m in await c.models()}["gone"] == "error"  # its files failed the check
        line = next(x for x in d.log_text().splitlines() if "model gone cannot be loaded" in x)
        assert "gone.safetensors" in line and "then run `weightcache reload`" in line, line  # says what to do
        # a reload that adds a bad model registers it, shows why, and fails
        d.config.write_text(d.config.read_text() + f'[[models]]\nname = "new"\npath = "{tmp_path}/new.safetensors"\n')
        report = await c.reload()
        assert report["added"] == ["new"] and report["failed"][0].startswith("new: ")
        assert "new.safetensors" in (await errors())["new"]
        # the file appears: the next reload's check clears the error; one that vanishes shows
        (tmp_path / "new.safetensors").write_bytes(ckpts["tiny"].read_bytes())
        ckpts_a = d.config.read_text()
        d.config.write_text(ckpts_a.replace(str(ckpts["a"]), str(tmp_path / "a2.safetensors")))
        (tmp_path / "a2.safetensors").write_bytes(ckpts["a"].read_bytes())
        assert (await c.reload())["changed"] == ["a"]
        (tmp_path / "a2.safetensors").unlink()
        assert not (await c.reload())["failed"]
        got = await errors()
        assert got["new"] == "" and "a2.safetensors" in got["a"]


async def test_a_load_failing_on_the_files_before_the_check_still_shows_error(start_daemon, ckpts, tmp_path):
    """The check's verdict decides the state, whichever error came first: a load (or a
    preload racing the start-up check) that failed on the same files first kept its own
    error in last_error, and the model showed "registered" after the check failed too."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(ckpts["tiny"].read_bytes())
    d = start_daemon(models={"m": path})
    async with Client(d.socket) as c:
        await eventually(lambda: _state(c, "m", "registered"))
        path.write_bytes(b"\x80\x04pickle, not safetensors" * 8)
        with pytest.raises(WeightcacheError):
            await c.load("m")
        report = await c.reload()  # unchanged config: the models' files are checked again
        assert not report["failed"]
        entry = {m["name"]: m for m in await c.models()}["m"]
        assert entry["state"] == "error" and "pickle" in entry["last_error"]["message"], entry
        path.write_bytes(ckpts["tiny"].read_bytes())  # fixed: the next check clears it
        await c.reload()
        assert {m["name"]: m["state"] for m in await c.models()}["m"] == "registered"


async def _state(c, name: str, state: str) -> bool:
    return {m["name"]: m["state"] for m in await c.models()}[name] == state


async def _both(errors) -> bool:
    got = await errors()
    return bool(got["gone"] and got["junk"])


async def test_max_loaded_models_changes_in_place_at_reload(start_daemon, ckpts, capsys):
    """daemon.max_loaded_models at reload: lowered, it evicts unattached models in LRU order
    down to the count; a count the attached models exceed is not applied, is reported
    under failed, and `weightcache reload` exits 1; removed, it lifts the limit."""
    d = start_daemon(budget="20MiB", models={k: ckpts[k] for k in ("tiny", "a", "b")},
                     extra_daemon={"max_loaded_models": {"cpu": 3}})
    three = d.config.read_text()
    async with Client(d.socket) as c:
        for name in ("tiny", "a", "b"):
            await c.load(name)
        async with c.attach("a"), c.attach("b"):
            d.config.write_text(three.replace("max_loaded_models = {cpu = 3}", "max_loaded_models = {cpu = 1}"))
            report = await c.reload()
            assert len(report["failed"]) == 1 and report["failed"][0].startswith("max_loaded_models.cpu: "), report
            assert "a" in report["failed"][0] and "b" in report["failed"][0]
            assert await states(c) == {"tiny": "resident", "a": "resident", "b": "resident"}  # nothing evicted
            capsys.readouterr()
            assert await asyncio.to_thread(main, ["--socket", d.socket, "reload"]) == 1  # main runs its own loop
            assert "failed: max_loaded_models.cpu: " in capsys.readouterr().out
        # detached: 2 applies, the least recently used (tiny) goes
        d.config.write_text(three.replace("max_loaded_models = {cpu = 3}", "max_loaded_models = {cpu = 2}"))
        report = await c.reload()
        assert not report["failed"] and report["max_loaded_models"] == [{"device": "cpu", "limit": 2, "previous": 3}], report
        assert await states(c) == {"tiny": "evicted", "a": "resident", "b": "resident"}
        await c.load("tiny")  # the count holds: a third load evicts (b, detached before a, is the LRU)
        assert await states(c) == {"tiny": "resident", "a": "resident", "b": "evicted"}
        # the key removed: no count any more
        d.config.write_text(three.replace("max_loaded_models = {cpu = 3}\n", ""))
        assert (await c.reload())["max_loaded_models"] == [{"device": "cpu", "limit": None, "previous": 2}]
        await c.load("b")
        assert await states(c) == {"tiny": "resident", "a": "resident", "b": "resident"}
