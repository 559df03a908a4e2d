"""Cache policy (pure): see core.py's Note [invariants]."""

from .core import CacheCore, Entry, Lease, LoadPlan, State

__all__ = ["CacheCore", "Entry", "Lease", "LoadPlan", "State"]
