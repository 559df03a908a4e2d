"""The ``weightcache`` load format (docs/vllm.md): vLLM's model loader with the daemon as
the weight source, and processed weights kept in the daemon between starts.

``load_model`` in order:

1. What this engine cannot take from the daemon (pipeline parallel, a checkpoint that
   is not safetensors, a model with secondary weight sources) goes to vLLM's default
   loader, with one log line saying why.
2. The checkpoint's name in the daemon: ``name`` from the options, else a model the
   daemon already has for these files on this device (the operator's config), else
   :func:`.keys.checkpoint_name`, registered from this process's own files (the
   daemon's tenant rules apply: it reads what this uid can read, and the model is this
   uid's). Its content fingerprint comes from the daemon.
3. Processed weights (modes ``auto`` and ``processed``), when this vLLM can re-run
   post-processing on them (``weights_already_processed``): a published model under the
   engine's :class:`.keys.ProcessedKey` is attached, checked (its fingerprint is the
   key's, bound to this uid; its tensors are exactly the model's parameters and
   buffers, names, shapes and dtypes) and put in place: parameters as the daemon's
   tensors on a GPU (zero-copy, the lease held for the engine's life), copies on the
   CPU (a read-only mapping cannot be a parameter vLLM may write); buffers always
   copies (vLLM writes some, e.g. attention scales). Then post-processing runs under
   ``weights_already_processed()``, which rebuilds only kernel state.
4. Otherwise the checkpoint is attached and fed to ``model.load_weights`` through
   vLLM's own ``DefaultModelLoader`` (its ``load_weights`` and its check that every
   parameter was loaded), then post-processed as usual; the lease ends once the
   copies are made. With ``publish`` the processed parameters and buffers are then
   published under the key, unless post-processing left a parameter empty (vLLM's CPU
   backend repacks linear weights into oneDNN and empties them), which is said once.

A daemon that is down, refuses this uid, or fails a request: one warning naming the
error, and vLLM's default loader. Options (:class:`.keys.Options`) that are wrong are a
ValueError at start, like vLLM's own loaders' (a typo should not quietly read the disk).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.config.load import LoadConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_default_torch_dtype

from ... import SyncClient, tenant_fingerprint
from ...checkpoint_files import discover_files
from ...errors import BadRequest, DaemonUnavailable, UnknownModel, WeightcacheError
from .keys import Options, ProcessedKey, checkpoint_name, is_checkpoint_name, processed_name
from .processed import NotPublishable, processed_key, publishable, put_in_place, target_device

try:  # vLLM's seam for attaching processed weights (the in-tree ipc_cache loader uses it)
    from vllm.model_executor.utils import weights_already_processed
except ImportError:  # an older vLLM: processed weights cannot be re-run through post-processing
    weights_already_processed = None

# Logged under "vllm." so that vLLM's own handler and level apply.
logger = init_logger("vllm.weightcache")

HOW = "docs/vllm.md"

# The leases of zero-copy parameters: held for the engine process's life (the daemon ends
# them when the process exits). And the bytes they map, for get_external_weight_memory.
_held: list[Any] = []


class Unusable(Exception):
    """The daemon cannot serve this engine this time: the default loader takes over."""


@dataclasses.dataclass
class Plan:
    """Where this engine's weights are in the daemon."""

    folder: str  # the checkpoint directory vLLM resolved
    device: str  # the daemon's device name for this rank ("cpu", "cuda:GPU-...")
    attach_device: str | None  # what attach takes ("cuda:N" in this process's numbering; None: the model's own)
    name: str  # the checkpoint's model in the daemon
    fingerprint: str  # its content fingerprint (from the daemon)
    key: ProcessedKey | None  # None: processed weights are not used here
    why_not_processed: str | None  # set when key is None and the mode asked for them
    # The fingerprints of this uid's registrations of the folder made from its files as
    # they were before (unregistered now): their processed weights are retired too.
    retired: tuple[str, ...] = ()


@register_model_loader("weightcache")
class WeightcacheModelLoader(BaseModelLoader):
    """``--load-format weightcache`` (docs/vllm.md)."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options = Options.parse(load_config.model_loader_extra_config)
        self.phases: dict[str, float] = {}  # seconds per phase of the last load_model
        self._plan_in_use: Plan | None = None  # the plan of the load_model in progress
        self._weights_started: float | None = None
        self._created: nn.Module | None = None  # the model create_model made last (dropped again when a load gives up)

    # -- vLLM's interface --------------------------------------------------------------
    def download_model(self, model_config: ModelConfig) -> None:
        self._disk().download_model(model_config)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Feed ``model`` the daemon's copy of the checkpoint: inside :meth:`load_model`
        (BaseModelLoader calls this between create_model and post-processing) from its
        plan, else (an in-place reload) from a plan made now."""
        plan = self._plan_in_use or self._plan_checkpoint(model_config, model)
        with self._client() as client:
            self._feed(client, plan, model, model_config)
        if self._weights_started is not None:
            self.phases["weights_s"] = time.perf_counter() - self._weights_started

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """What the parameters attached zero-copy will map on this GPU: vLLM's GPU worker
        asks before the model is loaded and leaves it out of its memory budget."""
        if self.options.mode == "copy" or not _zero_copy_device(vllm_config):
            return 0
        with contextlib.suppress(Exception):  # a guess that fails is 0: the load then says why it cannot attach
            plan = self._plan(vllm_config, vllm_config.model_config, model=None)
            if plan.key is not None:
                with self._client() as client:
                    name = processed_name(plan.folder, plan.key)
                    for m in client.models():
                        if m["name"] == name and m["state"] == "resident" and \
                                m["fingerprint"] == tenant_fingerprint(plan.key.fingerprint(), os.geteuid()):
                            return int(m["nbytes"])
        return 0

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        self.phases, self._created = {}, None
        try:
            plan = self._plan(vllm_config, model_config, model=None)
        except Unusable as exc:
            logger.warning("weightcache: %s; loading with vLLM's default loader", exc)
            return self._default_load(vllm_config, model_config, prefix)
        if plan.why_not_processed is not None:
            logger.info("weightcache: processed weights are not used here: %s; attaching the checkpoint", plan.why_not_processed)
        if plan.key is not None:
            try:
                model = self._attach_processed(vllm_config, model_config, prefix, plan)
                if model is not None:
                    self._log_phases()
                    return model
            except (WeightcacheError, OSError) as exc:
                logger.warning("weightcache: attaching processed weights failed (%s); attaching the checkpoint", _one_line(exc))
        try:
            model = self._load_from_checkpoint(vllm_config, model_config, prefix, plan)
        except (Unusable, WeightcacheError, OSError) as exc:
            logger.warning("weightcache: %s; loading with vLLM's default loader", _one_line(exc))
            self._drop_created(vllm_config)
            return self._default_load(vllm_config, model_config, prefix)
        if plan.key is not None and self.options.publish:
            self._publish(model, plan)
        self._log_phases()
        return model

    def _log_phases(self) -> None:
        logger.info("weightcache: load_model phases: %s", ", ".join(f"{k[:-2]} {v:.3f} s" for k, v in self.phases.items()))

    # -- the plan ----------------------------------------------------------------------
    def _plan(self, vllm_config: VllmConfig, model_config: ModelConfig, model: nn.Module | None) -> Plan:
        why = _unsupported(vllm_config, model_config)
        if why:
            raise Unusable(why)
        plan = self._plan_checkpoint(model_config, model)
        if self.options.mode == "copy":
            return plan
        why_not = _processed_unsupported(vllm_config, model_config)
        if why_not:
            if self.options.mode == "processed":
                plan.why_not_processed = why_not
            return plan
        plan.key = processed_key(vllm_config, model_config, plan.fingerprint)
        # Files rewritten with the same bytes (touch, a copy, a download again) have the same
        # fingerprint: their processed weights are the ones this start will use.
        stale = {processed_name(plan.folder, processed_key(vllm_config, model_config, fp)) for fp in plan.retired
                 if fp != plan.fingerprint} - {processed_name(plan.folder, plan.key)}
        if stale:
            try:
                with self._client() as client:
                    _retire(client, sorted(stale))
            except (WeightcacheError, OSError) as exc:  # a cleanup that failed is no reason to load otherwise
                logger.info("weightcache: processed weights of the old files not unregistered: %s", _one_line(exc))
        return plan

    def _plan_checkpoint(self, model_config: ModelConfig, model: nn.Module | None) -> Plan:
        folder = self._checkpoint_folder(model_config, model)
        device, attach_device = _daemon_device()
        retired: tuple[str, ...] = ()
        try:
            with self._client() as client:
                name = self.options.name or _configured_for(client, folder, device)
                if name is None:
                    name = _register(client, checkpoint_name(folder, discover_files(folder), device, os.geteuid()), folder, device)
                    try:
                        retired = _retire_earlier(client, name, folder, device)
                    except (WeightcacheError, OSError) as exc:  # a cleanup that failed is no reason to load otherwise
                        logger.info("weightcache: registrations of the old files not unregistered: %s", _one_line(exc))
                fingerprint = _fingerprint(client, name)
        except (WeightcacheError, OSError) as exc:
            raise Unusable(f"the daemon at {self._socket_path()} (this engine runs as uid {os.geteuid()}): {_one_line(exc)}") from exc
        return Plan(folder, device, attach_device, name, fingerprint, None, None, retired)

    def _checkpoint_folder(self, model_config: ModelConfig, model: nn.Module | None) -> str:
        if model is not None and getattr(model, "secondary_weights", None):
            raise Unusable("this model reads weights from more than one source")
        try:
            folder, files, use_safetensors, _ = self._disk("safetensors")._prepare_weights(
                model_config.model, None, model_config.revision, fall_back_to_pt=False,
                allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None))
        except (RuntimeError, ValueError, OSError) as exc:
            raise Unusable(f"no safetensors checkpoint for {model_config.model!r} ({_one_line(exc)})") from exc
        if not use_safetensors or not files:
            raise Unusable(f"{model_config.model!r} is not a safetensors checkpoint")
        discovered = {os.path.realpath(f) for f in discover_files(folder)}
        if discovered != {os.path.realpath(f) for f in files}:
            raise Unusable(f"vLLM reads other files of {folder} than the daemon would (an index naming a subset, or extra files)")
        return str(folder)

    # -- the two ways in ---------------------------------------------------------------
    def _load_from_checkpoint(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str, plan: Plan) -> nn.Module:
        """vLLM's own load (create, load_weights, post-process) with the attached checkpoint as the source."""
        started = time.perf_counter()
        self._plan_in_use = plan
        try:
            model = super().load_model(vllm_config, model_config, prefix)
        finally:
            self._plan_in_use = self._weights_started = None
        self.phases["load_s"] = time.perf_counter() - started
        return model

    def create_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        started = time.perf_counter()
        model = super().create_model(vllm_config, model_config, prefix)
        self._created = model
        self.phases["init_s"] = time.perf_counter() - started
        if getattr(model, "secondary_weights", None):
            raise Unusable("this model reads weights from more than one source")
        self._weights_started = time.perf_counter()
        return model

    def _feed(self, client: SyncClient, plan: Plan, model: nn.Module, model_config: ModelConfig) -> None:
        with client.attach(plan.name, device=plan.attach_device) as weights:
            if plan.key is not None and weights.fingerprint != plan.fingerprint:
                # Loaded again since the plan (evicted and reloaded from changed files):
                # publish under what was really fed.
                plan.key = dataclasses.replace(plan.key, checkpoint=weights.fingerprint)
            _Attached(self._fallback_config(), weights).load_weights(model, model_config)
            if weights.device != "cpu":
                torch.accelerator.synchronize()  # the copies are done before the lease ends
        logger.info("weightcache: loaded %d tensors of %s from the daemon (%s)", len(weights), plan.folder, plan.name)

    def _attach_processed(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str,
                          plan: Plan) -> nn.Module | None:
        assert plan.key is not None and weights_already_processed is not None
        name = processed_name(plan.folder, plan.key)
        want = tenant_fingerprint(plan.key.fingerprint(), os.geteuid())
        client = self._client()
        try:
            cm = client.attach(name, device=plan.attach_device)
            try:
                weights = cm.__enter__()
            except UnknownModel:
                client.close()
                logger.info("weightcache: no processed weights for this engine yet (%s)", name)
                return None
            zero_copy = weights.device != "cpu"
            try:
                if weights.fingerprint != want:
                    raise NotPublishable(f"{name} holds weights published under another key or by another user")
                started = time.perf_counter()
                target = target_device(vllm_config)
                with set_default_torch_dtype(model_config.dtype):
                    with torch.device("meta"):
                        model = self.create_model(vllm_config, model_config, prefix)
                    self.phases["init_s"] = time.perf_counter() - started
                    started = time.perf_counter()
                    put_in_place(model, weights, target, zero_copy)
                    self.phases["weights_s"] = time.perf_counter() - started
                    started = time.perf_counter()
                    with weights_already_processed():
                        process_weights_after_loading(model, model_config, target)
                    self.phases["post_s"] = time.perf_counter() - started
            except NotPublishable as exc:
                cm.__exit__(None, None, None)
                client.close()
                self._drop_created(vllm_config)
                logger.warning("weightcache: processed weights %s are not usable here (%s); attaching the checkpoint "
                               "and publishing them again", name, exc)
                return None
            except BaseException:
                cm.__exit__(None, None, None)
                self._drop_created(vllm_config)
                raise
            if zero_copy:
                _held.append((client, cm))  # the parameters are the daemon's memory: keep the lease
            else:
                cm.__exit__(None, None, None)
                client.close()
            logger.info("weightcache: attached processed weights %s (%d tensors, %s)", name, len(weights),
                        "zero-copy" if zero_copy else "copied")
            return model.eval()
        except BaseException:
            with contextlib.suppress(Exception):
                client.close()
            raise

    def _publish(self, model: nn.Module, plan: Plan) -> None:
        assert plan.key is not None
        name = processed_name(plan.folder, plan.key)
        try:
            tensors = publishable(model)
        except NotPublishable as exc:
            logger.info("weightcache: processed weights cannot be published from this engine: %s (%s)", exc, HOW)
            return
        started = time.perf_counter()
        try:
            with self._client() as client:
                client.publish(name, tensors, fingerprint=plan.key.fingerprint(), replace=True)
        except (WeightcacheError, OSError, TypeError, ValueError) as exc:
            logger.warning("weightcache: publishing processed weights as %s failed: %s", name, _one_line(exc))
            return
        self.phases["publish_s"] = time.perf_counter() - started
        logger.info("weightcache: published processed weights as %s (%d tensors)", name, len(tensors))

    # -- helpers -----------------------------------------------------------------------
    def _drop_created(self, vllm_config: VllmConfig) -> None:
        """Forget a model this load built and gave up on: its attention layers registered
        themselves by name in the config's forward context, where the next build of the
        same layers would be refused as duplicates."""
        model, self._created = self._created, None
        if model is None:
            return
        mine = {id(m) for m in model.modules()}
        context = vllm_config.compilation_config.static_forward_context
        for name in [k for k, v in context.items() if id(v) in mine]:
            del context[name]
        del model
        gc.collect()

    def _client(self) -> SyncClient:
        try:
            return SyncClient(self.options.socket, name=f"vllm pid {os.getpid()}")
        except DaemonUnavailable as exc:
            if "broke" not in exc.message:
                raise
            # A daemon that refuses a peer sends PERMISSION_DENIED and closes at once;
            # the hello may meet the closed socket before the refusal is read.
            raise DaemonUnavailable(f"{exc.message}: the daemon closed the connection as it opened, as it does for a uid "
                                    "its allowed_uids / allowed_gids leave out") from exc

    def _socket_path(self) -> str:
        from ...protocol import client_socket_path

        return str(client_socket_path(self.options.socket))

    def _fallback_config(self, load_format: str = "auto") -> LoadConfig:
        # DefaultModelLoader refuses extra config keys it does not know: give it none.
        return dataclasses.replace(self.load_config, load_format=load_format, model_loader_extra_config={})

    def _disk(self, load_format: str = "auto") -> DefaultModelLoader:
        return DefaultModelLoader(self._fallback_config(load_format))

    def _default_load(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str) -> nn.Module:
        return self._disk().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)


class _Attached(DefaultModelLoader):
    """vLLM's default loader with an attached model as its one weight source: its
    ``load_weights`` (the check that every parameter was loaded) as is."""

    def __init__(self, load_config: LoadConfig, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__(load_config)
        self._weights = weights

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        if self.counter_before_loading_weights == 0.0:  # type: ignore[has-type]  # vLLM logs the time from it
            self.counter_before_loading_weights = time.perf_counter()
        yield from self._weights.items()


# -- what the daemon can do for this engine ------------------------------------------
def _unsupported(vllm_config: VllmConfig, model_config: ModelConfig) -> str | None:
    """Why this engine must load with vLLM's default loader, or None."""
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        return f"pipeline parallel ({pc.pipeline_parallel_size} stages) is not supported"
    if model_config.quantization in ("bitsandbytes", "gguf"):
        return f"{model_config.quantization} checkpoints are read by their own loaders"
    return None


def _processed_unsupported(vllm_config: VllmConfig, model_config: ModelConfig) -> str | None:
    """Why processed weights cannot be used by this engine (the checkpoint still can), or None."""
    if weights_already_processed is None:
        return "this vLLM has no weights_already_processed() to re-run post-processing on processed weights"
    if model_config.quantization is not None:
        return f"quantization {model_config.quantization!r} is not verified with processed weights"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return f"kv cache dtype {cache_dtype!r} keeps scales post-processing turns into attributes"
    return None


def _zero_copy_device(vllm_config: VllmConfig) -> bool:
    return target_device(vllm_config).type == "cuda"


def _daemon_device() -> tuple[str, str | None]:
    """This rank's device as the daemon names it, and as attach takes it."""
    if current_platform.is_cuda_alike() and torch.cuda.is_available():
        from ...client.libcuda import driver

        index = torch.cuda.current_device()
        return f"cuda:{driver().device_uuid(index)}", f"cuda:{index}"
    return "cpu", None


def _configured_for(client: SyncClient, folder: str, device: str) -> str | None:
    """A model the daemon already has for ``folder`` on ``device`` (e.g. the operator's
    config). Paths are shown to admins and owners only; others register their own."""
    real = os.path.realpath(folder)
    for m in client.models():
        path = m.get("path")
        # Configured models only: the daemon opened them by path and reloads them when the
        # files change; a registered one holds the files as they were (its name says which).
        if path and m.get("origin") == "config" and m.get("shard_of") is None and m.get("replica_of") is None \
                and m.get("state") != "error" and os.path.realpath(path) == real and m.get("device") in (device, "cpu" if device == "cpu" else None):
            return str(m["name"])
    return None


def _register(client: SyncClient, name: str, folder: str, device: str) -> str:
    """Register ``folder`` as ``name`` from this process's files; a name already there is
    this checkpoint as it is now (the name says so), registered by an earlier start."""
    try:
        client.register(name, folder, device=device)
        logger.info("weightcache: registered %s as %s on %s", folder, name, device)
    except BadRequest as exc:
        if "already" not in str(exc):
            raise
    return name


def _retire_earlier(client: SyncClient, name: str, folder: str, device: str) -> tuple[str, ...]:
    """Unregister this uid's registrations of ``folder`` on ``device`` other than ``name``:
    each was made from the files as they were before they changed on disk (the name
    digests their identity), and no start will ask for it again. One an engine still
    attaches, or that is loading, is refused by the daemon and left for a later start.
    Returns the fingerprints of those unregistered (their processed weights go too)."""
    real, uid = os.path.realpath(folder), os.geteuid()

    def earlier(m: dict[str, Any]) -> bool:
        registered_on = f"cuda:{m['device_uuid']}" if m.get("device_uuid") else m.get("device")
        return (m.get("name") != name and is_checkpoint_name(str(m.get("name")), folder) and m.get("origin") == "register"
                and m.get("owner") == uid and bool(m.get("path")) and os.path.realpath(m["path"]) == real
                and str(registered_on).lower() == device.lower())

    stale = [m for m in client.models() if earlier(m)]
    return tuple(str(m["fingerprint"]) for m in stale if _retire(client, [m["name"]]) and m.get("fingerprint"))


def _retire(client: SyncClient, names: list[str]) -> bool:
    """Unregister ``names`` (those the daemon has); False if one of them was refused."""
    held = {m.get("name") for m in client.models()}
    done = True
    for name in names:
        if name not in held:
            continue
        try:
            client.unregister(name)
            logger.info("weightcache: unregistered %s: made from this checkpoint's files as they were before they were rewritten", name)
        except WeightcacheError as exc:
            logger.info("weightcache: %s kept: %s", name, _one_line(exc))
            done = False
    return done


def _fingerprint(client: SyncClient, name: str) -> str:
    """The content fingerprint of ``name`` (loading it if the daemon never did)."""
    for m in client.models():
        if m["name"] == name and m.get("fingerprint") and m.get("state") in ("resident", "host"):
            return str(m["fingerprint"])
    return str(client.load(name)["fingerprint"])


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


__all__ = ["WeightcacheModelLoader"]
