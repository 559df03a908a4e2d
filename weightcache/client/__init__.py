"""Clients for engines: async, sync, and torch helpers."""

from .client import AttachedModel, Client
from .sync import SyncClient

__all__ = ["AttachedModel", "Client", "SyncClient"]
