"""Put attached weights into an ``nn.Module`` without copying a byte."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import nn


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Build modules whose *parameters* live on the ``meta`` device (no memory, no
    initialization cost) while their *buffers* are computed for real.

    This is the skeleton for :func:`load_into_module`: building an 8B model for real
    allocates and randomly initializes 16 GB only to throw it away. Building it under
    ``torch.device("meta")`` costs nothing but leaves non-persistent buffers (rotary
    frequencies, masks), which no checkpoint holds, as meta tensors with no values; and
    ``torch.nn.utils.skip_init`` / ``to_empty`` leave them uninitialized. So each
    parameter is moved to ``meta`` as it is registered, before the module's own
    ``reset_parameters`` runs on it (accelerate's ``init_empty_weights(include_buffers=False)``
    does the same; accelerate is not a dependency of this package).

    It patches ``nn.Module.register_parameter`` for the duration of the block: build the
    skeleton in one thread at a time.

    >>> with empty_parameters():                                  # doctest: +SKIP
    ...     model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            # Keep the Parameter's class and attributes (frameworks tag parameters).
            # Subclasses (quantized ones) take their attributes as constructor arguments.
            if type(param) is nn.Parameter:
                meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                meta.__dict__.update(param.__dict__)
            else:
                meta = type(param)(param.to("meta"), **dict(param.__dict__, requires_grad=param.requires_grad))
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_into_module(module: nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool = True) -> nn.Module:
    """Make ``module``'s parameters and buffers views of ``weights`` (e.g. an
    :class:`~weightcache.AttachedModel`). Returns the module.

    A transformers model gets the checkpoint converted as ``from_pretrained`` converts it
    (weightcache/client/conversions.py): keys renamed by transformers' own conversion
    for the class (views under new names), each tensor in the dtype ``from_pretrained``
    gives it (the load dtype; fp32 for ``_keep_in_fp32_modules``; the skeleton, on
    ``meta``, takes it). What must be built (fused MoE experts, a cast) is built here, in
    this process's memory; :func:`~weightcache.client.conversions.attach_converted` builds
    it once and keeps it in the daemon instead. Any other module gets no conversion.

    Checks, before touching the module: with ``strict`` the key sets match exactly
    (missing and unexpected keys are both named, with the way out); every shared key has
    the same shape and dtype (no silent casts beyond transformers' own); no parameter or
    buffer is left on ``meta`` (a skeleton from :func:`empty_parameters` needs every
    parameter in the weights). Buffers that the weights do not hold (non-persistent ones:
    rotary frequencies) are moved to the weights' device, so that the module is ready to
    run there. The parameters come back with ``requires_grad=False``: they are views of
    read-only shared memory. For the same reason a later ``load_state_dict`` that would
    copy into them (without ``assign=True``) raises instead of crashing the process;
    one that loads other tensors (an adapter's) is left alone.

    >>> with SyncClient() as c, c.attach("tiny") as w:      # doctest: +SKIP
    ...     with empty_parameters():
    ...         skeleton = TinyModel()
    ...     model = load_into_module(skeleton, w)
    """
    from .conversions import build, plan

    own = module.state_dict(keep_vars=True)
    p = plan(module, weights, own)
    unexpected_keys = p.unexpected
    if p.converted or p.built:
        weights = p.resolve(weights, build(p, weights, module))
    else:
        unexpected_keys = []
    aliases = _alias_groups(module, own)
    # A tied tensor is one key of the weights, as in the checkpoint that stores it once:
    # ``canonical`` maps every name of a group to the one whose tensor the group gets.
    canonical = {name: _pick(group, weights) for group in aliases for name in group}
    covered = set(weights) | {n for n, c in canonical.items() if c in weights}
    problems, missing, unexpected = [], [], []
    if strict:
        missing = sorted(set(own) - covered)
        unexpected = sorted({*unexpected_keys, *(set(weights) - set(own))})
        if missing:
            problems.append(f"missing keys: {_some(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_some(unexpected)}")
    wrong_dtype = []
    for key in sorted(set(own) & covered):
        mine, theirs = own[key], weights[canonical.get(key, key)]
        if mine.shape != theirs.shape:
            problems.append(f"{key}: shape {tuple(theirs.shape)} in the weights, {tuple(mine.shape)} in the module")
        elif mine.dtype != theirs.dtype and p.dtypes.get(key) != theirs.dtype:
            problems.append(f"{key}: dtype {theirs.dtype} in the weights, {mine.dtype} in the module")
            wrong_dtype.append(theirs.dtype)
    left_on_meta = sorted(k for k, t in _named_tensors(module) if t.is_meta and k not in covered)
    if left_on_meta and not (strict and problems):  # under strict, "missing keys" already names them
        problems.append(f"left on the meta device (not in the weights): {_some(left_on_meta)}")
    devices = {t.device for t in weights.values()}
    if len(devices) > 1:
        problems.append(f"the weights span several devices: {sorted(map(str, devices))}")
    if problems:
        raise ValueError(f"cannot load weights into {type(module).__name__}: " + "; ".join(problems)
                         + _way_out(module, missing, unexpected, wrong_dtype))
    # assign=True makes each parameter wrap the given tensor instead of copying into it.
    # Only one name per tied group is assigned (assign would give each name a Parameter
    # of its own and untie them); the others are made that same Parameter afterwards.
    chosen = {k: v for k, v in weights.items() if k in own and canonical.get(k, k) == k}
    chosen.update({c: weights[c] for c in set(canonical.values()) if c in weights})
    module.load_state_dict(chosen, strict=False, assign=True)
    for name, source in canonical.items():
        if name != source and source in weights:
            _set_tensor(module, name, _get_tensor(module, source))
    for p_ in module.parameters():
        p_.requires_grad_(False)
    device = next(iter(devices), None)
    views = {n for n in own if n in covered}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        p_dot = f"{prefix}." if prefix else ""
        if sub._parameters or sub._buffers:
            if sub not in _attached:
                sub.register_load_state_dict_pre_hook(_refuse_copy_into_views)
            _attached[sub] = {leaf: weakref.ref(t) for leaf, t in (*sub._parameters.items(), *sub._buffers.items())
                              if t is not None and p_dot + leaf in views}
        for name, buf in sub._buffers.items():
            if device is not None and buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)
    return module


def _way_out(module: nn.Module, missing: list[str], unexpected: list[str], wrong_dtype: list[torch.dtype]) -> str:
    """What to do about keys or dtypes that do not match, for the error's end."""
    hints = []
    if missing and unexpected:
        prefix = _prefix_between(missing, unexpected)
        if prefix is not None:
            strip, add = prefix
            hints.append(f"the weights' keys differ from the module's by a prefix: pass "
                         f"{{{f'{add!r} + ' if add else ''}k{f'.removeprefix({strip!r})' if strip else ''}: v "
                         "for k, v in weights.items()}} (the same tensors, no copy)")
        elif _is_transformers(module):
            import transformers

            hints.append(f"transformers {transformers.__version__}'s conversion for {type(module).__name__} does not "
                         "map these keys either: check that the checkpoint is this model's, register a conversion "
                         "(transformers.conversion_mapping.register_checkpoint_conversion_mapping), or publish the "
                         "converted state dict once (docs/engine-integration.md, \"Publish\")")
        else:
            hints.append("rename the weights' keys to the module's (a dict of the same tensors: views, no copy), or "
                         "publish the processed tensors once (docs/engine-integration.md, \"Publish\")")
    elif missing:
        hints.append("the weights do not hold these: build the skeleton from the checkpoint's own config (it may "
                     "have fewer layers, or no such head)")
    elif unexpected:
        hints.append("strict=False leaves the weights' extra tensors out")
    if wrong_dtype:
        dtype = max(set(wrong_dtype), key=wrong_dtype.count)
        if _is_transformers(module):
            hints.append(f"build the skeleton in the checkpoint's dtype (from_config(cfg, dtype={dtype}) under "
                         "empty_parameters(); a parameter kept in another dtype: cast it on the skeleton, still on meta)")
        else:
            hints.append(f"build the skeleton in the checkpoint's dtype: under empty_parameters() its "
                         f"parameters are on meta, so casting them costs nothing (module.to({dtype}) casts its "
                         "floating buffers too)")
    return "".join(f". Way out: {h}" for h in hints)


def _prefix_between(missing: list[str], unexpected: list[str]) -> tuple[str, str] | None:
    """(strip, add) such that ``add + k.removeprefix(strip)`` turns every unexpected key
    into a missing one, or None."""
    u, m = unexpected[0], set(missing)
    for cut in range(len(u)):
        if cut and u[cut - 1] != ".":
            continue
        rest = u[cut:]
        for cand in (c for c in m if c.endswith(rest) and (len(c) == len(rest) or c[-len(rest) - 1] == ".")):
            strip, add = u[:cut], cand[: len(cand) - len(rest)]
            if (strip or add) and all(k.startswith(strip) and add + k[len(strip):] in m for k in unexpected):
                return strip, add
    return None


def _is_transformers(module: nn.Module) -> bool:
    from .conversions import _transformers_model

    return _transformers_model(module)


# The tensors each module got from load_into_module: {local name: the view}, for the guard below.
_attached: weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.ref[torch.Tensor]]] = weakref.WeakKeyDictionary()


def _refuse_copy_into_views(module: nn.Module, state_dict: Mapping[str, torch.Tensor], prefix: str,
                            local_metadata: dict[str, object], *_: object) -> None:
    # load_state_dict copies into the existing tensors unless assign=True: into read-only
    # shared memory that is a SIGSEGV on the CPU and a CUDA error on a GPU. Raised from a
    # pre-hook because torch copies before it reports the errors that hooks collect. Only
    # keys that would land on an attached view count: an adapter's lora_A/lora_B, or an
    # empty state dict, load as usual.
    if local_metadata.get("assign_to_params_buffers", False):
        return
    views = _attached.get(module, {})
    hit = sorted(prefix + leaf for leaf, ref in views.items()
                 if prefix + leaf in state_dict and ref() is not None
                 and ref() is (module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)))
    if hit:
        where = f" ({prefix.rstrip('.')})" if prefix else ""
        raise RuntimeError(f"{type(module).__name__}{where}: {_some(hit)} are read-only views of weightcache memory, so "
                           "load_state_dict cannot copy into them; pass assign=True, leave those keys out, or call "
                           "weightcache.load_into_module again")


def _alias_groups(module: nn.Module, own: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names under which one tensor appears more than once in ``module``'s state dict:
    the parameters a model ties (an output layer that is its input embedding). These
    are found by identity, which is what ``tie_weights()`` leaves behind (transformers'
    ``post_init`` runs it, under ``empty_parameters`` too), plus the pairs the model
    declares in ``_tied_weights_keys`` (transformers 5: {target: source}; 4: a list of
    targets whose source is the input embedding) for a skeleton whose ties were undone.
    Each group is in the module's order, the declared source first."""
    by_id: dict[int, list[str]] = {}
    for name, t in own.items():
        by_id.setdefault(id(t), []).append(name)
    groups = [g for g in by_id.values() if len(g) > 1]
    for target, source in _declared_ties(module).items():
        if target not in own or source not in own:
            continue
        g_t = next((g for g in groups if target in g), [target])
        g_s = next((g for g in groups if source in g), [source])
        if g_t is g_s:
            continue
        groups = [g for g in groups if g is not g_t and g is not g_s]
        groups.append([*g_s, *g_t])
    # The declared source leads its group (from_pretrained keeps the source's bytes).
    sources = set(_declared_ties(module).values())
    return [sorted(g, key=lambda n: n not in sources) for g in groups]


def _declared_ties(module: nn.Module) -> dict[str, str]:
    """``{target: source}`` of every tie ``module``'s submodules declare (transformers'
    ``_tied_weights_keys``, with the submodule's prefix), only where the model's config
    says the embeddings are tied."""
    ties: dict[str, str] = {}
    for prefix, sub in module.named_modules():
        declared = getattr(type(sub), "_tied_weights_keys", None)
        config = getattr(sub, "config", None)
        if not declared or not getattr(config, "tie_word_embeddings", True):
            continue
        p = f"{prefix}." if prefix else ""
        if isinstance(declared, Mapping):
            ties.update({p + t: p + s for t, s in declared.items()})
        else:  # transformers 4: targets, tied to the input embedding
            get_input = getattr(sub, "get_input_embeddings", None)
            embed = get_input() if callable(get_input) else None
            source = next((n for n, m in sub.named_modules() if m is embed), None)
            if source is not None:
                ties.update({p + t: f"{p}{source}.weight" for t in declared})
    return ties


def _pick(group: list[str], weights: Mapping[str, torch.Tensor]) -> str:
    """The name of ``group`` whose tensor the group gets: the first one the weights hold
    (the source, where the checkpoint stores both, as from_pretrained does)."""
    return next((n for n in group if n in weights), group[0])


def _get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    return sub._parameters[leaf] if leaf in sub._parameters else sub._buffers[leaf]  # type: ignore[return-value]


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner)
    if leaf in sub._parameters:
        sub._parameters[leaf] = tensor  # type: ignore[assignment]
    else:
        sub._buffers[leaf] = tensor


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _some(keys: list[str]) -> str:
    return f"{keys[:10]}{' ...' if len(keys) > 10 else ''}"
