"""Published models on disk: what survives a restart of the daemon.

Note [published store]
----------------------
With ``[published] dir`` set, every publish is also written to the store
(loader/store.py has the files): its tensors as a safetensors file named by their
content fingerprint (the same bytes published under two names, or twice, are one file),
and a record of the name, owner, access lists and fingerprints. The publish's reply
waits for the write (``on_disk`` in the model says whether it was kept, ``store_note``
why not): an engine whose publish returned can count on the next daemon having it.

At start (and at reload) the records are read back and their models registered again,
with their owners, tenants and access lists, as ``published`` models that are not
resident: the first attach or load reads the file with the loader's threads, which
hash every byte (Note [content fingerprint]); a fingerprint other than the recorded
one, or a file that cannot be parsed or read, is CORRUPT_CHECKPOINT for that request,
the record and its file are removed and the line logged, and the bytes are never
served. The model's fingerprint is the publish's, as before the restart.

What the store holds is bounded twice, as memory is (Note [quotas] in cache/eviction.py):
a tenant with ``quotas."uid:N".published`` may keep that many bytes (a file its models
share counted once); a publish that would pass it first removes that tenant's own
records, least recently used first; then the store's ``budget``, removing anyone's,
least recently used first. Records of models that are attached or loading are never
removed. A publish that cannot fit is still published in memory, not stored
(``store_note`` says which limit). The file being written counts once it is in place:
until then the store may pass its budget by the one file (written to tmp/ first).
"Used" is the record's last publish or read back, or the model's last use in this run
(attach, detach, load), whichever is later.

A model removed by its owner (unregister) or replaced by a new publish of its name
loses its record at once. The store's files are the daemon's alone: its directory must
be owned by root or the daemon's uid and writable by no one else (a start error
otherwise); a record or file in it that someone else could have written is ignored,
logged, and left alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..backends import Backend
from ..cache import CacheCore, State
from ..config import ModelConfig, Settings
from ..errors import ConfigError, CorruptCheckpoint, LoadFailed, NoSpace, WeightcacheError
from ..loader import OpenedSource, open_source, parse_checkpoint
from ..loader import store as disk
from ..loader.store import StoredRecord, StoreProblem
from ..units import format_size
from .registry import Registry
from .residency.fill import ReadFiles, _to_thread_finished
from .residency.io import collector_paused

if TYPE_CHECKING:
    from .access import AccessPolicy
    from .residency import Residency
    from .residency.job import LoadJob

log = logging.getLogger("weightcache.daemon")

# The connection id of the daemon's own lease on a publish's arena while it is written
# (SingleFlight's INTERNAL_CONN: real connections count from 1).
STORE_CONN = -1


class PublishedStore:
    def __init__(self, settings: Settings, core: CacheCore, registry: Registry, backends: dict[str, Backend],
                 residency: Residency, access: AccessPolicy) -> None:
        config = settings.published
        assert config.dir is not None and config.budget is not None
        self.root: Path = config.dir
        self.budget: int = config.budget
        self.settings = settings
        self.core = core
        self.registry = registry
        self.backends = backends
        self.residency = residency
        self.access = access
        self.records: dict[str, StoredRecord] = {}  # by model name
        self._lock = asyncio.Lock()  # one change of the records at a time
        self._reading: set[str] = set()  # names being read back (never removed meanwhile)
        self._lock_fd: int | None = None  # the store's flock, held while the daemon runs (loader/store.lock)

    # -- start and reload ---------------------------------------------------------------
    def open(self) -> None:
        """Check the directory and read the records (blocking: at start, before serving).
        ConfigError naming published.dir for a directory the daemon cannot use."""
        try:
            disk.prepare(self.root)
            self._lock_fd = disk.lock(self.root)
            for line in disk.clean_tmp(self.root):
                log.info("published store: %s", line)
            records, bad, ignored = disk.index(self.root)
        except (StoreProblem, OSError) as exc:
            raise ConfigError(f"published.dir: {exc}", key="published.dir") from None
        for path, why in bad:
            log.warning("published store: %s; removed", why)
            disk.remove_file(path)
        for why in ignored:
            log.warning("published store: ignored %s (the store's files must be the daemon's alone)", why)
        self.records = {r.name: r for r in records}
        log.info("published store %s: %d model(s), %s of a %s budget", self.root, len(records),
                 format_size(self.used()), format_size(self.budget))

    def restore(self) -> list[str]:
        """Register the stored models that are not registered: published, not resident,
        with their owners and access lists. Skipped (and logged): a name the config or a
        peer holds now, a device without a budget, an owner at max_models_per_uid."""
        added = []
        limit = self.settings.daemon.max_models_per_uid
        # the most recently used first: those are registered where max_models_per_uid leaves room for some
        for rec in sorted(self.records.values(), key=lambda r: r.used, reverse=True):
            if rec.name in self.registry.groups or rec.name in self.registry.models:
                if self.registry.models.get(rec.name) is not None and self.registry.models[rec.name].stored == rec.content:
                    continue  # it is this record's model
                log.warning("published store: %r is kept on disk but not registered: a model of that name is "
                            "registered (the config's, or one registered since)", rec.name, extra={"model": rec.name})
                continue
            if rec.device not in self.backends:
                log.warning("published store: %r was published on %s, which has no budget now; kept on disk, not "
                            "registered", rec.name, rec.device, extra={"model": rec.name})
                continue
            if rec.owner != 0 and rec.owner not in self.access.admin_uids and self.registry.models_owned_by(rec.owner) >= limit:
                log.warning("published store: %r not registered: uid %d has max_models_per_uid=%d models", rec.name,
                            rec.owner, limit, extra={"model": rec.name})
                continue
            try:
                mc = ModelConfig(name=rec.name, path=disk.blob_path(self.root, rec.content), device=rec.device,
                                 allowed_uids=rec.allowed_uids, allowed_gids=rec.allowed_gids)
                self.registry.register(mc, origin="publish", owner=rec.owner, tenants=rec.tenants)
            except (ValueError, WeightcacheError) as exc:
                log.warning("published store: %r not registered: %s", rec.name, exc, extra={"model": rec.name})
                continue
            model = self.registry.models[rec.name]
            model.stored, model.seen = rec.content, (rec.fingerprint, rec.tensors)
            added.append(rec.name)
        if added:
            log.info("published store: registered %d model(s) kept on disk: %s", len(added), ", ".join(added))
        return added

    async def reload(self, new: Settings, report: dict[str, Any]) -> None:
        """A new budget or quotas apply at once (removing what no longer fits); a new
        directory only at the next start. Records whose names are free again are registered."""
        if new.published.dir != self.root:
            report["failed"].append("published.dir: changed in the file, but read at start only: restart the daemon "
                                    "to apply it")
        self.settings = new  # its quotas and limits
        budget = new.published.budget
        if budget is not None and budget != self.budget:
            self.budget = budget
            async with self._lock:
                over = self._victims(None, budget)
                if over is None:
                    report["failed"].append(f"published.budget: {format_size(budget)} is less than the attached models' "
                                            f"files hold; {format_size(self.used())} kept")
                else:
                    for rec in over:
                        await self._drop(rec.name, f"published.budget lowered to {format_size(budget)}")
        self.restore()

    # -- sizes ---------------------------------------------------------------------------
    def used(self, records: list[StoredRecord] | None = None, tenant: str | None = None) -> int:
        """Bytes of the files ``records`` (default: all) name, each file once; only those
        of ``tenant``'s records if given."""
        recs = self.records.values() if records is None else records
        return sum({r.content: r.nbytes for r in recs if tenant is None or tenant in r.tenants}.values())

    def _quota(self, tenant: str) -> int | None:
        q = self.settings.quotas.get(tenant)
        return None if q is None else q.published

    def _last_used(self, rec: StoredRecord) -> float:
        """Wall-clock time of its last use: the record's, or its model's in this run."""
        idle = self.core.idle_s(rec.name) if rec.name in self.core.entries else None
        return max(rec.used, time.time() - idle) if idle is not None else rec.used

    def _removable(self, rec: StoredRecord) -> bool:
        if rec.name in self._reading:
            return False
        e = self.core.entries.get(rec.name)
        return e is None or self.registry.models[rec.name].stored != rec.content or not (e.leases or e.state is State.LOADING)

    def _victims(self, new: StoredRecord | None, budget: int) -> list[StoredRecord] | None:
        """The records to remove, least recently used first, so that ``new`` fits its
        tenants' quotas and the budget; None if removing every removable one would not do."""
        kept = [r for r in self.records.values() if new is None or r.name != new.name]
        order = sorted((r for r in kept if self._removable(r)), key=self._last_used)
        victims: list[StoredRecord] = []

        def total(tenant: str | None) -> int:
            return self.used([*kept, *([new] if new is not None else [])], tenant)

        def shed(tenant: str | None, limit: int) -> bool:
            for rec in list(order):
                if total(tenant) <= limit:
                    return True
                if tenant is not None and tenant not in rec.tenants:
                    continue
                before = total(tenant)
                kept.remove(rec)
                if total(tenant) < before:  # only a record whose file then goes frees anything
                    order.remove(rec)
                    victims.append(rec)
                else:
                    kept.append(rec)
            return total(tenant) <= limit

        for tenant in new.tenants if new is not None else ():
            quota = self._quota(tenant)
            if quota is not None and not shed(tenant, quota):
                return None
        return victims if shed(None, budget) else None

    def _refusal(self, rec: StoredRecord) -> str:
        """Why ``rec`` cannot fit (after _victims said so): the quota or the budget."""
        for tenant in rec.tenants:
            quota = self._quota(tenant)
            if quota is not None and self._victims(dataclasses.replace(rec, tenants=(tenant,)), 2**63) is None:
                return (f"its {format_size(rec.nbytes)} would put {tenant} over its quota of "
                        f'{format_size(quota)} on disk (quotas."{tenant}".published), counting what its attached '
                        "models' files hold")
        return (f"its {format_size(rec.nbytes)} do not fit the store's budget of {format_size(self.budget)} "
                "(published.budget) beside the files of attached models")

    # -- publish ---------------------------------------------------------------------------
    async def keep(self, name: str) -> None:
        """Write the just published, resident model ``name`` to the store (its reply
        waits for this); the outcome is in its record's ``stored`` and ``store_note``."""
        model = self.registry.models[name]
        arena, ckpt = model.resident.arena, model.resident.checkpoint
        assert arena is not None and ckpt is not None and model.owner is not None
        backend = self.backends[model.device]
        async with self._lock:
            if name in self.records:  # the version it replaced is not this name's any more
                await self._drop(name, "replaced by a new publish")
        size = await asyncio.to_thread(disk.blob_size, ckpt)
        rec = StoredRecord(name=name, device=model.device, owner=model.owner, tenants=self.core.entry(name).tenants,
                           allowed_uids=model.config.allowed_uids, allowed_gids=model.config.allowed_gids,
                           fingerprint=ckpt.fingerprint, content="0" * 32, nbytes=size, tensors=len(ckpt.tensors),
                           published=time.time(), used=time.time())
        for tenant in rec.tenants:  # what could never fit is not written
            quota = self._quota(tenant)
            if quota is not None and size > quota:
                return self._not_kept(model, f"its {format_size(size)} are more than {tenant}'s quota of "
                                             f'{format_size(quota)} on disk (quotas."{tenant}".published)')
        if size > self.budget:
            return self._not_kept(model, f"its {format_size(size)} are more than the store's budget of "
                                         f"{format_size(self.budget)} (published.budget)")
        lease = self.core.attach(name, STORE_CONN)  # the arena is not freed while it is read
        t0 = time.monotonic()
        try:
            temp, content, size = await _to_thread_finished(self._write, backend, arena, ckpt)
        except Exception as exc:
            return self._not_kept(model, f"writing it failed: {exc}")
        finally:
            self.core.detach(lease.id, STORE_CONN)
            self.residency.room.notify()
        rec = dataclasses.replace(rec, content=content, nbytes=size)
        try:
            async with self._lock:
                if self.registry.models.get(name) is not model:
                    raise StoreProblem("the model was replaced or removed while it was written")
                victims = self._victims(rec, self.budget)
                if victims is None:
                    raise StoreProblem(self._refusal(rec))
                for v in victims:
                    await self._drop(v.name, f"least recently used, to make room for {name!r}")
                await asyncio.to_thread(disk.commit_blob, self.root, temp, content)
                await asyncio.to_thread(disk.write_record, self.root, rec)
                self.records[name] = rec
        except (StoreProblem, OSError) as exc:
            await asyncio.to_thread(disk.remove_file, str(temp))
            return self._not_kept(model, str(exc))
        model.stored, model.store_note = content, None
        log.info("published store: kept %s (%d tensors, %s, content %s) in %.3fs; the store holds %s of %s", name,
                 rec.tensors, format_size(size), content, time.monotonic() - t0, format_size(self.used()),
                 format_size(self.budget), extra={"model": name, "bytes": size})
        return None

    def _write(self, backend: Backend, arena: Any, ckpt: Any) -> tuple[Path, str, int]:
        with backend.reading(arena) as read:
            return disk.write_blob(self.root, ckpt, read)

    def _not_kept(self, model: Any, why: str) -> None:
        model.stored, model.store_note = None, f"not kept on disk: {why}"
        self.residency.fill.model_event(model, logging.WARNING, "publish not stored", "published store: %s not kept: %s",
                                        model.config.name, why, extra={"model": model.config.name})

    async def forget(self, name: str, why: str) -> None:
        """``name`` was unregistered or replaced: its record goes (and its file, if no
        other record names it)."""
        async with self._lock:
            if name in self.records:
                await self._drop(name, why)

    async def _drop(self, name: str, why: str) -> None:
        """Remove ``name``'s record, and its file where no other record names it (lock held)."""
        rec = self.records.pop(name)
        model = self.registry.models.get(name)
        if model is not None and model.stored == rec.content:
            model.stored = None
        shared = any(r.content == rec.content for r in self.records.values())
        await asyncio.to_thread(disk.remove_record, self.root, name)
        if not shared:
            await asyncio.to_thread(disk.remove_blob, self.root, rec.content)
        log.info("published store: removed %s (%s): %s", name, format_size(rec.nbytes), why, extra={"model": name})

    # -- reading back ------------------------------------------------------------------------
    def record_for(self, name: str) -> StoredRecord | None:
        """The record a load of the published model ``name`` reads, if it is stored."""
        rec = self.records.get(name)
        model = self.registry.models.get(name)
        return rec if rec is not None and model is not None and model.stored == rec.content else None

    async def read_back(self, job: LoadJob, rec: StoredRecord) -> str:
        """Fill ``job``'s published model from its file, every byte checked against the
        recorded content fingerprint (Note [published store])."""
        name = job.name
        model = self.registry.models[name]
        backend = self.backends[model.device]
        d = self.settings.daemon
        io = self.residency.io
        path = disk.blob_path(self.root, rec.content)
        self._reading.add(name)
        opened: OpenedSource | None = None
        try:
            try:
                opened = await io.run(open_source, path, roots=None, follow_symlinks=False, cleanup=OpenedSource.close,
                                      tenant=model.owner)
                ckpt = await io.run(collector_paused(parse_checkpoint), opened, tenant=model.owner)
                fill = CheckedRead(ReadFiles(backend, d, opened, label=name, cancelled=lambda: job.abandoned.is_set()),
                                   rec.content, str(path))
                await self.residency.fill.fill_new_arena(
                    name, dataclasses.replace(ckpt, fingerprint=rec.fingerprint), backend.capacity(ckpt.arena_bytes), 0,
                    fill, verb="read back from the published store", job=job)
            except NoSpace:
                raise  # the caller waits for room and tries again
            except WeightcacheError as exc:
                if job.abandoned.is_set() or not _damaged(exc):
                    raise  # the file may be whole: a later read tries again
                await self._corrupt(name, rec, exc)
                raise CorruptCheckpoint(f"published model {name!r}: its copy on disk is damaged ({exc.message}); it "
                                        "was removed from the store: publish it again", model=name,
                                        reason="stored copy damaged") from None
        finally:
            self._reading.discard(name)
            if opened is not None:
                opened.close()
        async with self._lock:
            if self.records.get(name) is rec:
                self.records[name] = rec = dataclasses.replace(rec, used=time.time())
                try:
                    await asyncio.to_thread(disk.write_record, self.root, rec)
                except OSError as exc:
                    log.warning("published store: could not note the use of %s: %s", name, exc)
        return "disk"

    async def _corrupt(self, name: str, rec: StoredRecord, exc: WeightcacheError) -> None:
        log.error("published store: %s's file %s is damaged (%s): removed, never served", name,
                  disk.blob_path(self.root, rec.content), exc.message, extra={"model": name, "code": exc.code})
        async with self._lock:
            if self.records.get(name) is rec:
                await self._drop(name, "its file is damaged")
            # other names of the same damaged file go too: their reads would fail the same way
            for other in [r.name for r in self.records.values() if r.content == rec.content]:
                await self._drop(other, f"its file is {name!r}'s, which is damaged")

    def status(self) -> dict[str, Any]:
        return {"dir": str(self.root), "budget": self.budget, "used": self.used(), "models": len(self.records)}


def _damaged(exc: WeightcacheError) -> bool:
    """Whether a read back failed for the file itself (malformed, truncated, other bytes,
    gone) rather than for the moment (a timeout, a cancelled load, no memory)."""
    reason = exc.details.get("reason")
    if isinstance(exc, CorruptCheckpoint):
        return reason not in ("cancelled", "changed during load")
    return isinstance(exc, LoadFailed) and reason in ("not found", "not a regular file", "empty", "symlink")


@dataclasses.dataclass(frozen=True)
class CheckedRead:
    """A read of a stored file whose bytes must hash to the recorded content fingerprint."""

    read: ReadFiles
    content: str
    path: str

    def __call__(self, ckpt: Any, arena: Any, progress: Any) -> str | None:
        got = self.read(ckpt, arena, progress)
        if got != self.content:
            raise CorruptCheckpoint(f"{self.path}: its tensors hash to {got}, not to the {self.content} they were "
                                    "stored with", file=self.path, reason="fingerprint mismatch")
        return None  # the checkpoint's fingerprint (the publish's) stands
