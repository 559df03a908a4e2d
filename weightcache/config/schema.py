"""The config file's shape: one pydantic model per table, validated at load and frozen.

``Settings`` is the whole file: a field per top-level table. A new table is a model class
here and a field of ``Settings`` (and a commented example in configs/example.toml); one
with many keys and checks of its own may get a module of its own (peers.py, ``[peers]``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ..protocol import DEFAULT_SOCKET
from ..units import format_size, parse_duration, parse_size
from .checks import AUTO, auto_devices, check_device, check_model_name, resolve_group, tenant_key, under_roots
from .peers import PeersConfig


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
    published: int | None = Field(default=None, ge=0, description=(
        "bytes of its published models kept on disk in the [published] store (a file stored once counts once)"))

    @field_validator("published", mode="before")
    @classmethod
    def _published(cls, v: Any) -> int | None:
        return None if v is None else parse_size(v)

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


class PublishedConfig(BaseModel):
    """[published]: where published models are kept on disk so that they survive a
    restart (server/store.py; docs/deployment.md, "Published weights on disk"). Off
    while ``dir`` is not set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path | None = Field(default=None, description="an absolute path, the daemon's alone (mode 0700); made if missing")
    budget: int | None = Field(default=None, gt=0, description="bytes the store may hold, e.g. \"20GiB\"")

    @field_validator("budget", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> int | None:
        return None if v is None else parse_size(v)

    @field_validator("dir")
    @classmethod
    def _dir(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_absolute():
            raise ValueError(f"{str(v)!r} is relative; give an absolute path such as \"/var/lib/weightcache/published\"")
        return v

    @model_validator(mode="after")
    def _sized(self) -> PublishedConfig:
        # A store without a size would take the disk: the operator says how much it may.
        if self.dir is not None and self.budget is None:
            raise ValueError('published.dir is set without published.budget: say how much the store may hold, '
                             'e.g. budget = "20GiB"')
        return self


class DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: Path = Path(DEFAULT_SOCKET)
    socket_mode: int = Field(default=0o660, ge=0, le=0o777, description="permission bits of the socket file")
    max_frame_bytes: int = Field(default=16 * 2**20, ge=1024)
    log_level: str = "info"
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    # More readers than cores buys nothing for a memory-bound copy and stretches the
    # control plane's tail latency, hence at most the cores. 12 on a 16-core H100 host
    # loaded 1.16x faster than 8 through the daemon, with status's p99 during the load at
    # 1.67 ms against 1.61 (docs/benchmarks.md, "The loader from the page cache (H100)");
    # 16 on the H200 host was faster still but put that p99 at 5.0 ms ("The loader
    # against InstantTensor (H200, page cache warm)").
    load_threads: int = Field(default_factory=lambda: min(12, os.cpu_count() or 1), ge=1, le=256)
    load_chunk_bytes: int = Field(default=16 * 2**20, ge=4096)
    # Both below stay off: at the default 12 threads neither beat one buffer a thread with
    # every chunk staged on the H100 hosts (docs/benchmarks.md, "The loader from the page
    # cache (H100)"). Read at start.
    load_depth: int = Field(default=1, ge=1, le=16, description=(
        "pinned staging buffers per loader thread (GPU loads): a thread reads into one while the copies out of the others run"))
    load_page_cache_dma: Literal["auto", "on", "off"] = Field(default="off", description=(
        "GPU loads of files wholly in the page cache: also copy from their registered pages, beside the staging path "
        "(backends/page_windows.py); 'auto' probes the driver's registration at start and uses it when it is fast"))
    # The C loop by default: through the daemon on one H100 host, 43.2 GB/s best against
    # 40.1 staged from Python in the same call; on another, the same within the spread
    # (docs/benchmarks.md, "The chunk loop through the daemon").
    load_chunk_loop: Literal["auto", "c", "tasks", "python"] = Field(default="auto", description=(
        "GPU loads: each chunk's reads and copies run in the C loop built at install, in 2 MiB slots, 3 in flight "
        "a thread (backends/cuda_writer.py, Note [the chunk loop in C]); 'auto' where it is built, else staged from "
        "Python with a warning at start; 'c' refuses to start without it; 'tasks' also runs each loader thread's "
        "tasks in one call of the loop, the hash kernels launched from C (Note [a thread's tasks in one call]; "
        "not yet measured on a GPU), and refuses to start without the loop; 'python' stages every chunk from Python"))
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
    max_read_bytes_per_s_per_uid: int = Field(default=64 * 2**20, ge=0, description=(
        "bytes per second read from one uid's connections together once they have sent max_frame_bytes at once "
        "(0: no limit): requests are small, so only a peer that floods the socket waits"))
    request_timeout_s: float = Field(default=900.0, gt=0, description="a request running longer gets TIMEOUT")
    frame_read_timeout_s: float = Field(default=30.0, gt=0, description="a frame not complete this long after its first byte closes the connection")
    hello_timeout_s: float = Field(default=10.0, gt=0, description="a connection that has not said hello by then is closed")
    loop_stall_s: float = Field(default=0.1, ge=0, description=(
        "an event-loop timer firing this late is a stall: kept with the loop's stack (status, for administrators) and "
        "logged at most every 10 s (0: no watch; server/loop_watch.py)"))
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
                     "hello_timeout_s", "io_timeout_s", "loop_stall_s", mode="before")
    @classmethod
    def _durations(cls, v: Any) -> float:
        # Seconds, or "30s" / "15m" as keep_alive takes them.
        return parse_duration(v)

    @field_validator("max_frame_bytes", "load_chunk_bytes", "host_budget", "max_queued_reply_bytes", "max_partial_frame_bytes",
                     "max_partial_frame_bytes_per_uid", "max_read_bytes_per_s_per_uid", mode="before")
    @classmethod
    def _sizes(cls, v: Any) -> int:
        return parse_size(v)


def config_group_names(daemon: DaemonConfig) -> dict[str, int]:
    """The group names the config file itself uses (``socket_group``, ``allowed_gids``,
    ``admin_gids``), resolved: the only names a peer's ``allowed_gids`` may give. A peer's
    request never makes the daemon look a name up (a publish listing "root" 1,000,000
    times ran one getgrnam each on the event loop, 36 s; with sssd or LDAP each is a
    network round trip). Called once per config (model_ops caches it)."""
    names = [g for g in (daemon.socket_group, *daemon.allowed_gids, *daemon.admin_gids) if isinstance(g, str) and not g.isdigit()]
    return {g: resolve_group(g) for g in names}


class Settings(BaseSettings):
    """Everything the daemon reads at start. Frozen: a reload builds a new one."""

    model_config = SettingsConfigDict(
        env_prefix="WEIGHTCACHE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    daemon: DaemonConfig = DaemonConfig()
    budgets: dict[str, Budget] = Field(default_factory=lambda: {"cpu": Budget(fraction=0.5)})
    models: list[ModelConfig] = Field(default_factory=list)
    peers: PeersConfig = PeersConfig()  # neighbour daemons (weightcache/peers/)
    published: PublishedConfig = PublishedConfig()  # published models kept on disk (server/store.py)

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


