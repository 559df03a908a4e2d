"""Processed weights (after vLLM's ``process_weights_after_loading``): the key an
engine publishes them under, what of a model is published, and how attached ones are
put in place (weightcache/integrations/vllm/loader.py says when each runs)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig

from .keys import ProcessedKey, quant_config_digest

BUFFER_PREFIX = "buffers/"  # published buffers' names: a parameter's name never has a "/"


class NotPublishable(Exception):
    """The processed weights cannot be published or attached on this engine (said once)."""


def target_device(vllm_config: VllmConfig) -> torch.device:
    """Where vLLM puts the model's weights."""
    return torch.device(vllm_config.load_config.device or vllm_config.device_config.device)


def processed_key(vllm_config: VllmConfig, model_config: ModelConfig, checkpoint: str) -> ProcessedKey:
    """The key of this engine's processed weights (:class:`.keys.ProcessedKey`)."""
    import vllm
    from vllm.distributed import get_dp_group, get_pp_group, get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    pc = vllm_config.parallel_config
    hf = model_config.hf_config
    quant = getattr(hf, "quantization_config", None) or getattr(hf, "compression_config", None)
    try:
        dp_size, dp_rank = get_dp_group().world_size, get_dp_group().rank_in_group
    except (AssertionError, AttributeError):
        dp_size, dp_rank = pc.data_parallel_size, pc.data_parallel_rank
    target = target_device(vllm_config)
    kind = target.type
    if kind == "cuda":
        major, minor = torch.cuda.get_device_capability()
        kind = f"cuda sm{major}{minor} {torch.cuda.get_device_name()}"
    backends = tuple(sorted((k, str(v)) for k, v in os.environ.items()
                            if k in ("VLLM_ATTENTION_BACKEND", "VLLM_USE_DEEP_GEMM", "VLLM_USE_FLASHINFER_MOE_FP8",
                                     "VLLM_USE_FLASHINFER_MOE_FP4", "VLLM_MXFP4_USE_MARLIN", "VLLM_ROCM_USE_AITER",
                                     "VLLM_CPU_SGL_KERNEL")))
    attention = getattr(vllm_config, "attention_config", None)
    if attention is not None and getattr(attention, "backend", None) is not None:
        backends += (("attention_config.backend", str(attention.backend)),)
    return ProcessedKey(
        checkpoint=checkpoint,
        architectures=tuple(getattr(hf, "architectures", None) or ()),
        dtype=str(model_config.dtype),
        quantization=model_config.quantization,
        quant_config=quant_config_digest(quant if isinstance(quant, dict) else getattr(quant, "to_dict", lambda: quant)()),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        tp_size=get_tensor_model_parallel_world_size(),
        tp_rank=get_tensor_model_parallel_rank(),
        pp_size=get_pp_group().world_size,
        pp_rank=get_pp_group().rank_in_group,
        dp_size=int(dp_size),
        dp_rank=int(dp_rank),
        ep=bool(getattr(pc, "enable_expert_parallel", False)),
        backends=backends,
        device_kind=kind,
        vllm_version=vllm.__version__,
        torch_version=torch.__version__,
        max_model_len=int(model_config.max_model_len),
    )


def publishable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The processed parameters and buffers to publish, by name (buffers under
    ``buffers/``); NotPublishable says why there are none to publish."""
    params = dict(model.named_parameters())
    empty = [n for n, p in params.items() if p.numel() == 0]
    if empty:
        return _refuse(f"post-processing left {len(empty)} parameter(s) empty (e.g. {empty[0]}): this backend keeps "
                       "the processed weights outside the parameters (vLLM's CPU backend packs linear weights for oneDNN)")
    out: dict[str, torch.Tensor] = {n: p.data for n, p in params.items()}
    out.update({BUFFER_PREFIX + n: b for n, b in model.named_buffers()})
    devices = {t.device for t in out.values()}
    if len(devices) != 1:
        return _refuse(f"the processed tensors are on several devices ({sorted(map(str, devices))})")
    return out


def _refuse(why: str) -> dict[str, torch.Tensor]:
    raise NotPublishable(why)


def put_in_place(model: nn.Module, weights: Mapping[str, torch.Tensor], target: torch.device, zero_copy: bool) -> None:
    """Make ``weights`` (published by :func:`publishable`) the parameters and buffers of
    ``model`` (built on ``meta``); NotPublishable if they are not exactly its tensors."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    want = {**{n: (tuple(p.shape), p.dtype) for n, p in params.items()},
            **{BUFFER_PREFIX + n: (tuple(b.shape), b.dtype) for n, b in buffers.items()}}
    have = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
    if have != want:
        missing = sorted(set(want) - set(have))[:3]
        extra = sorted(set(have) - set(want))[:3]
        other = sorted(n for n in set(want) & set(have) if want[n] != have[n])[:3]
        raise NotPublishable(f"tensors differ from this model's: missing {missing}, unexpected {extra}, other shape or dtype {other}")
    replaced: dict[int, nn.Parameter] = {}
    for name, old in params.items():
        tensor = weights[name]
        new = nn.Parameter(tensor if zero_copy else tensor.to(target, copy=True), requires_grad=False)
        new.__dict__.update(old.__dict__)  # vLLM's attributes (weight_loader, ...) for a later reload
        replaced[id(old)] = new
    # By identity, in every module: a tied parameter is one object under two names, which
    # named_parameters() listed once.
    modules = dict(model.named_modules(remove_duplicate=False))
    for module in modules.values():
        for leaf, p in list(module._parameters.items()):
            if p is not None and id(p) in replaced:
                module._parameters[leaf] = replaced[id(p)]
    for name in buffers:
        module_name, _, leaf = name.rpartition(".")
        modules[module_name]._buffers[leaf] = weights[BUFFER_PREFIX + name].to(target, copy=True)
