"""Discrete-time simulation of instances: the real schedulers, the latency model as the clock."""

from .instance import SimInstance, VirtualClock

__all__ = ["SimInstance", "VirtualClock"]
