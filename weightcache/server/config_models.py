"""The operator's models: those the config file names. Registered at start, checked
behind the socket (a bad path or header shows in ``models`` long before anyone loads
it), and, at a reload, added, removed, replaced or updated in place, winning their names
back from peers' models (Note [config names win]). daemon.py's reload applies the
daemon-wide settings (settings_reload.py), then hands the model list here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..backends import Backend
from ..cache import CacheCore
from ..config import AUTO, ModelConfig
from ..errors import WeightcacheError
from .registry import CHECK_FAILED, Registry
from .residency import Residency

log = logging.getLogger("weightcache.daemon")

# The fields a reload changes in place: the rest say which bytes and where.
POLICY_FIELDS = ("keep_alive", "pin", "preload", "allowed_uids", "allowed_gids")


class ConfigModels:
    def __init__(self, core: CacheCore, registry: Registry, residency: Residency, backends: dict[str, Backend],
                 shutting_down: Callable[[], bool]) -> None:
        self.core = core
        self.registry = registry
        self.residency = residency
        self.backends = backends
        self._shutting_down = shutting_down
        self.claims: dict[str, ModelConfig] = {}  # config names a peer's model still holds (Note [config names win])

    def preload_if_asked(self, mc: ModelConfig) -> None:
        if mc.preload:
            self.residency.preloads.start(mc.name)

    async def reload(self, models: list[ModelConfig], report: dict[str, Any]) -> None:
        """Apply a reloaded config's model list; each outcome goes in ``report`` (Daemon.reload_config)."""
        registry = self.registry
        wanted = {m.name: m for m in models}
        for name in list(self.claims):
            if name not in wanted:  # the file no longer names it: the peer's model keeps its name
                self._drop_claim(name)
        # Only the config's own models: what peers registered or published stays.
        for name in [n for n in registry.groups if registry.first(n).origin == "config"]:
            old = registry.first(name).config
            mc = wanted.get(name)
            if mc == old:
                report["unchanged"].append(name)
                continue
            if mc is not None and mc == old.model_copy(update={f: getattr(mc, f) for f in POLICY_FIELDS}):
                self._update_policy(name, old, mc)
                report["updated"].append(name)
                wanted.pop(name)
                continue
            if mc is not None:
                problem = await self.checkpoint_problem(mc)
                if problem is not None:  # keep what works until the file is fixed
                    report["failed"].append(f"{name}: {problem.message}")
                    wanted.pop(name)
                    continue
            try:
                self.residency.step_down.forget(registry.unregister(name))
            except WeightcacheError as exc:
                what = "changed in the file" if mc is not None else "removed from the file"
                report["failed"].append(f"{name}: {what}, but kept as it was: {exc.message}; run the reload again "
                                        "once it is free")
                wanted.pop(name, None)
                continue
            self.residency.preloads.forget(name)
            report["changed" if name in wanted else "removed"].append(name)
        for name, mc in wanted.items():
            if name in registry.groups and registry.first(name).origin == "config":
                continue  # unchanged: the config's own model stands
            # Checked before the peer's model of that name is displaced, so that no await
            # lies between displacing it and registering the config's: a peer that
            # registered the name again meanwhile made the reload fail half done.
            problem = None if name in report["changed"] else await self.checkpoint_problem(mc)
            missing = [dev for _p, dev in mc.parts if dev not in self.backends and dev != AUTO]
            if missing:
                report["failed"].append(f"{name}: device {missing[0]} has no budget in the running daemon "
                                        "(a new device needs a daemon restart)")
                continue
            if name in registry.groups and registry.first(name).origin != "config":
                # The config names it: the operator's model wins over a peer's of that name
                # (else a tenant could take a name before the operator adds it).
                try:
                    self.residency.step_down.forget(registry.unregister(name))
                except WeightcacheError as exc:
                    self._claim(name, mc)
                    owner = registry.first(name).owner
                    report["pending"].append(
                        f"{name}: a model of that name registered by uid {owner} stays while {exc.message}; new "
                        "attaches of it are refused, and the config's model takes the name when they end")
                    continue
                report["displaced"].append(name)
            if name not in registry.groups:
                # Checked before it is registered (above): what `models` shows from then on is final.
                registry.register(mc)
                if name not in report["changed"]:
                    report["added"].append(name)
                    if problem is not None:
                        # A new model with a bad file is registered (the operator sees it and
                        # its last_error in `models`) but the reload reports it as failed.
                        self._mark_bad(name, problem)
                        report["failed"].append(f"{name}: {problem.message}")
                self.preload_if_asked(mc)

    # Note [config names win]
    # A tenant may register or publish a name before the operator adds it to the config
    # (it held one lease, the reload said "kept", and every tenant attaching
    # the name got the squatter's bytes). The config's name wins. Displaced at once when
    # the peer's model is free; while it is attached, the name is *claimed*: no new
    # load, attach, pin or evict of the peer's copy (Registry.check_use refuses them),
    # no register, publish or replace of the name by a peer (Registry.register,
    # swap_in), the existing leases run on (their mappings are the engines'), and when
    # the last ends (every lease end notifies space_freed) the peer's model is dropped
    # and the config's registered. The reload reports it under ``pending`` and exits
    # non-zero: the config's model is not serving yet. At a daemon restart the config's
    # models are registered before the socket listens, so no peer can take one.
    def _claim(self, name: str, mc: ModelConfig) -> None:
        first = name not in self.claims
        self.claims[name] = mc
        self.registry.claimed.add(name)
        if first:
            self.residency.tasks.spawn(self._take_name(name))

    def _drop_claim(self, name: str) -> None:
        self.claims.pop(name, None)
        self.registry.claimed.discard(name)

    async def _take_name(self, name: str) -> None:
        registry = self.registry
        while name in self.claims and not self._shutting_down():
            if name in registry.groups and registry.first(name).origin != "config":
                try:
                    self.residency.step_down.forget(registry.unregister(name))
                except WeightcacheError:
                    # Woken at each lease end (and each detach anywhere). The timeout bounds
                    # what wakes nobody (the peer unregistering or replacing its model); it
                    # decides nothing, each pass checks again.
                    await self.residency.room.freed.wait(self.residency.room.freed.ticket(), 5.0)
                    continue
                log.info("model %s: the peer's copy of that name had no lease left; the config's model takes the name",
                         name, extra={"model": name})
            mc = self.claims.pop(name)
            registry.claimed.discard(name)
            if name not in registry.groups:
                registry.register(mc)
                self.preload_if_asked(mc)
                await self.check([name])
            return



    def _update_policy(self, name: str, old: ModelConfig, mc: ModelConfig) -> None:
        """Apply a new keep_alive, pin or preload to a registered model without touching
        what is resident. A pin the file changed is applied; an unchanged one leaves a
        runtime pin or unpin (the ``pin`` op) as the operator set it."""
        for entry in self.registry.groups[name]:
            self.registry.models[entry].config = mc
            e = self.core.entry(entry)
            if mc.keep_alive != old.keep_alive:
                # The configured value, and the one in force: a request's keep_alive is
                # replaced by the operator's new one, as a fresh registration would be.
                e.configured_keep_alive = mc.keep_alive
                self.core.set_keep_alive(entry, mc.keep_alive)
            if mc.pin != old.pin:
                self.core.set_pinned(entry, mc.pin)
        if mc.preload and not old.preload:
            self.preload_if_asked(mc)
        elif not mc.preload:
            self.residency.preloads.forget(name)  # no longer gates readiness

    async def checkpoint_problem(self, mc: ModelConfig) -> WeightcacheError | None:
        """Why ``mc``'s checkpoints cannot be loaded (Checks.check_files, which register
        runs too), or None when they can."""
        return await self.residency.checks.check_files(mc)

    async def check(self, names: list[str]) -> list[str]:
        """Check each named config model's files; a bad one gets last_error (shown by
        ``models``, redacted for peers like a load's error) and a log line. Returns
        the names that failed."""
        bad = []
        for name in names:
            if name not in self.registry.groups:
                continue
            problem = await self.checkpoint_problem(self.registry.first(name).config)
            if name not in self.registry.groups:
                continue
            if problem is None:  # fixed since the last check: its error no longer applies
                for entry in self.registry.groups[name]:
                    m = self.registry.models[entry]
                    m.check_failed = None
                    if m.last_error is not None and m.last_error.get("reason") == CHECK_FAILED:
                        m.last_error = None
                continue
            bad.append(name)
            self._mark_bad(name, problem)
        return bad

    def _mark_bad(self, name: str, problem: WeightcacheError) -> None:
        # The check's own code (CORRUPT_CHECKPOINT for a bad header, LOAD_FAILED for a file
        # that does not open), as a load and a register of the same file say it.
        reason = problem.message
        err = type(problem)(f"{name}: {reason}", **{**problem.details, "model": name, "reason": CHECK_FAILED}).to_wire()
        for entry in self.registry.groups[name]:
            m = self.registry.models[entry]
            m.check_failed = reason
            if m.last_error is None:  # a real load's error says more
                m.last_error = err
        log.error("model %s cannot be loaded: %s; fix the file or the model's path in the config, then run "
                  "`weightcache reload` (until then `weightcache models` shows it as error)", name, reason,
                  extra={"model": name, "code": err["code"]})
