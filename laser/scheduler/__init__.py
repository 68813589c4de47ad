"""Scheduling policies, registered by name. Torch-free."""

from __future__ import annotations

from .base import Scheduler
from .sarathi import SarathiScheduler
from .laser.scheduler import LaserScheduler
from .vllm import VLLMScheduler

POLICIES: dict[str, type[Scheduler]] = {}


def register(cls: type[Scheduler]) -> type[Scheduler]:
    POLICIES[cls.name] = cls
    return cls


for _cls in (VLLMScheduler, SarathiScheduler, LaserScheduler):
    register(_cls)


def get_policy(name: str) -> type[Scheduler]:
    """Policy class by name. Raises ValueError listing the known names."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None


__all__ = ["POLICIES", "Scheduler", "get_policy", "register"]
