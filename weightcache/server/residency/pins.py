"""Pinned fingerprints and the files they are trusted for.

Note [pinned fingerprints]
--------------------------
``[peers] fingerprints`` pins what a model's files hold, so that a daemon that has not
read them can fill the model from a neighbour's copy of that content (weightcache/peers/).
A pin is a string in a config file: nothing ties it to the files. With the files
rewritten (new weights, the same layout) and the pin left as it was, a daemon filled the
model from a neighbour still holding the old content and served it as this model: the
files were never read. So a pin is trusted only for the files it was found to match:

- This daemon records, per configured model, the identity of its files (device, inode,
  size, mtime and ctime of each; any write moves ctime) and the fingerprint it found them
  to hold, at each load from them and at each verification (below).
- Before a neighbour's fill, a pin is trusted when nothing is recorded for the model (the
  daemon has not read these files since it started: what pinning is for) or when the
  record is of these very files and found the pin. Files changed since (another identity)
  or found to hold another fingerprint: the pin is not used, and the files are read (the
  fingerprint recomputed); a load that finds a fingerprint other than the pin says so in
  the log (once per model and files) and counts ``pin_mismatches``.
- A model filled from a neighbour is then verified in the background against the local
  files: they are read and hashed (one verification at a time, in one thread of its
  own at the loaders' nice level) and the result recorded. If they hold another
  fingerprint the arena is refuted (Resident.refuted): evicted at once when nobody is
  attached, else served only to those attached meanwhile, as a changed file's bytes
  are, and reloaded from the files once nobody holds it; logged as an error, counted in
  ``neighbour_mismatches`` (``neighbour_checks`` counts the verifications).

What remains: between a first fill (nothing recorded yet) and the end of its
verification, a wrong pin serves the neighbour's bytes; the verification reads the whole
model once. Files changed while the fill ran are not verified: the staleness check
(Model.unchanged) reloads them at the next attach.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from ...cache import CacheCore, State
from ...config import DaemonConfig
from ...loader import Checkpoint, OpenedSource, open_source
from ...loader.reader import FileIdentity, fingerprint_opened
from ..registry import Model, Registry
from .stats import Stats
from .stepdown import StepDowns
from .tasks import Tasks

log = logging.getLogger("weightcache.daemon")

FilesIdentity = tuple[FileIdentity, ...]
VERIFY_THREADS = 2  # reader threads of one verification: it runs beside the loads and engines, not as one


def files_identity(opened: OpenedSource) -> FilesIdentity | None:
    """Which files ``opened`` holds, as they are now; None if one cannot be stat'ed."""
    try:
        sts = [os.fstat(f.fd) for f in opened.files]
    except OSError:
        return None
    return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for st in sts)


class Pins:
    """Note [pinned fingerprints]: what this daemon found its configured models' files to
    hold, and the verification of neighbours' fills against them."""

    def __init__(self, settings: DaemonConfig, core: CacheCore, registry: Registry, step_down: StepDowns, tasks: Tasks,
                 stats: Stats, shutting_down: Callable[[], bool]) -> None:
        self.settings = settings
        self.core = core
        self.registry = registry
        self.step_down = step_down
        self.tasks = tasks
        self.stats = stats
        self._shutting_down = shutting_down
        # The pins as configured now ([peers] fingerprints; the daemon sets it with its peers).
        self.pinned: Callable[[], Mapping[str, str]] = dict
        self._found: dict[str, tuple[FilesIdentity, str]] = {}  # model -> (its files, the fingerprint they hold)
        # The files each model's last "not trusted" and "does not match" lines were about:
        # each said once per model and files.
        self._told_distrust: dict[str, FilesIdentity] = {}
        self._told_mismatch: dict[str, FilesIdentity] = {}
        self._pool: ThreadPoolExecutor | None = None

    def trusted(self, name: str, opened: OpenedSource) -> bool:
        """Whether a neighbour may fill ``name`` under its pinned fingerprint (a model with
        no pin: yes, peers/ knows its fingerprint from these files' own digests or not at all)."""
        pin = self.pinned().get(name)
        found = self._found.get(name)
        if not pin or found is None:
            return True
        ident = files_identity(opened)
        if found == (ident, pin):
            return True
        if ident is not None and self._told_distrust.get(name) != ident:
            self._told_distrust[name] = ident
            why = "its files changed since" if found[0] != ident else f"its files hold {found[1]}"
            log.info("load %s: the pinned fingerprint is not trusted for these files (%s): from the files", name, why,
                     extra={"model": name})
        return False

    def found(self, name: str, model: Model, opened: OpenedSource, fingerprint: str) -> None:
        """A load of ``name`` from ``opened`` found ``fingerprint``: recorded; a pin that
        differs is logged (once per files) and counted."""
        if model.origin != "config" or not fingerprint:
            return
        ident = files_identity(opened)
        if ident is not None:
            self._record(name, ident, fingerprint)

    def _record(self, name: str, ident: FilesIdentity, fingerprint: str) -> None:
        self._found[name] = (ident, fingerprint)
        pin = self.pinned().get(name)
        if pin and pin != fingerprint:
            self.stats.counters["pin_mismatches"] += 1
            if self._told_mismatch.get(name) != ident:
                self._told_mismatch[name] = ident
                log.warning("model %s: its files hold fingerprint %s, not the one pinned in [peers] fingerprints (%s): "
                            "this daemon fills it from no neighbour until the pin matches its files", name, fingerprint,
                            pin, extra={"model": name})

    # -- after a neighbour's fill ----------------------------------------------------------
    def verify_soon(self, name: str) -> None:
        """``name`` was just filled from a neighbour: check it against its files in the
        background."""
        model = self.registry.models[name]
        checkpoint = model.resident.checkpoint
        if checkpoint is None or model.origin != "config":
            return
        self.tasks.spawn(self._verify(name, model, checkpoint))

    async def _verify(self, name: str, model: Model, filled: Checkpoint) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="wc-verify")
        loop = asyncio.get_running_loop()
        try:
            got = await loop.run_in_executor(self._pool, self._hash_files, model, filled)
        except Exception as exc:  # unreadable now, cancelled at shutdown: the staleness check has the last word
            log.warning("model %s: its files could not be read to verify the neighbour's fill (%s)", name, exc,
                        extra={"model": name})
            return
        if got is None:  # changed since the fill parsed them: Model.unchanged reloads at the next attach
            return
        ident, fingerprint = got
        self.stats.counters["neighbour_checks"] += 1
        self._record(name, ident, fingerprint)
        if fingerprint == filled.fingerprint:
            log.info("model %s: the neighbour's fill matches its files (%s)", name, fingerprint, extra={"model": name})
            return
        self.stats.counters["neighbour_mismatches"] += 1
        res = model.resident
        if self.registry.models.get(name) is not model or res.checkpoint is not filled:
            return  # unregistered, evicted or reloaded meanwhile: nothing of it is served
        res.refuted = True
        holders = [x for x in (self.core.entry(name), *self.core.siblings(name)) if x.state is State.RESIDENT]
        evict = bool(holders) and not any(x.leases for x in holders)  # a pin keeps a model, not bytes its files never held
        log.error("model %s: filled from a neighbour under fingerprint %s, but its files hold %s: %s", name,
                  filled.fingerprint, fingerprint,
                  "evicted" if evict else "served only to engines attached now, reloaded from the files after",
                  extra={"model": name})
        for x in holders if evict else ():
            await self.step_down.carry_out(self.core.evict(x.name, ignore_pin=True, demote=False),
                                           reason="its neighbour's bytes are not its files'")

    def _hash_files(self, model: Model, filled: Checkpoint) -> tuple[FilesIdentity, str] | None:
        d = self.settings
        with open_source(model.path, roots=d.model_roots or None, follow_symlinks=d.follow_symlinks) as opened:
            ident = files_identity(opened)
            if ident is None or not filled.matches(opened):
                return None
            return ident, fingerprint_opened(filled, opened, threads=VERIFY_THREADS, chunk=d.load_chunk_bytes,
                                             nice=d.load_nice, cancelled=self._shutting_down)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
