"""What the residency rooms count and report: the daemon-wide counters, each load's
progress and each model's last load rate (``status``, ``models``, the metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...loader import Progress

# Daemon-wide totals for ``status`` and the metrics (per-model ones live on the core's
# entries, and go when a model is unregistered).
COUNTERS = ("loads", "promotions", "evictions", "demotions", "kept_copy_demotions", "failed_demotions", "failed_loads",
            "wasted_loads", "cancelled_loads")


@dataclass
class Stats:
    counters: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(COUNTERS, 0)))
    progress: dict[str, Progress] = field(default_factory=dict)  # entry -> its load in flight's progress
    last_load_rate: dict[str, float] = field(default_factory=dict)  # bytes/s of each model's last load (metrics)
