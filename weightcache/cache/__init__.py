"""Cache policy (pure): see core.py's Note [invariants]."""

from .core import CacheCore, Entry, Lease, LoadPlan, State, StepDown

__all__ = ["CacheCore", "Entry", "Lease", "LoadPlan", "State", "StepDown"]
