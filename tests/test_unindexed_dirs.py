"""A directory of .safetensors files without an index was merged into one model
silently, whatever the files were. It is still loaded as one model (a directory of
shards named any way keeps working; tensor names that clash are refused), but unless
its files plainly belong together (one file, an index, or one complete
`<stem>-0000i-of-0000N` shard set) the operator is told which files were merged: in the
daemon's log at start, reload and register, and by `weightcache register`."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from weightcache.cli import main
from weightcache.tools.synth import write_checkpoint


def unrelated(d: Path) -> Path:
    d.mkdir()
    write_checkpoint(d / "llama.safetensors", 64 * 1024, 4, seed=1)
    save_file({"other.weight": torch.arange(4096, dtype=torch.float32)}, str(d / "mistral.safetensors"))  # another model
    return d


def shard_set(d: Path, drop: int | None = None) -> Path:
    index = write_checkpoint(d, 96 * 1024, 6, shards=3, seed=5)
    index.unlink()  # save_pretrained's names, no index
    if drop is not None:
        (d / f"model-{drop:05d}-of-00003.safetensors").unlink()
    return d


def test_the_rule(tmp_path):
    from weightcache.loader.sources import unindexed_note

    note = unindexed_note(unrelated(tmp_path / "two"))
    assert note is not None and "loaded as ONE model: ['llama.safetensors', 'mistral.safetensors']" in note
    assert unindexed_note(shard_set(tmp_path / "set")) is None
    assert unindexed_note(tmp_path / "two" / "llama.safetensors") is None  # a file
    assert "not one shard set" in (unindexed_note(shard_set(tmp_path / "gap", drop=2)) or "")
    shutil.copy(tmp_path / "two" / "llama.safetensors", tmp_path / "set" / "stray.safetensors")
    assert "stray.safetensors" in (unindexed_note(tmp_path / "set") or "")
    (tmp_path / "set" / "model.safetensors.index.json").write_text("{}")  # an index says which files: no note
    assert unindexed_note(tmp_path / "set") is None


def test_start_and_register_say_which_files_were_merged(start_daemon, tmp_path, capsys):
    two = unrelated(tmp_path / "two")
    ok = shard_set(tmp_path / "set")
    d = start_daemon(budget="20MiB", models={"two": two, "set": ok})
    for extra in ([], ["--by-path"]):
        capsys.readouterr()
        assert main(["--socket", d.socket, "register", f"t{len(extra)}", str(two), *extra]) == 0
        assert "note: " + str(two) + " has no *.safetensors.index.json" in capsys.readouterr().err
    from weightcache import SyncClient

    with SyncClient(d.socket) as c:
        c.reload()  # checks every unchanged config model again, and returns once that is done
    log = d.log_text()
    assert f"model two: {two} has no" in log and "model set:" not in log, log[-3000:]
    assert f"model t1: {two} has no" in log  # registered by path: the daemon looked, and said so
