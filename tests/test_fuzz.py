"""Protocol fuzzing: random requests, garbage payloads and byte-mutated valid frames
against one live daemon. Every reply must be well formed, the daemon must stay
up and keep its books straight, and it must log no traceback (conftest)."""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.errors import ERRORS_BY_CODE
from weightcache.protocol import OPS, encode_frame
from weightcache.protocol.framing import HEADER

KNOWN_CODES = set(ERRORS_BY_CODE)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30), st.binary(max_size=30))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                      max_leaves=8)
names = st.sampled_from(["tiny", "nope", "", "tiny@0", "x" * 300]) | st.text(max_size=12)
paths = st.sampled_from(["/nonexistent", "/etc/hostname", "/tmp", "/dev/null"])
requests = st.fixed_dictionaries(
    {"id": st.integers(-(2**63), 2**63 - 1) | st.none() | st.text(max_size=3),
     "op": st.sampled_from(sorted(OPS - {"hello"})) | st.text(max_size=10) | values},
    optional={"name": names | values, "lease": st.integers(-5, 2**40) | values, "wait_s": st.floats(-1, 0.2) | values,
              "device": st.sampled_from(["cpu", "cuda:0", "cuda:GPU-00"]) | values, "rank": st.integers(-2, 3) | values,
              "writable": st.booleans() | values, "path": paths | values, "junk": values},
)


def frames_from(data: st.DataObject, valid: bytes) -> bytes:
    kind = data.draw(st.sampled_from(["request", "garbage", "mutated"]))
    if kind == "request":
        return encode_frame(data.draw(requests))
    if kind == "garbage":
        payload = data.draw(st.binary(max_size=200))
        return HEADER.pack(len(payload)) + payload
    buf = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(HEADER.size, len(buf) - 1))  # mutate the payload, keep the framing in step
        buf[i] = data.draw(st.integers(0, 255))
    return bytes(buf)


def test_fuzzed_frames_get_well_formed_replies(start_daemon, ckpts):
    d = start_daemon(budget="20MiB", models={"tiny": ckpts["tiny"]}, extra_daemon={"request_timeout_s": 5})
    valid = encode_frame({"id": 7, "op": "attach", "name": "tiny", "wait_s": 0})
    stats = {"frames": 0, "errors": 0}

    @settings(max_examples=int(os.environ.get("WC_FUZZ_EXAMPLES", "300")), deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data())
    def one_connection(data):
        c = d.raw()
        sent = data.draw(st.integers(1, 4))
        for _ in range(sent):
            c.send(frames_from(data, valid))
        c.send(encode_frame({"id": 424242, "op": "status"}))
        seen_status = False
        while not seen_status:
            reply = c.recv()
            assert reply is not None, "the daemon closed a connection whose framing was intact"
            assert isinstance(reply, dict) and "id" in reply
            if "event" in reply:
                continue
            assert isinstance(reply.get("ok"), bool)
            if not reply["ok"]:
                assert reply["error"]["code"] in KNOWN_CODES and isinstance(reply["error"]["message"], str)
                stats["errors"] += 1
            seen_status = reply["id"] == 424242 and reply["ok"]
        stats["frames"] += sent
        c.close()

    one_connection()
    # Afterwards: every fuzzing connection is closed, so no lease survives and the books add up.
    import time

    check = d.raw()
    for _ in range(100):
        status = check.call({"id": 1, "op": "status"})
        if status["leases"] == 0:
            break
        time.sleep(0.05)
    assert status["leases"] == 0
    models = check.call({"id": 2, "op": "models"})["models"]
    dev = status["devices"]["cpu"]
    assert dev["used"] == sum(m["nbytes"] for m in models if m["state"] == "resident" and m["device"] == "cpu")
    assert dev["reserved"] == 0 and dev["used"] <= dev["budget"]
    print(f"fuzz: {stats}")
    assert stats["frames"] > 0 and stats["errors"] > 0
