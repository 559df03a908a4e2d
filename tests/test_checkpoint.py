"""Our safetensors header parser against the reference library, and every malformation."""

import gc
import itertools
import json
import math
import os
import random
import struct
import time
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import load_file, save_file

from weightcache.errors import BadRequest, CorruptCheckpoint, LoadFailed
from weightcache.loader import ARENA_ALIGN, TensorInfo, open_checkpoint
from weightcache.loader.published import _checked_table, _fast_table, published_checkpoint
from weightcache.loader.reader import copy_ranges
from weightcache.loader.tensor_table import DTYPE_SIZES


def raw_file(path: Path, header: dict, data: bytes = b"", header_len: int | None = None) -> Path:
    h = json.dumps(header).encode()
    n = len(h) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + h + data)
    return path


def test_layout_matches_the_reference_library(ckpts):
    ckpt = open_checkpoint(ckpts["a"])
    ref = load_file(ckpts["a"])
    assert {t.name for t in ckpt.tensors} == set(ref)
    for t in ckpt.tensors:
        assert t.arena_offset % ARENA_ALIGN == 0
        assert t.nbytes == ref[t.name].numel() * ref[t.name].element_size()
        assert list(t.shape) == list(ref[t.name].shape)
    ends = sorted((t.arena_offset, t.arena_offset + t.nbytes) for t in ckpt.tensors)
    assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(ends)), "arena ranges overlap"


def test_sharded_index_loads_every_file(ckpts):
    ckpt = open_checkpoint(ckpts["sharded"])
    assert len(ckpt.files) == 3 and len(ckpt.tensors) == 30
    # a directory resolves through the same index
    assert open_checkpoint(ckpts["sharded"].parent).layout == ckpt.layout


def test_copy_ranges_cover_every_tensor_once(ckpts):
    ckpt = open_checkpoint(ckpts["sharded"])
    ranges = copy_ranges(ckpt, chunk=100_000)
    assert all(r.nbytes <= 100_000 for r in ranges)
    assert sum(r.nbytes for r in ranges) == ckpt.data_bytes


def test_layout_changes_with_the_header_and_the_fingerprint_waits_for_the_bytes(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, str(p))
    ckpt = open_checkpoint(p)
    assert ckpt.fingerprint == ""  # covers the bytes: known once they are read (test_fingerprint.py)
    save_file({"w": torch.zeros(5)}, str(p))
    assert open_checkpoint(p).layout != ckpt.layout


def test_unchanged_on_disk_notices_rewrites(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, str(p))
    ckpt = open_checkpoint(p)
    assert ckpt.unchanged_on_disk()
    os.utime(p, ns=(0, 0))
    assert not ckpt.unchanged_on_disk()


GOOD = {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize(
    ("header", "data", "header_len", "reason"),
    [
        (GOOD, b"\0" * 4, None, "run past the data"),
        (GOOD, b"\0" * 8, 10**9, "exceeds"),
        (GOOD, b"", 500, "runs past the end"),
        ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unsupported dtype"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "needs 12"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "non-negative"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, None, "not ordered"),
        ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "exactly dtype"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, None, "overlap"),
        ({"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
        ([1, 2], b"", None, "not a JSON object"),
    ],
    ids=["truncated-data", "huge-header", "header-past-eof", "dtype", "shape-vs-bytes", "negative-dim", "reversed",
         "missing-field", "overlap", "metadata", "not-object"],
)
def test_malformed_headers_are_corrupt_checkpoints(tmp_path, header, data, header_len, reason):
    p = raw_file(tmp_path / "bad.safetensors", header, data, header_len)
    with pytest.raises(CorruptCheckpoint) as info:
        open_checkpoint(p)
    assert reason in info.value.message
    assert info.value.details["file"] == str(p)


def test_non_json_and_tiny_files(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b'{"\xff":')
    with pytest.raises(CorruptCheckpoint, match="not UTF-8 JSON"):
        open_checkpoint(p)
    p.write_bytes(struct.pack("<Q", 6) + b'{"w":[')
    with pytest.raises(CorruptCheckpoint, match="not UTF-8 JSON: Expecting value at char 6"):
        open_checkpoint(p)
    p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")  # no JSON object at all
    with pytest.raises(CorruptCheckpoint, match="not a safetensors file"):
        open_checkpoint(p)
    p.write_bytes(b"abc")
    with pytest.raises(CorruptCheckpoint, match="too short"):
        open_checkpoint(p)


def test_missing_paths_are_load_failures(tmp_path):
    with pytest.raises(LoadFailed, match="does not exist"):
        open_checkpoint(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadFailed, match=r"no \.safetensors"):
        open_checkpoint(tmp_path / "empty")


def test_index_problems(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "missing.safetensors"}}))
    with pytest.raises(LoadFailed, match=r"missing\.safetensors"):
        open_checkpoint(idx)
    idx.write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    with pytest.raises(CorruptCheckpoint, match="outside its directory"):
        open_checkpoint(idx)
    idx.write_text("{not json")
    with pytest.raises(CorruptCheckpoint, match="invalid index"):
        open_checkpoint(idx)


def test_duplicate_tensor_across_shards(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CorruptCheckpoint, match="also appears"):
        open_checkpoint(tmp_path)


# -- published tables ------------------------------------------------------------------------


def table_of(n: int, seed: int = 0, ties: bool = False) -> tuple[list, int]:
    """A valid table of ``n`` rows, rows shuffled, some zero-size, with gaps; and its arena
    size. With ``ties``, empty tensors may share their offset with the next tensor."""
    rng = random.Random(seed)
    rows, off = [], 0
    for i in range(n):
        dtype = rng.choice(sorted(DTYPE_SIZES))
        shape = [rng.randrange(0 if i % 7 == 0 else 1, 5) for _ in range(rng.randrange(0, 4))]
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        rows.append([f"t{i}", dtype, shape, off, nbytes])
        gap = rng.randrange(0, 2) if ties or nbytes else 1
        off += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN + ARENA_ALIGN * gap
    rng.shuffle(rows)
    return rows, off + ARENA_ALIGN


def publish(table, arena=4096):
    return published_checkpoint("m", table, arena, "fp")


def test_published_table_fast_path_agrees_with_the_row_by_row_check():
    for seed in range(20):
        table, arena = table_of(300, seed, ties=True)  # the fast path declines some of these
        slow = _checked_table(table, arena, lambda r: BadRequest(r))
        assert publish(table, arena).tensors == slow
        fast = _fast_table(table, arena)
        assert fast is None or fast == slow
        table, arena = table_of(300, seed)
        fast = _fast_table(table, arena)
        slow = _checked_table(table, arena, lambda r: BadRequest(r))
        assert fast is not None and fast == slow
        assert all(type(t) is TensorInfo for t in fast)
        assert [t.arena_offset for t in fast] == sorted(t.arena_offset for t in fast)
        ckpt = publish(table, arena)
        assert ckpt.tensors == fast
        assert msgpack.unpackb(ckpt.encoded_tables()[0]) == [[t.name, t.dtype, list(t.shape), t.arena_offset, t.nbytes] for t in fast]


GOOD_ROW = ["w", "F32", [4], 0, 16]


@pytest.mark.parametrize(("row", "reason"), [
    (["w", ["F32"], [4], 0, 16], "unsupported dtype ['F32']"),  # was TypeError: unhashable
    (["w", {"a": 1}, [4], 0, 16], "unsupported dtype"),
    (["w", "Q4", [4], 0, 16], "unsupported dtype 'Q4'"),
    ([7, "F32", [4], 0, 16], "tensor name 7 is not a string"),
    (["x" * 1025, "F32", [4], 0, 16], "at most 1024 characters"),
    (["w", "F32", [True, 4], 0, 16], "shape must be"),
    (["w", "F32", [4.0], 0, 16], "shape must be"),
    (["w", "F32", [-4, -1], 0, 16], "shape must be"),
    (["w", "U8", [2**62 + 1, 0], 0, 0], "shape must be"),
    (["w", "U8", [2**64], 0, 2**64], "shape must be"),
    (["w", "U8", [2**40, 2**40, 0], 0, 0], "shape must be"),  # fine: product 0, dims bounded -> accepted below
    (["w", "F32", [4], True, 16], "offset and nbytes must be integers"),
    (["w", "F32", [4], 0, 16.0], "offset and nbytes must be integers"),
    (["w", "F32", [4], -256, 16], "offset and nbytes must be integers in [0, 2**62]"),
    (["w", "F32", [4], 2**63, 16], "offset and nbytes must be integers in [0, 2**62]"),
    (["w", "F32", [5], 0, 16], "16 bytes for shape [5] of F32"),
    (["w", "F32", [2**31, 2**31], 0, 2**62], "bytes for shape"),
    (["w", "F32", [4], 8, 16], "aligned"),
    (["w", "F32", [2000], 0, 8000], "inside the 4096-byte arena"),
    (["w", "F32", [4], 0], "is not [name, dtype, shape, offset, nbytes]"),
    (("w", "F32", [4], 0, 16), "is not [name, dtype, shape, offset, nbytes]"),
])
def test_published_rows_are_checked_like_header_entries(row, reason):
    if reason == "shape must be" and row[2] == [2**40, 2**40, 0]:
        assert publish([row, ["g", "F32", [4], 256, 16]]).tensors[0].shape == (2**40, 2**40, 0)
        return
    many, many_arena = table_of(50)
    # alone, after a good row, and in the middle of a big table (whose arena is larger)
    for table, arena in (([row], 4096), ([["g", "F32", [4], 1024, 16], row], 4096), ([*many[:25], row, *many[25:]], many_arena)):
        if "arena" in reason and arena != 4096:
            continue
        with pytest.raises(BadRequest) as info:
            publish(table, arena)
        assert reason in info.value.message, (table[:2], info.value.message)


def test_published_tables_refuse_duplicates_overlaps_and_bad_arenas():
    with pytest.raises(BadRequest, match="'w' appears twice"):
        publish([GOOD_ROW, ["w", "F32", [4], 256, 16]])
    with pytest.raises(BadRequest, match="overlap"):
        publish([["a", "F32", [100], 0, 400], ["b", "F32", [4], 256, 16]])
    with pytest.raises(BadRequest, match="overlap"):
        publish([["b", "F32", [4], 256, 16], ["z", "F32", [0], 256, 0], ["a", "F32", [100], 0, 400]])
    for arena in (0, -1, True, 2**63, 4096.0, "4096"):
        with pytest.raises(BadRequest, match="arena nbytes"):
            publish([GOOD_ROW], arena)
    for table in ([], {}, "x", None):
        with pytest.raises(BadRequest, match="non-empty list"):
            publish(table)


def test_published_messages_stay_short():
    huge = ["x"] * 100_000
    for row in ([huge, "F32", [4], 0, 16], ["w", huge, [4], 0, 16], ["w", "F32", huge, 0, 16], huge):
        with pytest.raises(BadRequest) as info:
            publish([row])
        assert len(info.value.message) < 300


def test_long_shapes_are_checked_row_by_row_and_accepted():
    row = ["w", "F32", [1] * 20 + [4], 0, 16]  # more dimensions than the column check takes
    assert _fast_table([row], 4096) is None
    assert publish([row]).tensors[0].shape == (1,) * 20 + (4,)
    with pytest.raises(BadRequest, match="bytes for shape"):
        publish([["w", "U8", [2**62] * 100_000, 0, 16]])  # the product stops early instead of growing without end


def test_a_600k_row_table_validates_quickly():
    n = 600_000
    table = [[f"model.layers.{i // 10}.experts.{i % 10}.w", "BF16", [16, 8], i * 256, 256] for i in range(n)]
    table.reverse()
    t0 = time.perf_counter()
    ckpt = publish(table, n * 256)
    elapsed = time.perf_counter() - t0
    assert len(ckpt.tensors) == n and ckpt.tensors[0].arena_offset == 0 and ckpt.arena_bytes == n * 256
    assert gc.isenabled()
    assert elapsed < 10, elapsed  # 0.8 s on the 2-core VM; the row-by-row loop took 2.2 s
