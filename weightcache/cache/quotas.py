"""Per-tenant quotas (issue 15): what one uid's or group's models may hold. Pure data;
the core enforces them (core.py, Note [quotas]).

A tenant is named ``"uid:N"`` or ``"gid:N"``. A model registered or published by a peer
belongs to every tenant its owner was at that moment: its uid and each of its groups
(``tenant_keys``). The operator's configured models belong to no tenant and count
against no quota.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Quota:
    tenant: str  # "uid:1000" or "gid:100"
    nbytes: dict[str, int] = field(default_factory=dict)  # device -> most bytes resident or loading there
    pins: int | None = None  # most of its models pinned at once; None: no limit

    def where(self) -> str:
        """The config key that sets it, for messages."""
        return f'quotas."{self.tenant}"'


def tenant_keys(uid: int, gids: Iterable[int]) -> tuple[str, ...]:
    """The tenants a peer's model belongs to: its owner's uid, then its groups."""
    return (f"uid:{uid}", *(f"gid:{g}" for g in sorted(set(gids))))


def model_of(entry: str) -> str:
    """The model an entry belongs to (a shard is ``model@rank``; '@' is never in a model
    name): pins are counted per model, so a sharded model pinned is one pin."""
    return entry.partition("@")[0]
