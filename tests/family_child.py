"""A fresh engine process for tests/test_model_families.py: attaches a transformers
checkpoint from the daemon into an ``empty_parameters`` skeleton and compares its output
with ``from_pretrained``'s on the same files, in this same fresh process.

usage: family_child.py SOCKET MODEL PATH FAMILY plain      -> load_into_module(skeleton, attached)
       family_child.py SOCKET MODEL PATH FAMILY converted  -> through conversions.attach_converted
Prints one JSON line: equal, the dtypes, and what the engine attached.
"""

import json
import sys
import time

import torch
import transformers

from weightcache import SyncClient, empty_parameters, load_into_module
from weightcache.client.conversions import attach_converted

transformers.logging.set_verbosity_error()
sock, name, path, family, mode = sys.argv[1:6]
cls = getattr(transformers, {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "vit": "ViTForImageClassification",
                             "llava": "LlavaForConditionalGeneration", "t5": "T5ForConditionalGeneration",
                             "llama_mixed": "LlamaForCausalLM"}[family])
ids = torch.tensor([[1, 7, 42, 99, 3, 25, 11, 0]])
g = torch.Generator().manual_seed(0)
inputs = {"vit": {"pixel_values": torch.randn(1, 3, 32, 32, generator=g)},
          "llava": {"input_ids": torch.tensor([[1] + [150] * 16 + [7, 42, 99]]), "pixel_values": torch.randn(1, 3, 32, 32, generator=g)},
          "t5": {"input_ids": ids, "decoder_input_ids": ids}}.get(family, {"input_ids": ids})


def out(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


ref = cls.from_pretrained(path).eval()
cfg = transformers.AutoConfig.from_pretrained(path)
with empty_parameters():
    skeleton = cls._from_config(cfg, dtype=cfg.dtype)
report: dict[str, object] = {}
with SyncClient(sock) as c:
    t0 = time.perf_counter()
    if mode == "plain":
        with c.attach(name) as w:
            model = load_into_module(skeleton, w).eval()
            report["source_fingerprint"] = w.fingerprint
            report["equal"] = torch.equal(out(model), out(ref))
    else:
        with attach_converted(c, name, skeleton) as w:
            model = load_into_module(skeleton, w).eval()
            report["load_s"] = time.perf_counter() - t0
            report.update(derived=w.derived_name, built_here=w.built_here,
                          derived_fingerprint=w.derived.fingerprint if w.derived is not None else None,
                          source_fingerprint=w.source.fingerprint)
            # Every parameter is a view of one of the two attached models.
            spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                     for m in (w.source, w.derived) if m is not None for t in m.values()]
            report["all_views"] = all(any(a <= p.data_ptr() < b for a, b in spans) for p in model.parameters())
            report["equal"] = torch.equal(out(model), out(ref))
    report["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    report["ref_dtypes"] = sorted({str(p.dtype) for p in ref.parameters()})
    report["models"] = sorted(m["name"] for m in c.models())
print(json.dumps(report), flush=True)
