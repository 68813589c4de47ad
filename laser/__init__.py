"""Laser: layer-level scheduling for multi-SLO LLM serving (PPoPP'26) on a real engine."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "SLO", "__version__"]


def __getattr__(name):  # lazy: importing laser must not import torch (schedulers are torch-free)
    if name == "LLM":
        from .frontend.llm import LLM

        return LLM
    if name in ("SamplingParams", "SLO"):
        from .core import request

        return getattr(request, name)
    raise AttributeError(name)
