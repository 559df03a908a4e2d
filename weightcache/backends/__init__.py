"""Memory backends, chosen by device name."""

from __future__ import annotations

from ..errors import ConfigError, WeightcacheError
from .base import Arena, Backend, HostCopy, HostPool, PublishedSource, Room
from .cpu import CpuBackend


def backend_for(device: str) -> Backend:
    """The backend that serves ``device``. CUDA support is imported only when asked for,
    so a CPU host never needs cuda-bindings."""
    if device == "cpu":
        return CpuBackend(device)
    if device.startswith("cuda:"):
        # A budget for a GPU this host does not have (or cannot use) is a config error
        # naming the key: the daemon stops with one line, not a traceback.
        try:
            from .cuda import CudaBackend

            return CudaBackend(device)
        except ImportError as exc:
            raise ConfigError(f"budgets.{device}: CUDA support is not installed ({exc}); on a GPU host run "
                              "`pip install 'weightcache[cuda]'`, on a host without one remove the budget", key=f"budgets.{device}") from None
        except WeightcacheError as exc:  # no such device or UUID, the driver refused (cuda_driver.CudaError)
            raise ConfigError(f"budgets.{device}: {exc.message}; name a GPU this host has (nvidia-smi -L lists them), "
                              "or remove the budget", key=f"budgets.{device}") from None
    raise ValueError(f"no backend for device {device!r}")


__all__ = ["Arena", "Backend", "CpuBackend", "HostCopy", "HostPool", "PublishedSource", "Room", "backend_for"]
