"""A checkpoint's tensors -> a transformers module's parameters, by transformers' own rules.

transformers 5 converts checkpoints as it loads them: it renames keys (ViT's
``attention.attention.query`` -> ``attention.q_proj``, Llava's ``language_model.model.*`` ->
``model.language_model.*``), builds new tensors (Mixtral's per-expert ``w1``/``w3`` stacked
and concatenated into ``experts.gate_up_proj``) and casts each tensor to the dtype the model
gets (the load dtype, fp32 for ``_keep_in_fp32_modules``). :func:`plan` asks the installed
transformers for the model's conversion (``get_model_conversion_mapping``, the list
``from_pretrained`` uses) and applies it to the key names only: a rename is the same
tensor under another name (a view, no copy). What must be built (a converter's output, a
cast) is :func:`build`'s, and :func:`attach_converted` keeps it in the daemon as a derived
model so that the next engine attaches it instead of building it again.

A module that is not a transformers model gets no conversion: its keys must be the
checkpoint's, and its dtypes too.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import re
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import Attached, LimitExceeded, LoadFailed, NoSpace, PermissionDenied, UnknownModel
from ..protocol import tenant_fingerprint

if TYPE_CHECKING:
    from .aio import Client
    from .mapping import AttachedModel
    from .sync import SyncClient

log = logging.getLogger(__name__)


@dataclass
class Plan:
    """How a module's state-dict keys come out of a checkpoint's tensors.

    ``views``: module key -> checkpoint key whose tensor it is as is (renamed or not).
    ``built``: module keys whose tensors :func:`build` makes (converter outputs, casts).
    ``dtypes``: module key -> the dtype transformers gives it, where that is not the skeleton's.
    ``unexpected``: checkpoint keys that go nowhere in the module."""

    views: dict[str, str] = field(default_factory=dict)
    built: list[str] = field(default_factory=list)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    # How to build: module key -> checkpoint key cast to dtypes[key]; first target key of a
    # converter -> (the converter, [(source pattern, checkpoint key), ...]).
    casts: dict[str, str] = field(default_factory=dict)
    converters: dict[str, tuple[Any, list[tuple[str, str]]]] = field(default_factory=dict)
    converted: bool = False  # transformers' conversion renamed or built anything

    def resolve(self, weights: Mapping[str, torch.Tensor], built: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module's tensors: views of ``weights`` under the module's names, and ``built``."""
        out = {key: weights[src] for key, src in self.views.items()}
        out.update(built)
        return out

    def identity(self, module: nn.Module) -> str:
        """What the built tensors depend on besides the checkpoint's bytes: transformers'
        version, the module's class and the recipe of every built tensor."""
        import transformers

        cls = type(module)
        h = hashlib.sha256(f"transformers {transformers.__version__}\0{cls.__module__}.{cls.__qualname__}".encode())
        for key in sorted(self.casts):
            h.update(f"\0cast {self.casts[key]} -> {key} {self.dtypes.get(key)}".encode())
        for key in sorted(self.converters):
            conv, sources = self.converters[key]
            h.update(f"\0{conv!r} {getattr(conv, 'operations', '')!r} {sorted(sources)} -> {key} {self.dtypes.get(key)}".encode())
        return h.hexdigest()


def _transformers_model(module: nn.Module) -> bool:
    # A transformers model means transformers is imported: a plain torch engine does not
    # pay for importing it (seconds) to learn that its module is not one.
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


def _load_dtype(module: nn.Module) -> torch.dtype | None:
    dtype = getattr(getattr(module, "config", None), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def target_dtypes(module: nn.Module, keys: list[str], own: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """The dtype ``from_pretrained`` gives each of ``keys``: the load dtype (the config's,
    which ``from_config(cfg, dtype=...)`` sets), fp32 where the model's keep-in-fp32 plan
    says so, and the skeleton's own dtype where that differs from the load dtype (a
    parameter the model builds in another dtype on purpose)."""
    dtype = _load_dtype(module)
    if dtype is None:
        return {k: own[k].dtype for k in keys}
    get_plan = getattr(module, "_get_dtype_plan", None)
    dtype_plan = get_plan(dtype) if callable(get_plan) else {}
    out = {}
    if dtype_plan:
        from transformers.core_model_loading import build_glob_alternation

        alternation, by_group, _ = build_glob_alternation(list(dtype_plan))
    for k in keys:
        target = dtype
        match = alternation.search(k) if dtype_plan else None
        if match is not None and match.lastgroup is not None:
            target = dtype_plan[by_group[match.lastgroup]]
        elif own[k].dtype != dtype:
            target = own[k].dtype
        out[k] = target
    return out


def plan(module: nn.Module, weights: Mapping[str, torch.Tensor], own: dict[str, torch.Tensor] | None = None) -> Plan:
    """How ``weights`` (a checkpoint's tensors, by its names) become ``module``'s state dict
    (``own``: ``module.state_dict(keep_vars=True)``, where the caller has it)."""
    own = module.state_dict(keep_vars=True) if own is None else own
    p = Plan()
    if not _transformers_model(module):
        p.views = {k: k for k in weights if k in own}
        p.unexpected = sorted(k for k in weights if k not in own)
        return p
    sources: dict[str, str] = {}
    if set(weights) <= set(own):  # already the module's layout (a converted or published form)
        sources = {k: k for k in weights}
    else:
        _rename(module, weights, own, p, sources)
    dtypes = target_dtypes(module, [*sources, *p.converters], own)
    for key, src in sources.items():
        if weights[src].dtype != dtypes[key] and weights[src].is_floating_point():
            p.casts[key] = src
        else:
            p.views[key] = src
    p.built = sorted({*p.casts, *p.converters})
    # Every key whose dtype is transformers' choice, where the weights have it: the skeleton
    # (on meta) takes it, as from_pretrained's model would.
    p.dtypes = {k: d for k, d in dtypes.items() if d != own[k].dtype or k in p.built}
    return p


def _rename(module: Any, weights: Mapping[str, torch.Tensor], own: dict[str, torch.Tensor], p: Plan,
            sources: dict[str, str]) -> None:
    """transformers' renaming loop (core_model_loading.convert_and_load_state_dict_in_model)
    on the names alone: renames into ``sources``, converters into ``p.converters``."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # transformers 4: a class-level {regex: replacement} table, renames only
        table = getattr(module, "_checkpoint_conversion_mapping", None) or {}
        for key in weights:
            new = key
            for pattern, replacement in table.items():
                new, n = re.subn(pattern, replacement, new)
                if n:
                    break
            target = new if new in own else key
            if target in own:
                sources[target] = key
                p.converted |= target != key
            else:
                p.unexpected.append(key)
        return
    mapping = get_model_conversion_mapping(module)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: conv for conv in converters for pattern in conv.source_patterns}
    prefix = module.base_model_prefix
    for key in sorted(weights, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, own)
        if renamed not in own and key in own:
            renamed, pattern = rename_source_key(key, [], [], prefix, own)
        if renamed not in own:
            p.unexpected.append(key)
        elif pattern is None:
            sources[renamed] = key
            p.converted |= renamed != key
        else:
            if renamed not in p.converters:
                p.converters[renamed] = (copy.deepcopy(by_pattern[pattern]), [])
            p.converters[renamed][1].append((pattern, key))
            p.converted = True


@torch.no_grad()
def build(p: Plan, weights: Mapping[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``p`` cannot take as views, made as ``from_pretrained`` makes them: each
    source cast to its target's dtype, then the converter's operations (transformers' own
    ``WeightConverter.convert``). New memory, on the weights' device."""
    out = {key: weights[src].to(p.dtypes[key]) for key, src in p.casts.items()}
    for first, (template, collected) in p.converters.items():
        conv = copy.deepcopy(template)
        for pattern, src in collected:
            t = weights[src]
            dtype = p.dtypes.get(first)
            conv.add_tensor(first, src, pattern, t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        for name, value in conv.convert(first, model=module, config=getattr(module, "config", None)).items():
            out[name] = (value[0] if isinstance(value, list) else value).contiguous()
    return out


class ConvertedWeights(Mapping[str, torch.Tensor]):
    """A module's tensors from an attached checkpoint: views of ``source`` under the
    module's names, and the built ones, views of the ``derived`` model the daemon keeps
    (or, where it could not keep them, this process's own). ``built_here`` says whether
    this process built them. Pass it to :func:`~weightcache.load_into_module`."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: AttachedModel, derived: AttachedModel | None,
                 derived_name: str | None, built_here: bool) -> None:
        self._tensors = tensors
        self.source = source
        self.derived = derived
        self.derived_name = derived_name
        self.built_here = built_here

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return (f"ConvertedWeights(source={self.source.name!r}, derived={self.derived_name!r}, tensors={len(self)}, "
                f"built_here={self.built_here})")


def derived_model(name: str, fingerprint: str, p: Plan, module: nn.Module) -> tuple[str, str]:
    """The daemon name and fingerprint of ``name``'s tensors that ``p`` builds: keyed by the
    source's content fingerprint and the conversion's identity, so that another checkpoint
    or another transformers gets another one."""
    fp = f"{fingerprint}+{p.identity(module)}"
    return f"{name[:100]}:converted-{hashlib.sha256(fp.encode()).hexdigest()[:12]}", fp


def _whole_models_only(attach_args: dict[str, Any]) -> None:
    # transformers converts a whole checkpoint; one rank's shard of a sharded model is not one.
    if attach_args.get("rank") is not None:
        raise ValueError("attach_converted converts whole checkpoints, not one rank's shard (rank=): attach the shard "
                         "with client.attach(name, rank=...) and pass it to load_into_module")


def _trusted(derived: AttachedModel, fingerprint: str) -> bool:
    return derived.fingerprint == tenant_fingerprint(fingerprint, os.getuid())


_MISSING = (UnknownModel, LoadFailed)  # never published, or evicted since (a published model has no files)
# Why a publish may fail and the engine still serve, from the tensors it built: the name is
# held by an attached model (another uid's or another source's), no room, the uid's quota.
_NOT_KEPT = (Attached, NoSpace, PermissionDenied, LimitExceeded)


@contextlib.contextmanager
def attach_converted(client: SyncClient, name: str, module: nn.Module, device: str | None = None,
                     **attach_args: Any) -> Iterator[ConvertedWeights]:
    """Attach ``name`` for ``module`` (a skeleton, e.g. from
    :func:`~weightcache.empty_parameters`), converted as transformers converts it. Renamed
    tensors are views of the checkpoint. Tensors that must be built (fused MoE experts,
    dtype casts) are built once and published to the daemon as a derived model, named
    and fingerprinted from the source's content fingerprint and the conversion
    (:func:`derived_model`); later engines attach that one. Both leases last as long as
    the block.

    >>> with SyncClient() as c, attach_converted(c, "mixtral", skeleton) as w:   # doctest: +SKIP
    ...     model = load_into_module(skeleton, w)
    """
    _whole_models_only(attach_args)
    with client.attach(name, device, **attach_args) as source:
        p = plan(module, source)
        if not p.built:
            yield ConvertedWeights(p.resolve(source, {}), source, None, None, False)
            return
        dname, dfp = derived_model(name, source.fingerprint, p, module)
        with contextlib.ExitStack() as stack:
            derived, built_here = _attach_derived(client, stack, dname, dfp, device, attach_args), False
            built: Mapping[str, torch.Tensor] | None = None
            if derived is None:
                built, built_here = build(p, source, module), True
                try:
                    client.publish(dname, built, fingerprint=dfp, replace=True)
                except _NOT_KEPT as exc:
                    log.warning("could not publish %s's converted tensors as %s: %s", name, dname, exc)
                derived = _attach_derived(client, stack, dname, dfp, device, attach_args)
            yield ConvertedWeights(p.resolve(source, derived if derived is not None else built or {}), source, derived,
                                   dname, built_here)


def _attach_derived(client: SyncClient, stack: contextlib.ExitStack, name: str, fingerprint: str, device: str | None,
                    attach_args: dict[str, Any]) -> AttachedModel | None:
    try:
        with contextlib.ExitStack() as attempt:
            derived = attempt.enter_context(client.attach(name, device, **attach_args))
            if not _trusted(derived, fingerprint):
                return None  # another source's or another uid's: built again and replaced
            stack.enter_context(attempt.pop_all())
            return derived
    except _MISSING:
        return None


@contextlib.asynccontextmanager
async def attach_converted_async(client: Client, name: str, module: nn.Module, device: str | None = None,
                                 **attach_args: Any) -> AsyncIterator[ConvertedWeights]:
    """:func:`attach_converted` for the asyncio :class:`~weightcache.Client`."""
    _whole_models_only(attach_args)
    async with client.attach(name, device, **attach_args) as source:
        p = plan(module, source)
        if not p.built:
            yield ConvertedWeights(p.resolve(source, {}), source, None, None, False)
            return
        dname, dfp = derived_model(name, source.fingerprint, p, module)
        async with contextlib.AsyncExitStack() as stack:
            derived, built_here = await _attach_derived_async(client, stack, dname, dfp, device, attach_args), False
            built: Mapping[str, torch.Tensor] | None = None
            if derived is None:
                built, built_here = build(p, source, module), True
                try:
                    await client.publish(dname, built, fingerprint=dfp, replace=True)
                except _NOT_KEPT as exc:
                    log.warning("could not publish %s's converted tensors as %s: %s", name, dname, exc)
                derived = await _attach_derived_async(client, stack, dname, dfp, device, attach_args)
            yield ConvertedWeights(p.resolve(source, derived if derived is not None else built or {}), source, derived,
                                   dname, built_here)


async def _attach_derived_async(client: Client, stack: contextlib.AsyncExitStack, name: str, fingerprint: str,
                                device: str | None, attach_args: dict[str, Any]) -> AttachedModel | None:
    try:
        async with contextlib.AsyncExitStack() as attempt:
            derived = await attempt.enter_async_context(client.attach(name, device, **attach_args))
            if not _trusted(derived, fingerprint):
                return None
            await stack.enter_async_context(attempt.pop_all())
            return derived
    except _MISSING:
        return None
