"""The model registry: what the daemon holds for each model beyond the core's accounting.

A model is one cache entry named like the model, or, sharded, one entry per rank named
``model@rank``, each on its own device. The registry maps names to entries and entries
to their ``Model`` records, resolves the names clients use for models and devices, and
describes models to a viewer (paths and errors only to their owner and admins). Its
records decide nothing about memory and do no I/O: unregistering returns the records
whose arenas, host copies and files the caller must free. Each arena's own record is
``Resident`` (Note [one record per arena]), above ``Model``.

Last, under its banner, which entries a request acts on (``entries_for``): for a model
with ``device = "auto"`` the placement core's choice, made from the GPUs' free memory
(a driver call) and its ranks' sizes (``learn_sizes``: their files stat'ed in the io
pool).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..backends import Arena, Backend, HostCopy
from ..cache import CacheCore, Entry, State
from ..cache.eviction import arena_key
from ..cache.names import ArenaKey, FilesShare, rank_entry, replica_entry, staging_entry
from ..cache.placement import Placement, place_ranks, views
from ..config import AUTO, ModelConfig, auto_devices
from ..errors import BadRequest, LimitExceeded, LoadFailed, PermissionDenied, UnknownModel
from ..loader import Checkpoint, OpenedSource, Progress
from ..units import format_size
from .access import AccessPolicy, Peer

log = logging.getLogger("weightcache.daemon")

# The reason of a model's last_error when the start or reload check of its files failed
# (a path typo, not a safetensors file); ``models`` then shows its state as "error"
# (Model.check_failed), whichever error came first.
CHECK_FAILED = "checkpoint check failed"

# Where a model came from: the operator's config file, a peer's register, a peer's publish.
Origin = Literal["config", "register", "publish"]


# ===============================================================================================
# ONE RECORD PER ARENA
# ===============================================================================================
# One arena's record in the registry: what the daemon holds for the bytes the core counts
# under one arena key.
#
# Note [one record per arena]
# ---------------------------
# What the daemon holds for an arena's bytes is one ``Resident`` record, keyed as the core
# keys the arena (cache/eviction.py's ``arena_key``: the entry's own name, or the share key
# of the names that read the same files, Note [shared arenas]); every name's ``Model``
# points at its key's record. So two names on one arena see one arena, one checkpoint,
# one table and one source, and nothing copies them from name to name. Which names
# hold the arena now is the record's ``holders``: a name takes it when its fill ends or
# when it joins a sibling, and lets go when it steps down or is unregistered; the arena is
# freed by the last one to let go. A host copy is one entry's (the core's host tier counts
# a copy per entry: ``HostHeld.entry``). Names of one arena never keep one (the core never
# demotes an arena two names share), except a name demoted before a second name of its
# files was registered: when that second name then fills the arena from the files, the
# host copy is dropped (residency/fill.py), so that a record never holds two versions
# of its bytes (the host copy's checkpoint would be overwritten by the new fill's).


@dataclass(frozen=True)
class HostHeld:
    """A host-tier copy of an arena's bytes and the one entry whose copy it is (the core's
    host tier counts a copy per entry): one field, so the two cannot disagree."""

    copy: HostCopy
    entry: str


@dataclass(eq=False)
class Resident:
    """One arena's bytes, wherever they are (Note [one record per arena])."""

    key: ArenaKey  # the core's key of the arena (cache/eviction.arena_key)
    arena: Arena | None = None  # while some name holds it on its device
    checkpoint: Checkpoint | None = None  # parsed at load time; identity of what is resident (or on the host tier)
    table: bytes = b""  # the attach reply's tensor table, msgpack-encoded once per load: rows
    columns: bytes = b""  # the same table as columns (tensor_table.wire_columns), for clients that ask
    # Bytes its load was charged beyond the arena for the checkpoint and table (Note [held
    # bytes] in loader/checkpoint.py; a promotion is admitted for the same).
    held: int = 0
    # Where the resident bytes came from (LoadJob.source: "files", "host", "peer" for
    # another GPU, "neighbour" for another daemon; "publish"); shown in ``models``.
    source: str | None = None
    host: HostHeld | None = None  # the host-tier copy (the model HOST, or one kept since its promotion)
    holders: set[str] = field(default_factory=set)  # the names that hold ``arena`` now
    # Its bytes were found not to be what its files hold (a neighbour's fill under a pinned
    # fingerprint the files no longer have: residency/pins.py): served only to those
    # attached meanwhile, as a changed file's, then reloaded.
    refuted: bool = False

    def fill(self, name: str, arena: Arena, checkpoint: Checkpoint, tables: tuple[bytes, bytes], held: int,
             source: str) -> None:
        """``name`` filled the arena with ``checkpoint``'s bytes (no other name holds one:
        the core admits no load while a sibling loads or is resident)."""
        self.arena, self.checkpoint, self.held, self.source = arena, checkpoint, held, source
        self.refuted = False
        self.table, self.columns = tables
        self.holders = {name}

    def held_by(self, name: str) -> Arena | None:
        """The arena, if ``name`` holds it (a sibling may hold it while ``name`` is evicted)."""
        return self.arena if name in self.holders else None

    def let_go(self, name: str) -> Arena | None:
        """``name`` no longer holds the arena (it steps down, or is unregistered). Returns
        the arena if it was the last name holding it: the caller frees it."""
        if name not in self.holders:
            return None
        self.holders.discard(name)
        if self.holders:
            return None
        arena, self.arena = self.arena, None
        return arena

    def host_copy_of(self, name: str) -> HostCopy | None:
        """``name``'s host copy, or None if it has none here."""
        return self.host.copy if self.host is not None and self.host.entry == name else None

    def take_host(self, name: str) -> HostCopy | None:
        """``name``'s host copy, forgotten here (the caller frees it); None if it has none."""
        copy = self.host_copy_of(name)
        if copy is not None:
            self.host = None
        return copy

    def drop_parsed(self) -> None:
        """Forget the parsed checkpoint and table once the arena is gone (evicted, not on
        the host tier): kept, a 100k-tensor header cost ~50 MiB of RSS per model after
        eviction that no budget counted. The next load parses the files again."""
        self.checkpoint, self.table, self.columns, self.held = None, b"", b"", 0

    def rename(self, name: str, new: str, key: ArenaKey) -> None:
        """A publish's staging entry became the model ``new``: its own arena's key is ``key`` now."""
        self.key = key
        if name in self.holders:
            self.holders = (self.holders - {name}) | {new}
        if self.host is not None and self.host.entry == name:
            self.host = HostHeld(self.host.copy, new)


# ===============================================================================================
# THE MODELS
# ===============================================================================================

@dataclass
class Model:
    """One cache entry's record; its arena's is ``resident``."""

    config: ModelConfig  # the whole model's config (all ranks)
    path: Path  # this entry's checkpoint
    device: str  # this entry's device
    rank: int | None  # None for an unsharded model
    origin: Origin = "config"
    owner: int | None = None  # uid that registered or published it; None for the operator's config
    files: OpenedSource | None = None  # a peer's own open files (register with fds), held while registered
    # Files a load opened and then found no room for: the retry (when detaches made room)
    # reads these same files, so a path swapped meanwhile changes nothing.
    parked: OpenedSource | None = None
    # Their parse (or that of ``files``), kept with them: the retry does not parse again
    # (server/residency/flight.py, within PARKED_PARSE_BYTES).
    parked_parse: Checkpoint | None = None
    # What ``models`` shows of the bytes this name last held, also once they are dropped:
    # (fingerprint, tensors); None until it first holds an arena.
    seen: tuple[str, int] | None = None
    last_error: dict[str, Any] | None = None
    # Why the last check of its files (start, reload) failed; None once one passes or a
    # load succeeds. Kept apart from last_error: a load that failed on the same files
    # first (a preload racing the check) keeps its own, more detailed, error there.
    check_failed: str | None = None
    # A device = "auto" rank has one entry per candidate device (a replica); ``slot`` is
    # the rank's name (``model``, or ``model@0``) they share. None: not placed automatically.
    slot: str | None = None
    # A published model kept on disk (server/store.py): its file's content fingerprint,
    # None while it is not stored; and why its last publish was not stored, if it was not.
    stored: str | None = None
    store_note: str | None = None
    # Its arena's record, shared with the other names of its share key (Note [one record
    # per arena]); set by the registry when the entry is registered.
    resident: Resident = field(init=False, repr=False)

    def close_files(self) -> None:
        """Close the open files it holds (a peer's, or those parked by a load that waits)."""
        for files in (self.files, self.parked):
            if files is not None:
                files.close()

    @property
    def published(self) -> bool:  # sent by an engine: no files to reload it from
        return self.origin == "publish"

    def unchanged(self) -> bool:
        """The resident bytes still are what the files hold (the staleness check)."""
        checkpoint = self.resident.checkpoint
        if checkpoint is None or self.resident.refuted:
            return False
        if self.published:
            return True
        if self.files is not None:  # a peer's fds: the same inodes, unchanged since parsed
            return checkpoint.matches(self.files)
        return checkpoint.unchanged_on_disk()


@dataclass
class Dropped:
    """An unregistered entry, and what of its memory the caller frees."""

    entry: str
    model: Model
    arena: Arena | None  # it was the last name holding it
    host: HostCopy | None  # its host copy


def share_key(path: Path, rank: int, ranks: int, owner: int | None) -> FilesShare | None:
    """What makes two names' entries one arena (cache/eviction.py, Note [shared arenas]): the
    same checkpoint path, symlinks resolved, as the same rank of the same number of
    ranks, for the same owner (the core adds the device). So the two always read the same
    files, whose identity (the staleness check) is then the same for both. A path through
    a symlink is not shared: the link could be pointed elsewhere for one name and not
    the other. None: not shared."""
    try:
        real = os.path.realpath(path)
        if real != os.path.abspath(path):
            return None
    except OSError:
        return None
    return FilesShare(real, rank, ranks, owner)


def redacted(error: dict[str, Any]) -> dict[str, Any]:
    """A load error as a peer who may not see the model's files gets it: the code, and
    nothing about paths, sizes or bytes (those answer questions about the daemon's disks)."""
    return {"code": error.get("code", "INTERNAL"),
            "message": "the checkpoint could not be loaded; the daemon's log and administrators have the details"}


class Registry:
    def __init__(self, core: CacheCore, backends: dict[str, Backend], access: AccessPolicy) -> None:
        self.core = core
        self.backends = backends
        self.access = access
        self.models: dict[str, Model] = {}  # by entry name
        self.arenas: dict[ArenaKey, Resident] = {}  # by the core's arena key (Note [one record per arena])
        self.groups: dict[str, list[str]] = {}  # model name -> its entries, in rank order
        # Auto models (Note [placement] in cache/placement.py): model name -> its ranks'
        # slots in rank order; slot -> device -> the replica entry there; slot -> the last
        # placement decision (for ``models``).
        self.slots: dict[str, list[str]] = {}
        self.replicas: dict[str, dict[str, str]] = {}
        self.placed: dict[str, dict[str, Any]] = {}
        self.size_hint: dict[str, int] = {}  # slot -> its files' bytes, until a load tells the arena's (learn_sizes)
        self._staging_ids = itertools.count(1)
        self._reserved: Counter[int] = Counter()  # uid -> model slots held by publishes and registers in flight
        self._files_reserved: Counter[int] = Counter()  # uid -> open files held by registers in flight
        # Names the config claims while a peer's model of that name is still attached
        # (config_models.py, Note [config names win]): that copy takes no new use, and no peer
        # may take the name again.
        self.claimed: set[str] = set()

    # -- registering ----------------------------------------------------------------
    def register(self, mc: ModelConfig, *, origin: Origin = "config", owner: int | None = None,
                 sources: list[OpenedSource] | None = None, tenants: tuple[str, ...] = ()) -> None:
        """Add a model's entries. ``sources`` are a peer's own open files, one per rank;
        the entries hold them until unregistered. ``tenants``: whose quotas it counts
        against (cache/eviction.py; none for the operator's)."""
        if mc.name in self.groups or mc.name in self.models:
            raise BadRequest(f"model {mc.name!r} is already registered", model=mc.name)
        if origin != "config":
            self._check_unclaimed(mc.name)
        sharded = bool(mc.shards)
        ranks = [rank_entry(mc.name, r) if sharded else mc.name for r in range(len(mc.parts))]
        # (entry, rank, path, device, slot): a fixed rank is one entry named like the rank;
        # an auto rank one replica per candidate device, "<rank>@<device>".
        todo: list[tuple[str, int, Path, str, str | None]] = []
        for i, (rank_name, (path, device)) in enumerate(zip(ranks, mc.parts, strict=True)):
            if device == AUTO:
                todo += [(replica_entry(rank_name, d), i, path, d, rank_name) for d in auto_devices(self.backends)]
            else:
                todo.append((rank_name, i, path, device, None))
        done: list[str] = []
        for entry, i, path, device, slot in todo:
            # A peer's own open files are its alone; published memory has no files.
            share = share_key(path, i, len(mc.parts), owner) if sources is None and origin != "publish" else None
            try:
                e = self.core.register(entry, device, pinned=mc.pin, keep_alive=mc.keep_alive, share=share,
                                       tenants=tenants, model=mc.name)
            except BaseException:
                for d in done:
                    self.drop_entry(d)
                raise
            done.append(entry)
            self.models[entry] = self._with_record(
                Model(config=mc, path=path, device=device, rank=i if sharded else None, origin=origin, owner=owner,
                      files=sources[i] if sources else None, slot=slot), e)
            if slot is not None:
                self.replicas.setdefault(slot, {})[device] = entry
        if any(slot is not None for *_, slot in todo):
            self.slots[mc.name] = ranks
        self.groups[mc.name] = done

    def _with_record(self, model: Model, e: Entry) -> Model:
        """``model`` pointing at its arena's record, made by the first name of its key."""
        key = arena_key(e)
        model.resident = self.arenas.setdefault(key, Resident(key))
        return model

    def unregister(self, name: str) -> list[Dropped]:
        """Forget a whole model (every rank), only if no rank is attached or loading.
        Returns the records whose arenas, host copies and files the caller frees."""
        if name not in self.groups:
            raise UnknownModel(f"no model named {name!r} is registered", model=name)
        for entry in self.groups[name]:
            self.core.check_removable(entry)  # ATTACHED / BAD_REQUEST with the reason
        for slot in self.slots.pop(name, ()):
            self.replicas.pop(slot, None)
            self.placed.pop(slot, None)
            self.size_hint.pop(slot, None)
        return [self.drop_entry(entry) for entry in self.groups.pop(name)]

    def drop_entry(self, entry: str) -> Dropped:
        """Forget one entry (a rank, or a publish's staging entry); the caller frees what
        the returned record says: the arena if no other name holds it, its host copy, its files."""
        if self.core.entry(entry).state is State.LOADING:
            self.core.abort_load(entry)
        self.core.unregister(entry)
        model = self.models.pop(entry)
        res = model.resident
        dropped = Dropped(entry, model, arena=res.let_go(entry), host=res.take_host(entry))
        if not self.core.sharing(res.key):  # its key's last name
            del self.arenas[res.key]
        return dropped

    def stage(self, name: str, model: Model, tenants: tuple[str, ...] = ()) -> str:
        """An entry for ``name``'s next version that nobody can reach by name yet (a
        publish fills it, then ``swap_in`` makes it the model; cache/names.py)."""
        staging = staging_entry(name, next(self._staging_ids))
        self.models[staging] = self._with_record(model, self.core.register(staging, model.device, tenants=tenants, model=name,
                                                                           staging=True))
        return staging

    def swap_in(self, staging: str, name: str) -> None:
        """Make a staged entry the (unsharded) model ``name``; an old one must be gone."""
        # A name the config claims (checked here, where a failed publish is rolled back,
        # and not when staging: the caller's published memory is closed only past that).
        self._check_unclaimed(name)
        e = self.core.rename(staging, name)
        model = self.models[name] = self.models.pop(staging)
        res = self.arenas[arena_key(e)] = self.arenas.pop(model.resident.key)  # its own arena: keyed by its name
        res.rename(staging, name, arena_key(e))
        self.groups[name] = [name]

    # -- holding arenas (Note [one record per arena]) ------------------------------------
    def filled(self, name: str, arena: Arena, checkpoint: Checkpoint, tables: tuple[bytes, bytes], held: int,
               source: str) -> None:
        """``name``'s fill made its arena resident, holding ``checkpoint``'s bytes (``tables``:
        its attach table as rows and as columns, Checkpoint.encoded_tables)."""
        model = self.models[name]
        model.resident.fill(name, arena, checkpoint, tables, held, source)
        self._holds(model)

    def joined(self, name: str) -> None:
        """``name`` is resident on the arena a sibling of its share key holds (CacheCore.join)."""
        model = self.models[name]
        assert model.resident.holders, f"{name} joined an arena no name holds"
        model.resident.holders.add(name)
        self._holds(model)

    @staticmethod
    def _holds(model: Model) -> None:
        checkpoint = model.resident.checkpoint
        assert checkpoint is not None
        model.last_error, model.seen = None, (checkpoint.fingerprint, len(checkpoint.tensors))

    def models_owned_by(self, uid: int) -> int:
        """Models ``uid`` registered or published, publishes in flight included (each
        reserved slot too): each once, whatever its ranks or replicas."""
        return self._reserved[uid] + len({(m.config.name, self.core.entry(entry).staging) for entry, m in self.models.items()
                                          if m.owner == uid})

    def reserve_model(self, uid: int) -> Callable[[], None]:
        """Hold one of ``uid``'s max_models_per_uid slots for a publish that has checked the
        count and now awaits (the table's validation, the fds' opening) before its staging
        entry exists: checked there and not held, 120 concurrent publishes under a limit of
        4 all passed the check and all succeeded. Returns the release (idempotent): called
        once the staging entry counts in its place, or when the publish fails first."""
        return _hold(self._reserved, uid, 1)

    def reserve_files(self, uid: int, n: int, limit: int) -> Callable[[], None]:
        """Hold ``n`` of ``uid``'s ``limit`` (max_files_per_uid) open files for a register
        that checks its header before the registry holds them (LimitExceeded if they do not
        fit beside those held and those reserved): checked and not held, 16 concurrent
        registers under a limit of 4 all registered. Returns the release, as reserve_model."""
        held = self.files_held_by(uid) + self._files_reserved[uid]
        if held + n > limit:
            raise LimitExceeded(f"uid {uid}'s registered models hold {held} open files (registers in flight included); "
                                f"{n} more would pass max_files_per_uid={limit}", limit=limit)
        return _hold(self._files_reserved, uid, n)

    def holding(self, name: str) -> Arena | None:
        """The arena ``name`` holds now, or None (not resident, or only a sibling is)."""
        return self.models[name].resident.held_by(name)

    def files_held_by(self, uid: int) -> int:
        # an auto model's replicas of one rank share its open files: counted once
        held = {id(m.files): len(m.files.files) for m in self.models.values() if m.files is not None and m.owner == uid}
        return sum(held.values())

    # -- names ----------------------------------------------------------------------
    def first(self, name: str) -> Model:
        """The record of ``name``'s first entry (rank 0)."""
        return self.models[self.members(name)[0]]

    def members(self, name: str) -> list[str]:
        """The entries an op on ``name`` acts on: every rank of a sharded model, or the
        one entry (a shard may also be named directly as ``model@rank``)."""
        if name in self.groups:
            return self.groups[name]
        if name in self.models and not self.core.entry(name).staging:
            return [name]
        raise UnknownModel(f"no model named {name!r} is registered", model=name)

    def entry_for(self, name: str, rank: int | None) -> str:
        """The entry an attach of ``name`` (with ``rank``) maps; for a rank placed
        automatically, the rank's slot (entries_for picks the replica)."""
        members = self.members(name)
        unsharded = self.models[members[0]].rank is None
        members = self.slots.get(name, members)  # one name per rank
        if unsharded:
            if rank not in (None, 0):
                raise BadRequest(f"model {name!r} is not sharded; rank {rank} does not exist", model=name, rank=rank)
            return members[0]
        if rank is None:
            raise BadRequest(f"model {name!r} is sharded over {len(members)} ranks: attach one of them with rank=0 to "
                             f"rank={len(members) - 1} (`weightcache attach {name} --rank 0`), one engine per rank",
                             model=name, ranks=len(members))
        if not 0 <= rank < len(members):
            raise BadRequest(f"model {name!r} has ranks 0..{len(members) - 1}, not {rank}", model=name, rank=rank)
        return members[rank]

    def resolve_device(self, device: str) -> str:
        """This daemon's name for ``device`` (given as its name or as cuda:GPU-<uuid>)."""
        for mine, backend in self.backends.items():
            if backend.names(device):
                return mine
        raise BadRequest(f"device {device!r} has no budget in this daemon; configured: {sorted(self.backends)}", device=device)

    # -- who may use a model -----------------------------------------------------------
    def may_use(self, peer: Peer, model: Model) -> bool:
        """Whether ``peer`` may use and see ``model`` (docs/deployment.md, "Tenants"):
        administrators always; else a model with neither allowed list is everyone's, and
        one with lists is its owner's and theirs."""
        c = model.config
        if c.allowed_uids is None and c.allowed_gids is None:
            return True
        if self.access.is_admin(peer) or peer.uid == model.owner:
            return True
        return peer.uid in (c.allowed_uids or ()) or bool(peer.groups & frozenset(c.allowed_gids or ()))

    def check_use(self, peer: Peer, name: str) -> None:
        """PERMISSION_DENIED unless ``peer`` may use the model (or shard) ``name``. The
        message says nothing about who may: the lists are the operator's business. A
        peer's model whose name the config claims is refused to everyone, administrators
        too: its bytes are not the model the operator configured under that name."""
        model = self.models[self.members(name)[0]]
        if model.origin != "config" and model.config.name in self.claimed:
            raise PermissionDenied(f"model {name!r} is being replaced by the operator's model of that name: the "
                                   "copy registered by a peer takes no new use, and the configured one is registered "
                                   "when its last attachment ends", model=name, claimed=True)
        if not self.may_use(peer, model):
            raise PermissionDenied(f"model {name!r} is not available to uid {peer.uid}", model=name)

    def _check_unclaimed(self, name: str) -> None:
        if name in self.claimed:
            raise PermissionDenied(f"model name {name!r} is the operator's (the config file names it)", model=name)

    def visible(self, peer: Peer, entry: str) -> bool:
        """Whether ``peer`` may see the entry named ``entry`` in listings and errors."""
        model = self.models.get(entry)
        return model is not None and self.may_use(peer, model)

    # -- describing -----------------------------------------------------------------
    def may_see(self, peer: Peer, model: Model) -> bool:
        """Paths and load errors of a model are its owner's and the administrators' to see:
        for anyone else they would tell what exists on the daemon's disks."""
        return model.owner == peer.uid or self.access.is_admin(peer)

    def _error_as_seen(self, viewer: Peer, error: dict[str, Any] | None) -> dict[str, Any] | None:
        """A kept NO_SPACE as ``viewer`` may see it: like the load's own reply
        (handlers._name_holders), holders it may not use are not named, only their bytes
        summed (the error is kept as the core raised it, naming every holder)."""
        holders = error.get("holders") if error else None
        if error is None or not isinstance(holders, list) or self.access.is_admin(viewer):
            return error
        shown = [h for h in holders if isinstance(h, dict) and self.visible(viewer, str(h.get("name")))]
        hidden = [h for h in holders if h not in shown]
        if not hidden:
            return error
        held = [f"{h['name']} ({format_size(h['nbytes'])}, {h['state']}, {h['attach_count']} attached"
                f"{', pinned' if h.get('pinned') else ''})" for h in shown]
        held.append(f"{format_size(sum(h.get('nbytes', 0) for h in hidden))} in {len(hidden)} model(s) not available to you")
        full = (f"{error['device']} holds {error['loaded']} models, its max_loaded_models; "
                if error.get("max_loaded_models") is not None else "")
        message = (f"model {error.get('model')!r} needs {format_size(error.get('needed', 0))} on {error.get('device')}; "
                   f"{full}budget {format_size(error.get('budget', 0))}, free {format_size(error.get('free', 0))}; "
                   f"held by: {', '.join(held)}")
        return {**error, "message": message, "holders": shown}

    def placement_as_seen(self, viewer: Peer, slot: str | None) -> dict[str, Any] | None:
        """The last placement of ``slot`` as ``viewer`` may see it: the models it expected
        to evict are named only where the viewer may use them (any model on the device
        may be one), the others counted."""
        p = self.placed.get(slot) if slot is not None else None
        if p is None or not p.get("evicts") or self.access.is_admin(viewer):
            return p
        shown = [n for n in p["evicts"] if self.visible(viewer, n)]
        hidden = len(p["evicts"]) - len(shown)
        if not hidden:
            return p
        named = ", ".join([*shown, f"{hidden} model(s) not available to you"])
        return {**p, "evicts": shown, "detail": f"{p['device']}: making room there evicts the least ({named})"}

    @staticmethod
    def _expires_in(e: Entry, idle: float | None) -> float | None:
        """Seconds until keep_alive evicts the entry (CacheCore.expired), or None when it
        will not: no keep_alive, pinned, attached (the clock restarts at the last
        detach), or not resident. The daemon's sweep wakes at that deadline (CacheCore.next_expiry)."""
        if e.keep_alive is None or idle is None or not e.evictable:
            return None
        return max(0.0, e.keep_alive - idle)

    def describe(self, name: str, viewer: Peer, progress: Progress | None) -> dict[str, Any]:
        """The ``models`` entry of one cache entry, as ``viewer`` may see it."""
        e = self.core.entry(name)
        m = self.models[name]
        private = not self.may_see(viewer, m)
        idle = self.core.idle_s(name)
        unloadable = e.state in (State.REGISTERED, State.EVICTED) and m.check_failed is not None
        return {
            "name": name, "state": "error" if unloadable else str(e.state), "device": e.device,
            "device_uuid": self.backends[e.device].uuid, "nbytes": e.nbytes,
            "attach_count": e.attach_count, "pinned": e.pinned, "keep_alive": e.keep_alive,
            "shard_of": m.config.name if m.rank is not None else None, "rank": m.rank,
            # device = "auto": the rank this replica serves, and the last placement decision for it
            "replica_of": m.slot, "placement": self.placement_as_seen(viewer, m.slot),
            "shares_with": [x.name for x in self.core.siblings(name)],  # one arena, counted once
            "origin": m.origin, "owner": m.owner,
            # who may use it (None: everyone), shown to those who may see its paths
            "allowed_uids": None if private or m.config.allowed_uids is None else list(m.config.allowed_uids),
            "allowed_gids": None if private or m.config.allowed_gids is None else list(m.config.allowed_gids),
            "path": None if private else str(m.path), "fingerprint": m.seen[0] if m.seen else None,
            # a published model kept in the store on disk (survives a restart); why not, to its owner
            "on_disk": m.stored is not None, "store_note": None if private else m.store_note,
            "tensors": m.seen[1] if m.seen else None,
            "idle_s": idle, "expires_in_s": self._expires_in(e, idle),
            "loads": e.loads, "evictions": e.evictions, "demotions": e.demotions, "promotions": e.promotions,
            # its bytes are in the host tier: HOST, or resident with the copy kept since its promotion
            "host_copy": e.host_copy,
            # which arena the resident copy got ("file", "memfd", "cuda_vmm") and, where the
            # faster one was refused, why (it names files: shown where path is)
            "arena": arena.kind if (arena := m.resident.held_by(name)) is not None else None,
            "source": m.resident.source if arena is not None else None,  # where the resident bytes came from
            "arena_note": (arena.fallback or None) if arena is not None and not private else None,
            "last_error": redacted(m.last_error) if private and m.last_error else self._error_as_seen(viewer, m.last_error),
            "progress": progress.snapshot() if progress is not None else None,
        }


def _hold(counts: Counter[int], uid: int, n: int) -> Callable[[], None]:
    """Count ``n`` more for ``uid`` until the returned release (idempotent) is called."""
    counts[uid] += n
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            counts[uid] -= n
            if counts[uid] <= 0:
                del counts[uid]

    return release


# ===============================================================================================
# WHICH ENTRIES A REQUEST ACTS ON: the operator's, or the placed replica of a device = "auto" model
# ===============================================================================================
# Which entries a load or attach acts on: for a model with ``device = "auto"``, the
# replica on the device the placement core chooses (cache/placement.py, Note
# [placement]), or the one on the device the request names; for any other model, its
# entries as configured (a named device must be theirs).
#
# The decision and its reason are logged and kept for ``models`` and ``status``
# (``placement``). Reading a GPU's real free memory is one ``cuMemGetInfo`` per candidate
# device, made on the loop (a driver call of microseconds), and only when some rank is
# resident nowhere.


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


async def learn_sizes(core: CacheCore, registry: Registry, io_run: Callable[..., Awaitable[int]], name: str) -> None:
    """Before an auto model is first placed: how big each rank is, from its files'
    sizes (``checkpoint_bytes``, run by ``io_run``: the io pool's), so that placement
    can tell which devices have room for it. Known sizes (an earlier load's arena, an
    earlier hint) are kept."""
    for slot in registry.slots.get(name, ()):
        replicas = registry.replicas.get(slot)
        if not replicas or slot in registry.size_hint:
            continue
        if any(core.entry(e).nbytes for e in replicas.values()):
            continue
        m = registry.models[next(iter(replicas.values()))]
        fds = [f.fd for f in m.files.files] if m.files is not None else None
        try:
            registry.size_hint[slot] = await io_run(checkpoint_bytes, m.path, fds)
        except LoadFailed:  # the io pool's timeout: placed as of unknown size
            registry.size_hint[slot] = 0
