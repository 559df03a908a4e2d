"""The ops that add and remove models, and who may: register, unregister, publish.

Rules (docs/protocol.md, "Who may connect"): by path only admins register (the daemon
opens the files with its own rights, under model_roots); tenants may register with their
own open fds where tenant_register allows; a peer owns what it registered or published,
and only the owner or an admin unregisters or replaces it; configured models are the
operator's. A peer's model gets a fingerprint bound to its uid.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..cache import State
from ..cache.eviction import tenant_keys
from ..cache.names import rank_entry
from ..config import ModelConfig, check_model_name, config_group_names, problems, under_roots
from ..errors import Attached, BadRequest, LimitExceeded, PermissionDenied, Pinned
from ..loader import OpenedSource, adopt_fds
from ..loader.published import published_checkpoint
from ..protocol import close_fds, tenant_fingerprint
from ..protocol.arena import parse_arena
from ..protocol.framing import Deferred
from .access import Peer
from .handlers import Caller, Context, Reply, Request
from .registry import Model
from .residency.fill import CopyPublished

log = logging.getLogger("weightcache.daemon")


async def register(ctx: Context, caller: Caller, req: Request) -> Reply:
    """Add a model at run time, by path (admins) or with the peer's own fds (``files``)."""
    d = ctx.settings.daemon
    admin = ctx.access.is_admin(caller.peer)
    files = req.args.get("files")
    if files is None and not admin:
        raise PermissionDenied("registering by path is for administrators; send the files' descriptors instead "
                               "(Client.register does by default)", op="register")
    if files is not None and not (admin or d.tenant_register):
        raise PermissionDenied("registering models is for administrators here (daemon.tenant_register = false)",
                               op="register")
    fields: dict[str, Any] = {k: req.args[k] for k in ("name", "path", "device", "shards", "pin", "preload", "keep_alive")
                              if k in req.args}
    _bounded(req.args, "shards", MAX_SHARDS)
    _bounded(req.args, "files", MAX_SHARDS)
    fields.update(_access_fields(ctx, req))
    mc = _private_unless_listed(_model_config(fields), caller.peer, admin)
    if mc.pin and not admin:
        raise PermissionDenied("pinning is for administrators", op="register", argument="pin")
    if files is None:
        if req.fds:
            raise BadRequest("file descriptors came without 'files' naming them", argument="files")
        for path, _device in mc.parts:
            if d.model_roots and not under_roots(path, d.model_roots):
                raise PermissionDenied(f"{path} is not under daemon.model_roots", path=str(path))
    # Both per-uid limits reserved here, before the first await (the header's check), and
    # returned on every way out: checked there and not held, 16 concurrent registers of a
    # file each under max_files_per_uid = 4 all registered, and all 16 over
    # max_models_per_uid = 3 parsed their header (20,000 tensors each) before any refusal.
    # Once registered, the model and its files count in the registry's own sums instead.
    releases: list[Callable[[], None]] = []
    sources: list[OpenedSource] | None = None
    try:
        if not admin:
            _check_model_count(ctx, caller.peer)
            releases.append(ctx.registry.reserve_model(caller.peer.uid))
        if files is not None:
            releases.append(ctx.registry.reserve_files(caller.peer.uid, len(req.fds), d.max_files_per_uid))
            sources = _adopt_files(mc, files, req)
        # The header checked now, as the config's models are at start: a file that is not a
        # checkpoint is refused with the error its load would give, not registered to fail later.
        tenants = tenant_keys(caller.peer.uid, caller.peer.groups)
        problem = await ctx.residency.checks.check_files(mc, sources, tenant=None if admin else caller.peer.uid,
                                                         tenants=tenants)
        if problem is not None:
            raise problem
        ctx.registry.register(mc, origin="register", owner=caller.peer.uid, sources=sources, tenants=tenants)
    except BaseException:
        for src in sources or ():
            src.close()
        raise
    finally:
        for release in releases:
            release()
    if mc.preload:
        ctx.residency.preloads.start(mc.name, gates=admin)
    return {"model": ctx.registry.describe(ctx.registry.groups[mc.name][0], caller.peer, None)}, []


# Who may use a model, as register and publish take them (config.ModelConfig).
ACCESS_FIELDS = ("allowed_uids", "allowed_gids")

# Bounds on what a request may list, checked before any per-entry work: a
# publish whose allowed_gids was ["root"] * 1,000,000 (a 4.8 MB frame) was validated on
# the event loop with one getgrnam each, and another peer's status waited 24.1 s.
# Real lists name a few teams; a model has at most a few dozen ranks.
MAX_ACCESS_ENTRIES = 256
MAX_SHARDS = 256
MAX_FINGERPRINT_CHARS = 256  # a hex digest is 32-64; tenant_fingerprint prefixes the uid

_group_names: tuple[object, dict[str, int]] | None = None  # (the DaemonConfig, its resolved group names)


def _bounded(args: dict[str, Any], key: str, limit: int) -> None:
    """BadRequest if ``args[key]`` is a list (or string) longer than ``limit``: said before
    anything looks at its entries."""
    v = args.get(key)
    if isinstance(v, (list, tuple, str, bytes)) and len(v) > limit:
        raise BadRequest(f"argument {key!r} has {len(v)} entries; at most {limit} are taken", argument=key, limit=limit)


def _access_fields(ctx: Context, req: Request) -> dict[str, Any]:
    """``allowed_uids`` / ``allowed_gids`` of a request, bounded, with group names
    replaced by gids from the config's own names (config.config_group_names): a name
    the config does not use is BAD_REQUEST, never a lookup on the peer's behalf."""
    global _group_names
    out: dict[str, Any] = {}
    for key in ACCESS_FIELDS:
        if key not in req.args:
            continue
        _bounded(req.args, key, MAX_ACCESS_ENTRIES)
        v = req.args[key]
        if key == "allowed_gids" and isinstance(v, list) and any(isinstance(g, str) for g in v):
            daemon = ctx.settings.daemon
            if _group_names is None or _group_names[0] is not daemon:
                _group_names = (daemon, config_group_names(daemon))
            known = _group_names[1]
            gids: list[Any] = []
            for g in v:
                if isinstance(g, str) and not g.isdigit():
                    if g not in known:
                        raise BadRequest(f"allowed_gids: group {g[:64]!r} is not a name this daemon's config uses; "
                                         "send its gid (names are resolved from the config only)", argument=key)
                    g = known[g]
                gids.append(g)
            v = gids
        out[key] = v
    return out


def _model_config(fields: dict[str, Any]) -> ModelConfig:
    """A model a peer sends, validated as a config file's [[models]] entry would be; its
    problems as one line naming each key (pydantic's own dump spans lines and a URL)."""
    try:
        return ModelConfig(**fields)
    except ValidationError as exc:
        raise BadRequest("invalid model: " + "; ".join(problems(exc, ModelConfig))) from None


def _private_unless_listed(mc: ModelConfig, peer: Peer, admin: bool) -> ModelConfig:
    """A model a tenant adds is its own unless it says who else may use it: another
    tenant's engine must not map it by guessing the name. An administrator's is everyone's
    unless listed, like the operator's configured models."""
    if admin or mc.allowed_uids is not None or mc.allowed_gids is not None:
        return mc
    return mc.model_copy(update={"allowed_uids": (peer.uid,)})


def _adopt_files(mc: ModelConfig, files: Any, req: Request) -> list[OpenedSource]:
    """The peer's fds for ``mc``: ``files`` holds one list of file names per rank, the
    fds came in the same order. Takes the fds out of the request (they are the sources'
    now, closed on failure and at unregister)."""
    fds = req.fds
    if not (isinstance(files, list) and len(files) == len(mc.parts)
            and all(isinstance(f, list) and f and all(isinstance(n, str) for n in f) for f in files)):
        raise BadRequest(f"'files' must be a list of {len(mc.parts)} non-empty list(s) of file names, one per rank",
                         argument="files")
    if sum(len(f) for f in files) != len(fds):
        raise BadRequest(f"'files' names {sum(len(f) for f in files)} file(s) but {len(fds)} fd(s) arrived",
                         argument="files")
    req.fds = []
    sources: list[OpenedSource] = []
    start = 0
    try:
        for rank, names in enumerate(files):
            part = fds[start : start + len(names)]
            start += len(names)
            sources.append(adopt_fds(f"fds:{rank_entry(mc.name, rank)}", names, part))
    except BaseException:
        for src in sources:
            src.close()
        close_fds(fds[start:])
        raise
    return sources


async def unregister(ctx: Context, caller: Caller, req: Request) -> Reply:
    name = req.arg("name", str)
    ctx.registry.check_use(caller.peer, name)
    model = ctx.registry.first(name)
    if not (ctx.access.is_admin(caller.peer) or (model.owner == caller.peer.uid and model.origin != "config")):
        raise PermissionDenied(f"model {name!r} is not yours to unregister", model=name, op="unregister")
    ctx.residency.step_down.forget(ctx.registry.unregister(name))
    ctx.residency.preloads.forget(name)
    if (store := ctx.residency.flights.store) is not None:
        await store.forget(name, f"unregistered by uid {caller.peer.uid}")
    return {"unregistered": name}, []


async def publish(ctx: Context, caller: Caller, req: Request) -> Reply:
    """An engine hands over weights it processed itself (quantized, repacked) with the
    memory they live in (fds, as in an attach reply). The daemon copies them into its
    own arena, so the engine may exit; later starts attach the processed form.

    Everything is validated, and the copy made under a staging entry, before an
    existing model of that name is replaced: a failed publish changes nothing."""
    name = req.arg("name", str)
    try:
        check_model_name(name)
    except ValueError as exc:
        raise BadRequest(str(exc), argument="name") from None
    replace = req.arg("replace", bool, False)
    _check_may_publish(ctx, caller.peer, name, replace)
    access_fields = _access_fields(ctx, req)
    fingerprint = req.arg("fingerprint", str)
    if len(fingerprint) > MAX_FINGERPRINT_CHARS:
        raise BadRequest(f"fingerprint has {len(fingerprint)} characters; at most {MAX_FINGERPRINT_CHARS} are taken",
                         argument="fingerprint")
    release_slot: Callable[[], None] | None = None
    if name not in ctx.registry.groups and not ctx.access.is_admin(caller.peer):
        _check_model_count(ctx, caller.peer)
        release_slot = ctx.registry.reserve_model(caller.peer.uid)  # held until the staging entry counts instead
    try:
        return await _publish(ctx, caller, req, name, replace, access_fields, fingerprint, release_slot)
    finally:
        if release_slot is not None:
            release_slot()


async def _publish(ctx: Context, caller: Caller, req: Request, name: str, replace: bool, access_fields: dict[str, Any],
                   fingerprint: str, release_slot: Callable[[], None] | None) -> Reply:
    device = ctx.registry.resolve_device(req.arg("device", str))
    backend = ctx.backends[device]
    # Read by the parser the client's attach uses, every field checked; more than the
    # budget is NO_SPACE at admission, like any load.
    desc = parse_arena(req.arg("arena", dict))
    if desc.kind != backend.kind:
        raise BadRequest(f"{device} models are published as {backend.kind!r} arenas, not {desc.kind!r}")
    nbytes = desc.nbytes
    wait = ctx.wait_arg(req)
    # Checked before anything is opened; the path is the published memory's, set below.
    access = _private_unless_listed(
        _model_config({"name": name, "path": Path("."), "device": device, **access_fields}),
        caller.peer, ctx.access.is_admin(caller.peer))
    fingerprint = tenant_fingerprint(fingerprint, caller.peer.uid)
    residency = ctx.residency
    tenant = None if ctx.access.is_admin(caller.peer) else caller.peer.uid  # its share of the io pool (IoPool.run)
    ckpt = await residency.io.run(published_checkpoint, name, req.arg("tensors", Deferred), nbytes, fingerprint, tenant=tenant)
    source = await residency.io.run(backend.open_published, desc, req.fds, cleanup=backend.close_published, tenant=tenant)
    config = access.model_copy(update={"path": Path(ckpt.source)})
    staging = ctx.registry.stage(name, Model(config=config, path=config.parts[0][0], device=device, rank=None,
                                             origin="publish", owner=caller.peer.uid),
                                 tenants=tenant_keys(caller.peer.uid, caller.peer.groups))
    if release_slot is not None:
        release_slot()  # the staging entry holds the slot now (registry.models_owned_by)
    try:
        await residency.fill.fill_new_arena(staging, ckpt, backend.capacity(ckpt.arena_bytes), wait,
                                   CopyPublished(backend, source, ckpt.arena_bytes),
                                   verb=f"published by {caller.client!r} (pid {caller.peer.pid}, uid {caller.peer.uid}):")
        if name in ctx.registry.groups:  # again: it may have been attached or pinned during the copy
            _check_may_publish(ctx, caller.peer, name, replace)
            residency.step_down.forget(ctx.registry.unregister(name))
        ctx.registry.swap_in(staging, name)
    except BaseException:
        if staging in ctx.registry.models:
            residency.step_down.forget([ctx.registry.drop_entry(staging)])  # a failed publish leaves nothing behind
        raise
    finally:
        await residency.io.run(backend.close_published, source)
    if (store := residency.flights.store) is not None:
        await asyncio.shield(store.keep(name))  # durable when the reply says so, even if the peer hung up
    return {"model": ctx.registry.describe(name, caller.peer, None)}, []


def _check_model_count(ctx: Context, peer: Peer) -> None:
    """A published model stays registered once evicted, and every listing, placement and
    eviction walks every entry: without a bound one tenant could slow the daemon for all
    (3,000 tiny publishes made another connection's status take 32 ms on the CI machine)."""
    limit = ctx.settings.daemon.max_models_per_uid
    held = ctx.registry.models_owned_by(peer.uid)
    if held >= limit:
        raise LimitExceeded(f"uid {peer.uid} has {held} models registered or published; one more would pass "
                            f"max_models_per_uid={limit} (unregister one first)", limit=limit)


def _check_may_publish(ctx: Context, peer: Peer, name: str, replace: bool) -> None:
    if name not in ctx.registry.groups:
        return
    if not replace:
        raise BadRequest(f"a model named {name!r} exists; publish with replace=true to supersede it", model=name)
    model = ctx.registry.first(name)
    if not ctx.access.is_admin(peer):
        if model.origin == "config":
            raise PermissionDenied(f"model {name!r} is configured by the operator; only an administrator may replace it",
                                   model=name)
        if model.owner != peer.uid:  # its owner's uid is not said: the peer may not even see the model
            raise PermissionDenied(f"model {name!r} is not yours to replace", model=name)
    for entry in ctx.registry.groups[name]:
        e = ctx.core.entry(entry)
        if e.pinned:
            raise Pinned(f"model {name!r} is pinned; unpin it before replacing it", model=name)
        if e.leases:
            raise Attached(f"model {name!r} has {e.attach_count} live attachment(s)", model=name,
                           attach_count=e.attach_count)
        if e.state is State.LOADING:
            raise BadRequest(f"model {name!r} is loading; replace it when the load ends", model=name)
