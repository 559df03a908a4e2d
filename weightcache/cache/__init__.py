"""Cache policy (pure): see core.py's Note [invariants] and the map of its rooms there."""

from .core import CacheCore, Entry, Lease, LoadPlan, State, StepDown

__all__ = ["CacheCore", "Entry", "Lease", "LoadPlan", "State", "StepDown"]
