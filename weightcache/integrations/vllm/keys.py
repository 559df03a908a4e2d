"""The vLLM loader's options and the names it keeps models under in the daemon: plain
Python (no vLLM, no torch), so that the rules are tested without an engine.

Two kinds of model per checkpoint:

- the **checkpoint** itself, registered from the engine's own files (the daemon reads
  what this uid can read) under :func:`checkpoint_name`: one name per checkpoint *as it
  is on disk now* (real paths, inode, size, mtime of every file), device and uid. A
  checkpoint changed on disk since gets a new name, so a fresh register and load: the
  daemon's copy of the old bytes is never handed out for the new files. Two engines
  of one checkpoint on one device get the same name, hence one arena.
- its **processed** weights (after vLLM's ``process_weights_after_loading``), published
  under :func:`processed_name` of a :class:`ProcessedKey`: everything that decides what
  post-processing produces (the fields of vLLM's own ``WeightCacheKey``: architecture,
  dtype, quantization and its config, parallel ranks, kernel backends, vLLM version) and
  the checkpoint's *content* fingerprint from the daemon. The key's digest is also the
  fingerprint the engine publishes with; the daemon binds it to the publisher's uid
  (``tenant_fingerprint``), and an attach whose fingerprint is not that one is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("auto", "copy", "processed")
KEY_VERSION = 1  # bump when the key's fields or their meaning change: old entries then never match


@dataclass(frozen=True)
class Options:
    """``--model-loader-extra-config`` for ``--load-format weightcache`` (all optional).

    >>> Options.parse({"mode": "copy", "publish": False})
    Options(socket=None, name=None, mode='copy', publish=False)
    """

    socket: str | None = None  # the daemon's socket; default $WEIGHTCACHE_SOCKET, else the client's default
    name: str | None = None  # the daemon's name for the checkpoint; default: found or registered by path
    mode: str = "auto"  # "copy": feed load_weights; "processed": publish/attach processed weights; "auto": processed where it works
    publish: bool = True  # publish processed weights after a normal load (modes auto and processed)

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> Options:
        """The options from vLLM's ``model_loader_extra_config``; a ValueError names what is wrong."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - {"socket", "name", "mode", "publish"})
        if unknown:
            raise ValueError(f"--model-loader-extra-config for weightcache: unknown key(s) {unknown}; "
                             "known: socket, name, mode, publish (docs/vllm.md)")
        for key in ("socket", "name"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ValueError(f"--model-loader-extra-config for weightcache: {key!r} must be a string")
        mode = extra.get("mode", "auto")
        if mode not in MODES:
            raise ValueError(f"--model-loader-extra-config for weightcache: mode {mode!r} is not one of {list(MODES)}")
        publish = extra.get("publish", True)
        if not isinstance(publish, bool):
            raise ValueError("--model-loader-extra-config for weightcache: 'publish' must be true or false")
        return cls(socket=extra.get("socket"), name=extra.get("name"), mode=mode, publish=publish)


_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._-]+")


def _label(path: str) -> str:
    """A readable part of a name: the checkpoint directory's base name, cleaned."""
    base = os.path.basename(os.path.normpath(path)) or "model"
    return _NOT_IN_NAMES.sub("-", base).strip("-._")[:48] or "model"


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoint_name(model_dir: str, files: Sequence[str], device: str, uid: int) -> str:
    """The daemon's name for ``files`` (the checkpoint of ``model_dir``) as they are now on
    disk, on ``device``, registered by ``uid``. Stats every file (no reads)."""
    ident = []
    for f in sorted(files):
        st = os.stat(f)
        ident.append([os.path.realpath(f), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns])
    return f"vllm-{_label(model_dir)}-{_digest([KEY_VERSION, ident, device, uid])[:20]}"


def is_checkpoint_name(name: str, model_dir: str) -> bool:
    """Whether ``name`` is a :func:`checkpoint_name` of ``model_dir`` (of its files as they
    are now, or as they were): not a name someone chose that only begins the same way."""
    return re.fullmatch(re.escape(f"vllm-{_label(model_dir)}-") + r"[0-9a-f]{20}", name) is not None


@dataclass(frozen=True)
class ProcessedKey:
    """What processed weights were made from and how: two engines whose keys differ in any
    field never share them."""

    checkpoint: str  # the daemon's content fingerprint of the checkpoint the engine loaded
    architectures: tuple[str, ...]
    dtype: str
    quantization: str | None
    quant_config: str  # the digest of the checkpoint's quantization config (canonical JSON), "" if none
    kv_cache_dtype: str
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    dp_size: int
    dp_rank: int
    ep: bool  # expert parallel
    backends: tuple[tuple[str, str], ...]  # kernel choices that change the processed layout, by name
    device_kind: str  # e.g. "cpu", "cuda sm90"
    vllm_version: str
    torch_version: str
    max_model_len: int  # some post-processing sizes tensors by it (rotary caches)

    def fields(self) -> dict[str, Any]:
        return {"key_version": KEY_VERSION, **asdict(self)}

    def digest(self) -> str:
        return _digest(self.fields())

    def fingerprint(self) -> str:
        """The fingerprint the engine publishes with (the daemon binds it to the uid)."""
        return f"vllm-processed-v{KEY_VERSION}:{self.digest()}"


def quant_config_digest(config: Any) -> str:
    """A stable digest of a quantization config (a dict, or anything JSON can show)."""
    if not config:
        return ""
    return _digest(json.loads(json.dumps(config, sort_keys=True, default=str)))


def processed_name(model_dir: str, key: ProcessedKey) -> str:
    """The published model's name: the checkpoint's label, the ranks, and the key's digest."""
    return f"vllm-processed-{_label(model_dir)}-tp{key.tp_rank}of{key.tp_size}-{key.digest()[:20]}"
