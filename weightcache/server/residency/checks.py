"""Reading checkpoints without loading them, in the io pool: whether a model's files can
be loaded at all (``check_files``), at start, at reload and at a register."""

from __future__ import annotations

import logging

from ...cache import CacheCore
from ...config import DaemonConfig, ModelConfig
from ...errors import LoadFailed, WeightcacheError
from ...loader import OpenedSource, open_source
from ...loader.sources import unindexed_note
from ..registry import Registry
from .io import IoPool, parse_charged

log = logging.getLogger("weightcache.daemon")


class Checks:
    def __init__(self, settings: DaemonConfig, core: CacheCore, registry: Registry, io: IoPool) -> None:
        self.settings = settings
        self.core = core
        self.registry = registry
        self.io = io

    async def check_files(self, mc: ModelConfig, sources: list[OpenedSource] | None = None,
                          tenant: int | None = None, tenants: tuple[str, ...] = ()) -> WeightcacheError | None:
        """Why ``mc``'s checkpoints cannot be loaded, as a load would say it (the files
        opened as a load opens them, or a peer's own ``sources``, and every header parsed,
        in the io pool), or None when they can. One check for every way a model arrives:
        the config at start and reload, and ``register`` (a pickle registered
        fine and failed only at its load)."""
        d = self.settings
        for i, (path, device) in enumerate(mc.parts):
            opened = None
            try:
                # As a load parses (its tenant's share of the io pool, its quota charged, the collector paused).
                if sources is not None:
                    target = sources[i]
                else:
                    target = opened = await self.io.run(open_source, path, roots=d.model_roots or None,
                                                        follow_symlinks=d.follow_symlinks, cleanup=OpenedSource.close,
                                                        tenant=tenant)
                await parse_charged(self.io, self.core, target, uid=tenant, tenants=tenants, device=device, what=mc.name)
                if sources is None:
                    note = await self.io.run(unindexed_note, path)
                    if note is not None:  # merged as it always was, but not silently
                        log.warning("model %s: %s", mc.name, note, extra={"model": mc.name})
            except WeightcacheError as exc:
                return exc
            except Exception as exc:  # an OSError and the like: the reason, not a traceback
                return LoadFailed(f"{type(exc).__name__}: {exc}", model=mc.name)
            finally:
                if opened is not None:
                    opened.close()
        return None
