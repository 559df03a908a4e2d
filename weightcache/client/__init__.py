"""Clients for engines: async, sync, and torch helpers.

``Client`` and ``SyncClient`` import without torch, so that control calls (status, health,
the CLI) start fast. The names that are torch, ``AttachedModel``, ``load_into_module`` and
``empty_parameters``, are imported when first asked for, and so is ``Client`` (aio.py):
an engine that imports ``SyncClient`` pays for no asyncio client.

>>> from weightcache.client import Client, SyncClient   # no torch yet
>>> from weightcache.client import AttachedModel         # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sync import SyncClient

if TYPE_CHECKING:
    from .aio import Client
    from .mapping import AttachedModel
    from .torch_utils import empty_parameters, load_into_module

_LAZY = {"Client": "aio", "AttachedModel": "mapping", "load_into_module": "torch_utils", "empty_parameters": "torch_utils"}


def __getattr__(name: str) -> Any:
    # Module attributes not found the usual way come here (PEP 562): the async client and
    # the torch half, on demand.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["AttachedModel", "Client", "SyncClient", "empty_parameters", "load_into_module"]
