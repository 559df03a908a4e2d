"""Sizes and durations as people write them (parse_size, parse_duration: "6GiB", "5m")
and read them (format_size), and sizes rounded to allocation units (round_up, capacity).
Free of pydantic and torch: the CLI, the client and the daemon all use it; the config's
schema validates its keys with the same parsers.
"""

from __future__ import annotations

import math
import re
from typing import Any

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


def format_size(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def capacity(nbytes: int, unit: int) -> int:
    """What an allocation of ``nbytes`` takes in whole ``unit``s (pages, VMM granularity),
    at least one: the daemon's arenas and an engine's published memory alike."""
    return max(unit, round_up(nbytes, unit))
