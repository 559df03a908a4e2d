"""An attach reply's tensor table as columns (``"table": "columns"``, docs/protocol.md):
the same rows as the row table, from files and from published tables, read back by the
client (protocol/arena.py's ``column_rows``), and refused when it does not hold together."""

import struct

import msgpack
import pytest
import torch
from safetensors.torch import save_file

from weightcache.errors import BadRequest
from weightcache.loader import open_checkpoint
from weightcache.loader.published import published_checkpoint
from weightcache.loader.tensor_table import wire_columns
from weightcache.protocol import pymsgpack
from weightcache.protocol.arena import column_rows

LIMIT = 1 << 30


def rows_of(ckpt):
    return [tuple(r) for r in msgpack.unpackb(ckpt.encoded_tables()[0])]


def columns_of(ckpt):
    return list(column_rows(pymsgpack.unpackb(ckpt.encoded_tables()[1], max_map_len=LIMIT, max_array_len=LIMIT,
                                              max_str_len=LIMIT, max_bin_len=LIMIT)))


def test_columns_hold_the_rows_of_a_file_checkpoint(tmp_path):
    tensors = {"embed.wéight": torch.zeros(3, 4, dtype=torch.bfloat16), "scalar": torch.tensor(2.0),
               "empty": torch.zeros(0, 5, dtype=torch.int8), "模型.bias": torch.ones(7, dtype=torch.float64),
               "flags": torch.ones(2, 2, 2, dtype=torch.bool)}
    save_file(tensors, tmp_path / "m.safetensors")
    ckpt = open_checkpoint(tmp_path / "m.safetensors")
    assert len(rows_of(ckpt)) == 5
    assert columns_of(ckpt) == [(n, d, s, o, b) for n, d, s, o, b in rows_of(ckpt)]


def test_columns_hold_the_rows_of_a_published_table():
    table = [["b", "F16", [2, 3], 0, 12], ["a", "U8", [], 256, 1], ["z", "I64", [1, 1, 1, 2], 512, 16]]
    ckpt = published_checkpoint("m", table, 1024, "fp")
    assert columns_of(ckpt) == rows_of(ckpt) == [tuple(r) for r in sorted(table, key=lambda r: r[3])]
    assert list(column_rows(msgpack.unpackb(wire_columns(())))) == []


def good_columns():
    return msgpack.unpackb(wire_columns(published_checkpoint("m", [["w", "F32", [2, 2], 0, 16], ["v", "U8", [3], 256, 3]],
                                                                512, "fp").tensors))


@pytest.mark.parametrize("change, reason", [
    (lambda c: c.pop("dims"), "needs byte strings"),
    (lambda c: c.update(count="2"), "needs 'count'"),
    (lambda c: c.update(offsets=c["offsets"][:8]), "'offsets' holds 8 bytes, not 2"),
    (lambda c: c.update(dims=c["dims"] + b"\0"), "'dims' holds 25 bytes"),
    (lambda c: c.update(dtypes=b"\x63\x00"), "do not end where"),
    (lambda c: c.update(names=c["names"] + b"x"), "do not end where"),
    (lambda c: c.update(dtype_names=[1]), "'dtype_names'"),
    (lambda c: c.update(dims=struct.pack("<3Q", 2, 2**63, 3)), "above 2\\*\\*62"),
    (lambda c: c.update(count=0, dtypes=b"", **{k: b"" for k in ("name_ends", "shape_ends", "offsets", "nbytes")}),
     "do not end where"),  # no tensors, yet names and dims
])
def test_columns_that_do_not_hold_together_are_refused_before_any_row(change, reason):
    assert [r[0] for r in column_rows(good_columns())] == ["w", "v"]
    cols = good_columns()
    change(cols)
    with pytest.raises(BadRequest, match=reason):
        column_rows(cols)


def test_the_daemon_serves_either_table_and_refuses_any_other(start_daemon, ckpts):
    d = start_daemon(models={"a": ckpts["a"]})
    conn = d.raw()
    rows = conn.call({"id": 1, "op": "attach", "name": "a"})
    cols = conn.call({"id": 2, "op": "attach", "name": "a", "table": "columns"})
    assert rows["ok"] and cols["ok"] and len(rows["tensors"]) == 40
    assert list(column_rows(cols["tensors"])) == [tuple(r) for r in rows["tensors"]]
    bad = conn.call({"id": 3, "op": "attach", "name": "a", "table": "csv"})
    assert bad["error"]["code"] == "BAD_REQUEST" and "'table'" in bad["error"]["message"]
    assert conn.call({"id": 4, "op": "status"})["leases"] == 2  # the refused attach took none; still serving


def test_a_name_that_is_not_utf8_is_refused_when_its_row_is_taken():
    cols = good_columns()
    cols["names"] = b"\xff" + cols["names"][1:]
    rows = column_rows(cols)
    with pytest.raises(BadRequest, match="not UTF-8"):
        next(rows)


def test_published_names_are_charged_by_their_utf8_bytes():
    # A bound under what both tables hold would charge the owner's quota less than the
    # daemon keeps: names of 4-byte characters take 4 bytes a character in either table.
    table = [[f"{i}" + "\U0001F600" * 1000, "U8", [1], 256 * i, 1] for i in range(50)]
    ckpt = published_checkpoint("m", table, 256 * 50, "fp")
    rows, columns = ckpt.encoded_tables()
    assert ckpt.held_bytes >= len(rows) + len(columns)
