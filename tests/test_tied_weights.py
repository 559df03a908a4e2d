"""Models whose input and output embeddings are one tensor (GPT-2, Llama-3.2-1B/3B,
Qwen2.5-0.5B/1.5B, Gemma): their checkpoints store the shared tensor once, and
``from_pretrained`` ties the output layer to it again. Attached from a real daemon and
put into an ``empty_parameters`` skeleton with ``load_into_module``, the logits must be
``from_pretrained``'s bit for bit. Tiny configs, built locally: no downloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from weightcache import SyncClient, empty_parameters, load_into_module

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


def configs() -> dict[str, object]:
    from transformers import GemmaConfig, GPT2Config, LlamaConfig, Qwen2Config

    return {
        "gpt2": GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                            tie_word_embeddings=True),
        "llama32": LlamaConfig(**COMMON, rope_theta=500000.0),  # Llama-3.2-1B/3B tie their embeddings
        "qwen2": Qwen2Config(**COMMON),
        "gemma": GemmaConfig(**COMMON, head_dim=16),
    }


@pytest.fixture(scope="module")
def tied_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, cfg) in enumerate(configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied, as saved
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name], safe_serialization=True)
    return out


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 7, 42, 99, 3, 250, 511, 0]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_tied_models_give_from_pretrained_logits_bit_for_bit(tied_models, start_daemon):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = start_daemon(budget="64MiB", models=tied_models)
    with SyncClient(d.socket) as c:
        for name, path in tied_models.items():
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            with c.attach(name) as w:
                # The checkpoint holds the shared tensor once (what the issue saw fail).
                assert not any(k.startswith("lm_head") for k in w), sorted(w)
                with empty_parameters():
                    skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
                model = load_into_module(skeleton, w).eval()
                # One tensor, as from_pretrained leaves it, and a view of the daemon's memory.
                assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, name
                assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
                assert torch.equal(logits(model), logits(ref)), name
                del model, skeleton


class TiedByHand(nn.Module):
    """An alias without transformers: one Parameter under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_an_alias_stored_once_or_twice_loads_as_one_tensor():
    torch.manual_seed(0)
    ref = TiedByHand()
    once = {"embed.weight": ref.embed.weight.detach().clone()}
    twice = {"embed.weight": once["embed.weight"], "head.weight": once["embed.weight"].clone()}
    ids = torch.tensor([[1, 2, 3]])
    for weights in (once, twice):
        with empty_parameters():
            skeleton = TiedByHand()
        model = load_into_module(skeleton, weights)
        assert model.head.weight is model.embed.weight
        assert model.embed.weight.data_ptr() == once["embed.weight"].data_ptr()
        assert torch.equal(model(ids), ref(ids))


def test_a_missing_shared_tensor_is_still_named():
    with empty_parameters():
        skeleton = TiedByHand()
    with pytest.raises(ValueError, match=r"missing keys: \['embed.weight', 'head.weight'\]"):
        load_into_module(skeleton, {})


def test_a_skeleton_whose_ties_were_undone_is_tied_by_its_declared_keys(tied_models):
    # _tied_weights_keys names the pair even where the two Parameters are no longer one
    # object (code that replaced lm_head.weight after building): tied as from_pretrained does.
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tied_models["llama32"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with empty_parameters():
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    skeleton.lm_head.weight = nn.Parameter(torch.empty_like(skeleton.lm_head.weight, device="meta"))
    model = load_into_module(skeleton, load_file(path / "model.safetensors")).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(logits(model), logits(ref))
