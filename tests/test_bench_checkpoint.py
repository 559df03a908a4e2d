"""``weightcache bench --checkpoint PATH`` on the files users have: one file
written by safetensors' ``save_file``, and a sharded directory as transformers'
``save_pretrained`` writes it (shards and their index json; written by transformers where
it is installed, else by ``save_file`` and an index json of the same shape). Every row
runs on the CPU backend, tiny; the rows the operator asked for (ready to compute, the
fresh process) must be present and sane, and a row that cannot run says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from weightcache.cli import main
from weightcache.tools.bench import user_checkpoint
from weightcache.tools.bench_measure import INSTANTTENSOR_BACKENDS, checkpoint_bytes, checkpoint_paths

# Every row, as few times as each allows; the control plane's model is 2 MiB.
SMALL = ("--device", "cpu", "--attaches", "3", "--reps", "1", "--restarts", "1", "--fresh", "1", "--big-gib", str(2 / 1024))


def some_tensors(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(64, 16 + i, generator=g).to(torch.bfloat16) for i in range(n)}


def pretrained_dir(path: Path) -> tuple[Path, int]:
    """A save_pretrained directory of several shards, and its tensor count."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                         eos_token_id=0)
        transformers.GPT2LMHeadModel(config).save_pretrained(path, max_shard_size="40KB")
        return path, len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    path.mkdir()
    shards = [some_tensors(6, seed=s) for s in (1, 2, 3)]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        shard = {f"s{i}.{k}": v for k, v in shard.items()}
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    total = sum(v.numel() * v.element_size() for s in shards for v in s.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return path, len(weight_map)


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the table's rows and title on one line each


def bench(capsys: pytest.CaptureFixture[str], tmp_path: Path, ckpt: Path, *extra: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "run.json"
    capsys.readouterr()
    rc = main(["bench", "--checkpoint", str(ckpt), *SMALL, "--workdir", str(tmp_path / "work"), "--out", str(out), *extra])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    return json.loads(out.read_text()), printed.out + printed.err


def check_rows(r: dict[str, Any], printed: str, ckpt: Path, tensors: int) -> None:
    files = checkpoint_paths(ckpt)
    nbytes = sum(f.stat().st_size for f in files)
    assert r["checkpoint"] == str(ckpt) and r["files"] == len(files) and r["tensors"] == tensors
    assert r["checkpoint_bytes"] == nbytes == r["content_hash"]["nbytes"]  # the files' bytes, not a directory's st_size
    assert r["load_file_warm_s"] > 0 and r["loader_warm_s"] > 0 and r["attach_p50_ms"] > 0
    ready = r["ready_to_compute"]  # attach + read every byte vs load_file + read every byte
    assert ready["attach_s"]["p50"] > 0 and ready["load_file_s"]["p50"] > 0 and ready["ratio_load_file_over_attach"] > 0
    # the daemon's copies plus the files' page cache, over the files' size: one copy, give or take pages
    assert 0.5 < ready["resident_over_file"] < 2.5
    assert ready["arena"] in ("file", "memfd")
    if ready["arena"] == "memfd":  # the page cache was refused: the output says why
        assert ready["arena_note"] and ready["arena_note"] in printed
    fresh = r["fresh_attach"]  # a fresh process: import the client -> usable tensors, beside load_file's
    assert fresh["n"] == 1 and fresh["import_to_tensors_ms"]["p50"] > 0 and fresh["load_file_ms"]["p50"] > 0
    assert fresh["first_attach_ms"]["p50"] > 0
    assert r["restart_checksums_equal"] is True  # engines that loaded the files and that attached saw the same bytes
    for b in INSTANTTENSOR_BACKENDS:  # a row that cannot run on the CPU says why
        assert r[f"instanttensor_{b}_error"].startswith("no CPU target") and f"InstantTensor {b}: skipped: no CPU target" in printed
    assert f"{tensors} tensors, {ckpt} ({len(files)} file" in printed
    assert "ready to compute: attach + read every byte" in printed and "fresh process: import the client" in printed


def test_bench_on_a_file_written_by_save_file(capsys, tmp_path):
    p = tmp_path / "m.safetensors"
    save_file(some_tensors(12, seed=0), str(p))
    assert p.stat().st_mode & 0o777 == 0o600  # as users' files are
    r, printed = bench(capsys, tmp_path, p, "--cold-reps", "0")
    check_rows(r, printed, p, 12)
    assert r["load_file_cold_s"] is None and "notes" not in r


def test_bench_on_a_sharded_save_pretrained_directory(capsys, tmp_path):
    d, tensors = pretrained_dir(tmp_path / "model")
    assert len(checkpoint_paths(d)) > 1 and (d / "model.safetensors.index.json").exists()
    r, printed = bench(capsys, tmp_path, d, "--cold-reps", "1")
    check_rows(r, printed, d, tensors)
    # cold: every shard's pages dropped before each run, or (a tmpfs, a mapping) the rows skipped with the reason
    if "notes" in r:
        assert "cold rows" in r["notes"][0] and r["notes"][0] in printed and r["loader_cold_s"] is None
    else:
        assert r["loader_cold_s"] > 0 and r["load_file_cold_s"] > 0


def test_a_checkpoint_path_is_taken_as_the_daemon_takes_it(tmp_path):
    """A file, a directory, its index json: the same files; anything else refused in one line."""
    d, tensors = pretrained_dir(tmp_path / "model")
    index = d / "model.safetensors.index.json"
    shards = checkpoint_paths(d)
    assert checkpoint_paths(index) == shards and checkpoint_paths(shards[0]) == [shards[0]]
    assert checkpoint_bytes(d) == sum(f.stat().st_size for f in shards)
    assert user_checkpoint(str(d))[1] == user_checkpoint(str(index))[1] == tensors
    single = tmp_path / "single"
    single.mkdir()
    save_file(some_tensors(3, seed=4), str(single / "model.safetensors"))  # an unsharded save_pretrained
    assert user_checkpoint(str(single))[1] == 3


@pytest.mark.parametrize("what", ["missing", "empty", "not safetensors"])
def test_a_checkpoint_the_bench_cannot_use_is_refused_in_one_line(capsys, tmp_path, what):
    path = tmp_path / "x"
    if what == "empty":
        path.mkdir()
    elif what == "not safetensors":
        path.write_bytes(b"\xff" * 64)
    capsys.readouterr()
    rc = main(["bench", "--checkpoint", str(path), "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"weightcache bench: {path}") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists()  # refused before anything was generated
