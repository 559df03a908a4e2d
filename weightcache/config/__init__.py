"""Daemon configuration: a TOML file read through pydantic-settings.

Precedence, highest first: ``WEIGHTCACHE_*`` environment variables (nested keys with
``__``, e.g. ``WEIGHTCACHE_DAEMON__LOG_LEVEL=debug``), then the TOML file, then the
defaults. ``WEIGHTCACHE_SOCKET`` sets the socket path for the daemon and the clients
alike; ``WEIGHTCACHE_CONFIG`` names the file the daemon reads when none is given.

The rooms:

- schema.py: the file's shape, one pydantic model per table (``Settings`` is the whole
  file; a new table is a model there and a field of ``Settings``); peers.py: ``[peers]``'s
  (weightcache/peers/), a model of its own beside schema.py;
- load.py: :func:`load_settings` (file, then environment) and :func:`problems` (one line
  per problem, naming its key);
- file.py: the TOML file before validation (reading it, its relative paths, the socket it
  names), free of pydantic;
- checks.py: the value rules the server also applies to what peers send (names,
  devices, groups, tenants, model roots), free of pydantic.

Sizes and durations are parsed by weightcache/units.py, for the CLI as for the schema.

Importing this package imports neither torch nor pydantic: the schema's and the loader's
names are imported when first asked for, so that the CLI's client commands, which read at
most the file's ``[daemon] socket`` (file.py), do not pay ~150 ms for pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .checks import (
    AUTO,
    auto_devices,
    check_device,
    check_model_name,
    resolve_group,
    tenant_key,
    under_roots,
)

if TYPE_CHECKING:
    from .load import load_settings, problems
    from .peers import PeersConfig
    from .schema import Budget, DaemonConfig, ModelConfig, PublishedConfig, QuotaConfig, Settings, ShardConfig, config_group_names

_LAZY = {
    **dict.fromkeys(("Budget", "DaemonConfig", "ModelConfig", "PublishedConfig", "QuotaConfig", "Settings", "ShardConfig",
                     "config_group_names"), "schema"),
    **dict.fromkeys(("load_settings", "problems"), "load"),
    "PeersConfig": "peers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AUTO", "Budget", "DaemonConfig", "ModelConfig", "PeersConfig", "PublishedConfig", "QuotaConfig", "Settings", "ShardConfig",
           "auto_devices", "check_device", "check_model_name", "config_group_names", "load_settings", "problems",
           "resolve_group", "tenant_key", "under_roots"]
