"""Checkpoint rows in columns (loader/tensor_table.py) and big headers parsed in a worker
process (loader/parse_worker.py): the same checkpoint either way, the same errors, and a
worker that fails or lies is refused."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import msgpack
import pytest

from weightcache.errors import CorruptCheckpoint, LoadFailed
from weightcache.loader import TensorInfo, open_source, parse_checkpoint, parse_worker
from weightcache.loader.tensor_table import TensorTable, wire_table
from weightcache.tools.synth import write_checkpoint


def raw_file(path: Path, header: dict) -> Path:
    raw = json.dumps(header).encode()
    data_len = max((e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"), default=0)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data_len))
    return path


def many(n: int) -> dict:
    h = {f"layer.{i}.w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [12 * i, 12 * i + 12]} for i in range(n)}
    h["empty"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    h["__metadata__"] = {"format": "pt"}
    return h


def parse(path: Path, apart: bool, monkeypatch) -> object:
    monkeypatch.setattr(parse_worker, "PARSE_APART_BYTES", 0 if apart else 1 << 40)
    with open_source(path) as opened:
        return parse_checkpoint(opened)


def test_a_table_of_columns_reads_back_the_rows_it_was_made_of() -> None:
    rows = [TensorInfo("a", "F32", (2, 3), 0, 100, 24, 0), TensorInfo("bé", "BF16", (), 1, 8, 2, 256),
            TensorInfo("c", "BOOL", (0, 7), 0, 124, 0, 512)]
    table = TensorTable.of(rows)
    assert list(table) == rows and len(table) == 3
    assert table[0] == rows[0] and table[-1] == rows[-1] and table[1:] == rows[1:]
    assert table == rows and table == TensorTable.from_wire(table.to_wire())
    assert table.data_bytes == 26
    assert msgpack.unpackb(wire_table(table)) == [[t.name, t.dtype, list(t.shape), t.arena_offset, t.nbytes] for t in rows]
    with pytest.raises(IndexError):
        table[3]


@pytest.mark.parametrize("mutate", [
    lambda w: w[:8],  # a column missing
    lambda w: [w[0], w[1], w[2] + b"\x00", *w[3:]],  # one dtype more than rows
    lambda w: [w[0], w[1], b"\x63" * len(w[2]), *w[3:]],  # an unknown dtype code
    lambda w: [*w[:5], w[5][:-3], *w[6:]],  # a column not of whole integers
    lambda w: [w[0] + b"x", *w[1:]],  # names longer than their ends say
    lambda w: [*w[:4], "dims", *w[5:]],  # not bytes
    lambda w: [*w[:9], w[9][:8] * 2, *w[10:]],  # the name order holds one row twice
    lambda w: [*w[:9], (2).to_bytes(8, "little") + w[9][8:], *w[10:]],  # ... or a row that is not there
    lambda w: [*w[:10], w[10] + b"x", w[11]],  # tails longer than their ends say
])
def test_columns_that_do_not_make_a_table_are_refused(mutate) -> None:
    wire = [bytes(p) for p in TensorTable.of([TensorInfo("a", "F32", (2,), 0, 8, 8, 0),
                                              TensorInfo("b", "F32", (2,), 0, 16, 8, 256)]).to_wire()]
    with pytest.raises(ValueError):
        TensorTable.from_wire(mutate(wire))


def test_a_header_parsed_in_the_worker_is_the_checkpoint_parsed_here(tmp_path, monkeypatch) -> None:
    for path in (raw_file(tmp_path / "m.safetensors", many(300)),
                 write_checkpoint(tmp_path / "sharded", 3 << 20, 12, shards=3)):
        here, apart = parse(path, False, monkeypatch), parse(path, True, monkeypatch)
        assert here.table is None and apart.table is not None  # the worker encoded the table too
        assert list(apart.tensors) == list(here.tensors) and apart.tensors == here.tensors
        assert (apart.arena_bytes, apart.layout, apart.files) == (here.arena_bytes, here.layout, here.files)
        assert apart.encoded_tables() == here.encoded_tables()
        assert apart.data_bytes == here.data_bytes > 0
        assert apart.held_bytes >= apart.tensors.buffer_bytes + len(apart.table)


@pytest.mark.parametrize(("header", "reason"), [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
     "overlap"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, "unsupported dtype 'Q4'"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "needs 12"),
])
def test_a_malformed_header_fails_the_same_way_in_the_worker(tmp_path, monkeypatch, header, reason) -> None:
    path = raw_file(tmp_path / "bad.safetensors", header)
    errors = []
    for apart in (False, True):
        with pytest.raises(CorruptCheckpoint) as exc:
            parse(path, apart, monkeypatch)
        errors.append((exc.value.message, exc.value.details))
    assert errors[0] == errors[1] and reason in errors[0][0]
    assert errors[0][1]["file"] == str(path)


PYTHON = sys.executable


# parse_worker's reply framing: meta's length, meta, the parts padded to 8 bytes, the table
REPLY = """def reply(meta, parts=(), table=b""):
    meta = msgpack.packb({**meta, "parts": [len(p) for p in parts], "table": len(table)})
    out = sys.stdout.buffer
    out.write(len(meta).to_bytes(8, "little") + meta)
    for p in parts:
        out.write(bytes(p) + bytes(-len(p) % 8))
    out.write(table)
"""


def fake_worker(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!{PYTHON}\nimport sys, msgpack\nsys.stdin.buffer.read()\n{REPLY}\n{body}\n")
    os.chmod(script, 0o755)
    return str(script)


def test_a_worker_that_fails_or_lies_fails_the_parse_with_a_reason(tmp_path, monkeypatch) -> None:
    path = raw_file(tmp_path / "m.safetensors", many(20))
    rows = TensorTable.of([TensorInfo("a", "F32", (2,), 0, 8, 8, 1 << 40)])  # far past the arena it claims
    outside = [bytes(p) for p in rows.to_wire()]
    cases = {
        "sys.exit('boom')": "the header parse worker failed: boom",
        "sys.stdout.buffer.write(b'\\xc1not msgpack')": "reply is malformed",
        "reply({'arena_bytes': 1, 'layout': 'x'}, [b''] * 3)": "reply is malformed",
        "m = msgpack.packb({'parts': [], 'table': 10}); sys.stdout.buffer.write(len(m).to_bytes(8, 'little') + m + b'12345')":
            "reply is malformed (truncated)",
        "sys.stdout.buffer.write((10).to_bytes(8, 'little') + msgpack.packb({'parts': [1 << 40], 'table': 0}))": "reply is malformed",
        f"reply({{'arena_bytes': 4096, 'layout': 'x'}}, {outside!r})": "places a tensor outside its file or arena",
    }
    for body, message in cases.items():
        monkeypatch.setattr(sys, "executable", fake_worker(tmp_path, body))
        with pytest.raises(LoadFailed) as exc:
            parse(path, True, monkeypatch)
        assert message in exc.value.message and exc.value.details["reason"] == "parse worker", (body, exc.value.message)


def test_a_parsed_checkpoint_leaves_nothing_per_tensor_for_the_collector(tmp_path, monkeypatch) -> None:
    """A NamedTuple row stays tracked by the cyclic collector for the model's life, and every
    full collection walked 100k of them per such model, holding the lock against the event
    loop; columns are a handful of objects whatever the count."""
    path = raw_file(tmp_path / "m.safetensors", many(20_000))
    for apart in (False, True):
        gc.collect()
        before = len(gc.get_objects())
        ckpt = parse(path, apart, monkeypatch)
        gc.collect()
        assert len(gc.get_objects()) - before < 200, apart
        assert len(ckpt.tensors) == 20_001
