"""How the names of cache entries and the keys of their arenas are spelled: in one place,
so that no module tests a separator of its own.

A model is one entry named like the model; a sharded one has an entry per rank,
``model@rank``; a rank placed automatically (device = "auto") has a replica per candidate
device, ``<rank's name>@<device>``; a publish fills a staging entry, ``model#N``, before it
takes the model's name. '@' and '#' are never in a model name (config.check_model_name),
so none of these can clash with a model's own name. Names that read the same files share
one arena: they are registered with one share key (``files_share``), which the core keys
per device (``shared_arena``).
"""

from __future__ import annotations


def rank_entry(model: str, rank: int) -> str:
    return f"{model}@{rank}"


def replica_entry(rank_name: str, device: str) -> str:
    return f"{rank_name}@{device}"


def staging_entry(model: str, n: int) -> str:
    return f"{model}#{n}"


def is_staging(entry: str) -> bool:
    """Whether ``entry`` is a publish's staging entry, which nobody can reach by name."""
    return "#" in entry


def published_as(entry: str) -> str:
    """The name an entry is shown under: a staging entry's model (what its publish will
    replace), or the entry's own name."""
    return entry.partition("#")[0]


def model_of(entry: str) -> str:
    """The model an entry belongs to (``model@rank``, ``model@rank@device``): pins are
    counted per model, so a sharded model pinned is one pin."""
    return entry.partition("@")[0]


def files_share(real_path: str, rank: int, ranks: int, owner: int | None) -> str:
    """The share key of a checkpoint's names (server/registry.py's share_key says when two
    names get one): its real path, as rank ``rank`` of ``ranks``, for ``owner``."""
    return f"{real_path}\0rank {rank} of {ranks}\0owner {owner}"


def shared_arena(device: str, share: str) -> str:
    """The core's key of the arena that the entries registered with ``share`` on ``device``
    hold between them (Note [shared arenas])."""
    return f"{device}\0{share}"


def own_arena(entry: str) -> str:
    """The key of the arena of an entry that shares none: a shared arena's key never
    starts with NUL (a device name does not), so the two kinds cannot meet."""
    return "\0" + entry
