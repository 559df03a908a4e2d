"""How the names of cache entries are spelled, and the keys of their arenas.

A model is one entry named like the model; a sharded one has an entry per rank,
``model@rank``; a rank placed automatically (device = "auto") has a replica per candidate
device, ``<rank's name>@<device>``; a publish fills a staging entry, ``model#N``, before it
takes the model's name. '@' and '#' are never in a model name (config.check_model_name),
so none of these can clash with a model's own name. A name is only ever made here and
shown: nothing parses one back. What an entry is (its model, whether it is a staging
entry) is recorded when it is registered (cache/eviction.py's ``Entry``).

Names that read the same files share one arena: they are registered with one share key
(``FilesShare``), which the core keys per device (``ArenaKey``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


def rank_entry(model: str, rank: int) -> str:
    return f"{model}@{rank}"


def replica_entry(rank_name: str, device: str) -> str:
    return f"{rank_name}@{device}"


def staging_entry(model: str, n: int) -> str:
    return f"{model}#{n}"


@dataclass(frozen=True, slots=True)
class FilesShare:
    """The share key of a checkpoint's names (server/registry.py's share_key says when two
    names get one): its real path, as rank ``rank`` of ``ranks``, for ``owner``."""

    real_path: str
    rank: int
    ranks: int
    owner: int | None


@dataclass(frozen=True, slots=True)
class ArenaKey:
    """The core's key of an arena: the one that the entries registered with ``share`` on
    ``device`` hold between them (Note [shared arenas]), or, with no share, ``entry``'s own."""

    device: str
    share: Hashable | None  # a FilesShare from the registry; the core only compares them
    entry: str | None = None  # an own arena's entry

    @classmethod
    def shared(cls, device: str, share: Hashable) -> ArenaKey:
        return cls(device, share)

    @classmethod
    def own(cls, device: str, entry: str) -> ArenaKey:
        return cls(device, None, entry)
