"""LoRA adapters on an attached base: PEFT (``PeftModel.from_pretrained``, ``load_adapter``),
transformers' ``model.load_adapter``, and adapter directories served by the daemon like any
checkpoint. The base's weights are read-only views; the adapters' own tensors load as
usual, and the logits equal the same adapters on a ``from_pretrained`` base bit for bit
(PEFT keeps the LoRA weights, and so its LoRA math, in fp32 over a bf16 base)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from weightcache import SyncClient, empty_parameters, load_into_module

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.tensor([[1, 7, 42, 99, 3, 25, 11, 0]])


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    base.save_pretrained(d / "base")
    out = {"base": d / "base"}
    for i, (name, targets) in enumerate({"a1": ["q_proj", "v_proj"], "a2": ["k_proj", "o_proj", "down_proj"]}.items()):
        torch.manual_seed(10 + i)  # init_lora_weights=False: lora_B is not zero, so the adapter changes the logits
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        peft.get_peft_model(copy.deepcopy(base), lora).save_pretrained(d / name)
        out[name] = d / name
    return out


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def attached_base(w: object, path: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with empty_parameters():
        skeleton = AutoModelForCausalLM.from_config(cfg, dtype=cfg.dtype)
    return load_into_module(skeleton, w).eval()  # type: ignore[arg-type]


def from_disk(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def with_adapters(base: nn.Module, paths: dict[str, Path]) -> dict[str, torch.Tensor]:
    """The logits of each way of putting adapters on ``base`` (a fresh base for each)."""
    out = {}
    p = peft.PeftModel.from_pretrained(base(), paths["a1"])
    out["PeftModel.from_pretrained"] = logits(p)
    assert {t.dtype for n, t in p.named_parameters() if "lora_" in n} == {torch.float32}  # PEFT's fp32 LoRA
    p.load_adapter(paths["a2"], adapter_name="second")
    p.set_adapter("second")
    out["PeftModel.load_adapter"] = logits(p)
    m = base()
    m.load_adapter(str(paths["a1"]))  # transformers' own
    out["transformers load_adapter"] = logits(m)
    return out


def test_adapters_on_an_attached_base_equal_the_same_on_from_pretrained(base_and_adapters, start_daemon):
    paths = base_and_adapters
    d = start_daemon(budget="64MiB", models={"base": paths["base"]})
    ref = with_adapters(lambda: from_disk(paths["base"]), paths)
    with SyncClient(d.socket) as c, c.attach("base") as w:
        got = with_adapters(lambda: attached_base(w, paths["base"]), paths)
        assert logits(attached_base(w, paths["base"])).ne(got["PeftModel.from_pretrained"]).any()  # the adapter did something
    for way, expected in ref.items():
        assert torch.equal(got[way], expected), way


def test_adapter_directories_served_by_the_daemon(base_and_adapters, start_daemon):
    # Many adapters, one base, one budget: each adapter directory is a model of its own.
    from peft.utils import set_peft_model_state_dict

    paths = base_and_adapters
    d = start_daemon(budget="64MiB", models=paths)
    for name in ("a1", "a2"):
        expected = logits(peft.PeftModel.from_pretrained(from_disk(paths["base"]), paths[name]))
        with SyncClient(d.socket) as c, c.attach("base") as w, c.attach(name) as adapter:
            model = peft.PeftModel(attached_base(w, paths["base"]), peft.PeftConfig.from_pretrained(paths[name]))
            # PEFT wants a dict; it copies the adapter's few tensors into its own fp32 ones.
            result = set_peft_model_state_dict(model, dict(adapter))
            assert not result.unexpected_keys, result
            assert torch.equal(logits(model.eval()), expected), name


def test_only_keys_that_land_on_attached_tensors_are_refused(base_and_adapters, start_daemon):
    paths = base_and_adapters
    d = start_daemon(budget="64MiB", models={"base": paths["base"]})
    with SyncClient(d.socket) as c, c.attach("base") as w:
        model = attached_base(w, paths["base"])
        model.load_state_dict({}, strict=False)  # nothing to copy: nothing to refuse
        head = {"lm_head.weight": torch.zeros_like(w["lm_head.weight"])}
        with pytest.raises(RuntimeError, match=r"^Linear \(lm_head\): \['lm_head\.weight'\] are read-only views of weightcache memory"):
            model.load_state_dict(head, strict=False)
        assert w["lm_head.weight"].ne(0).any()  # nothing was copied
        # A module of the engine's own (not from the weights) loads as usual, inside the attached model.
        model.extra = nn.Linear(2, 2)
        model.load_state_dict({"extra.weight": torch.ones(2, 2)}, strict=False)
        assert torch.equal(model.extra.weight.detach(), torch.ones(2, 2))
