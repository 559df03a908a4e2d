"""Settings from the config file and the environment; every problem as one line that
names its key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import ConfigError
from ..protocol import CONFIG_ENV, SOCKET_ENV
from .file import read_file
from .schema import Settings


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


def load_settings(path: str | Path | None = None) -> Settings:
    """Read the config file (``path``, else ``$WEIGHTCACHE_CONFIG``, else defaults only).

    Raises :class:`ConfigError` with one line per problem, each naming the key.
    """
    from_env = not path and bool(os.environ.get(CONFIG_ENV))
    path = path or os.environ.get(CONFIG_ENV)
    data: dict[str, Any] = {}
    if path:
        # A stale $WEIGHTCACHE_CONFIG in the environment is the likely cause of a missing file: name it.
        data = read_file(Path(path), f" (named by ${CONFIG_ENV}; pass --config or fix the variable)" if from_env else "")
    if os.environ.get(SOCKET_ENV):
        data.setdefault("daemon", {})["socket"] = os.environ[SOCKET_ENV]
    try:
        return Settings(**data)
    except ValidationError as exc:
        lines = problems(exc)
        where = f" in {path}" if path else ""
        raise ConfigError(f"invalid configuration{where}:\n  " + "\n  ".join(lines)) from None

