"""What a reload does to the daemon-wide settings: [budgets] and daemon.max_loaded_models
applied in place (evicting what a lowered one no longer holds), the [daemon] keys read at
start only reported, and the one budget check start and reload share (``resolve_budget``).
daemon.py's reload_config calls these before it turns to the models; each adds to the
reload's report (docs/protocol.md, "reload"): every change that did not take effect is a
line in ``failed``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..backends import Backend
from ..cache import CacheCore, StepDown
from ..config import Budget, Settings
from ..errors import ConfigError, NoSpace
from ..units import format_size
from .residency import Residency


def resolve_budget(device: str, budget: Budget, total: int) -> int:
    """The bytes ``budget`` gives ``device``, whose memory is ``total`` bytes; a size the
    device does not have is a ConfigError naming the key. Start (main.build) and reload
    both call this: a reload accepted 100 TiB on a 23 GiB host that start refused."""
    if budget.nbytes is not None and budget.nbytes > total:
        raise ConfigError(f"budgets.{device}: {budget} is more than the device's {format_size(total)}; "
                          "give a size it has, or a fraction such as \"0.8\"", key=f"budgets.{device}")
    return budget.resolve(total)


def settings_changes(old: Settings, new: Settings, report: dict[str, Any]) -> None:
    """[daemon] keys other than max_loaded_models are read at start only (sockets,
    limits, access lists, pools): a changed one is a change that did not take effect."""
    for key in type(old.daemon).model_fields:
        if key == "max_loaded_models" or getattr(new.daemon, key) == getattr(old.daemon, key):
            continue
        report["failed"].append(f"daemon.{key}: changed in the file, but read at start only: restart the daemon "
                                "to apply it")
    if new.peers != old.peers:  # [peers] (weightcache/peers/): its port, agent and peers are made at start
        report["failed"].append("peers: changed in the file, but read at start only: restart the daemon to apply it")


def evicted(core: CacheCore, step: StepDown, reason: str) -> list[dict[str, Any]]:
    """What ``step`` moves off its device, for the reload's report (before it is done)."""
    out = []
    for name in step.leaving:
        # What the budget counted for it, as `models` and `ps` show it (the arena, padded,
        # and what the daemon holds for the checkpoint: Note [held bytes]).
        out.append({"name": name, "nbytes": core.entry(name).nbytes,
                    "to": "host" if name in step.demote or name in step.release else "evicted", "reason": reason})
    return out


async def _lowered(change: Callable[[], StepDown], key: str, reason: str, core: CacheCore, residency: Residency,
                   report: dict[str, Any]) -> bool:
    """Apply one limit ``change`` in the core and carry out the evictions it plans, listed
    under ``evicted``; False, with the reason under ``failed``, when attached or pinned
    models alone exceed the new limit (the old one stays)."""
    try:
        step = change()
    except NoSpace as exc:
        report["failed"].append(f"{key}: {exc.message}")
        return False
    report["evicted"] += evicted(core, step, reason)
    await residency.step_down.carry_out(step, reason=reason)
    residency.room.notify()
    return True


async def reload_max_loaded(core: CacheCore, backends: dict[str, Backend], residency: Residency,
                            new: Settings, report: dict[str, Any]) -> None:
    """Apply a changed daemon.max_loaded_models in place: a lowered count evicts
    unattached models in the policy's order, as a lowered budget does. A count that
    attached or pinned models exceed is not applied (the old one stays) and goes in
    ``failed``: the reload then exits non-zero."""
    wanted = new.daemon.max_loaded_models
    for device in sorted(set(wanted) | set(core.max_loaded)):
        limit, previous = wanted.get(device), core.max_loaded.get(device)
        if limit == previous:
            continue
        if device not in backends:
            report["failed"].append(f"max_loaded_models.{device}: a new device needs a daemon restart")
            continue
        if await _lowered(functools.partial(core.set_max_loaded, device, limit), f"max_loaded_models.{device}",
                          f"{device} max_loaded_models lowered", core, residency, report):
            report["max_loaded_models"].append({"device": device, "limit": limit, "previous": previous})


async def reload_budgets(core: CacheCore, backends: dict[str, Backend], residency: Residency,
                         new: Settings, report: dict[str, Any]) -> None:
    """Each [budgets] entry as start resolves and checks it (``resolve_budget``), then
    applied: a lowered budget evicts unattached models in the policy's order. A device
    the running daemon has no backend for, one the file no longer names, a budget
    larger than the device, and one that attached or pinned models exceed are not
    applied (the old budget stays) and go in ``failed``."""
    for device in sorted(set(backends) - set(new.budgets)):
        report["failed"].append(f"budgets.{device}: removed from the file, but a device's budget stays until the "
                                f"daemon restarts (now {format_size(core.devices[device].budget)})")
    for device, budget in new.budgets.items():
        if device not in backends:
            report["failed"].append(f"budgets.{device}: a new device needs a daemon restart")
            continue
        try:
            nbytes = resolve_budget(device, budget, backends[device].total_memory())
        except ConfigError as exc:
            report["failed"].append(exc.message)
            continue
        previous = core.devices[device].budget
        if nbytes == previous:
            continue

        def change(device: str = device, nbytes: int = nbytes) -> StepDown:
            step = core.set_budget(device, nbytes)
            backends[device].limit(nbytes)  # before the evictions are carried out, as the core now counts
            return step

        if await _lowered(change, f"budgets.{device}", f"{device} budget lowered", core, residency, report):
            report["budgets"].append({"device": device, "budget": nbytes, "previous": previous})
