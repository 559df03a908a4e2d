"""Engines' own plugin seams, each in a subpackage that imports its engine only when the
engine loads it (``vllm``: a model loader registered through vLLM's plugin entry point)."""
