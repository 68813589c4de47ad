"""Decode->decode migration's trigger and victim (CONTROLLER.md A8.4, D9), judged from a decode
instance's scheduler between its steps (the instance wraps the answer for the controller:
:func:`laser.instance.state.migration_candidate`). Torch-free."""

from __future__ import annotations

import math

from ..core.request import Request
from .laser.decode import exec_plan, level_given_up


def _gaps_still_count(r: Request) -> bool:
    """Whether moving ``r`` off an overloaded instance can still save something: it has a TBT
    target, reachable alone, and its first token met its TTFT target (else its SLO was lost from
    the start). A P99 TBT broken by one stall -- every stream on an instance that was frozen --
    does not count as lost here: each of its next gaps is still felt (the scheduler's T_g release,
    :meth:`LaserScheduler._nothing_to_keep`, counts it lost; moving it is what relieves the rest)."""
    return r.slo.tbt is not None and not r.ttft_missed and not r.tbt_infeasible


#: Decode requests tried as the T_g victim (Alg. 1 is re-run once per try), fewest blocks first.
MIGRATION_TRIES = 8


def migration_victim(sched, latency_model, num_layers: int,
                     exclude: set[str] | frozenset = frozenset()) -> tuple[Request, str] | None:
    """Decode->decode migration trigger and victim (CONTROLLER.md A8.4, D9) of a decode instance
    whose scheduler is ``sched``, between steps; None when nothing must move.

    * ``memory``: the free KV blocks of the fullest layer are fewer than the decoding requests
      need for the token after the next one (the step about to start is covered: one step of
      growth in reserve, checked between steps). Victim: the request holding the fewest blocks
      that still cover the shortfall (else the one holding the most).
    * ``slo``: T_g is finite, the last decode iteration took longer than T_g and Alg. 1's plans
      (:meth:`LaserScheduler.predict_decode`) predict an iteration over T_g; or Alg. 1 gave up
      a tighter TBT level that its own requests overload (:func:`level_given_up`; T_g is then
      the next looser target, or inf when there is none -- a backlog of one class, as after a
      thaw), and the last iteration took longer than that level. Victim: among the
      ``MIGRATION_TRIES`` requests with the fewest blocks, the first whose departure lets Alg. 1
      (:func:`exec_plan`) reach its T_g without giving a level up; when no single departure
      does but the departure of every movable request except one would, the request with the
      tightest target, fewest blocks first (the first of several moves, one per step); else
      none (moving would not help).

    Requests in ``exclude`` (already leaving) and those not at a token boundary (a layer group
    of the token in flight) are not chosen. Changes nothing.
    """
    bm = sched.bm
    planning = sched.planning_report()
    t_g, last = planning.get("t_g", math.inf), planning.get("last_iteration_s")
    iteration, plans, _, memo, share = sched.decode_state()
    slo = t_g != math.inf and last is not None and last > t_g  # cheap pre-check of the T_g trigger
    # (a level given up: a request with a tighter target than T_g, reachable alone; the scan is
    # skipped while T_g holds the tightest target on the instance. T_g is inf with no target at
    # all, none reachable alone, when every request's SLO is lost (the scheduler released T_g) --
    # but also when the requests of the one class it has overload it together: that level is
    # given up, and moving some lets the rest keep their gaps)
    given_up = (not slo and last is not None
                and any(_gaps_still_count(r) and r.slo.tbt < t_g and last > r.slo.tbt for r in sched.running)
                and level_given_up(latency_model, sched.decoding(), t_g, memo))
    slo = slo or given_up
    if not slo and bm.min_free() >= len(sched.running):
        return None  # each request grows by at most one block per token: room for everyone
    decoding = [r for r in sched.decoding() if r.req_id not in exclude]
    if len(decoding) < 2:
        return None  # a lone request has nowhere better to be
    held = bm.num_held
    growth = sum(1 for r in decoding if bm.blocks_needed(r.num_tokens + 1) > held(r.req_id, 0))
    short = growth - bm.min_free()
    if short <= 0 and not (given_up or (slo and sched.predict_decode(decoding) > t_g)):
        return None
    movable = sorted((r for r in decoding if r.next_layer == 0), key=lambda r: (held(r.req_id, 0), r.req_id))
    if not movable:
        return None
    if short > 0:
        cover = [r for r in movable if held(r.req_id, 0) >= short]
        return (cover[0] if cover else movable[-1]), "memory"
    factor = sched.plan_target_factor()

    def restores(leaving: list) -> bool:  # Alg. 1 reaches its T_g, no level given up, without ``leaving``
        rest = [x for x in decoding if all(x is not r for r in leaving)]
        _, t_g2, load = exec_plan(latency_model, num_layers, iteration, rest, plans, factor, memo,
                                  best_effort_share=share)
        return not level_given_up(latency_model, rest, t_g2, memo) and (load is None or load.predict() <= t_g2)

    for r in movable[:MIGRATION_TRIES]:
        if restores([r]):
            return r, "slo"
    leaving = movable if len(movable) < len(decoding) else movable[:-1]
    if len(leaving) > 1 and restores(leaving):  # a backlog: several must go, the first now
        return min(movable, key=lambda r: (r.slo.tbt_or_inf, held(r.req_id, 0), r.req_id)), "slo"
    return None
