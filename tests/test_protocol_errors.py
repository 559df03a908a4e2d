"""Bad input gets its error and leaves the daemon serving everyone else (a real daemon
process, CPU backend): garbage and oversized frames, unknown ops, malformed requests,
hello mistakes, error codes mapped to exception classes, corrupt and missing checkpoints."""

from pathlib import Path

import pytest
from conftest import eventually

from weightcache import Client
from weightcache.errors import CorruptCheckpoint, DaemonUnavailable, LoadFailed, ProtocolVersionError, UnknownModel, UnknownOp


async def test_bad_inputs_get_errors_and_others_keep_being_served(start_daemon, ckpts):
    d = start_daemon(models={"tiny": ckpts["tiny"]}, extra_daemon={"max_frame_bytes": "64KiB"})
    bystander = d.raw()
    # unknown op, bad args, missing id, garbage msgpack: each answered, connection kept
    r = d.raw()
    assert r.call({"id": 1, "op": "explode"})["error"]["code"] == "UNKNOWN_OP"
    assert r.call({"id": 2, "op": "load"})["error"]["code"] == "BAD_REQUEST"
    assert r.call({"id": 3, "op": "load", "name": 7})["error"]["message"].startswith("argument 'name' must be str")
    assert r.call({"op": "status"}) == {"id": None, "ok": False, "error": {"code": "BAD_REQUEST", "message": "request needs an integer 'id'"}}
    r.send(b"\x00\x00\x00\x03\xc1\xc1\xc1")
    assert r.recv()["error"]["code"] == "BAD_REQUEST"
    assert r.call({"id": 4, "op": "status"})["ok"]
    # an oversized frame: answered, then that connection alone is closed
    r.send((10**6).to_bytes(4, "big") + b"x" * 100)
    reply = r.recv()
    assert reply["error"]["code"] == "FRAME_TOO_LARGE"
    assert r.recv() is None
    # raw garbage that happens to announce a huge frame
    g = d.raw(hello=False)
    g.send(b"GET / HTTP/1.1\r\n\r\n")
    assert g.recv()["error"]["code"] == "FRAME_TOO_LARGE"
    # a connection that skips hello, and one with the wrong version
    n = d.raw(hello=False)
    assert n.call({"id": 1, "op": "status"})["error"]["message"].startswith("the first request")
    assert n.call({"id": 2, "op": "hello", "protocol": 99})["error"]["code"] == "PROTOCOL_VERSION"
    # the bystander never noticed
    assert bystander.call({"id": 9, "op": "attach", "name": "tiny"})["ok"]
    assert bystander.call({"id": 10, "op": "status"})["ok"]


async def test_client_maps_error_codes_to_classes(start_daemon):
    d = start_daemon()
    async with Client(d.socket) as c:
        with pytest.raises(UnknownOp):
            await c.request("explode")
        with pytest.raises(UnknownModel):
            await c.load("nope")
    with pytest.raises(DaemonUnavailable, match="not connected"):
        await Client(d.socket).status()
    with pytest.raises(DaemonUnavailable, match="cannot connect"):
        await Client("/tmp/definitely-not-a-weightcache.sock", wait_for_daemon=0).connect()


async def test_hello_version_mismatch_is_an_exception(start_daemon, monkeypatch):
    d = start_daemon()
    monkeypatch.setattr("weightcache.client.core.PROTOCOL_VERSION", 2)
    with pytest.raises(ProtocolVersionError):
        await Client(d.socket).connect()


async def test_corrupt_and_missing_checkpoints_leave_the_daemon_serving(start_daemon, ckpts, tmp_path):
    bad = tmp_path / "bad.safetensors"
    good_bytes = Path(ckpts["b"]).read_bytes()
    bad.write_bytes(good_bytes[: len(good_bytes) // 2])  # truncated mid-data
    d = start_daemon(models={"a": ckpts["a"], "bad": bad, "gone": tmp_path / "gone.safetensors"})
    async with Client(d.socket) as c:
        before = (await c.status())["devices"]
        with pytest.raises(CorruptCheckpoint) as info:
            await c.load("bad")
        assert info.value.details["file"] == str(bad) and "truncated" in info.value.message
        with pytest.raises(LoadFailed, match="does not exist"):
            await c.load("gone")
        assert (await c.status())["devices"] == before  # budget exactly as before
        models = {m["name"]: m for m in await c.models()}
        assert models["bad"]["last_error"]["code"] == "CORRUPT_CHECKPOINT"
        # The start-up check (in the background) finds the truncation too: state "error",
        # and the load's own, more detailed, error stays in last_error.

        async def bad_shows_error() -> bool:
            return {m["name"]: m["state"] for m in await c.models()}["bad"] == "error"

        await eventually(bad_shows_error)
        async with c.attach("a") as m:
            assert len(m) == 40


def test_no_space_fits_ever_is_a_typed_attribute_that_crosses_the_wire():
    from weightcache.errors import NoSpace, error_from_wire

    back = error_from_wire(NoSpace("full", fits_ever=True, model="m").to_wire())
    assert isinstance(back, NoSpace) and back.fits_ever is True and back.details == {"model": "m", "fits_ever": True}
    unknown = NoSpace("full")  # not said: waiting is not known to help
    assert unknown.fits_ever is False and "fits_ever" not in unknown.details
