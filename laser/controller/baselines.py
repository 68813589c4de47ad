"""Baseline controllers on the same simulated instances (PPoPP'26 §9 baselines).

* ``distserve`` — DistServe (OSDI'24): disaggregated, iteration-level instances with EDF
  queues (the ``vllm`` policy: whole-prompt prefill batches on prefill instances,
  one-token decode iterations on decode instances); each request goes to the prefill
  instance with the fewest pending prefill tokens and, when its prefill ends, to the
  decode instance with the fewest KV blocks in use (DistServe pulls KV after prefill).
* ``colocated`` — every instance mixed (prefill and decode together) behind a
  least-loaded router (KV demand: blocks held + blocks the queued prompts need).
  Instances run Sarathi-Serve (``colocated``) or Laser's mixed role (``colocated-laser``).
* ``round_robin`` — a floor: Laser instances, prefill and decode instances taken in turn
  (prefix-blind by design: it is the no-information floor).

The least-loaded routers are cache-aware (issue 29): an instance's load counts the request's own
work there, which is only what its prefix cache does not hold (:meth:`_LeastLoaded.added_load`):
the instance holding a prompt's prefix wins unless its queue is longer by more than the cached
work -- the balance rule of SGLang's cache-aware router (longest prefix match unless the loads are
imbalanced), stated in the load's own unit. Without block hashes (prefix caching off, or a
prefix-blind front end) every instance holds nothing and the choice is the plain least-loaded one.
"""

from __future__ import annotations

import itertools

from ..instance.messages import RequestInfo
from .base import Controller, Route, least_loaded_decode, mixed_load_key, prefill_load_key, register


class _LeastLoaded(Controller):
    """Routes each request to the instance of ``self.prefill`` with the smallest ``load_key`` once
    the request's own uncached work is added to it (:meth:`added_load`)."""

    def __init__(self, **options):
        super().__init__(**options)
        self.num_routed_cached_tokens = 0  # prompt tokens routed to an instance caching them

    @staticmethod
    def load_key(rep):
        raise NotImplementedError

    @staticmethod
    def added_load(rep, info: RequestInfo, cached: int) -> float:
        """What ``info`` adds to ``load_key(rep)[0]`` on that instance when ``cached`` of its prompt
        tokens are in its prefix cache (in the load key's unit)."""
        raise NotImplementedError

    def route(self, info: RequestInfo, now: float) -> Route:
        self.decisions += 1
        best, best_key, best_cached = None, None, 0
        for i in self.prefill:
            rep = i.report()
            cached = rep.cached_prefix_tokens(info)
            load, *rest = self.load_key(rep)
            key = (load + self.added_load(rep, info, cached), *rest, i.instance_id)
            if best_key is None or key < best_key:
                best, best_key, best_cached = i, key, cached
        self.num_routed_cached_tokens += best_cached
        return Route(best.instance_id, None)


@register
class DistServeController(_LeastLoaded):
    name = "distserve"
    disaggregated = True
    instance_policy = "vllm"
    load_key = staticmethod(prefill_load_key)

    @staticmethod
    def added_load(rep, info: RequestInfo, cached: int) -> float:
        """Prompt tokens still to compute there."""
        return info.prompt_len - cached

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

    @staticmethod
    def added_load(rep, info: RequestInfo, cached: int) -> float:
        """New KV blocks the prompt needs there (cached blocks are shared, not allocated)."""
        return -(-(info.prompt_len - cached) // rep.block_size)


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
