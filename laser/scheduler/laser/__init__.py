"""The Laser policy (PPoPP'26 §6): the scheduler, its layer-level chunked prefill (§6.1) and
its layer-level decode plans (§6.2, Alg. 1)."""

from .scheduler import LaserScheduler

__all__ = ["LaserScheduler"]
