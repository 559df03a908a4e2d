"""vLLM's loaders driven in the test process, without an engine: the config an engine
would build (``EngineArgs(...).create_engine_config()``), a one-rank gloo group, and
``get_model_loader(load_config).load_model(...)``, as vLLM's worker calls it. Seconds
a load where an engine start takes tens, so each bad input gets its own test.

vLLM's CPU backend packs every linear weight for oneDNN after loading and leaves the
parameter empty; processed weights can then be neither published nor compared.
``keep_linear_weights()`` makes the CPU backend take its own fallback (torch's linear
on the parameter, as when oneDNN is not built in), so that post-processing keeps its
results in the parameters, as on a GPU: the processed path runs here end to end.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

_initialized = False


def init_one_rank() -> None:
    """A one-rank world (gloo on loopback) and model-parallel groups of 1, once per process."""
    global _initialized
    if _initialized:
        return
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does: torch.accelerator has no device here

    # A file rendezvous: a free TCP port found first can be taken by another process
    # before gloo binds it (seen on the busy CI VM).
    rendezvous = tempfile.mkdtemp(prefix="wcv-gloo-")
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{rendezvous}/store", local_rank=0,
                                     backend="gloo")
        initialize_model_parallel(1, 1)
    _initialized = True


def engine_config(model: str, load_format: str, extra: dict[str, Any] | None = None, dtype: str = "float32") -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, load_format=load_format, dtype=dtype, max_model_len=128, enforce_eager=True,
                      model_loader_extra_config=extra or {}).create_engine_config()


def load(model: str, load_format: str = "weightcache", extra: dict[str, Any] | None = None,
         dtype: str = "float32") -> tuple[torch.nn.Module, Any]:
    """The model as vLLM's worker would load it, and the loader that did."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    init_one_rank()
    cfg = engine_config(model, load_format, extra, dtype)
    with set_current_vllm_config(cfg):
        loader = get_model_loader(cfg.load_config)
        return loader.load_model(vllm_config=cfg, model_config=cfg.model_config), loader


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, by name (tied names once)."""
    return {**{n: p.detach() for n, p in model.named_parameters()}, **{"buffer " + n: b for n, b in model.named_buffers()}}


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = state(a), state(b)
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


@contextlib.contextmanager
def keep_linear_weights() -> Iterator[None]:
    """The CPU backend's post-processing without oneDNN packing (module docstring)."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils

    saved = ops._supports_onednn, utils.check_cpu_sgl_kernel
    ops._supports_onednn = False
    utils.check_cpu_sgl_kernel = lambda *a, **k: False
    try:
        yield
    finally:
        ops._supports_onednn, utils.check_cpu_sgl_kernel = saved


class Lines(logging.Filter):
    """The plugin's log lines (logger ``vllm.weightcache``). A filter, not a handler: vLLM
    configures logging again while an engine's config is built (logging.config resets
    the handlers of the loggers under "vllm", not their filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.lines.append(record.getMessage())
        return True

    def text(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def plugin_lines() -> Iterator[Lines]:
    from weightcache.integrations.vllm.loader import logger as log

    lines = Lines()
    log.addFilter(lines)
    try:
        yield lines
    finally:
        log.removeFilter(lines)
