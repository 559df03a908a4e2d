"""The asyncio daemon (docs/architecture.md draws its rooms)."""

from .daemon import Daemon
from .main import run_daemon

__all__ = ["Daemon", "run_daemon"]
