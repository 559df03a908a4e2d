"""weightcache: keep model weights resident so inference engines restart in seconds.

Public surface: :class:`Client` (async), :class:`SyncClient`, :class:`AttachedModel`,
:func:`load_into_module` (with :func:`empty_parameters` for its skeleton),
:func:`tenant_fingerprint` (the fingerprint of a model a peer published or
registered), and the error classes in :mod:`weightcache.errors`.

Importing the package imports neither torch nor the client: the daemon and the CLI import
it too. ``Client`` and ``SyncClient`` are torch-free; the torch names are imported when
first asked for (weightcache/client/__init__.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import WeightcacheError
from .protocol import tenant_fingerprint

if TYPE_CHECKING:
    from .client import AttachedModel, Client, SyncClient, empty_parameters, load_into_module

_FROM_CLIENT = frozenset({"Client", "SyncClient", "AttachedModel", "load_into_module", "empty_parameters"})


def __getattr__(name: str) -> Any:
    # Lazy: the CLI and the daemon import this package without paying for the client, and
    # weightcache.client in turn imports torch only for the names that need it.
    if name in _FROM_CLIENT:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'weightcache' has no attribute {name!r}")


__all__ = ["AttachedModel", "Client", "SyncClient", "WeightcacheError", "__version__", "empty_parameters", "load_into_module",
           "tenant_fingerprint"]
