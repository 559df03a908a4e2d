"""Tiny checkpoints written the way users get them: transformers' ``save_pretrained``
(safetensors, config.json) and a tokenizer saved beside them, so that vLLM's own
paths (LLM, the OpenAI server) run unchanged on them."""

from __future__ import annotations

from pathlib import Path

WORDS = [f"w{i}" for i in range(500)]
PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30", "w7 w7 w7 w7 w7 w7"]
VOCAB = 768  # the model's vocabulary: at least the tokenizer's


def save_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer over the test words (~750 tokens): transformers picks
    its tokenizer class from the model type (Qwen2Tokenizer for Qwen2), and each of them
    reads this tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 3, vocab_size=VOCAB, min_frequency=1, special_tokens=["<unk>", "<s>", "</s>"],
                            show_progress=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


def save_model(out: Path, arch: str, seed: int, dims: tuple[int, int, int, int] = (256, 512, 2, VOCAB)) -> Path:
    """A float32 model of ``arch``: "llama" (vLLM fuses its qkv and gate/up projections
    on load) or "qwen2-tied" (lm_head is the input embedding). ``dims``: hidden size,
    intermediate size, layers, vocabulary (the default: ~6 MB)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    hidden, intermediate, layers, vocab = dims
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False)
    elif arch == "qwen2-tied":
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: greedy tokens that vary
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(out)
    return out
