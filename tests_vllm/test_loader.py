"""The ``weightcache`` load format driven as vLLM's worker drives it (drive.py), against
a real daemon: what each bad input gives (one clear line, then the default loader or
the fresh files; never other weights), and the processed path end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from drive import keep_linear_weights, load, plugin_lines, same_state, state
from safetensors.torch import load_file, save_file

from weightcache import SyncClient, tenant_fingerprint
from weightcache.integrations.vllm.keys import is_checkpoint_name, processed_name

DEFAULT = "loading with vLLM's default loader"


def names(socket: str) -> dict[str, dict]:
    with SyncClient(socket) as c:
        return {m["name"]: m for m in c.models()}


def test_the_entry_point_registers_the_load_format() -> None:
    """In a fresh interpreter, as vLLM's processes start: plugins loaded, format known."""
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as formats, get_model_loader; "
            "from vllm.config.load import LoadConfig; "
            "assert type(get_model_loader(LoadConfig(load_format='weightcache'))).__name__ == 'WeightcacheModelLoader', formats")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]


def test_copy_path_equals_a_disk_load_and_registers_once(daemon, ckpts) -> None:
    with keep_linear_weights():
        disk, _ = load(str(ckpts["llama"]), "auto")
        with plugin_lines() as lines:
            got, _ = load(str(ckpts["llama"]))
            again, _ = load(str(ckpts["llama"]))
    assert same_state(got, disk) and same_state(again, disk)
    assert "loaded" in lines.text() and "from the daemon" in lines.text() and DEFAULT not in lines.text()
    raw = [m for n, m in names(daemon.socket).items() if not n.startswith("vllm-processed-")]
    assert len(raw) == 1 and raw[0]["loads"] == 1  # the second start found the first's registration and arena


def test_processed_weights_are_published_then_attached(daemon, ckpts) -> None:
    with keep_linear_weights():
        with plugin_lines() as first:
            normal, _ = load(str(ckpts["qwen"]))
        assert "published processed weights as vllm-processed-qwen" in first.text()
        with plugin_lines() as second:
            attached, loader = load(str(ckpts["qwen"]))
    assert "attached processed weights vllm-processed-qwen" in second.text()
    assert "loaded" not in second.text()  # no checkpoint attached, no load_weights
    assert "load_s" not in loader.phases and {"init_s", "weights_s", "post_s"} <= loader.phases.keys()
    assert same_state(attached, normal)
    # The tie survives: one tensor under both names, as after a normal load.
    assert attached.lm_head.weight is attached.model.embed_tokens.weight


def test_the_cpu_backend_says_why_it_publishes_nothing(daemon, ckpts) -> None:
    with plugin_lines() as lines:
        load(str(ckpts["llama"]))
    assert "cannot be published from this engine" in lines.text() and "oneDNN" in lines.text()
    assert not [n for n in names(daemon.socket) if n.startswith("vllm-processed-")]


def test_daemon_down_is_one_line_and_the_default_loader(tmp_path, ckpts, monkeypatch) -> None:
    monkeypatch.setenv("WEIGHTCACHE_SOCKET", str(tmp_path / "nobody.sock"))
    monkeypatch.setenv("WEIGHTCACHE_WAIT_FOR_DAEMON", "0")
    with keep_linear_weights():
        disk, _ = load(str(ckpts["llama"]), "auto")
        with plugin_lines() as lines:
            got, _ = load(str(ckpts["llama"]))
    assert same_state(got, disk)
    assert len(lines.lines) == 1 and "cannot connect to weightcache" in lines.text() and DEFAULT in lines.text()


def test_an_unknown_model_name_is_one_line_and_the_default_loader(daemon, ckpts) -> None:
    with keep_linear_weights():
        disk, _ = load(str(ckpts["llama"]), "auto")
        with plugin_lines() as lines:
            got, _ = load(str(ckpts["llama"]), extra={"name": "no-such-model"})
    assert same_state(got, disk)
    assert len(lines.lines) == 1 and "no-such-model" in lines.text() and DEFAULT in lines.text()


def test_a_daemon_that_refuses_this_uid_is_one_line_and_the_default_loader(start_daemon, ckpts, monkeypatch) -> None:
    """The daemon's allowed_uids leave this engine's uid out (the socket's permissions as
    the daemon applies them: a root engine passes any file mode)."""
    d = start_daemon(daemon={"allowed_uids": [os.geteuid() + 12345]})
    monkeypatch.setenv("WEIGHTCACHE_SOCKET", d.socket)
    monkeypatch.setenv("WEIGHTCACHE_WAIT_FOR_DAEMON", "0")
    with keep_linear_weights():
        disk, _ = load(str(ckpts["llama"]), "auto")
        with plugin_lines() as lines:
            got, _ = load(str(ckpts["llama"]))
    assert same_state(got, disk)
    assert len(lines.lines) == 1, lines.lines
    line = lines.lines[0]
    assert d.socket in line and f"uid {os.geteuid()}" in line and DEFAULT in line, line
    assert "may not use this weightcache daemon" in line or "allowed_uids" in line, line


def test_bad_options_are_refused_at_start(ckpts) -> None:
    with pytest.raises(ValueError, match="unknown key"):
        load(str(ckpts["llama"]), extra={"sockett": "/x"})
    with pytest.raises(ValueError, match="mode"):
        load(str(ckpts["llama"]), extra={"mode": "fast"})


def test_another_dtype_does_not_attach_the_published_weights(daemon, ckpts) -> None:
    with keep_linear_weights():
        load(str(ckpts["llama"]))  # publishes the float32 weights
        disk, _ = load(str(ckpts["llama"]), "auto", dtype="bfloat16")
        with plugin_lines() as lines:
            got, _ = load(str(ckpts["llama"]), dtype="bfloat16")
    assert "no processed weights for this engine yet" in lines.text()
    assert same_state(got, disk) and got.model.embed_tokens.weight.dtype == torch.bfloat16
    assert len([n for n in names(daemon.socket) if n.startswith("vllm-processed-llama")]) == 2


def test_a_corrupted_published_entry_is_replaced_not_used(daemon, ckpts) -> None:
    with keep_linear_weights():
        good, _ = load(str(ckpts["qwen"]))
        name = next(n for n in names(daemon.socket) if n.startswith("vllm-processed-qwen"))
        published = {k: v.clone() for k, v in state_for_publish(good).items()}
        wrong = dict(published)
        first = next(k for k in wrong if not k.startswith("buffers/"))
        wrong[first] = torch.zeros_like(wrong[first])[:1]  # another shape
        with SyncClient(daemon.socket) as c:
            key_fp = _fingerprint_string_of(c, name)
            c.publish(name, wrong, fingerprint=key_fp, replace=True)
        with plugin_lines() as lines:
            got, _ = load(str(ckpts["qwen"]))
        assert "are not usable here" in lines.text() and "other shape or dtype" in lines.text()
        assert same_state(got, good)
        # Published again, right this time: the next start attaches it.
        with plugin_lines() as lines:
            again, _ = load(str(ckpts["qwen"]))
    assert "attached processed weights" in lines.text() and same_state(again, good)


def test_weights_published_under_another_fingerprint_are_not_used(daemon, ckpts) -> None:
    with keep_linear_weights():
        good, _ = load(str(ckpts["qwen"]))
        name = next(n for n in names(daemon.socket) if n.startswith("vllm-processed-qwen"))
        poisoned = {k: torch.full_like(v, 0.5) if v.is_floating_point() else v.clone() for k, v in state_for_publish(good).items()}
        with SyncClient(daemon.socket) as c:
            c.publish(name, poisoned, fingerprint="something else", replace=True)
        with plugin_lines() as lines:
            got, _ = load(str(ckpts["qwen"]))
    assert "published under another key or by another user" in lines.text()
    assert same_state(got, good)


def test_a_checkpoint_changed_on_disk_gives_the_new_weights(daemon, fresh_ckpt) -> None:
    with keep_linear_weights():
        load(str(fresh_ckpt))  # registered, loaded and published as the files are now
        f = fresh_ckpt / "model.safetensors"
        tensors = load_file(f)
        tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] + 1.0
        save_file(tensors, f, metadata={"format": "pt"})  # rewritten in place, same inode
        disk, _ = load(str(fresh_ckpt), "auto")
        with plugin_lines() as lines:
            got, _ = load(str(fresh_ckpt))
    assert same_state(got, disk)
    assert "attached processed weights" not in lines.text()
    # The registration of the files as they were, and the weights processed from it, are
    # unregistered: no start would ask for them again.
    assert "made from this checkpoint's files as they were before they were rewritten" in lines.text()
    left = names(daemon.socket)
    assert len([n for n in left if n.startswith("vllm-processed-")]) == 1, left
    assert len([n for n in left if is_checkpoint_name(n, str(fresh_ckpt))]) == 1, left


def test_a_checkpoint_rewritten_with_the_same_bytes_keeps_its_processed_weights(daemon, fresh_ckpt) -> None:
    """touch, a copy or a download again: a new registration (the name digests the files'
    identity), the old one unregistered, but the same content fingerprint, so the weights
    processed from it are this start's and are attached, not unregistered."""
    with keep_linear_weights():
        first, _ = load(str(fresh_ckpt))
        f = fresh_ckpt / "model.safetensors"
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
        with plugin_lines() as lines:
            again, _ = load(str(fresh_ckpt))
    assert "made from this checkpoint's files as they were before they were rewritten" in lines.text()
    assert "attached processed weights" in lines.text() and same_state(again, first)
    left = names(daemon.socket)
    assert len([n for n in left if n.startswith("vllm-processed-")]) == 1, left
    assert len([n for n in left if is_checkpoint_name(n, str(fresh_ckpt))]) == 1, left


def state_for_publish(model) -> dict[str, torch.Tensor]:
    from weightcache.integrations.vllm.processed import publishable

    return publishable(model)


def _fingerprint_string_of(c: SyncClient, name: str) -> str:
    """The key's fingerprint string for ``name``: the one whose binding the daemon shows."""
    from drive import engine_config
    from vllm.config import set_current_vllm_config

    from weightcache.integrations.vllm.processed import processed_key

    shown = next(m for m in c.models() if m["name"] == name)["fingerprint"]
    raw = next(m for m in c.models() if not m["name"].startswith("vllm-processed-") and m["name"].startswith("vllm-qwen"))
    cfg = engine_config(str(Path(raw["path"])), "weightcache")
    with set_current_vllm_config(cfg):
        key = processed_key(cfg, cfg.model_config, raw["fingerprint"])
    assert processed_name(raw["path"], key) == name and tenant_fingerprint(key.fingerprint(), os.geteuid()) == shown
    return key.fingerprint()


__all__ = ["state"]
