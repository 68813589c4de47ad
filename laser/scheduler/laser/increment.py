"""Alg. 2's ``LatencyIncrement`` (PPoPP'26 §7.2.1, lines 1-9) as a pure function over Alg. 1
(:mod:`laser.scheduler.laser.decode`): what admitting one more request would add to a decode
instance's aggregate TBT. The controller's instance reports (:mod:`laser.instance.state`) ask it.
Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...latency import LatencyModel
from .decode import DecodeMemo, DecodePlan, _LayerLoad, exec_plan, level_given_up, tbt_infeasible


@dataclass(frozen=True, slots=True)
class Increment:
    """Answer of :func:`latency_increment`: ``value`` (seconds of aggregate TBT, inf when
    the strictest TBT would break), ``iter_before``/``iter_after`` (predicted worst
    iteration, seconds), ``t_g_after`` (tightest TBT with the candidate, seconds)."""

    value: float
    iter_before: float
    iter_after: float
    t_g_after: float


def latency_increment(lm: LatencyModel, num_layers: int, iteration: int, decoding: list,
                      plans: dict[str, DecodePlan], candidate, target_factor: float = 1.0,
                      memo: DecodeMemo | None = None, best_effort_share: float = 1.0) -> Increment:
    """``LatencyIncrement(r*, d)``, Algorithm 2 lines 1-9 (PPoPP'26 §7.2.1), on copies.

    ``Iter`` = predicted worst iteration of the current plans; Alg. 1 (:func:`exec_plan`)
    with ``candidate`` added gives ``(L*, O*, Iter*, T_g*)``. If ``Iter* > T_g*`` (times
    ``target_factor``, the fraction the scheduler plans to), or the candidate's own TBT target
    is out of reach even alone here (:func:`tbt_infeasible`), or Alg. 1 met ``T_g*`` only by
    giving up a tighter level that its own requests overload (:func:`level_given_up`: the
    strictest TBT breaks, so the paper's ``Iter* > T_g*`` over the tightest target holds), the
    answer is inf; else
    ``sum_{r in R*} Iter*·ceil(N/L*_r) - sum_{r in R} Iter·ceil(N/L_r)`` seconds (each
    request's TBT is its iteration time times its iterations per token). Memory is the
    instance's check, not this function's. ``memo``: a :class:`DecodeMemo` of ``lm``.
    ``best_effort_share``: the instance scheduler's (:func:`exec_plan`'s rule: beside SLO work best
    effort takes at most this share of an iteration), so ``L*``, ``Iter*`` and ``T_g*`` are the
    plans that scheduler will run (1.0, the paper's rule, prices best effort restored up to T_g:
    an SLO stream's increment on an instance with best-effort streams is then priced against
    plans it will never run).
    """
    n = num_layers
    cur = {r.req_id: plans.get(r.req_id, DecodePlan(n, 0)) for r in decoding}
    if decoding:
        it = _LayerLoad(lm, n, iteration, decoding, cur, memo).predict()
        before = _aggregate_tbt(it, cur.values(), n)
    else:
        it = before = 0.0
    reqs = list(decoding) + [candidate]
    new, t_g, load = exec_plan(lm, n, iteration, reqs, cur, target_factor, memo, best_effort_share=best_effort_share)
    it_star = (load if load is not None else _LayerLoad(lm, n, iteration, reqs, new, memo)).predict()
    if (it_star > t_g * target_factor or tbt_infeasible(lm, candidate, memo)
            or level_given_up(lm, reqs, t_g, memo)):
        return Increment(math.inf, it, it_star, t_g)
    after = _aggregate_tbt(it_star, new.values(), n)
    return Increment(after - before, it, it_star, t_g)


def _aggregate_tbt(it: float, plans, n: int) -> float:
    """``sum_r it * ceil(N / L_r)`` over ``plans`` (seconds): each request's TBT is the iteration
    time ``it`` times its iterations per token."""
    return sum(it * p.groups(n) for p in plans)
