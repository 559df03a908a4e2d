"""The asyncio daemon."""

from .daemon import Daemon, run_daemon

__all__ = ["Daemon", "run_daemon"]
