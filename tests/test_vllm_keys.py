"""The vLLM plugin's names and keys (weightcache/integrations/vllm/keys.py), without vLLM:
which engines share a model in the daemon and which never do. The plugin itself runs
against real vLLM in tests_vllm/ (`make test-vllm`)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from weightcache.integrations.vllm.keys import Options, ProcessedKey, checkpoint_name, processed_name, quant_config_digest

KEY = ProcessedKey(checkpoint="uid0:abc", architectures=("LlamaForCausalLM",), dtype="torch.bfloat16", quantization=None,
                   quant_config="", kv_cache_dtype="auto", tp_size=2, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0,
                   ep=False, backends=(), device_kind="cuda sm90 NVIDIA H100", vllm_version="0.33.0", torch_version="2.11.0",
                   max_model_len=4096)


def test_every_field_of_the_key_changes_the_name_and_the_fingerprint() -> None:
    changed = {"checkpoint": "uid0:abd", "architectures": ("Qwen2ForCausalLM",), "dtype": "torch.float16",
               "quantization": "fp8", "quant_config": "x", "kv_cache_dtype": "fp8", "tp_size": 4, "tp_rank": 1, "pp_size": 2,
               "pp_rank": 1, "dp_size": 2, "dp_rank": 1, "ep": True, "backends": (("VLLM_ATTENTION_BACKEND", "FLASHINFER"),),
               "device_kind": "cuda sm80 A100", "vllm_version": "0.33.1", "torch_version": "2.12.0", "max_model_len": 8192}
    assert set(changed) == {f.name for f in dataclasses.fields(ProcessedKey)}
    names = {processed_name("/m/llama", KEY)}
    prints = {KEY.fingerprint()}
    for field, value in changed.items():
        other = dataclasses.replace(KEY, **{field: value})
        names.add(processed_name("/m/llama", other))
        prints.add(other.fingerprint())
    assert len(names) == len(prints) == len(changed) + 1
    assert processed_name("/m/llama", KEY) == processed_name("/m/llama", dataclasses.replace(KEY))  # stable


def test_another_tp_size_is_another_model() -> None:
    tp1 = dataclasses.replace(KEY, tp_size=1, tp_rank=0)
    assert processed_name("/m/llama", tp1) != processed_name("/m/llama", KEY)
    assert "tp0of2" in processed_name("/m/llama", KEY) and "tp0of1" in processed_name("/m/llama", tp1)


def test_quant_config_digest_ignores_key_order() -> None:
    assert quant_config_digest({"a": 1, "b": [1, 2]}) == quant_config_digest({"b": [1, 2], "a": 1}) != quant_config_digest({"a": 2})
    assert quant_config_digest(None) == quant_config_digest({}) == ""


def test_checkpoint_name_is_per_files_as_on_disk_device_and_uid(tmp_path) -> None:
    d = tmp_path / "My Model!"
    d.mkdir()
    f = d / "model.safetensors"
    f.write_bytes(b"x" * 100)
    name = checkpoint_name(str(d), [str(f)], "cpu", 0)
    assert name.startswith("vllm-My-Model-") and len(name) <= 128
    assert checkpoint_name(str(d), [str(f)], "cpu", 0) == name
    assert checkpoint_name(str(d), [str(f)], "cuda:GPU-1", 0) != name
    assert checkpoint_name(str(d), [str(f)], "cpu", 1000) != name
    st = os.stat(f)
    f.write_bytes(b"y" * 100)  # rewritten in place: same inode and size, new mtime
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert checkpoint_name(str(d), [str(f)], "cpu", 0) != name
    renamed = checkpoint_name(str(d), [str(f)], "cpu", 0)
    new = d / "new"
    new.write_bytes(b"z" * 100)
    os.replace(new, f)  # replaced by rename: a new inode
    assert checkpoint_name(str(d), [str(f)], "cpu", 0) != renamed


def test_options() -> None:
    assert Options.parse(None) == Options() == Options(socket=None, name=None, mode="auto", publish=True)
    assert Options.parse({"socket": "/s", "name": "m", "mode": "processed", "publish": False}).mode == "processed"
    for bad, match in [({"sockett": 1}, "unknown key"), ({"mode": "fast"}, "mode"), ({"publish": "yes"}, "publish"),
                       ({"name": 3}, "'name' must be a string")]:
        with pytest.raises(ValueError, match=match):
            Options.parse(bad)
