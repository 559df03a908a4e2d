"""Daemon configuration: a TOML file read through pydantic-settings.

Precedence, highest first: ``WEIGHTCACHE_*`` environment variables (nested keys with
``__``, e.g. ``WEIGHTCACHE_DAEMON__LOG_LEVEL=debug``), then the TOML file, then the
defaults below. ``WEIGHTCACHE_SOCKET`` sets the socket path for the daemon and the
clients alike; ``WEIGHTCACHE_CONFIG`` names the file the daemon reads when none is given.

This module imports no torch: the CLI and the client read it before anything heavy.
"""

from __future__ import annotations

import grp
import math
import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .defaults import CONFIG_ENV, DEFAULT_SOCKET, SOCKET_ENV
from .errors import ConfigError
from .units import format_size

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_POW2 = {"K": 10, "M": 20, "G": 30, "T": 40}
_POW10 = {"K": 3, "M": 6, "G": 9, "T": 12}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """``"6GiB"`` -> 6442450944. Integers are bytes. Raises ValueError with the reason."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if m and m.group(2).lower() in ("k", "m", "g", "t"):
        # "8G" is 8 GiB to docker and java, 8 GB to Kubernetes: read either way, a budget
        # is off by 7%. Ask which one was meant.
        n, unit = m.group(1), m.group(2).upper()
        raise ValueError(f"{value!r} is ambiguous: write '{n}{unit}iB' ({n} x 2^{_POW2[unit]} bytes) "
                         f"or '{n}{unit}B' ({n} x 10^{_POW10[unit]})")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use bytes or a unit: KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d)?\s*$")
_DURATION_UNITS = {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> float:
    """``"90s"``, ``"5m"``, ``"1h"``, ``"1d"``, or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(str(value))
        if not m:
            raise ValueError(f"not a duration: {value!r} (use seconds, or a number with s, m, h or d: '30s', '5m', '1h')")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not math.isfinite(seconds):
        # TOML's `inf` (and nan) passed as a duration, and `models --json` then printed
        # Infinity, which strict JSON parsers refuse. "Never" is said by leaving the key out.
        raise ValueError(f"{value!r} is not a finite duration: give a time such as '30m' or '1h' (to never expire, "
                         "leave the key out)")
    return seconds


class Budget(BaseModel):
    """A per-device budget: absolute bytes, or a fraction of the device's total memory."""

    model_config = ConfigDict(frozen=True)

    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: Any) -> Budget:
        if isinstance(value, Budget):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # `cpu = 1` is the whole device, as "1" is
        percent = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*", value) if isinstance(value, str) else None
        if percent:  # "80%": what nvidia-smi and people say; was "not a size"
            if not 0 < float(percent.group(1)) <= 100:
                raise ValueError(f"{value!r}: a share of the device's memory must be in (0%, 100%]")
            value = str(float(percent.group(1)) / 100)
        if isinstance(value, str) and re.fullmatch(r"\s*[0-9]+\s*", value) and 1 < int(value) < 2**20:
            # `cpu = 8` meant as 8 GiB must not start a daemon whose budget holds 8 bytes and
            # refuses every load NO_SPACE. A byte count of a MiB or more is taken as written
            # (the workload and bench tools write theirs so).
            n = value.strip()
            raise ValueError(f"{value!r} has no unit: give a size such as '{n}GiB' (or '{n}B' for bytes), "
                             "or a fraction of the device's memory such as '0.8'")
        if isinstance(value, float) or (isinstance(value, str) and re.fullmatch(r"\s*[0-9]*\.[0-9]*\s*|\s*1\s*", value)):
            # A bare number with a point is a fraction: "1.5" meant as 1.5 GiB must not
            # become a budget of one byte.
            frac = float(value)
            if not 0.0 < frac <= 1.0:
                raise ValueError(f"{value!r} reads as a fraction of the device's memory, which must be in (0, 1]; "
                                 "for a size give a unit, e.g. '1.5GiB'")
            return cls(fraction=frac)
        nbytes = parse_size(value)
        if nbytes == 0:
            raise ValueError(f"a budget of {value!r} holds nothing; give a size with a unit or a fraction in (0, 1]")
        return cls(nbytes=nbytes)

    def resolve(self, total_bytes: int) -> int:
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(total_bytes * self.fraction)

    def __str__(self) -> str:
        return format_size(self.nbytes) if self.nbytes is not None else f"{self.fraction:g} of total"


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_DEVICE_RE = re.compile(r"^(cpu|cuda:[0-9]+|cuda:GPU-[0-9a-fA-F-]+)$")


def check_model_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"model name {name!r} must be 1-128 chars of letters, digits and . _ : / -, starting alphanumeric")
    return name


AUTO = "auto"  # a model's device chosen by the daemon (cache/placement.py)


def check_device(device: str, *, auto: bool = False) -> str:
    """A device name; ``auto`` also allows "auto" (a model's or shard's device in the config)."""
    if auto and device == AUTO:
        return device
    if not _DEVICE_RE.match(device):
        more = ", 'auto'" if auto else ""
        raise ValueError(f"device {device!r} must be 'cpu', 'cuda:N', 'cuda:GPU-<uuid>'{more}")
    return device


def auto_devices(devices: Iterable[str]) -> list[str]:
    """Where a ``device = "auto"`` model may be placed, in order: every budgeted GPU, or
    the CPU on a host without one (an engine that wants a GPU never gets the CPU because
    a GPU was full)."""
    gpus = sorted((d for d in devices if d.startswith("cuda:")), key=_device_order)
    return gpus or [d for d in devices if d == "cpu"]


def _device_order(device: str) -> tuple[int, str]:
    ident = device.partition(":")[2]
    return (int(ident), "") if ident.isdigit() else (1 << 30, ident)


def resolve_group(group: Any) -> int:
    """A group name or gid -> the gid; ValueError naming it when no such group exists."""
    if isinstance(group, bool) or not isinstance(group, (int, str)):
        raise ValueError(f"not a group name or gid: {group!r}")
    if isinstance(group, int) or group.isdigit():
        if int(group) < 0:
            raise ValueError(f"gid must be >= 0, not {group}")
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r}") from None


def config_group_names(daemon: DaemonConfig) -> dict[str, int]:
    """The group names the config file itself uses (``socket_group``, ``allowed_gids``,
    ``admin_gids``), resolved: the only names a peer's ``allowed_gids`` may give. A peer's
    request never makes the daemon look a name up (a publish listing "root" 1,000,000
    times ran one getgrnam each on the event loop, 36 s; with sssd or LDAP each is a
    network round trip). Called once per config (model_ops caches it)."""
    names = [g for g in (daemon.socket_group, *daemon.allowed_gids, *daemon.admin_gids) if isinstance(g, str) and not g.isdigit()]
    return {g: resolve_group(g) for g in names}


def under_roots(path: str | os.PathLike[str], roots: list[Path]) -> bool:
    """Whether ``path``, symlinks resolved, lies under one of ``roots`` (by path component:
    /models2 is not under /models). The loader checks the files it really opened again."""
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(r)) for r in roots)


class ShardConfig(BaseModel):
    """One rank's part of a tensor- or pipeline-parallel checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path
    # "auto": placed on a GPU at load time (cache/placement.py). Left out, the rank takes
    # the model's device, which must then be "auto": ranks on one fixed device make no sense.
    device: str | None = None

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        return None if v is None else check_device(v, auto=True)


class ModelConfig(BaseModel):
    """A model: one checkpoint on one device (``path``, ``device``), or one checkpoint
    per rank (``shards``, in rank order), each on its own device."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    path: Path | None = Field(default=None, description="a .safetensors file, a directory of them, or an index json")
    device: str = "cpu"
    shards: tuple[ShardConfig, ...] = ()
    pin: bool = False
    preload: bool = False
    keep_alive: float | None = Field(default=None, gt=0, description="seconds (or '30m', '1h') unused and unattached before eviction")

    # Who may use the model (docs/deployment.md, "Tenants"): a peer whose uid is listed or
    # who is in a listed group. Neither list: every connected peer, except for a model a
    # non-admin registered or published, which is its owner's alone (model_ops.py).
    allowed_uids: tuple[int, ...] | None = Field(default=None, description="uids that may use the model")
    allowed_gids: tuple[int, ...] | None = Field(default=None, description="groups (names or gids) that may use the model")

    @field_validator("allowed_uids")
    @classmethod
    def _uids(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and any(u < 0 for u in v):
            raise ValueError(f"allowed_uids must be uids >= 0, not {list(v)}")
        return v

    @field_validator("allowed_gids", mode="before")
    @classmethod
    def _gids(cls, v: Any) -> Any:
        # Group names are resolved once, here: a typo is a config error naming the key,
        # not a model nobody can reach.
        if v is None:
            return None
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"allowed_gids must be a list of group names or gids, not {v!r}")
        return tuple(resolve_group(g) for g in v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_model_name(v)

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _keep_alive(cls, v: Any) -> float | None:
        if v is None:
            return None
        negative = isinstance(v, str) and re.fullmatch(r"\s*-[0-9.]+\s*", v) is not None
        if negative or parse_duration(v) <= 0:
            # A request's keep_alive takes 0 and -1 (protocol.md); the config's is the
            # operator's time limit, and leaving it out already means "until room is needed".
            raise ValueError(f"keep_alive = {v!r}: give a time > 0 such as '30m' or '1h', or leave keep_alive out "
                             "to keep the model until its memory is needed")
        return parse_duration(v)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v, auto=True)

    @model_validator(mode="after")
    def _path_or_shards(self) -> ModelConfig:
        if (self.path is None) == (not self.shards):
            raise ValueError(f"model {self.name!r} needs either path (one checkpoint) or shards (one per rank), not both")
        missing = [i for i, s in enumerate(self.shards) if s.device is None]
        if missing and self.device != AUTO:
            raise ValueError(f"model {self.name!r}: shard(s) {missing} name no device; give each one, "
                             f'or set device = "auto" on the model to place every rank on its own GPU')
        return self

    @property
    def parts(self) -> list[tuple[Path, str]]:
        """(path, device) per rank; a single part for an unsharded model. A device may be
        "auto" (placed at load time)."""
        if self.shards:
            return [(s.path, s.device or self.device) for s in self.shards]
        assert self.path is not None
        return [(self.path, self.device)]


class QuotaConfig(BaseModel):
    """What one tenant's registered and published models may hold (docs/deployment.md,
    "Tenants"): ``bytes`` per device, resident or loading there, and ``pins``, the
    number of its models pinned at once. A device or count not given is not limited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bytes: dict[str, int] = Field(default_factory=dict, description='per device, e.g. {"cuda:0" = "20GiB"}')
    pins: int | None = Field(default=None, ge=0, description="models pinned at once")

    @field_validator("bytes", mode="before")
    @classmethod
    def _bytes(cls, v: Any) -> dict[str, int]:
        if not isinstance(v, dict):
            raise ValueError('bytes must be a table of device = size, e.g. {"cuda:0" = "20GiB"}')
        out = {}
        for k, size in v.items():
            try:
                out[check_device(str(k))] = parse_size(size)
            except ValueError as exc:
                raise ValueError(f"{k}: {exc}") from None
        return out


_TENANT_RE = re.compile(r"^(uid|gid):(.+)$")


def tenant_key(key: str) -> str:
    """``"uid:1000"`` / ``"gid:1000"`` / ``"gid:ml-team"`` -> ``"uid:1000"`` / ``"gid:<gid>"``,
    the form the daemon keys quotas by; ValueError naming what is wrong."""
    m = _TENANT_RE.match(key)
    if not m:
        raise ValueError(f"quota key {key!r} must be 'uid:<uid>' or 'gid:<group name or gid>'")
    kind, who = m.groups()
    if kind == "uid":
        if not who.isdigit():
            raise ValueError(f"quota key {key!r}: a uid is a number")
        return f"uid:{int(who)}"
    return f"gid:{resolve_group(who)}"


class DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: Path = Path(DEFAULT_SOCKET)
    socket_mode: int = Field(default=0o660, ge=0, le=0o777, description="permission bits of the socket file")
    max_frame_bytes: int = Field(default=16 * 2**20, ge=1024)
    log_level: str = "info"
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    # More readers than cores buys nothing for a memory-bound copy and stretches the
    # control plane's tail latency (docs/benchmarks.md), hence the default min(8, cores).
    load_threads: int = Field(default_factory=lambda: min(8, os.cpu_count() or 1), ge=1, le=256)
    load_chunk_bytes: int = Field(default=16 * 2**20, ge=4096)
    load_direct_io: Literal["auto", "on", "off"] = Field(
        default="auto", description="O_DIRECT reads: 'auto' uses them for files mostly not in page cache (GPU loads)")
    load_nice: int = Field(default=19, ge=0, le=19, description="scheduling niceness of loader threads")
    no_space_wait_s: float = Field(default=0.0, ge=0, description="default time a load waits for detaches")
    host_budget: int = Field(default=0, ge=0, description="pinned host memory for demoted GPU models (0: no host tier)")
    max_loaded_models: dict[str, int] = Field(default_factory=dict, description=(
        "per device, the most models resident or loading there at once, as well as the byte budget "
        "(OLLAMA_MAX_LOADED_MODELS); a device not named has no count limit"))
    eviction_policy: Literal["lru", "gdsf"] = Field(default="lru", description=(
        "which unattached models a load evicts: 'lru' (least recently used) or 'gdsf' (cost-aware: "
        "size, uses, and the measured time to bring each back; docs/architecture.md)"))
    metrics_listen: str | None = Field(default=None, description="host:port for the Prometheus /metrics endpoint")
    metrics_all_models: bool = Field(default=False, description=(
        "label /metrics series with every model, also those only some peers may use (allowed_uids/allowed_gids, a "
        "tenant's own); any local user can read the port"))
    log_format: Literal["text", "json"] = "text"
    allow_writable_attach: bool = Field(default=False, description="let clients ask for read-write GPU mappings")
    # -- access control (server/access.py) --
    socket_group: str | int | None = Field(default=None, description="group owning the socket; its members may connect")
    allowed_uids: list[int] | None = Field(default=None, description="peers allowed to connect (default: the daemon's uid and root)")
    allowed_gids: list[str | int] = Field(default_factory=list, description="groups allowed to connect")
    admin_uids: list[int] | None = Field(default=None, description="peers allowed admin ops (default: the daemon's uid and root)")
    admin_gids: list[str | int] = Field(default_factory=list, description="groups allowed admin ops")
    # -- what the daemon may read on a peer's behalf (docs/reliability.md, threat model) --
    model_roots: list[Path] = Field(default_factory=list, description=(
        "directories every checkpoint path must resolve under (config models and runtime registers); empty: no limit"))
    follow_symlinks: bool = Field(default=True, description="false: a checkpoint path that is a symlink is refused (O_NOFOLLOW)")
    tenant_register: bool = Field(default=False, description=(
        "let non-admin peers register models by passing open file descriptors (never by path)"))
    # -- limits: each violation gets its error code and affects no other client --
    max_connections: int = Field(default=1024, ge=1)
    max_connections_per_uid: int = Field(default=64, ge=1)
    max_leases_per_connection: int = Field(default=1024, ge=1)
    max_requests_per_connection: int = Field(default=32, ge=1, description=(
        "requests in flight on one connection; the daemon stops reading it beyond this"))
    max_queued_reply_bytes: int = Field(default=1 << 20, ge=0, description=(
        "reply bytes a peer has not taken yet; the daemon stops reading its requests beyond this"))
    max_fds_per_frame: int = Field(default=256, ge=0, le=4096)
    max_fds_per_uid: int = Field(default=1024, ge=0, description=(
        "fds received from one uid's frames not yet complete, and fds sent in replies its connections have not read"))
    max_files_per_uid: int = Field(default=1024, ge=0, description=(
        "open files the daemon holds for the models one uid registered with its own fds"))
    max_models_per_uid: int = Field(default=1024, ge=0, description=(
        "models one uid that is not an administrator may have registered or published at once"))
    max_partial_frame_bytes: int = Field(default=256 * 2**20, ge=1024, description=(
        "bytes of half-received frames, summed over every connection"))
    max_partial_frame_bytes_per_uid: int = Field(default=64 * 2**20, ge=1024, description=(
        "bytes of half-received frames, summed over one uid's connections"))
    request_timeout_s: float = Field(default=900.0, gt=0, description="a request running longer gets TIMEOUT")
    frame_read_timeout_s: float = Field(default=30.0, gt=0, description="a frame not complete this long after its first byte closes the connection")
    hello_timeout_s: float = Field(default=10.0, gt=0, description="a connection that has not said hello by then is closed")
    io_threads: int = Field(default=4, ge=1, le=64, description="threads that open and parse checkpoints and validate publishes")
    io_timeout_s: float = Field(default=60.0, gt=0, description="opening and parsing one checkpoint longer than this fails")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        v = v.lower()
        if v not in ("debug", "info", "warning", "error"):
            raise ValueError("log_level must be one of debug, info, warning, error")
        return v

    @field_validator("eviction_policy", mode="before")
    @classmethod
    def _policy(cls, v: Any) -> Any:
        # pydantic's own message for a Literal does not repeat what was written; say it, and
        # which one is the default, so that "gsdf" is spotted at once.
        if isinstance(v, str) and v.lower() in ("lru", "gdsf"):
            return v.lower()
        raise ValueError(f"eviction_policy must be 'lru' (the default) or 'gdsf', not {v!r}")

    @field_validator("max_loaded_models", mode="before")
    @classmethod
    def _max_loaded(cls, v: Any) -> dict[str, int]:
        if not isinstance(v, dict):
            raise ValueError('max_loaded_models must be a table of device = count, e.g. {"cuda:0" = 3}')
        out = {}
        for k, n in v.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"max_loaded_models.{k} must be a whole number >= 1, not {n!r}")
            out[check_device(str(k))] = n
        return out

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _socket_mode(cls, v: Any) -> Any:
        # chmod's digits are octal: "660" (a string) is 0o660. An integer 660 is TOML's
        # decimal and means nothing as a mode; say how to write it.
        if isinstance(v, str) and re.fullmatch(r"(0o?)?[0-7]{1,4}", v.strip()):
            return int(v.strip().removeprefix("0o"), 8)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0o777:
            raise ValueError(f"{v} is not a permission mode; write it in octal: socket_mode = 0o{v} or \"{v}\"")
        return v

    @field_validator("socket_group")
    @classmethod
    def _socket_group(cls, v: str | int | None) -> str | int | None:
        # Resolved at start (server/access.py): a missing group must be a config error
        # naming the key, not a traceback when the socket is made.
        if v is not None:
            resolve_group(v)
        return v

    @field_validator("allowed_gids", "admin_gids")
    @classmethod
    def _groups(cls, v: list[str | int]) -> list[str | int]:
        for g in v:
            resolve_group(g)
        return v

    @field_validator("shutdown_grace_s", "no_space_wait_s", "request_timeout_s", "frame_read_timeout_s",
                     "hello_timeout_s", "io_timeout_s", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> float:
        # Seconds, or "30s" / "15m" as keep_alive takes them.
        return parse_duration(v)

    @field_validator("max_frame_bytes", "load_chunk_bytes", "host_budget", "max_queued_reply_bytes", "max_partial_frame_bytes",
                     "max_partial_frame_bytes_per_uid", mode="before")
    @classmethod
    def _sizes(cls, v: Any) -> int:
        return parse_size(v)


class PeersConfig(BaseModel):
    """``[peers]``: neighbour daemons a load that misses may be filled from, over NIXL
    (weightcache/peers/, issue 27; docs/deployment.md, "Peers"). Off unless ``listen``
    is set. Only the peers named here (``addresses``, and what ``dns`` resolves to) are
    asked and answered."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str | None = Field(default=None, description="host:port of this daemon's peer port (None: no peers)")
    addresses: tuple[str, ...] = Field(default=(), description="host:port of each peer daemon")
    dns: str | None = Field(default=None, description="name:port that resolves to the peers (a headless Service)")
    refresh_s: float = Field(default=10.0, gt=0, description="how often each peer is asked what it holds")
    # Model name -> the content fingerprint its files must have (`weightcache models`
    # shows it): what a peer's copy is checked against before it is served. A model whose
    # fingerprint this daemon does not know (pinned here, or from an earlier load of the
    # same, unchanged files) is never filled from a peer.
    fingerprints: dict[str, str] = Field(default_factory=dict)
    serve: bool = Field(default=True, description="lend this daemon's resident models to its peers")
    timeout_s: float = Field(default=120.0, gt=0, description="a fill from a peer not done by then falls back to the files")
    max_fill_bytes_per_s: int | None = Field(default=None, gt=0, description="cap on one fill's rate (None: none)")

    @field_validator("refresh_s", "timeout_s", mode="before")
    @classmethod
    def _peer_durations(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("max_fill_bytes_per_s", mode="before")
    @classmethod
    def _peer_rate(cls, v: Any) -> int | None:
        return None if v is None else parse_size(v)

    @field_validator("listen", "dns")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None:
            host, sep, port = v.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(f"{v!r} is not host:port")
        return v

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for a in v:
            cls._host_port(a)
        return v


class Settings(BaseSettings):
    """Everything the daemon reads at start. Frozen: a reload builds a new one."""

    model_config = SettingsConfigDict(
        env_prefix="WEIGHTCACHE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    daemon: DaemonConfig = DaemonConfig()
    budgets: dict[str, Budget] = Field(default_factory=lambda: {"cpu": Budget(fraction=0.5)})
    models: list[ModelConfig] = Field(default_factory=list)
    peers: PeersConfig = PeersConfig()  # neighbour daemons (weightcache/peers/)

    # "uid:1000" or "gid:<name or gid>" -> what that tenant's models may hold; keys are
    # normalised to "uid:N" / "gid:N" (tenant_key).
    quotas: dict[str, QuotaConfig] = Field(default_factory=dict)

    @field_validator("quotas", mode="before")
    @classmethod
    def _quotas(cls, v: Any) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise ValueError('quotas must be tables named by tenant, e.g. [quotas."uid:1000"]')
        out: dict[str, Any] = {}
        for k, q in v.items():
            try:
                key = tenant_key(str(k))
            except ValueError as exc:
                raise ValueError(f"{k}: {exc}") from None
            if key in out:
                raise ValueError(f"quota key {k!r} names {key}, which has a quota already")
            out[key] = q
        return out

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets(cls, v: Any) -> dict[str, Budget]:
        if not isinstance(v, dict):
            raise ValueError("budgets must be a table of device = size")
        out = {}
        for k, val in v.items():
            try:
                out[check_device(str(k))] = Budget.parse(val)
            except ValueError as exc:  # the key too: the field's path stops at "budgets"
                raise ValueError(f"budgets.{k}: {exc}") from None
        return out

    @model_validator(mode="after")
    def _models_consistent(self) -> Settings:
        for dev in self.daemon.max_loaded_models:
            if dev not in self.budgets:
                raise ValueError(f"daemon.max_loaded_models names device {dev!r}, which has no entry in [budgets]")
        for key, q in self.quotas.items():
            for dev in q.bytes:
                if dev not in self.budgets:
                    raise ValueError(f"quotas.{key}.bytes names device {dev!r}, which has no entry in [budgets]")
        seen: set[str] = set()
        for m in self.models:
            if m.name in seen:
                raise ValueError(f"model name {m.name!r} appears twice")
            seen.add(m.name)
            auto = sum(device == AUTO for _path, device in m.parts)
            if auto > len(auto_devices(self.budgets)):
                raise ValueError(f'model {m.name!r}: {auto} ranks with device "auto" need as many devices to place '
                                 f"them on, one each; [budgets] has {auto_devices(self.budgets) or 'none'}")
            for path, device in m.parts:
                if device not in self.budgets and device != AUTO:
                    raise ValueError(f"model {m.name!r} is on device {device!r}, which has no entry in [budgets]")
                if self.daemon.model_roots and not under_roots(path, self.daemon.model_roots):
                    roots = ", ".join(str(r) for r in self.daemon.model_roots)
                    raise ValueError(f"model {m.name!r}: {path} is not under daemon.model_roots ({roots})")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's contents arrive as init kwargs (see load_settings); the environment
        # must win over the file, so it comes first.
        return (env_settings, init_settings)


def problems(exc: ValidationError, root: type[BaseModel] | None = None) -> list[str]:
    """One line per problem of ``exc``, each naming its key: for the config file
    (``root`` Settings, the default), or for one model the daemon is sent (``register``:
    ``root=ModelConfig``), whose pydantic dump spanned four lines and a URL."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        # Our validators' messages are sentences, often naming the key themselves
        # ("budgets.cpu: ..."): no "Value error, " before them, no key twice.
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = _unknown_key(err["loc"], root or Settings)
        env = _env_name(err["loc"]) if root is None else None
        if env:  # the file may be fine: say where the value came from
            msg += f" (from ${env})"
        lines.append(msg if not loc or msg.startswith((f"{loc}.", f"{loc}:")) else f"{loc}: {msg}")
    return lines


def _unknown_key(loc: tuple[int | str, ...], root: type[BaseModel]) -> str:
    """pydantic says "Extra inputs are not permitted"; an operator wants to hear that the
    key is unknown and which known one it is closest to ("sokcet": socket)."""
    import difflib

    cls: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):  # a [[models]] entry's index
            continue
        field = getattr(cls, "model_fields", {}).get(part) if isinstance(cls, type) else None
        if field is None:  # a table's own key ([budgets], [quotas."uid:1000"]): its values' model
            continue
        cls = _model_in(field.annotation)
    known = list(getattr(cls, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return "unknown key" + (f" (known: {', '.join(known)})" if len(known) <= 10 else "; configs/example.toml shows every key")


def _model_in(annotation: Any) -> Any:
    """The pydantic model a field holds: itself, or inside list[...], tuple[...], dict[...]."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _env_name(loc: tuple[int | str, ...]) -> str | None:
    """The WEIGHTCACHE_* variable that set ``loc`` (or a table above it), if one is set."""
    parts = [str(p) for p in loc if not isinstance(p, int)]
    for n in range(len(parts), 0, -1):
        name = "WEIGHTCACHE_" + "__".join(parts[:n]).upper()
        if any(k.upper() == name for k in os.environ):
            return name
    return None


def config_relative(path: str, config_file: Path) -> str:
    """A path as written in ``config_file``: ``~`` expanded, relative ones taken from the
    file's directory. The CLI finds the daemon's socket the same way."""
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else str((config_file.parent / expanded).resolve())


def load_settings(path: str | Path | None = None) -> Settings:
    """Read the config file (``path``, else ``$WEIGHTCACHE_CONFIG``, else defaults only).

    Raises :class:`ConfigError` with one line per problem, each naming the key.
    """
    from_env = not path and bool(os.environ.get(CONFIG_ENV))
    path = path or os.environ.get(CONFIG_ENV)
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            # A stale $WEIGHTCACHE_CONFIG in the environment is the likely cause: name it.
            named = f" (named by ${CONFIG_ENV}; pass --config or fix the variable)" if from_env else ""
            raise ConfigError(f"config file {p} does not exist{named}") from None
        except OSError as exc:  # a directory, no read permission: was a traceback (and INTERNAL on reload)
            raise ConfigError(f"config file {p} cannot be read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start}): is it the TOML file?") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        # Relative paths (the models' and the socket's) are relative to the config file,
        # not to the cwd, which under systemd is /; "~" is the daemon user's home, as in a
        # shell (read literally it became a directory named "~").
        daemon = data.get("daemon")
        if isinstance(daemon, dict) and isinstance(daemon.get("socket"), str):
            daemon["socket"] = config_relative(daemon["socket"], p)
        for m in data.get("models", []) if isinstance(data.get("models"), list) else []:
            shards = m.get("shards", []) if isinstance(m, dict) else []
            for part in [m, *shards] if isinstance(shards, list) else [m]:
                if isinstance(part, dict) and isinstance(part.get("path"), str):
                    part["path"] = config_relative(part["path"], p)
    if os.environ.get(SOCKET_ENV):
        data.setdefault("daemon", {})["socket"] = os.environ[SOCKET_ENV]
    try:
        return Settings(**data)
    except ValidationError as exc:
        lines = problems(exc)
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid configuration{where}:\n  " + "\n  ".join(lines)) from None

