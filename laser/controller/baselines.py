"""Baseline controllers on the same simulated instances (PPoPP'26 §9 baselines).

* ``distserve`` — DistServe (OSDI'24): disaggregated, iteration-level instances with EDF
  queues (the ``vllm`` policy: whole-prompt prefill batches on prefill instances,
  one-token decode iterations on decode instances); each request goes to the prefill
  instance with the fewest pending prefill tokens and, when its prefill ends, to the
  decode instance with the fewest KV blocks in use (DistServe pulls KV after prefill).
* ``colocated`` — every instance mixed (prefill and decode together) behind a
  least-loaded router (KV demand: blocks held + blocks the queued prompts need).
  Instances run Sarathi-Serve (``colocated``) or Laser's mixed role (``colocated-laser``).
* ``round_robin`` — a floor: Laser instances, prefill and decode instances taken in turn.
"""

from __future__ import annotations

import itertools

from ..instance.messages import RequestInfo
from .base import Controller, Route, least_loaded_decode, mixed_load_key, prefill_load_key, register


class _LeastLoaded(Controller):
    """Routes each request to the instance of ``self.prefill`` with the smallest ``load_key``."""

    @staticmethod
    def load_key(rep):
        raise NotImplementedError

    def route(self, info: RequestInfo, now: float) -> Route:
        self.decisions += 1
        p = min(self.prefill, key=lambda i: (self.load_key(i.report()), i.instance_id))
        return Route(p.instance_id, None)


@register
class DistServeController(_LeastLoaded):
    name = "distserve"
    disaggregated = True
    instance_policy = "vllm"
    load_key = staticmethod(prefill_load_key)

    def at_handoff(self, info: RequestInfo, chosen: int | None, now: float) -> int:
        """The decode instance with the fewest KV blocks in use, then requests; the choice is
        reserved there until the hand-off is adopted, so the next hand-offs of a wave count it
        (a real instance adopts asynchronously: its report does not show the request yet)."""
        d = least_loaded_decode(self.decode)
        d.reserve(info)
        return d.instance_id


@register
class ColocatedController(_LeastLoaded):
    name = "colocated"
    disaggregated = False
    instance_policy = "sarathi"
    load_key = staticmethod(mixed_load_key)


@register
class ColocatedLaserController(ColocatedController):
    name = "colocated-laser"
    instance_policy = "laser"


@register
class RoundRobinController(Controller):
    name = "round_robin"
    disaggregated = True
    instance_policy = "laser"

    def attach(self, instances) -> None:
        super().attach(instances)
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)

    def route(self, info: RequestInfo, now: float) -> Route:
        self.decisions += 1
        d = next(self._d)
        d.reserve(info)
        return Route(next(self._p).instance_id, d.instance_id)
