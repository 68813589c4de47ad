"""Overload triage of Laser's prefills: Moore-Hodgson's rule decides which prefills are given up
(served behind the savable ones) and so the prefill order of a step. A pure function of explicit
inputs: it returns what it decided (:class:`Triage`); the scheduler records the given-up
requests (:meth:`~laser.scheduler.laser.scheduler.LaserScheduler.triage`). Torch-free.

Source: Moore, "An n job, one machine sequencing algorithm for minimizing the number of late
jobs", Management Science 1968 -- the number of requests meeting their TTFT is what SLO
attainment and goodput count. Our rule; the paper's §6.1 serves prefills in EDF order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core.plan import Work
from ...core.pricing import PlanCost
from ...core.request import Request
from ...latency import LatencyModel


def may_give_up(r: Request, holds_kv: bool, given_up_before: bool) -> bool:
    """Whether Moore-Hodgson's rule may put ``r`` behind the others: a prefill with a TTFT target
    that has not started (``holds_kv`` False and no chunk in flight: no work sunk into it; a
    cached prefix it would attach is not its work), or that was given up before
    (``given_up_before``) -- a piece of it merged into a step with room since must not promote it
    ahead of the savable ones it was given up for --, neither demoted nor boosted."""
    return (r.slo.ttft is not None and not r.demoted and not r.boosted
            and ((not holds_kv and not r.in_flight) or given_up_before))


@dataclass(frozen=True)
class Triage:
    """What one triage decided. ``tiers``: ``id(request) -> tier`` (0: savable and urgent, 1:
    given up, 2: savable with room; requests not listed are tier 2). ``given_up``: the requests
    it gave up (tier 1), in the order it gave them up. ``queue_key``: the scheduler's EDF key the
    prefill order falls back on."""

    tiers: dict[int, int]
    given_up: tuple[Request, ...]
    queue_key: Callable[[Request], tuple]

    def key(self, r: Request) -> tuple:
        """Prefill order: ``(tier, *queue_key(r))``."""
        return (self.tiers.get(id(r), 2), *self.queue_key(r))

    def is_given_up(self, r: Request) -> bool:
        return self.tiers.get(id(r)) == 1


def triage(cands: Sequence[Request], now: float, lm: LatencyModel, num_layers: int, rate: float,
           may_give_up: Callable[[Request], bool], queue_key: Callable[[Request], tuple],
           max_candidates: int) -> Triage:
    """Prefill order: EDF (``queue_key``), except for the prefills given up under overload, which go
    behind every other one (EDF's domino effect: serving the hopeless first makes the savable late
    too).

    ``cands``: the pending prefills (running and waiting), in ``queue_key`` order; the first
    ``max_candidates`` are judged. Walk them in EDF order, adding each to a set run from ``now`` as
    one merged pass (PlanCost: on a GPU their layer calls share the weight reads) at ``rate``, the
    share of the machine prefill gets (:func:`~laser.scheduler.laser.budget.triage_rate`); whenever
    the request just added, not started, would miss its TTFT target, give up the *longest* prefill
    of the set that ``may_give_up`` (:func:`may_give_up`), again until it makes it or is itself
    given up -- often a long prompt ahead that would make several short ones late, rather than the
    newcomer (a late started request gives up no one: nothing would save it; one that misses even
    run alone from now is given up itself). A given-up request is still served: behind the savable
    prefills that need the time, ahead of those whose deadlines hold with all given-up work run
    first (a long prompt with a far deadline must not keep a late short one waiting for seconds).

    Case: the paper's EDF serves the most urgent first even when it is hopeless; under overload that
    makes every later request late as well. Returns the :class:`Triage`; changes nothing."""
    n = num_layers
    hopeless: list[Request] = []
    kept: list[tuple[Request, Work]] = []  # the savable prefills so far, in EDF order
    ahead = PlanCost(lm, n, [])  # ``kept``, merged in one pass
    for r in cands[:max_candidates]:
        w = Work(r.req_id, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens, 0, n, True, r.masked)
        if w.num_tokens <= 0:
            continue

        def late() -> bool:
            return r.slo.ttft is not None and not r.demoted and now + ahead.with_work(w) / rate > r.ttft_deadline

        if not late() or not may_give_up(r):
            # on time, or started (its work is sunk, and giving up others would not save it)
            ahead.add(w)
            kept.append((r, w))
            continue
        while True:  # give up the longest until r makes it (or r itself is the longest)
            drop = max([qx for qx in kept if may_give_up(qx[0])] + [(r, w)],
                       key=lambda qx: (qx[1].num_tokens, queue_key(qx[0])))
            hopeless.append(drop[0])
            if drop[0] is r:
                break
            kept = [qx for qx in kept if qx[0] is not drop[0]]
            ahead = PlanCost(lm, n, [x for _, x in kept])
            if not late():
                ahead.add(w)
                kept.append((r, w))
                break
    room = _room(cands, hopeless, kept, now, lm, n, rate, queue_key)
    tiers = {id(q): (0 if i < room else 2) for i, (q, _) in enumerate(kept)}
    tiers.update((id(q), 1) for q in hopeless)
    return Triage(tiers, tuple(hopeless), queue_key)


def _room(cands: Sequence[Request], hopeless: list[Request], kept: list[tuple[Request, Work]], now: float,
          lm: LatencyModel, n: int, rate: float, queue_key: Callable[[Request], tuple]) -> int:
    """How many of ``kept`` (in EDF order) need the time before the given-up work: the savable ones
    from this index on still make their deadlines with all given-up work run before them, so they
    go after it."""
    room = len(kept)
    if hopeless and kept:
        ids = {id(q) for q in hopeless}
        given = [Work(q.req_id, q.num_computed_tokens, q.num_tokens - q.num_computed_tokens, 0, n, True, q.masked)
                 for q in cands if id(q) in ids]
        pre = PlanCost(lm, n, given)
        ends = []
        for _, x in kept:
            pre.add(x)
            ends.append(now + pre.total / rate)
        # (a best-effort request's deadline is its aging deadline, as in EDF: once that is
        # near, it needs the time too -- else a stream of given-up prompts starves it)
        while room > 0 and ends[room - 1] <= queue_key(kept[room - 1][0])[0]:
            room -= 1
    return room
