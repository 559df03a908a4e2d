"""Synthetic safetensors checkpoints for the demo, the benchmarks and the tests.

Made locally from a seed (no downloads). Tensor sizes vary like a transformer's: a few
large embedding-like matrices and many smaller per-layer ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def synth_tensors(nbytes: int, n_tensors: int, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``nbytes`` of tensors in ``n_tensors`` pieces: 2-D [rows, 256]-shaped, plus 1-D norms."""
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n_tensors = max(1, n_tensors)
    weights = torch.rand(n_tensors, generator=g) + 0.2
    elems = (weights / weights.sum() * (nbytes // itemsize)).long().clamp(min=256)
    out: dict[str, torch.Tensor] = {}
    for i, n in enumerate(elems.tolist()):
        if i % 5 == 4:
            shape: tuple[int, ...] = (int(n),)  # a "norm": 1-D
            name = f"model.layers.{i // 5}.norm.weight"
        else:
            shape = (int(n) // 256, 256)
            name = f"model.layers.{i // 5}.proj{i % 5}.weight"
        out[name] = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return out


def kept_checkpoint(path: Path, nbytes: int, n_tensors: int, *, seed: int = 0) -> Path:
    """A one-file checkpoint at ``path``, written only if it is not there yet (benchmarks
    keep theirs in a workdir between runs). Written under another name and renamed: a run
    killed while writing leaves no short file that the next run would take as made."""
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        write_checkpoint(tmp, nbytes, n_tensors, seed=seed)
        os.replace(tmp, path)
    return path


def write_checkpoint(path: str | os.PathLike[str], nbytes: int, n_tensors: int, *, shards: int = 1,
                     dtype: torch.dtype = torch.bfloat16, seed: int = 0, mode: int | None = None) -> Path:
    """Write a checkpoint with ``safetensors.torch.save_file``, as users' files are written
    (``save_pretrained`` writes through it), and return the path to give the daemon: the
    file for one shard, the index json for several (``path`` is then a directory). The
    files keep save_file's mode (0600) unless ``mode`` is given, e.g. 0o644 for a file
    that another uid's client opens in a test."""
    tensors = synth_tensors(nbytes, n_tensors, dtype=dtype, seed=seed)
    p = Path(path)
    if shards == 1:
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(p), metadata={"format": "pt"})
        if mode is not None:
            p.chmod(mode)
        return p
    p.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(p / fname), metadata={"format": "pt"})
        if mode is not None:
            (p / fname).chmod(mode)
        weight_map.update(dict.fromkeys(part, fname))
    index = p / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}))
    return index
