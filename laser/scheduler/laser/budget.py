"""The budget rules this project added to Laser's iteration budget T_g (PPoPP'26 §6.2 plans decode
iterations to T_g, the tightest TBT target it can meet, and leaves the rest of an iteration to prefill;
the paper is silent on what follows). Each rule is a pure function of explicit inputs, stated
with the case it exists for; :class:`~laser.scheduler.laser.scheduler.LaserScheduler` owns the
state (T_g, the plans, the requests) and calls them. Torch-free.

- **T_g and the partly spent gap** (:func:`iteration_limit`): an iteration may take
  ``planning_margin * T_g``, less when a request's current token gap is partly spent.
- **The planning margin** (:func:`planning_margin`): iterations are planned to a fraction of T_g.
- **The knowing break of T_g** (:func:`prefill_budget`, with :func:`prefill_need` and
  :func:`triage_rate`): one iteration may run past T_g when a waiting prefill's deadline needs it
  and every decode request can absorb one late gap.
- **The P99 allowance** (:func:`p99_allowance_left`): who may take that one late gap.
- **Given-up levels** (:func:`holds_tg`, :func:`nothing_to_keep`; Alg. 1's own overload rule is
  :func:`~laser.scheduler.laser.decode.level_given_up`): the requests whose target T_g no longer
  holds, and when no target is worth holding at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from ...core.pricing import PlanCost
from ...core.request import Phase, Request


def planning_margin(tg_margin: float, timing_spread: float) -> float:
    """Fraction of T_g that iterations are planned to: ``tg_margin`` over the latency model's
    measured :meth:`~laser.latency.LatencyModel.timing_spread` (1.0 unless ``--jitter-margin``).

    Case: real iterations run a few % over their predictions, and on a jittery machine the worst
    few percent of steps run further over; planned to the last millisecond of T_g, they would
    break the strictest TBT target. Used for Alg. 1's decode plans and the prefill budget alike."""
    return tg_margin / timing_spread


def holds_tg(r: Request, t_g: float) -> bool:
    """Whether T_g holds for request ``r``: it is decoding, with a TBT target at or above ``t_g``
    (seconds) and reachable alone (not ``tbt_infeasible``). No request while T_g is inf.

    Case (given-up levels): below T_g, Alg. 1 gave the level up because its own requests overload
    the iteration (:func:`~laser.scheduler.laser.decode.level_given_up`); a target out of reach even
    alone cannot be kept by any plan. Neither limits an iteration (:func:`iteration_limit`) nor
    vetoes a knowing break (:func:`p99_allowance_left`)."""
    tbt = r.slo.tbt
    return r.phase == Phase.DECODE and tbt is not None and tbt >= t_g and not r.tbt_infeasible


def nothing_to_keep(decoding: Iterable[Request]) -> bool:
    """Whether every decoding request with a TBT target has lost its SLO already: its first token
    missed its TTFT target, its P99 TBT is broken, or its TBT target is out of reach even alone
    (``tbt_infeasible``). Then T_g is inf and every request runs at full depth.

    Case (issue 16's offline case: a batch submitted at once misses every first token): a
    request's SLO is met only with both targets (:mod:`laser.core.metrics`), so holding T_g for
    these saves no SLO; Alg. 1 would only cut iterations (and prefill time) for targets nobody can
    meet any more."""
    return all(r.slo.tbt is None or r.ttft_missed or r.p99_tbt_broken or r.tbt_infeasible for r in decoding)


def p99_allowance_left(held: Iterable[Request]) -> bool:
    """Whether every request of ``held`` (those :func:`holds_tg` holds for) whose P99 TBT is not broken already
    (:attr:`Request.p99_tbt_broken`) may take one more token gap over its target and still meet its
    P99 TBT (:attr:`Request.tbt_miss_allowance`).

    Case (the P99 allowance): the SLO counts the P99 TBT, not every gap, so a stream may absorb a
    few late gaps; a knowing break of T_g (:func:`prefill_budget`) spends one of each. A request
    with nothing left to lose does not veto the break."""
    return all(r.p99_tbt_broken or r.num_tbt_misses + 1 <= r.tbt_miss_allowance for r in held)


def iteration_limit(now: float, decode_time: float, t_g: float, margin: float,
                    gaps: Iterable[tuple[float, float, int]]) -> float:
    """Seconds this iteration may take so that every request whose T_g holds (:func:`holds_tg`)
    still gets its token within its TBT target: ``margin * t_g`` (``margin``: :func:`planning_margin`),
    or less when a request's current token gap is already partly spent. ``gaps``: one
    ``(last token time, TBT target, g)`` per such request with a token and an Alg. 1 plan, ``g``
    the iterations left before its next token (:meth:`~.decode.DecodePlan.iterations_left`); one
    with ``s`` seconds left of its gap may take ``(s - (1 - margin) * TBT_r) / g`` (its TBT slack
    spread over its remaining iterations). A request whose gap is lost already (its share, even
    without the margin, is below ``decode_time``, this iteration's decode seconds) does not limit
    it; one that makes it only without the margin gets an iteration of decode work alone.

    Case: Alg. 1 changes a plan mid-token (e.g. T_g rises when the strictest request leaves): the
    reduced request's last group would otherwise run in an iteration sized to the new, looser
    T_g, and its token would come late."""
    limit = t_g * margin
    for last, tbt, left in gaps:
        own = (last + tbt * margin - now) / left
        if own >= decode_time:
            limit = min(limit, own)
        elif (last + tbt - now) / left >= decode_time:
            limit = min(limit, decode_time)  # only without prefill (and the margin) it still makes it
        # else its gap is lost already: holding prefill back saves nobody
    return limit


def prefill_need(f: float, whole: float, decode_time: float) -> tuple[float, float]:
    """Seconds of prefill per iteration the pending prefills need: an iteration of ``decode_time``
    seconds of decode work plus p of prefill gives prefill the share p / (decode_time + p) >= f,
    the share of the time from now they need (:meth:`~laser.scheduler.laser.prefill.PrefillPlanner.demand`).
    Returns ``(need, whole)``; ``whole`` (seconds) is the prefill that completes the requests
    setting ``f`` in one iteration, what a knowing break gives (:func:`prefill_budget`).

    Case: ``(0, 0)`` when ``f >= 1``: a prefill that misses its deadline even with the whole machine
    from now on is not saved by breaking the decode requests' T_g (an unbounded iteration that
    spent their P99 allowance for nobody)."""
    if f <= 0.0 or f >= 1.0:
        return 0.0, 0.0
    return decode_time * f / (1.0 - f), whole


def prefill_budget(limit: float, decode_time: float, need: float, whole: float,
                   allowance_left: Callable[[], bool]) -> float:
    """Seconds of prefill this iteration may carry beside ``decode_time`` seconds of decode work:
    the time left under ``limit`` (:func:`iteration_limit`), or -- the knowing break of T_g -- when
    a waiting prefill's deadline needs more (``need``, :func:`prefill_need`) and every decode
    request can still absorb one gap over its target (``allowance_left()``,
    :func:`p99_allowance_left`, asked only then), ``max(need, whole)``: the prefills up to the
    deadline that needs it complete in this iteration.

    Case: at T_g's pace the share ``need`` alone left those prefills late; breaking T_g once spends
    one late gap per stream (within its P99) and meets the deadline."""
    budget = max(0.0, limit - decode_time)
    if need > budget and allowance_left():
        budget = max(need, whole)
    return budget


def prefill_share(budget: float, decode_time: float) -> float:
    """Share of an iteration's time that prefill gets with ``budget`` seconds of prefill beside
    ``decode_time`` seconds of decode (1.0 with an unbounded budget or an empty iteration): prefill
    advances at about this fraction of its alone speed, what overload triage assumes next
    (:func:`triage_rate`)."""
    return budget / (decode_time + budget) if math.isfinite(budget) and decode_time + budget > 0 else 1.0


def triage_rate(prefill_rate: float, min_rate: float, break_open: bool) -> float:
    """The share of the machine overload triage (:func:`~laser.scheduler.laser.triage.triage`)
    judges prefills at: the last step's ``prefill_rate`` (at least ``min_rate``), or the whole
    machine (1.0) while a knowing break of T_g is open (``break_open``: decode is planned, T_g is
    finite and :func:`p99_allowance_left` holds).

    Case: judged at the share T_g leaves, a 190-token chat beside one code stream was given up and
    missed, where the break (one iteration that completes the urgent prefill) met both SLOs."""
    return 1.0 if break_open else max(prefill_rate, min_rate)


def yields_to_slo(slo) -> bool:
    """Whether work of a request with ``slo`` (a :class:`~laser.core.request.SLO`) gives way to SLO
    work under :func:`best_effort_limit`: best effort, no TTFT or TBT target and no batch-job
    deadline (a cold request with one must finish in its job's window)."""
    return slo.ttft is None and slo.tbt is None and slo.deadline is None


def best_effort_limit(slo_price: float, share: float) -> float:
    """Seconds an iteration may take with best-effort work in it, when its work for requests
    with SLO targets costs ``slo_price`` seconds and best effort may take ``share`` (in (0, 1])
    of it: ``slo_price / (1 - share)`` (inf at 1.0). Our rule (issue 28, item 3)."""
    return math.inf if share >= 1.0 else slo_price / (1.0 - share)


def slo_decode_price(lm, num_layers: int, works: Iterable, slo_of: Callable) -> float:
    """Seconds the decode works among ``works`` (:class:`~laser.core.plan.Work`) of requests that do
    not yield to SLO work (:func:`yields_to_slo` of ``slo_of(req_id)``) cost together
    (:class:`~laser.core.pricing.PlanCost` under ``lm``); 0.0 without any. The ``P`` of
    :func:`best_effort_limit` for a step's prefill merge."""
    slo = [w for w in works if w.is_decode and not yields_to_slo(slo_of(w.req_id))]
    return PlanCost(lm, num_layers, slo).total if slo else 0.0
