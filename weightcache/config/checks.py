"""The config's value rules that the daemon also applies to what peers send (a model's
name and device, groups, tenants, model roots): plain functions, free of pydantic, so
the server and the schema check a value the same way."""

from __future__ import annotations

import grp
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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


def under_roots(path: str | os.PathLike[str], roots: list[Path]) -> bool:
    """Whether ``path``, symlinks resolved, lies under one of ``roots`` (by path component:
    /models2 is not under /models). The loader checks the files it really opened again."""
    real = Path(os.path.realpath(path))
    return any(real.is_relative_to(os.path.realpath(r)) for r in roots)


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

