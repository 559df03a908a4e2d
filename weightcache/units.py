"""Byte sizes for people, free of pydantic so that the CLI's tables and the tools can
format sizes without loading the config machinery (an import cost every command pays)."""

from __future__ import annotations


def format_size(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
