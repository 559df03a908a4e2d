"""Our safetensors header parser against the reference library, and every malformation."""

import itertools
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightcache.errors import CorruptCheckpoint, LoadFailed
from weightcache.loader import ARENA_ALIGN, open_checkpoint
from weightcache.loader.reader import copy_ranges


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
    assert open_checkpoint(ckpts["sharded"].parent).fingerprint == ckpt.fingerprint


def test_copy_ranges_cover_every_tensor_once(ckpts):
    ckpt = open_checkpoint(ckpts["sharded"])
    ranges = copy_ranges(ckpt, chunk=100_000)
    assert all(r.nbytes <= 100_000 for r in ranges)
    assert sum(r.nbytes for r in ranges) == ckpt.data_bytes


def test_fingerprint_changes_with_the_file(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, str(p))
    fp = open_checkpoint(p).fingerprint
    save_file({"w": torch.zeros(5)}, str(p))
    assert open_checkpoint(p).fingerprint != fp


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
    p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}")
    with pytest.raises(CorruptCheckpoint, match="not UTF-8 JSON"):
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
