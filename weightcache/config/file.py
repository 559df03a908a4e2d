"""The config file as TOML gives it, before any validation: reading it, its relative
paths, and the daemon socket it names. Free of pydantic: a client command of the CLI
finds the daemon's socket here without paying for the schema's imports, and without
failing on parts of the daemon's config it does not use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..protocol import CONFIG_ENV, SOCKET_ENV


def read_file(path: Path, named: str = "") -> dict[str, Any]:
    """The tables of the config file at ``path``, its relative paths resolved (the models'
    and the socket's, :func:`config_relative`); nothing validated. Raises
    :class:`ConfigError` saying what is wrong with the file; ``named`` follows the
    message when it cannot be opened (who named it, and what to do)."""
    import tomllib  # here: `weightcache health` (a probe, run often) reads no file without a config

    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist{named}") from None
    except OSError as exc:  # a directory, no read permission: was a traceback (and INTERNAL on reload)
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}{named}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}): is it the TOML file?") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    # Relative paths (the models', the socket's, model_roots') are relative to the config
    # file, not to the cwd (the daemon leaves it at start: server/main.py); "~" is the daemon user's home, as in a
    # shell (read literally it became a directory named "~").
    daemon = data.get("daemon")
    if isinstance(daemon, dict) and isinstance(daemon.get("socket"), str):
        daemon["socket"] = config_relative(daemon["socket"], path)
    if isinstance(daemon, dict) and isinstance(daemon.get("model_roots"), list):
        daemon["model_roots"] = [config_relative(r, path) if isinstance(r, str) else r for r in daemon["model_roots"]]
    for m in data.get("models", []) if isinstance(data.get("models"), list) else []:
        shards = m.get("shards", []) if isinstance(m, dict) else []
        for part in [m, *shards] if isinstance(shards, list) else [m]:
            if isinstance(part, dict) and isinstance(part.get("path"), str):
                part["path"] = config_relative(part["path"], path)
    return data


def config_relative(path: str, config_file: Path) -> str:
    """A path as written in ``config_file``: ``~`` expanded, relative ones taken from the
    file's directory."""
    expanded = os.path.expanduser(path)
    return expanded if os.path.isabs(expanded) else str((config_file.parent / expanded).resolve())


def daemon_socket(config: str | None) -> str | None:
    """The socket a client command uses when not given one: $WEIGHTCACHE_SOCKET (or
    $WEIGHTCACHE_DAEMON__SOCKET, which the daemon also reads), else the ``[daemon] socket``
    of the file ``config`` (--config) or $WEIGHTCACHE_CONFIG names, as the daemon reads it
    (the environment wins over the file, as for the daemon), else None (the client's
    default). Only that key is looked at."""
    for env in (SOCKET_ENV, "WEIGHTCACHE_DAEMON__SOCKET"):
        if os.environ.get(env):
            return os.environ[env]
    path = config or os.environ.get(CONFIG_ENV)
    if not path:
        return None
    named = "--config" if config else f"${CONFIG_ENV}"
    data = read_file(Path(path), f" (named by {named}; pass --socket or fix it)")
    daemon = data.get("daemon", {})
    sock = daemon.get("socket") if isinstance(daemon, dict) else None
    if sock is not None and not isinstance(sock, str):
        raise ConfigError(f"daemon.socket in {path} must be a string, got {type(sock).__name__}")
    return sock
