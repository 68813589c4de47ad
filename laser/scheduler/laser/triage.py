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


def _never(r: Request) -> bool:
    return False


def _left(r: Request, n: int) -> Work:
    """``r``'s prompt tokens left to prefill, through all ``n`` layers, as one work."""
    return Work(r.req_id, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens, 0, n, True, r.masked)


@dataclass(frozen=True)
class Triage:
    """What one triage decided. ``tiers``: ``id(request) -> tier``: even tiers are savable, odd
    tiers given up, and the prefill order runs them by tier: the savable prefills that need the
    time before the first given-up one (tier 0), that one (tier 1), the savable ones that need the
    time before the next given-up one (tier 2), ... and after the last given-up one the savable
    ones with room for all of them (tier ``tail``; requests not listed have it too). With one
    given-up request (or none) the tiers are 0, 1, 2 as before. ``given_up``: the requests it gave
    up, in the order it gave them up. ``queue_key``: the scheduler's EDF key the prefill order
    falls back on within a tier, after ``yields`` (whether a prompt goes behind those with a deadline
    of their own: :func:`~laser.scheduler.report.prefill_yields`): within a tier, the
    prompts with a deadline first."""

    tiers: dict[int, int]
    given_up: tuple[Request, ...]
    queue_key: Callable[[Request], tuple]
    tail: int = 2
    yields: Callable[[Request], bool] = _never

    def key(self, r: Request) -> tuple:
        """Prefill order: ``(tier, yields(r), *queue_key(r))``."""
        return (self.tiers.get(id(r), self.tail), self.yields(r), *self.queue_key(r))

    def is_given_up(self, r: Request) -> bool:
        return self.tiers.get(id(r), 0) % 2 == 1


def triage(cands: Sequence[Request], now: float, lm: LatencyModel, num_layers: int, rate: float,
           may_give_up: Callable[[Request], bool], queue_key: Callable[[Request], tuple],
           max_candidates: int, yields: Callable[[Request], bool] = _never) -> Triage:
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
    prefills that need the time, ahead of those whose deadlines hold with it and the given-up work
    before it (EDF) run first (a long prompt with a far deadline must not keep a late short one
    waiting for seconds; :func:`_places`).

    Prefills without a deadline of their own (``yields``: best effort, demoted) are not judged,
    and no prompt with one is judged behind them: they go behind the savable ones whatever their
    aging deadline (beside SLO work best effort takes only ``best_effort_share`` of a step,
    :meth:`~.prefill.PrefillPlanner.merge`), and the given-up ones are placed among them as
    among the savable ones (:func:`_places`: one past its aging deadline goes ahead of them, so
    a stream of given-up prompts does not starve it).

    Case: the paper's EDF serves the most urgent first even when it is hopeless; under overload that
    makes every later request late as well. Case (issue 28 item 3, a closed loop of 12 best-effort
    requests beside Poisson chats on a machine 1.6x slower than its profile): a best-effort prompt
    that had waited its 30 s aging deadline sorted ahead of every new chat; counted ahead of them
    here, it got each chat given up on arrival, and it ran first with the whole step (no SLO work
    merged before it to hold it to the share): chats waited 1-3.5 s behind it. Returns the
    :class:`Triage`; changes nothing."""
    n = num_layers
    hopeless: list[Request] = []
    kept: list[tuple[Request, Work]] = []  # the savable prefills so far, in EDF order (then the yielding ones)
    ahead = PlanCost(lm, n, [])  # ``kept``, merged in one pass
    for r in [q for q in cands if not yields(q)][:max_candidates]:
        w = _left(r, n)
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
    kept += [(r, _left(r, n)) for r in [q for q in cands if yields(q)][:max(0, max_candidates - len(kept))]]
    tiers, tail = _places(hopeless, kept, now, lm, n, rate, queue_key)
    return Triage(tiers, tuple(hopeless), queue_key, tail, yields)


def _places(hopeless: list[Request], kept: list[tuple[Request, Work]], now: float, lm: LatencyModel, n: int,
            rate: float, queue_key: Callable[[Request], tuple]) -> tuple[dict[int, int], int]:
    """Where each given-up request goes among the savable ones ``kept`` (in EDF order): the
    given-up ones are placed one by one in EDF order, each before the savable ones (from some
    index on, never before an earlier given-up one's place) whose deadlines still hold with it and
    every given-up one before it run first, all merged in one pass at ``rate``, or that miss them
    even with no given-up work ahead (it makes none of them late; until their deadline has passed)
    -- behind the savable prefills that need the time, ahead of those with room for it. Returns (``id -> tier``, the tier of the
    savable ones after every given-up one; see :class:`Triage`).

    Case (issue 28, a burst of long and short prompts on a CPU, where a layer call's fixed cost
    makes a 20-token chat 28 % of a 150-token prompt): three chats out of reach beside the other
    chats' decode streams were given up together with three long prompts; judged as one block
    (the rule before: every given-up prompt ahead of a savable one, or none), the given-up long
    prompts left the savable long prompts no room, so the given-up chats waited behind all of them
    (first tokens at 7.3 s against 1 s); placed one by one, they run before the savable long
    prompts, which still make their deadlines. Case (the same, ``slo_pressure.py --scenarios kv``):
    a chat given up among four arriving together waited 26.8 s behind best-effort requests whose
    30 s aging deadline nothing could meet any more ("they need the time")."""
    tiers = {id(q): 0 for q, _ in kept}
    if not hopeless:
        return tiers, 2
    given = sorted(hopeless, key=queue_key)
    deadlines = [queue_key(q)[0] for q, _ in kept]
    works = {id(q): _left(q, n) for q in given}
    alone = PlanCost(lm, n, [])  # the savable ones without any given-up work ahead
    late = []
    for (_, x), d in zip(kept, deadlines):
        alone.add(x)
        late.append(now < d < now + alone.total / rate)
    places: list[int] = []
    place = 0
    for j in range(len(given)):
        if place < len(kept):
            pre = PlanCost(lm, n, [works[id(q)] for q in given[:j + 1]])
            ends = []
            for _, x in kept:
                pre.add(x)
                ends.append(now + pre.total / rate)
            # (a best-effort request's deadline is its aging deadline, as in EDF: once that is
            # near, it needs the time too -- else a stream of given-up prompts starves it; one
            # late even with no given-up work ahead is not made late by it, until its deadline
            # has passed: then it goes first, and aging bounds how long it waits)
            room = len(kept)
            while room > place and (ends[room - 1] <= deadlines[room - 1] or late[room - 1]):
                room -= 1
            place = room
        places.append(place)
    for i, (q, _) in enumerate(kept):
        tiers[id(q)] = 2 * sum(1 for p in places if p <= i)
    for j, q in enumerate(given):
        tiers[id(q)] = 2 * j + 1
    return tiers, 2 * len(given)
