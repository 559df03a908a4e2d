"""What a handler gets, and one function per op (docs/protocol.md): status, health,
models, load, attach, detach, evict, pin, unpin, reload, and ``hello``; register,
unregister and publish live in model_ops.py. connections.py's ``HANDLERS`` is the
dispatch table.

A handler is ``async def op(ctx: Context, caller: Caller, req: Request) -> Reply``. It
never sees a connection: ``Caller`` is who asked, ``Request`` what they asked (its fds a
field), ``Context`` the rooms of the daemon it may act on.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..backends import Backend
from ..cache import CacheCore, State
from ..cache.eviction import tenant_keys
from ..config import Settings
from ..errors import (
    Attached,
    BadRequest,
    CorruptCheckpoint,
    LimitExceeded,
    LoadFailed,
    NoSpace,
    PermissionDenied,
    ProtocolVersionError,
    WeightcacheError,
)
from ..protocol import PROTOCOL_VERSION
from ..protocol.framing import Packed
from ..units import format_size, parse_duration
from .access import AccessPolicy, Peer
from .registry import Registry, entries_for, learn_sizes, redacted
from .residency import Residency

# ===============================================================================================
# WHAT A HANDLER GETS: the request, who sent it, and the daemon's parts it may use
# ===============================================================================================

Reply = tuple[dict[str, Any], list[int]]  # the reply's fields, and fds to send with it (closed once sent)


@dataclass
class Request:
    id: int
    op: str
    args: dict[str, Any]
    # The fds that came with the frame. A handler that keeps some (register) takes them
    # out of this list; whatever is left is closed when the request ends.
    fds: list[int] = field(default_factory=list)

    def arg(self, key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
        """An argument of the expected type, or BadRequest naming it."""
        return arg(self.args, key, typ, default)


@dataclass(frozen=True)
class Caller:
    conn: int  # the connection's id: leases belong to it
    peer: Peer
    client: str  # the name it gave in hello
    # Done once the connection closed: a load it asked for finishes but waits for room no
    # more (SingleFlight.ensure_resident). None where no request runs (a lease's holder).
    gone: asyncio.Future[None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Context:
    settings: Settings
    core: CacheCore
    registry: Registry
    residency: Residency
    access: AccessPolicy
    backends: dict[str, Backend]
    started: float  # monotonic time the daemon started
    socket_path: str
    connections: Callable[[], int]
    caller_of: Callable[[int], Caller | None]  # who holds a connection (a lease's holder); None once it closed
    shutting_down: Callable[[], bool]
    health: Callable[[], dict[str, Any]]
    reload: Callable[[], Awaitable[dict[str, Any]]]
    outlived: Callable[[], list[dict[str, Any]]] = lambda: []  # mappings of an earlier daemon (server/outlived.py)
    other_daemons: Callable[[], list[dict[str, Any]]] = lambda: []  # other `weightcache serve` processes on the host
    peers: Callable[[], dict[str, Any] | None] = lambda: None  # [peers]: the status op's "peers" (weightcache/peers/)
    loop: Callable[[], dict[str, Any] | None] = lambda: None  # the event loop's stalls (server/loop_watch.py)

    def wait_arg(self, req: Request) -> float:
        wait = float(req.arg("wait_s", (int, float), self.settings.daemon.no_space_wait_s))
        if not 0 <= wait < float("inf"):  # also rejects NaN
            raise BadRequest(f"argument 'wait_s' must be a finite number >= 0, got {wait}", argument="wait_s")
        # The request times out at request_timeout_s anyway; the load it starts (which
        # others may join) must not go on waiting for room after that.
        return min(wait, self.settings.daemon.request_timeout_s)


Handler = Callable[[Context, Caller, Request], Awaitable[Reply]]


def arg(args: dict[str, Any], key: str, typ: type | tuple[type, ...], default: Any = ...) -> Any:
    """``args[key]`` if it has the expected type, ``default`` if absent or nil, else BadRequest."""
    if key not in args or args[key] is None:
        if default is ...:
            raise BadRequest(f"missing argument {key!r}", argument=key)
        return default
    value = args[key]
    if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, float, (int, float))):
        want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        raise BadRequest(f"argument {key!r} must be {want}, got {type(value).__name__}", argument=key)
    return value


# ===============================================================================================
# THE OPS
# ===============================================================================================

_FILE_DETAILS = frozenset({"file", "path", "roots"})  # error details that describe the daemon's files


def hello(ctx: Context, args: dict[str, Any]) -> dict[str, Any]:
    """The handshake (handled inline by the connection, so that pipelined requests behind
    it find it done)."""
    version = args.get("protocol")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"client speaks protocol {version!r}; this daemon speaks {PROTOCOL_VERSION}", supported=[PROTOCOL_VERSION]
        )
    d = ctx.settings.daemon
    return {"protocol": PROTOCOL_VERSION, "server": f"weightcache/{__version__}", "pid": os.getpid(),
            "max_frame_bytes": d.max_frame_bytes, "request_timeout_s": d.request_timeout_s}


def redact(ctx: Context, caller: Caller, req: Request, exc: WeightcacheError) -> WeightcacheError:
    """The error as the requester gets it: NO_SPACE and ATTACHED name who holds the
    leases (as far as this peer may see them); a load failure names files, and a peer
    who may not see the model gets the code only."""
    exc = _name_holders(ctx, caller.peer, exc)
    exc = _own_quota_only(ctx, caller.peer, exc)
    names_files = isinstance(exc, (LoadFailed, CorruptCheckpoint)) or bool(_FILE_DETAILS & exc.details.keys())
    if not names_files or ctx.access.is_admin(caller.peer):
        return exc
    if req.op == "register" and req.args.get("files") is not None:
        # A register's header check read the peer's own fds, named by the peer's own
        # file names: the reason tells it nothing about the daemon's files.
        return exc
    name = req.args.get("name")
    models = ctx.registry.models
    model = models.get(ctx.registry.groups[name][0] if name in ctx.registry.groups else name) if isinstance(name, str) else None
    if model is not None and ctx.registry.may_see(caller.peer, model):
        return exc
    return type(exc)(redacted(exc.to_wire())["message"], **({"model": name} if isinstance(name, str) else {}))


def _own_quota_only(ctx: Context, viewer: Peer, exc: WeightcacheError) -> WeightcacheError:
    """A quota's NO_SPACE tells how much its tenant holds: only to that tenant and to
    admins. Another peer allowed to load the tenant's model learns which quota refused."""
    quota = exc.details.get("quota")
    if (not isinstance(exc, NoSpace) or not isinstance(quota, str) or ctx.access.is_admin(viewer)
            or quota in tenant_keys(viewer.uid, viewer.groups)):
        return exc
    d = exc.details
    return NoSpace(f"model {d.get('model')!r} needs {format_size(int(d.get('needed', 0)))} on {d.get('device')}, over "
                   f"the quota of {quota}, its owner's (the owner's unattached models there cannot make room)",
                   model=d.get("model"), device=d.get("device"), needed=d.get("needed"), quota=quota,
                   fits_ever=exc.fits_ever)


def lease_holders(ctx: Context, entries: list[str], viewer: Peer) -> list[dict[str, Any]]:
    """Who holds leases on ``entries``: a row per connection (``count`` leases, the
    oldest ``since_s`` ago), oldest first, as ``viewer`` may see them. Peers are tenants
    who need not trust each other: a holder's pid, uid and client name are shown to
    admins and to peers of the holder's own uid only. The count of leases is not secret
    (``attach_count``), so others' leases are left out, not disguised. A row per
    connection, not per lease: the work and the reply are bounded by max_connections."""
    admin = ctx.access.is_admin(viewer)
    out = []
    for entry in entries:
        for conn, count, age in ctx.core.holders_on(entry):
            who = ctx.caller_of(conn)
            if who is None:  # its connection is closing: the lease ends in a moment
                continue
            if admin or who.peer.uid == viewer.uid:
                out.append({"pid": who.peer.pid, "uid": who.peer.uid, "client": who.client, "since_s": round(age, 3),
                            "count": count})
    return out


def _holders_text(holders: list[dict[str, Any]], attach_count: int) -> str:
    """``attached by pid 4242 (vllm, uid 1000) for 12s``: what an operator needs to find
    the engine that keeps a model in memory. Leases the viewer may not see are counted."""
    shown = [f"pid {h['pid']} ({h['client']}, uid {h['uid']}){_times(h['count'])} for {h['since_s']:.0f}s" for h in holders]
    others = attach_count - sum(h["count"] for h in holders)
    if not shown:
        return f"{attach_count} attached (by other users)"
    return "attached by " + ", ".join(shown) + (f" and {others} other(s)" if others > 0 else "")


def _times(count: int) -> str:
    return f" x{count}" if count > 1 else ""


def _entries_named(ctx: Context, name: Any) -> list[str]:
    """The cache entries an error's ``model`` detail means (a model, or one of its ranks)."""
    if isinstance(name, str) and name in ctx.registry.groups:
        return ctx.registry.groups[name]
    return [name] if isinstance(name, str) and name in ctx.core.entries else []


def _name_holders(ctx: Context, viewer: Peer, exc: WeightcacheError) -> WeightcacheError:
    """A new error (the original may be shared by every request that joined one load)
    whose message and details say who holds the memory or the model, with sizes in the
    units the CLI prints. The core raises these knowing only connection ids."""
    if isinstance(exc, Attached):
        entries = _entries_named(ctx, exc.details.get("model"))
        if not entries:
            return exc
        holders = lease_holders(ctx, entries, viewer)
        count = sum(ctx.core.entry(e).attach_count for e in entries)
        if not count:  # detached meanwhile: the core's message stands
            return exc
        return Attached(f"{exc.message}: {_holders_text(holders, count)}", **{**exc.details, "holders": holders})
    if isinstance(exc, NoSpace) and isinstance(exc.details.get("holders"), list):
        d = exc.details
        held = []
        holders = []
        # Models the viewer may not use are not named (docs/deployment.md, "Tenants"): their
        # bytes are told as one sum, since the budget and free figures show them anyway.
        hidden = [h for h in d["holders"] if not ctx.registry.visible(viewer, h.get("name"))]
        for h in d["holders"]:
            if not ctx.registry.visible(viewer, h.get("name")):
                continue
            entries = _entries_named(ctx, h.get("name"))
            leases = lease_holders(ctx, entries, viewer) if entries and h.get("attach_count") else []
            holders.append({**h, "leases": leases})
            who = _holders_text(leases, h["attach_count"]) if h.get("attach_count") else "not attached"
            held.append(f"{h['name']} ({format_size(h['nbytes'])}, {h['state']}, {who}{', pinned' if h.get('pinned') else ''})")
        if hidden:
            held.append(f"{format_size(sum(h['nbytes'] for h in hidden))} in {len(hidden)} model(s) not available to you")
        return NoSpace.over_budget(**{**d, "held": held, "holders": holders, "fits_ever": exc.fits_ever})
    return exc


def describe(ctx: Context, entry: str, caller: Caller) -> dict[str, Any]:
    """The ``models`` entry: the registry's view, and who holds its leases (the registry
    knows no connections)."""
    out = {**ctx.registry.describe(entry, caller.peer, ctx.residency.stats.progress.get(entry)),
           "leases": lease_holders(ctx, [entry], caller.peer)}
    if out.get("shares_with"):  # names of models the viewer may not use are not told
        out["shares_with"] = [n for n in out["shares_with"] if ctx.registry.visible(caller.peer, n)]
    return out


def describe_all(ctx: Context, entries: list[str], caller: Caller) -> dict[str, Any]:
    """The reply of ops on a whole model: its first entry, and every rank."""
    return {"model": describe(ctx, entries[0], caller), "shards": [describe(ctx, e, caller) for e in entries]}


async def status(ctx: Context, caller: Caller, req: Request) -> Reply:
    devices = ctx.core.device_summary()
    for dev, d in devices.items():
        d["backend"] = ctx.backends[dev].kind if dev in ctx.backends else "pinned-host"
        if dev in ctx.backends:
            d["content_hash"] = ctx.backends[dev].content_hash()
    admin = ctx.access.is_admin(caller.peer)
    return {
        "version": __version__, "pid": os.getpid(), "uptime_s": time.monotonic() - ctx.started,
        "socket": ctx.socket_path, "devices": devices,
        # Administrators only: daemon-wide, they tell a tenant what the others do (how many
        # engines, attaches, loads and evictions) and nothing it needs for its own models.
        "connections": ctx.connections() if admin else None, "leases": len(ctx.core.leases) if admin else None,
        "counters": dict(ctx.residency.stats.counters) if admin else None,
        "loading": {e.shown: {**p.snapshot(), "model": e.model} for name, p in ctx.residency.stats.progress.items()
                    if (e := ctx.core.entries.get(name)) is not None and ctx.registry.visible(caller.peer, name)},
        "shutting_down": ctx.shutting_down(),
        # What `weightcache ps` shows: the models that hold memory, with their leases.
        "resident": [describe(ctx, name, caller) for name in _listed(ctx, caller.peer)
                     if ctx.core.entry(name).state in (State.RESIDENT, State.LOADING, State.HOST)],
        "tenants": tenant_usage(ctx, caller.peer),
        # Processes still mapping an earlier daemon's memory (server/outlived.py): what an
        # administrator must know of memory no budget counts; a peer sees its own uid's.
        "outlived": [m for m in ctx.outlived() if ctx.access.is_admin(caller.peer) or m["uid"] == caller.peer.uid],
        # Administrators only: with /proc mounted hidepid, others could not see them.
        "other_daemons": ctx.other_daemons() if ctx.access.is_admin(caller.peer) else [],
        # Administrators only: its stacks name the daemon's code, its stalls other tenants' work.
        "loop": ctx.loop() if ctx.access.is_admin(caller.peer) else None,
        # device = "auto" models: the last placement of each (rank), as models shows it
        # Neighbour daemons, what they hold, this daemon's fills and lends ([peers]; None
        # when off): the operator's, and for others daemon-wide figures like the totals above.
        "peers": ctx.peers() if admin else None,
        # [published] (server/store.py): where published models are kept on disk, and how full; None when off
        "published": store.status() if admin and (store := ctx.residency.flights.store) is not None else None,
        "placement": {slot: ctx.registry.placement_as_seen(caller.peer, slot) for slot in ctx.registry.placed
                      if ctx.registry.visible(caller.peer, next(iter(ctx.registry.replicas[slot].values())))},
    }, []


def tenant_usage(ctx: Context, viewer: Peer) -> dict[str, Any]:
    """Per tenant, the bytes its models hold per device, its pins and its quota
    (cache/eviction.py, Note [quotas]): every tenant for administrators, a peer's own uid
    and groups for anyone else."""
    usage = ctx.core.tenant_usage()
    if ctx.access.is_admin(viewer):
        return usage
    mine = set(tenant_keys(viewer.uid, viewer.groups))
    return {t: u for t, u in usage.items() if t in mine}


async def health(ctx: Context, caller: Caller, req: Request) -> Reply:
    health = ctx.health()
    if not ctx.access.is_admin(caller.peer):  # failures name files: for administrators
        health["failed_preloads"] = {name: "failed (the daemon's log and administrators have the details)"
                                     for name in health["failed_preloads"] if ctx.registry.visible(caller.peer, _first(ctx, name))}
        health["preloading"] = [n for n in health["preloading"] if ctx.registry.visible(caller.peer, _first(ctx, n))]
    return health, []


def _first(ctx: Context, name: str) -> str:
    """A model's first entry (a preload is named by model)."""
    return ctx.registry.groups.get(name, [name])[0]


def _listed(ctx: Context, viewer: Peer) -> list[str]:
    """The entries ``viewer`` is shown: not a publish's staging entry, nor a model it may not use."""
    return [n for n in ctx.registry.models if not ctx.core.entry(n).staging and ctx.registry.visible(viewer, n)]


async def models(ctx: Context, caller: Caller, req: Request) -> Reply:
    return {"models": [describe(ctx, name, caller) for name in _listed(ctx, caller.peer)]}, []


_UNSET = object()


def keep_alive_arg(req: Request) -> Any:
    """``keep_alive`` of a load or attach, in seconds: ``-1`` (or ``"-1"``) is None,
    never expire; ``0`` expires the model as soon as its last lease goes; durations follow
    units.parse_duration ("30s", "5m", "1h"). ``_UNSET`` when the request has none."""
    v = req.args.get("keep_alive")
    if v is None:
        return _UNSET
    if not isinstance(v, bool) and v in (-1, "-1"):
        return None
    try:
        seconds = parse_duration(v)
    except ValueError as exc:
        raise BadRequest(f"keep_alive: {exc}", argument="keep_alive") from None
    if not 0 <= seconds < float("inf"):  # NaN too; -1 is the one negative that means something
        raise BadRequest(f"keep_alive: {v!r} is neither -1 (never expire) nor a duration >= 0", argument="keep_alive")
    return seconds


def apply_keep_alive(ctx: Context, caller: Caller, entries: list[str], seconds: Any) -> None:
    """Set a request's keep_alive on ``entries``. Administrators' values apply as given.
    A tenant's is capped at the model's configured keep_alive (when it has one): peers
    share the host's memory, and one tenant must not keep a model resident past what the
    operator configured, least of all forever (-1). Shorter values, 0 included, are
    allowed: they only drop an unattached copy sooner, which any tenant's load under
    memory pressure may do already, and never touch a model while it is leased."""
    if seconds is _UNSET:
        return
    admin = ctx.access.is_admin(caller.peer)
    for e in entries:
        cap = ctx.core.entry(e).configured_keep_alive
        value = seconds
        if not admin and cap is not None:
            value = cap if seconds is None else min(seconds, cap)
        ctx.core.set_keep_alive(e, value)


async def load(ctx: Context, caller: Caller, req: Request) -> Reply:
    wait = ctx.wait_arg(req)
    keep_alive = keep_alive_arg(req)
    rank = req.arg("rank", int, None)
    name = req.arg("name", str)
    ctx.registry.check_use(caller.peer, name)
    # device: where an engine that must run on one GPU needs it (an auto model goes there;
    # any other must already live there); none: placed (cache/placement.py).
    await learn_sizes(ctx.core, ctx.registry, ctx.residency.io.run, name)
    entries = entries_for(ctx.core, ctx.registry, ctx.backends, name, rank, req.arg("device", str, None))
    await asyncio.gather(*(ctx.residency.flights.ensure_resident(e, wait, gone=caller.gone) for e in entries))
    apply_keep_alive(ctx, caller, entries, keep_alive)
    return describe_all(ctx, entries, caller), []


async def attach(ctx: Context, caller: Caller, req: Request) -> Reply:
    model = req.arg("name", str)
    ctx.registry.check_use(caller.peer, model)
    table = req.arg("table", str, "rows")
    if table not in ("rows", "columns"):
        raise BadRequest(f"argument 'table' must be \"rows\" or \"columns\", got {table[:40]!r}", argument="table")
    device = req.arg("device", str, None)
    rank = req.arg("rank", int, None)
    ctx.registry.entry_for(model, rank)  # BAD_REQUEST for a rank that does not exist, or none given
    # An auto model's replica on the named device, or the placed one (registry.entries_for).
    await learn_sizes(ctx.core, ctx.registry, ctx.residency.io.run, model)
    [name] = entries_for(ctx.core, ctx.registry, ctx.backends, model, rank, device)
    wait = ctx.wait_arg(req)
    keep_alive = keep_alive_arg(req)
    writable = req.arg("writable", bool, False)
    if writable and not ctx.settings.daemon.allow_writable_attach:
        raise PermissionDenied("read-write attachments are disabled (daemon.allow_writable_attach = false)", argument="writable")
    entry = ctx.core.entry(name)
    backend = ctx.backends[entry.device]
    if writable and not backend.supports_writable_attach:
        raise BadRequest(f"{entry.device} arenas are sealed memfds: they cannot be mapped writable", argument="writable")
    source = "resident"
    waits: list[float] = []  # for room that other models held (attached, or loading)
    while True:
        got = await ctx.residency.flights.ensure_resident(name, wait, waits)
        if got != "resident":
            source = got  # a miss stays a miss, even if a retry then found it resident
        # Another request may have evicted it between the load and here; retry then.
        if ctx.core.entry(name).state is State.RESIDENT:
            break
    held = ctx.core.leases_held(caller.conn)
    if held >= ctx.settings.daemon.max_leases_per_connection:
        raise LimitExceeded(f"this connection holds {held} leases, the maximum", limit=held)
    lease = ctx.core.attach(name, caller.conn)
    apply_keep_alive(ctx, caller, [name], keep_alive)
    m = ctx.registry.models[name]
    res = m.resident
    assert res.arena is not None and res.checkpoint is not None
    try:
        fds, arena = backend.export(res.arena)
    except BaseException:
        ctx.core.detach(lease.id, caller.conn)
        raise
    return {
        "lease": lease.id, "model": name, "rank": m.rank, "device": entry.device, "fingerprint": res.checkpoint.fingerprint,
        "nbytes": entry.nbytes,  # what the budget counts, as `models` shows it (not the tensors' sum)
        "arena": {**arena, "writable": writable}, "source": source, "waited_s": round(sum(waits), 6),
        "placement": ctx.registry.placement_as_seen(caller.peer, m.slot), "tensors": Packed(res.columns if table == "columns" else res.table),
    }, fds


async def detach(ctx: Context, caller: Caller, req: Request) -> Reply:
    lease = ctx.core.detach(req.arg("lease", int), caller.conn)
    ctx.residency.room.notify()
    return {"lease": lease.id, "model": lease.model}, []


async def evict(ctx: Context, caller: Caller, req: Request) -> Reply:
    """One tier down for every rank: device -> host tier (where enabled) -> gone."""
    ctx.registry.check_use(caller.peer, req.arg("name", str))
    entries = [ctx.core.entry(n) for n in ctx.registry.members(req.arg("name", str))]
    movable = [e for e in entries if e.state in (State.RESIDENT, State.HOST)]
    for e in movable:  # check every rank before moving any: all or nothing
        if e.state is State.RESIDENT:
            ctx.core.check_evictable(e.name)  # ATTACHED / PINNED with the reason
    freed = sum(e.nbytes for e in movable if e.state is State.RESIDENT)
    # Every rank moves in the core before any demotion is awaited: carried out one rank
    # at a time, a peer could attach a later rank while an earlier one was copied to the
    # host tier, and the evict stopped between ranks with ATTACHED.
    steps = [ctx.core.evict(e.name) for e in movable]
    await asyncio.gather(*(t for step in steps for t in ctx.residency.step_down.start(step, reason="requested")))
    ctx.residency.room.notify()
    return {"evicted": bool(movable), "freed": freed, "state": str(entries[0].state)}, []


async def pin(ctx: Context, caller: Caller, req: Request) -> Reply:
    return await _set_pin(ctx, caller, req, True)


async def unpin(ctx: Context, caller: Caller, req: Request) -> Reply:
    return await _set_pin(ctx, caller, req, False)


# Admin ops that a model's owner may also run on its own model when a pins quota covers
# it (docs/deployment.md, "Tenants"): the quota is what makes a tenant's pins bounded.
OWNER_PIN_OPS = frozenset({"pin", "unpin"})


async def _set_pin(ctx: Context, caller: Caller, req: Request, pinned: bool) -> Reply:
    name = req.arg("name", str)
    op = "pin" if pinned else "unpin"
    if not ctx.access.is_admin(caller.peer):
        model = ctx.registry.first(name) if name in ctx.registry.groups or name in ctx.registry.models else None
        if model is None or model.owner != caller.peer.uid or model.origin == "config" \
                or not ctx.core.pins_limited(ctx.registry.members(name)[0]):
            raise PermissionDenied(f"op {op!r} is for administrators, and for a model's owner where a pins quota "
                                   f"covers it; uid {caller.peer.uid} may not {op} {name!r}", op=op)
    ctx.registry.check_use(caller.peer, name)
    entries = ctx.registry.members(name)
    for e in entries:
        ctx.core.set_pinned(e, pinned)
    if not pinned:
        ctx.residency.room.notify()
    return describe_all(ctx, entries, caller), []


async def reload(ctx: Context, caller: Caller, req: Request) -> Reply:
    return {"report": await ctx.reload()}, []
