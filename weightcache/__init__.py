"""weightcache: keep model weights resident so inference engines restart in seconds.

Public surface: :class:`Client` (async), :class:`SyncClient`, :class:`AttachedModel`,
:func:`load_into_module` (with :func:`empty_parameters` for its skeleton),
:func:`tenant_fingerprint` (the fingerprint of a model a peer published or
registered), and the error classes in :mod:`weightcache.errors`.
"""

__version__ = "0.1.0"

from .errors import WeightcacheError
from .protocol.messages import tenant_fingerprint


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # Lazy: the CLI and the daemon import this package without paying for torch.
    if name in ("Client", "SyncClient", "AttachedModel"):
        from . import client

        return getattr(client, name)
    if name in ("load_into_module", "empty_parameters"):
        from .client import torch_utils

        return getattr(torch_utils, name)
    raise AttributeError(f"module 'weightcache' has no attribute {name!r}")


__all__ = ["AttachedModel", "Client", "SyncClient", "WeightcacheError", "__version__", "empty_parameters", "load_into_module",
           "tenant_fingerprint"]
