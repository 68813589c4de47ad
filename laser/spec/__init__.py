"""Speculative decoding on the per-layer engine (self-speculation from trained early exits)."""

from .self_spec import SelfSpeculator, SpeculativeConfig, SpecStats, enable_self_speculation

__all__ = ["SelfSpeculator", "SpeculativeConfig", "SpecStats", "enable_self_speculation"]
