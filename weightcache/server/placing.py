"""Which entries a load or attach acts on: for a model with ``device = "auto"``, the
replica on the device the placement core chooses (cache/placement.py, Note
[placement]), or the one on the device the request names; for any other model, its
entries as configured (a named device must be theirs).

The decision and its reason are logged and kept for ``models`` and ``status``
(``placement``). Reading a GPU's real free memory is one ``cuMemGetInfo`` per candidate
device, made on the loop (a driver call of microseconds), and only when some rank is
resident nowhere.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from ..backends import Backend
from ..cache import CacheCore, State
from ..cache.placement import Placement, place_ranks, views
from ..errors import BadRequest
from .registry import Registry

log = logging.getLogger("weightcache.daemon")


def entries_for(core: CacheCore, registry: Registry, backends: dict[str, Backend], name: str, rank: int | None,
                device: str | None) -> list[str]:
    """The entries a request on ``name`` (one ``rank``, or every rank when None; on
    ``device``, or placed when None) acts on, in rank order."""
    slots = registry.slots.get(name)
    if slots is None:  # placed by the operator: the request may only confirm the device
        entries = [registry.entry_for(name, rank)] if rank is not None else registry.members(name)
        if device is not None:
            for e in entries:
                if not backends[core.entry(e).device].names(device):
                    raise BadRequest(f"model {name!r} lives on {core.entry(e).device}, not {device}", model=name,
                                     device=device)
        return entries
    wanted = [registry.entry_for(name, rank)] if rank is not None else slots
    if device is not None:
        if len(wanted) > 1:
            raise BadRequest(f"model {name!r} is sharded over {len(slots)} ranks, each on its own device: name a "
                             f"rank= with device=", model=name, device=device)
        return [_named(core, registry, backends, name, wanted[0], device)]
    auto = [s for s in slots if s in registry.replicas]
    if not auto:
        return wanted
    # Every auto rank is placed together, so that one rank's engine asking alone gets the
    # device the others' placement leaves it (ranks on distinct devices).
    # The GPUs' real free memory matters only where a rank is not resident anywhere: an
    # attach of a resident model (the hit an engine restart is) makes no driver call.
    # (Two ranks resident only on one device, which named devices can cause, are then
    # placed without it: the budget still holds, the core's admission checks it.)
    resident = all(any(core.entry(e).state is State.RESIDENT for e in registry.replicas[s].values()) for s in auto)
    free = {} if resident else {d: backends[d].free_memory() for d in {d for s in auto for d in registry.replicas[s]}}
    fixed = {core.entry(s).device for s in slots if s not in registry.replicas}
    rank_views = [[v for v in views(core, registry.replicas[s], free) if v.device not in fixed] for s in auto]
    # The arena's size once any replica was loaded; before that the files' (size_hint).
    sizes = [max((core.entry(e).nbytes for e in registry.replicas[s].values()), default=0) or registry.size_hint.get(s, 0)
             for s in auto]
    try:
        decisions = dict(zip(auto, place_ranks(rank_views, sizes), strict=True))
    except ValueError as exc:
        raise BadRequest(f"model {name!r} cannot be placed: {exc}", model=name) from None
    out = []
    for s in wanted:
        if s not in decisions:  # a fixed rank
            out.append(s)
            continue
        p = decisions[s]
        _record(registry, name, s, p)
        out.append(registry.replicas[s][p.device])
    return out


def _named(core: CacheCore, registry: Registry, backends: dict[str, Backend], name: str, slot: str, device: str) -> str:
    """The replica of ``slot`` on the device a request names (an engine that must run there)."""
    if slot not in registry.replicas:  # a fixed rank of a partly auto model
        if not backends[core.entry(slot).device].names(device):
            raise BadRequest(f"{slot!r} lives on {core.entry(slot).device}, not {device}", model=name, device=device)
        return slot
    dev = registry.resolve_device(device)
    entry = registry.replicas[slot].get(dev)
    if entry is None:
        raise BadRequest(f'model {name!r} (device = "auto") is placed on {sorted(registry.replicas[slot])}, '
                         f"not {device}", model=name, device=device)
    _record(registry, name, slot, Placement(dev, "named"))
    return entry


def _record(registry: Registry, name: str, slot: str, p: Placement) -> None:
    """Keep the decision for ``models``; log it when it is news (not "already resident" again)."""
    new: dict[str, Any] = {"device": p.device, "reason": p.reason, "detail": p.describe(), "fits": p.fits,
                           "evicts": list(p.evicts)}
    old = registry.placed.get(slot)
    registry.placed[slot] = new
    if p.reason != "resident" or old is None or old["device"] != p.device:
        log.info("placed %s on %s", slot, p.describe(), extra={"model": name, "device": p.device, "reason": p.reason})


def checkpoint_bytes(path: Path, fds: list[int] | None = None) -> int:
    """About how many bytes a checkpoint's arena takes, before its headers are read: the
    sizes of its files (the headers are a sliver of them). ``fds``: a peer's own open
    files. 0 when it cannot tell (placement then treats the size as unknown). Blocking:
    stat calls, run in the io pool."""
    try:
        if fds is not None:
            return sum(os.fstat(fd).st_size for fd in fds)
        if path.is_dir():
            files = set(path.glob("*.safetensors"))
        elif path.suffix == ".json":
            index = json.loads(path.read_text())
            files = {path.parent / f for f in index.get("weight_map", {}).values() if isinstance(f, str)}
        else:
            files = {path}
        return sum(f.stat().st_size for f in files)
    except (OSError, ValueError, AttributeError):
        return 0
