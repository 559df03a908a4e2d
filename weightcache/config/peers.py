"""``[peers]``: the neighbour daemons a load that misses may be filled from (weightcache/peers/,
with its own checks). A model of its own, apart from schema.py (which holds it as
``Settings.peers``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..units import parse_duration, parse_size

RING_SLOTS = 8  # reads in flight through a ring: enough that a stage's round trip hides behind the reads before it


class PeersConfig(BaseModel):
    """``[peers]``: neighbour daemons a load that misses may be filled from, over NIXL
    (weightcache/peers/; docs/deployment.md, "Peers"). Off unless ``listen``
    is set. A peer proves the key in ``secret_file`` before anything else is read
    (peers/auth.py); then only the peers named here (``addresses``, and what ``dns``
    resolves to) are asked and answered."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str | None = Field(default=None, description="host:port of this daemon's peer port (None: no peers)")
    addresses: tuple[str, ...] = Field(default=(), description="host:port of each peer daemon")
    dns: str | None = Field(default=None, description="name:port that resolves to the peers (a headless Service)")
    # Each non-empty line a key of >= 32 bytes; the first signs, every one is accepted (a
    # rotation: docs/deployment.md, "Peers"). Owned by the daemon's uid, no access for others.
    secret_file: str | None = Field(default=None, description="file of the key(s) every peer must prove (peers/auth.py)")
    # Without a secret, any process that can reach the port from a listed address is a
    # peer: for tests on one host only, never for a deployment.
    insecure_no_secret: bool = Field(default=False, description="allow peers without secret_file (tests only: INSECURE)")
    refresh_s: float = Field(default=10.0, gt=0, description="how often each peer is asked what it holds")
    # Model name -> the content fingerprint its files must have (`weightcache models`
    # shows it): what a peer's copy is checked against before it is served. A model whose
    # fingerprint this daemon does not know (pinned here, or from an earlier load of the
    # same, unchanged files) is never filled from a peer.
    fingerprints: dict[str, str] = Field(default_factory=dict)
    serve: bool = Field(default=True, description="lend this daemon's resident models to its peers")
    timeout_s: float = Field(default=120.0, gt=0, description="a fill from a peer not done by then falls back to the files")
    # A peer that stops moving bytes (hung, its NIC gone, SIGSTOPped) would otherwise hold
    # the load until timeout_s; a healthy one finishes a read of at most 64 MiB in well
    # under a second, even at 1 GB/s over TCP.
    stall_s: float = Field(default=5.0, gt=0, description="a fill from a peer that moves no bytes for this long falls back to the files")
    max_fill_bytes_per_s: int | None = Field(default=None, gt=0, description="cap on one fill's rate (None: none)")
    # "faster": each load a peer offers is read from the source expected faster, by the
    # rates this daemon measured (peers/choice.py); "peers": a peer first whatever the
    # rates, the files only if every peer fails (to measure the peer path itself, or where
    # the operator knows the network beats the files' every state).
    prefer: Literal["faster", "peers"] = Field(default="faster", description="how a load a peer offers picks its source")
    # A GPU model is lent and filled through a ring of device memory, outside the budget
    # (backends/cuda_staging.py): one per lend, one per fill, each cut into RING_SLOTS
    # slots. A chunk is the smaller of the lender's and the borrower's slot, so a bigger
    # ring on every daemon asks fewer round trips of a fill (docs/benchmarks.md, "Peers").
    gpu_ring_bytes: int = Field(default=512 * 2**20, ge=RING_SLOTS * 2**21, le=RING_SLOTS * 2**30,
                                description="device memory of each GPU lend's and fill's ring, outside the budget")

    @property
    def slot_bytes(self) -> int:
        """A ring's slot: gpu_ring_bytes / RING_SLOTS, in whole 2 MiB."""
        return self.gpu_ring_bytes // RING_SLOTS // 2**21 * 2**21

    @field_validator("refresh_s", "timeout_s", "stall_s", mode="before")
    @classmethod
    def _peer_durations(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("max_fill_bytes_per_s", "gpu_ring_bytes", mode="before")
    @classmethod
    def _peer_rate(cls, v: Any) -> int | None:
        return None if v is None else parse_size(v)

    @field_validator("listen", "dns")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is not None:
            host, sep, port = v.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise ValueError(f"{v!r} is not host:port")
        return v

    @model_validator(mode="after")
    def _secret(self) -> PeersConfig:
        if self.listen is not None and self.secret_file is None and not self.insecure_no_secret:
            raise ValueError("[peers] listen is set but secret_file is not: peers must prove a shared key before they are "
                             "answered (docs/deployment.md, \"Peers\"); set secret_file")
        if self.secret_file is not None and self.insecure_no_secret:
            raise ValueError("[peers] secret_file and insecure_no_secret = true contradict each other: drop insecure_no_secret")
        return self

    @field_validator("addresses")
    @classmethod
    def _addresses(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for a in v:
            cls._host_port(a)
        return v
