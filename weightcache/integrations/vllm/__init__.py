"""``vllm serve DIR --load-format weightcache``: a vLLM model loader backed by the daemon
(docs/vllm.md).

vLLM runs every entry point of the group ``vllm.general_plugins`` in each of its
processes (pyproject.toml names :func:`register`), before it parses a load format;
:func:`register` imports :mod:`.loader`, whose ``@register_model_loader("weightcache")``
makes the format valid. Importing this package imports neither vLLM nor torch: the
options and the cache keys (:mod:`.keys`) are plain Python, tested without vLLM.
"""

from __future__ import annotations


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers the ``weightcache`` load format."""
    from . import loader  # noqa: F401  (the decorator registers on import)
