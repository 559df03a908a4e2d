"""Memory backends, chosen by device name."""

from __future__ import annotations

from .base import Arena, Backend, HostCopy, HostPool, PublishedSource, Room
from .cpu import CpuBackend


def backend_for(device: str) -> Backend:
    """The backend that serves ``device``. CUDA support is imported only when asked for,
    so a CPU host never needs cuda-bindings."""
    if device == "cpu":
        return CpuBackend(device)
    if device.startswith("cuda:"):
        from .cuda import CudaBackend

        return CudaBackend(device)
    raise ValueError(f"no backend for device {device!r}")


__all__ = ["Arena", "Backend", "CpuBackend", "HostCopy", "HostPool", "PublishedSource", "Room", "backend_for"]
