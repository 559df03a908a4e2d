"""Put attached weights into an ``nn.Module`` without copying a byte."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def load_into_module(module: nn.Module, weights: Mapping[str, torch.Tensor], *, strict: bool = True) -> nn.Module:
    """Make ``module``'s parameters and buffers views of ``weights`` (e.g. an
    :class:`~weightcache.AttachedModel`). Returns the module.

    Checks, before touching the module: with ``strict`` the key sets match exactly
    (missing and unexpected keys are both named); every shared key has the same shape
    and dtype (no silent casts: a cast would be a copy). The parameters come back with
    ``requires_grad=False``: they are views of read-only shared memory.

    >>> with SyncClient() as c, c.attach("tiny") as w:      # doctest: +SKIP
    ...     model = load_into_module(TinyModel(), w)
    """
    own = module.state_dict(keep_vars=True)
    problems = []
    if strict:
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        if missing:
            problems.append(f"missing keys: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            problems.append(f"unexpected keys: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
    for key in sorted(set(own) & set(weights)):
        mine, theirs = own[key], weights[key]
        if mine.shape != theirs.shape:
            problems.append(f"{key}: shape {tuple(theirs.shape)} in the weights, {tuple(mine.shape)} in the module")
        elif mine.dtype != theirs.dtype:
            problems.append(f"{key}: dtype {theirs.dtype} in the weights, {mine.dtype} in the module")
    if problems:
        raise ValueError(f"cannot load weights into {type(module).__name__}: " + "; ".join(problems))
    # assign=True makes each parameter wrap the given tensor instead of copying into it.
    module.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=strict, assign=True)
    for p in module.parameters():
        p.requires_grad_(False)
    return module
