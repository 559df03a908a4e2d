"""What the residency rooms count and report: the daemon-wide counters, each load's
progress and each model's last load rate (``status``, ``models``, the metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...loader import Progress

# Daemon-wide totals for ``status`` and the metrics (per-model ones live on the core's
# entries, and go when a model is unregistered).
COUNTERS = ("loads", "promotions", "evictions", "demotions", "kept_copy_demotions", "failed_demotions", "failed_loads",
            "wasted_loads", "cancelled_loads", "pin_mismatches", "neighbour_checks", "neighbour_mismatches")


@dataclass
class Stats:
    counters: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(COUNTERS, 0)))
    progress: dict[str, Progress] = field(default_factory=dict)  # entry -> its load in flight's progress
    last_load_rate: dict[str, float] = field(default_factory=dict)  # bytes/s of each model's last load (metrics)
    # Bytes and seconds of the fills that made models resident, by where the bytes came
    # from (Model.source: "files", "host", "peer", "neighbour", "publish"; the metrics).
    filled_bytes: Counter[str] = field(default_factory=Counter)
    filled_seconds: dict[str, float] = field(default_factory=dict)

    def filled(self) -> dict[str, tuple[int, float]]:
        """Source -> (bytes, seconds) of its fills (metrics.Snapshot.filled)."""
        return {k: (v, self.filled_seconds.get(k, 0.0)) for k, v in list(self.filled_bytes.items())}
