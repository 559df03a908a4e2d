"""Byte-for-byte comparison of an attached model with its checkpoint files."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors import safe_open

from ..checkpoint_files import discover_files


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Compare bytes, not values: NaN != NaN, and -0.0 == 0.0, would both mislead.
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def verify_against_files(weights: Mapping[str, torch.Tensor], path: str) -> list[str]:
    """Names of tensors that differ from the files (missing, extra, shape, dtype, bytes)."""
    bad: list[str] = []
    seen: set[str] = set()
    for file in discover_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                seen.add(key)
                if key not in weights:
                    bad.append(f"{key}: missing from the attached model")
                    continue
                mine, ref = weights[key], f.get_tensor(key)
                if mine.shape != ref.shape or mine.dtype != ref.dtype:
                    bad.append(f"{key}: {mine.dtype}{tuple(mine.shape)} attached, {ref.dtype}{tuple(ref.shape)} on disk")
                elif not torch.equal(_bytes(mine), _bytes(ref)):
                    bad.append(f"{key}: bytes differ")
    bad.extend(f"{k}: not in the files" for k in sorted(set(weights) - seen))
    return bad
