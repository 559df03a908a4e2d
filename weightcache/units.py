"""Byte sizes: for people (format_size), and rounded to allocation units (round_up,
capacity). Free of pydantic and torch: the CLI, the client and the daemon all use it."""

from __future__ import annotations


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
