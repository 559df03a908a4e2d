"""Families whose checkpoints transformers converts as it loads them: MoE experts fused
from per-expert tensors (Mixtral, Qwen2-MoE), ViT's and Llava's renamed keys, T5 saved in
fp16 with its ``wo`` layers kept fp32, a Llama whose bf16 checkpoint holds fp32 ``lm_head``
and norms. Each is attached from a real daemon into an ``empty_parameters`` skeleton by a
fresh engine process (tests/family_child.py), which compares the logits with
``from_pretrained``'s bit for bit. Tiny configs built here: no downloads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
CHILD = Path(__file__).resolve().parent / "family_child.py"
TEXT = dict(vocab_size=160, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)


def build(family: str, out: Path) -> Path:
    """Save a tiny ``family`` checkpoint to ``out`` the way transformers writes it."""
    from transformers import (
        AutoModelForCausalLM,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        MixtralConfig,
        Qwen2MoeConfig,
        T5Config,
        T5ForConditionalGeneration,
        ViTConfig,
        ViTForImageClassification,
    )

    torch.manual_seed(0)
    if family == "mixtral":
        model = AutoModelForCausalLM.from_config(MixtralConfig(**TEXT, num_local_experts=4, num_experts_per_tok=2))
    elif family == "qwen2_moe":
        model = AutoModelForCausalLM.from_config(Qwen2MoeConfig(**TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                                num_experts=4, num_experts_per_tok=2))
    elif family == "vit":
        model = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                                    image_size=32, patch_size=8, num_labels=3))
    elif family == "llava":
        vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                                  patch_size=8, projection_dim=32)
        model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=LlamaConfig(**TEXT), image_token_index=150))
    elif family == "t5":
        # Loaded in fp16, T5 keeps its `wo` layers fp32 (_keep_in_fp32_modules), and saves them so.
        T5ForConditionalGeneration(T5Config(vocab_size=160, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                            decoder_start_token_id=0)).save_pretrained(out / "fp32")
        model = T5ForConditionalGeneration.from_pretrained(out / "fp32", dtype=torch.float16)
    else:  # llama_mixed
        model = AutoModelForCausalLM.from_config(LlamaConfig(**TEXT, tie_word_embeddings=False), dtype=torch.bfloat16)
        model.lm_head.float()
        for m in model.modules():
            if "RMSNorm" in type(m).__name__:
                m.float()
    model.save_pretrained(out / family)
    return out / family


FAMILIES = ["mixtral", "qwen2_moe", "vit", "llava", "t5", "llama_mixed"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("families")
    return {f: build(f, d) for f in FAMILIES}


def engine(sock: str, name: str, path: Path, family: str, mode: str) -> dict[str, object]:
    r = subprocess.run([sys.executable, str(CHILD), sock, name, str(path), family, mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_checkpoints_are_in_the_layouts_transformers_converts(checkpoints):
    # What makes these families need conversion, so that the tests below test it.
    from safetensors import safe_open

    def dtypes(family: str) -> dict[str, str]:
        with safe_open(str(checkpoints[family] / "model.safetensors"), "pt") as f:
            return {k: str(f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118

    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in dtypes("mixtral")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in dtypes("qwen2_moe")
    assert "vit.encoder.layer.0.attention.attention.query.weight" in dtypes("vit")
    assert "language_model.model.embed_tokens.weight" in dtypes("llava")
    t5 = dtypes("t5")
    assert t5["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == "F32" and t5["shared.weight"] == "F16"
    llama = dtypes("llama_mixed")
    assert llama["lm_head.weight"] == llama["model.norm.weight"] == "F32" and llama["model.embed_tokens.weight"] == "BF16"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fresh_engine_gets_from_pretrained_logits(family, checkpoints, start_daemon):
    d = start_daemon(budget="64MiB", models={family: checkpoints[family]})
    got = engine(d.socket, family, checkpoints[family], family, "plain")
    assert got["equal"], got
    assert got["dtypes"] == got["ref_dtypes"], got  # T5: fp16 and fp32 (wo); the Llama: bf16, as from_pretrained casts it


def test_a_second_engine_attaches_the_fused_experts_the_first_one_built(checkpoints, start_daemon):
    d = start_daemon(budget="64MiB", models={"mixtral": checkpoints["mixtral"]})
    first = engine(d.socket, "mixtral", checkpoints["mixtral"], "mixtral", "converted")
    assert first["equal"] and first["built_here"] and first["all_views"], first
    assert first["derived"] in first["models"], first  # published to the daemon
    second = engine(d.socket, "mixtral", checkpoints["mixtral"], "mixtral", "converted")
    assert second["equal"] and second["all_views"], second
    assert not second["built_here"], second  # attached the derived model, built nothing
    assert (second["derived"], second["derived_fingerprint"]) == (first["derived"], first["derived_fingerprint"])
    assert second["derived_fingerprint"].startswith("uid"), second  # a published model's (tenant_fingerprint)


def test_a_family_that_needs_no_build_attaches_no_derived_model(checkpoints, start_daemon):
    d = start_daemon(budget="64MiB", models={"vit": checkpoints["vit"]})
    got = engine(d.socket, "vit", checkpoints["vit"], "vit", "converted")
    assert got["equal"] and got["all_views"] and got["derived"] is None and got["models"] == ["vit"], got


async def test_the_async_client_keeps_and_finds_the_derived_model_too(checkpoints, start_daemon):
    from transformers import AutoConfig, MixtralForCausalLM

    from weightcache import Client, empty_parameters, load_into_module
    from weightcache.client.conversions import attach_converted_async

    path = checkpoints["mixtral"]
    d = start_daemon(budget="64MiB", models={"mixtral": path})
    ref = MixtralForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 7, 42, 99]])
    seen = []
    async with Client(d.socket) as c:
        for _ in range(2):
            cfg = AutoConfig.from_pretrained(path)
            with empty_parameters():
                skeleton = MixtralForCausalLM._from_config(cfg, dtype=cfg.dtype)
            async with attach_converted_async(c, "mixtral", skeleton) as w:
                model = load_into_module(skeleton, w).eval()
                with torch.no_grad():
                    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
                assert w.derived is not None and w.derived["model.layers.0.mlp.experts.gate_up_proj"].data_ptr() == \
                    model.model.layers[0].mlp.experts.gate_up_proj.data_ptr()
                seen.append((w.built_here, w.derived_name, w.derived.fingerprint))
    assert [s[0] for s in seen] == [True, False] and seen[0][1:] == seen[1][1:], seen


def test_transformers_4s_class_renames_apply_where_there_is_no_conversion_mapping(monkeypatch):
    # transformers 4 has no conversion_mapping module: its classes carry a
    # {regex: replacement} table that from_pretrained applies (first match wins).
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    from weightcache import empty_parameters, load_into_module

    class Old(PreTrainedModel):
        config_class = PretrainedConfig
        _checkpoint_conversion_mapping = {r"^language_model\.model": "model.language_model", r"^language_model\.": ""}

        def __init__(self, config: PretrainedConfig) -> None:
            super().__init__(config)
            self.model = nn.Module()
            self.model.language_model = nn.Linear(4, 4)
            self.lm_head = nn.Linear(4, 2)

    monkeypatch.setitem(sys.modules, "transformers.conversion_mapping", None)  # import fails, as on transformers 4
    src = {"language_model.model.weight": torch.randn(4, 4), "language_model.model.bias": torch.randn(4),
           "language_model.lm_head.weight": torch.randn(2, 4), "language_model.lm_head.bias": torch.randn(2)}
    with empty_parameters():
        skeleton = Old(PretrainedConfig())
    model = load_into_module(skeleton, src)
    assert model.model.language_model.weight.data_ptr() == src["language_model.model.weight"].data_ptr()  # renamed, a view
    assert model.lm_head.bias.data_ptr() == src["language_model.lm_head.bias"].data_ptr()


def test_a_skeleton_built_in_the_checkpoints_dtypes_takes_them_as_views(checkpoints):
    # from_pretrained casts the bf16 Llama's fp32 lm_head and norms to bf16 (a copy); a
    # skeleton whose parameters are fp32 there (on meta: free) keeps the checkpoint's as views.
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM

    from weightcache import empty_parameters, load_into_module
    from weightcache.client.conversions import plan

    path = checkpoints["llama_mixed"]
    weights = load_file(path / "model.safetensors")
    cfg = AutoConfig.from_pretrained(path)
    with empty_parameters():
        skeleton = LlamaForCausalLM._from_config(cfg, dtype=cfg.dtype)
    assert plan(skeleton, weights).built == sorted(k for k, v in weights.items() if v.dtype == torch.float32)  # casts
    for m in skeleton.modules():
        if m is skeleton.lm_head or "RMSNorm" in type(m).__name__:
            m.float()
    assert plan(skeleton, weights).built == []
    model = load_into_module(skeleton, weights)
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(t.data_ptr() == weights[k].data_ptr() for k, t in model.state_dict().items())


def test_attach_converted_refuses_one_ranks_shard_before_asking_the_daemon():
    from torch import nn

    from weightcache.client.conversions import attach_converted

    class NoClient:
        def attach(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("asked the daemon")

    with pytest.raises(ValueError, match=r"converts whole checkpoints, not one rank's shard \(rank=\)"), \
            attach_converted(NoClient(), "m", nn.Linear(2, 2), rank=1):  # type: ignore[arg-type]
        pass


async def test_where_the_daemon_has_no_room_for_the_derived_model_the_engine_serves_what_it_built(checkpoints, start_daemon, caplog):
    from transformers import AutoConfig, MixtralForCausalLM

    from weightcache import Client, empty_parameters, load_into_module
    from weightcache.client.conversions import attach_converted_async

    path = checkpoints["mixtral"]
    size = (path / "model.safetensors").stat().st_size
    d = start_daemon(budget=f"{size * 3 // 2 // 1024}KiB", models={"mixtral": path})  # the checkpoint fits, the experts again do not
    ref = MixtralForCausalLM.from_pretrained(path).eval()
    cfg = AutoConfig.from_pretrained(path)
    with empty_parameters():
        skeleton = MixtralForCausalLM._from_config(cfg, dtype=cfg.dtype)
    ids = torch.tensor([[1, 7, 42, 99]])
    async with Client(d.socket) as c, attach_converted_async(c, "mixtral", skeleton) as w:
        model = load_into_module(skeleton, w).eval()
        assert w.built_here and w.derived is None, w
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert [m["name"] for m in await c.models()] == ["mixtral"]
    assert "could not publish mixtral's converted tensors" in caplog.text and "NO_SPACE" in caplog.text, caplog.text
