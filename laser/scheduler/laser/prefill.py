"""Laser's prefill side (PPoPP'26 §6.1): the EDF merge of layer-level prefill work under the TTFT
deadlines (:meth:`PrefillPlanner.merge`, :meth:`PrefillPlanner.fit`) and what the pending
prefills need of each iteration (:meth:`PrefillPlanner.demand`).

:class:`PrefillPlanner` is a component of :class:`~laser.scheduler.laser.scheduler.LaserScheduler`:
it holds only its latency model, the layer count and its constants, and every input comes as an
argument (the candidates, their order from the step's :class:`~laser.scheduler.laser.triage.Triage`,
the price of the plan so far, the budget); the scheduler's KV actions (prefix lookup, allocation,
admission) are passed in as :class:`KVActions`. Torch-free.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core.plan import Work
from ...core.pricing import PlanCost
from ...core.request import Request
from ...latency import LatencyModel
from ..base import prefill_left
from ..util import largest
from .budget import best_effort_limit, yields_to_slo
from .triage import Triage


@dataclass(frozen=True)
class Demand:
    """What the pending prefills need to meet their queue deadlines (:meth:`PrefillPlanner.demand`):
    ``share`` f (fraction of the time from now prefill must get), ``rate`` (prompt tokens/s it must
    run at), ``whole`` (seconds: the merged prefill that sets ``share``)."""

    share: float = 0.0
    rate: float = 0.0
    whole: float = 0.0


@dataclass(frozen=True)
class KVActions:
    """The scheduler's KV actions the merge takes for a candidate (:class:`~laser.scheduler.base.Scheduler`):
    ``lookup_prefix(r)``, ``allocate(r, tokens, layers) -> bool``, ``admit(r)``."""

    lookup_prefix: Callable[[Request], None]
    allocate: Callable[[Request, int, range], bool]
    admit: Callable[[Request], None]


class _SLOPrice:
    """A step's price for its SLO work while the prefill merge runs (seconds): the decode part,
    ``decode_s()`` priced when a best-effort prompt first asks, plus the SLO prefill merged,
    added in merge order. Gives a best-effort prompt its :func:`best_effort_limit` (issue 28 item 3)."""

    def __init__(self, decode_s: Callable[[], float], share: float):
        self.decode_s, self.share = decode_s, share
        self.s: float | None = None
        self.adds: list[float] = []  # SLO prefill merged before the decode part was priced

    def merge(self, cost: PlanCost, w: Work, best_effort: bool) -> None:
        """Add ``w`` to the step's ``cost``; its price is SLO work unless ``best_effort``."""
        before = cost.total
        cost.add(w)
        if best_effort:
            return
        if self.s is None:
            self.adds.append(cost.total - before)
        else:
            self.s += cost.total - before

    def limit(self, limit: float) -> float:
        """``limit`` (seconds) for a best-effort prompt: at most :func:`best_effort_limit`."""
        if self.share >= 1.0:
            return limit
        if self.s is None:
            self.s = self.decode_s()
            for a in self.adds:
                self.s += a
        return min(limit, best_effort_limit(self.s, self.share)) if self.s > 0.0 else limit


class PrefillPlanner:
    """Prefill planning of one Laser scheduler (see the module docstring)."""

    #: Pending prefills looked at when sizing the prefill time per iteration.
    max_need_candidates = 64
    #: Work merged into a step after a request with a TTFT target may delay that request's
    #: first token to at most this fraction of its target (as ``tg_margin`` for T_g): the
    #: merge plans to the model's prediction, and a step that runs 10-15 % over it must not
    #: turn a deadline planned to the last millisecond into a miss. The request itself is
    #: admitted when it meets its full deadline. With ``--jitter-margin`` the margin is divided
    #: by the latency model's measured ``timing_spread()`` (steps that run over their prediction).
    ttft_margin = 0.9
    #: Work that can wait is held back from a step that completes prefills only when merging it
    #: would cost their first tokens at least this many times what waiting costs the prompts
    #: behind it (:meth:`holds_back`): the machine time a merge saves also serves the prompts
    #: that arrive later, which the queue of now does not count -- near a tie, merge.
    merge_preference = 2.0
    #: ... and only when it would stretch the time to the step's first completed prefill beyond
    #: this factor (a first token may wait for little work: the paper's Fig. 1b merge).
    first_token_stretch = 2.0
    #: Smallest prefill chunk worth a layer call (tokens).
    min_chunk = 16
    #: Work merged after a late request's last chunk may delay its first token by this
    #: fraction of its TTFT target (its deadline is missed already; others' need not be);
    #: given-up work by the step's decode seconds when that is more (:meth:`merge`).
    late_delay_share = 0.1
    #: Floor on the prefill rate that overload triage assumes (:func:`~.budget.triage_rate`).
    min_prefill_rate = 0.1
    #: Stop looking for more prefill work after this many candidates did not fit in time...
    max_misses = 2
    #: ... or in the KV pool.
    max_alloc_misses = 8

    def __init__(self, lm: LatencyModel, num_layers: int, best_effort_deadline_s: float, max_num_seqs: int,
                 chunk_tokens: int):
        self.lm = lm
        self.num_layers = num_layers
        self.best_effort_deadline_s = best_effort_deadline_s
        self.max_num_seqs = max_num_seqs
        self.chunk_tokens = chunk_tokens  # token budget of one step (max_num_batched_tokens)

    # -- what the pending prefills need -----------------------------------------------------------
    def demand(self, cands: Sequence[Request], order: Triage, now: float, floor: float) -> Demand:
        """What the pending prefills ``cands`` need to meet their queue deadlines, taken in prefill
        order (``order``: EDF, the given-up ones behind the urgent savable ones). ``f = max_k W_k /
        (D_k - now)`` is the fraction of the time from now that prefill must get, W_k the predicted
        time of the first k savable requests' remaining prefill run as one merged pass (PlanCost: on
        a GPU their layer calls share the weight reads, so k short prompts cost about one; on a CPU
        about their sum; the first ``max_need_candidates``), D_k the k-th deadline: arrival + TTFT
        target, or the best-effort aging deadline. ``rate = max_k T_k / max(D_k - now, floor)`` is
        the prefill throughput that takes (tokens/s), T_k the prompt tokens left of every pending
        request up to the k-th, the given-up ones included (they are served, and their work comes
        first); ``floor`` (seconds, ``tg_margin * T_g``): a deadline inside the coming iteration
        counts as one iteration away (no plan serves it sooner). Requests past their deadline, and
        those given up, have no D_k (nothing can save them). ``whole`` is the W_k that sets ``f``
        (0 when ``f`` is 0): what one iteration must carry to complete those prefills at once
        (:func:`~.budget.prefill_need`). Alg. 1 on a mixed instance prices its iterations with
        ``rate``."""
        if not cands:
            return Demand()
        cands = sorted(cands, key=order.key)
        n = self.num_layers
        work = PlanCost(self.lm, n, [])
        f = rate = whole = 0.0
        tokens = 0.0
        for i, r in enumerate(cands):
            given_up = order.is_given_up(r)
            priced = i < self.max_need_candidates and not given_up
            start, left = r.num_computed_tokens, r.num_tokens - r.num_computed_tokens
            if r.in_flight:  # the chunk has run layers [0, next_layer) already
                if priced:
                    work.add(Work(r.req_id, start, r.chunk_tokens, r.next_layer, n, left == r.chunk_tokens, r.masked))
                tokens += r.chunk_tokens * (n - r.next_layer) / n
                start, left = start + r.chunk_tokens, left - r.chunk_tokens
            if left > 0:
                if priced:
                    work.add(Work(r.req_id, start, left, 0, n, True, r.masked))
                tokens += left
            ttft = r.slo.ttft if r.slo.ttft is not None else self.best_effort_deadline_s
            slack = r.arrival_time + ttft - now
            if slack > 0 and not given_up:
                rate = max(rate, tokens / max(slack, floor))
                if priced and work.works and work.total / slack > f:
                    f, whole = work.total / slack, work.total
        return Demand(f, rate, whole)

    # -- the EDF merge (§6.1) -----------------------------------------------------------------------
    def merge(self, cands: Sequence[Request], order: Triage, queued: set[int], num_running: int, now: float,
              cost: PlanCost, budget: float, kv: KVActions, later_share: Callable[[], float],
              slo_decode_s: Callable[[], float] = lambda: 0.0, best_effort_share: float = 1.0) -> list[Work]:
        """EDF merge of prefill layer-work into the step (``cands`` in ``order``; ``queued``: ids of
        the waiting ones, each of which takes one of the ``max_num_seqs - num_running`` free
        running slots), within ``budget`` seconds beyond the decode part (``cost``: the price of the
        decode works; each merged work is added to it) and without breaking any included TTFT
        deadline that was being met (:class:`_Bounds`). The most urgent prefill advances at least
        one layer when nothing else was merged. Allocates KV and admits through ``kv``.
        ``later_share()``: the share of an iteration that prefill work held back from this step
        will get when it runs (:meth:`holds_back`; asked only then).

        A best-effort prompt (no TTFT target, no job deadline) fills the step only up to
        :func:`~.budget.best_effort_limit` of ``best_effort_share`` and the step's SLO work
        (:class:`_SLOPrice`: ``slo_decode_s()``, its SLO decode works, plus the SLO prefill merged);
        no limit while the step has no SLO work (issue 28 item 3: best effort slows down)."""
        n = self.num_layers
        limit = cost.total + budget
        slo = _SLOPrice(slo_decode_s, best_effort_share)
        bounds = _Bounds(now, decode_s=cost.total)
        works: list[Work] = []
        tokens = 0
        misses = alloc_misses = 0
        firsts = 0.0  # summed ttft_weight of the prefills the step completes
        first_at = 0.0  # the step's price when it first completed one (seconds)
        held = 0.0  # summed ttft_weight of the prefills held back from the step
        deferred = 0.0  # predicted seconds (alone) of the savable work held back from the step
        ttft_margin = self.ttft_margin / self.lm.timing_spread()
        slots = self.max_num_seqs - num_running
        cands = sorted(cands, key=order.key)
        behind: list[float] = []  # summed ttft_weight of cands[i:] (built when first needed)
        for i, r in enumerate(cands):
            # a preempted request with outputs waits in the PREFILL phase: it counts too
            # (and a running chunk behind it still proceeds)
            waiting = id(r) in queued
            if waiting:
                if slots <= 0:
                    continue
                kv.lookup_prefix(r)  # fresh: an allocation above may have evicted its prefix
            best_effort = yields_to_slo(r.slo)
            w = self._candidate_work(r, cost, slo.limit(limit) if best_effort else limit, bounds,
                                     order.is_given_up(r), works, tokens)
            if w is False:
                break
            if w is None:
                misses += 1
                if misses >= self.max_misses:
                    break
                continue
            if firsts and not behind:
                behind = list(itertools.accumulate([self.ttft_weight(q) for q in reversed(cands)]))[::-1]
            if firsts and self.holds_back(r, w, cost, first_at, firsts + held, behind[i], bounds.decode_s, order,
                                          ttft_margin, now, deferred, later_share):
                held += self.ttft_weight(r)  # it waits for this step's end too
                if not order.is_given_up(r):
                    deferred += self.alone(w) + self.rest(r, w)  # it runs before those behind it
                misses += 1  # it runs in a coming step, after the first tokens of this one
                if misses >= self.max_misses:
                    break
                continue
            if not kv.allocate(r, w.context_len, range(w.layer_start, w.layer_end)):
                # Short of KV for this one: the next candidates may fit (or already hold their
                # blocks: a chunk paused behind a more urgent newcomer must not starve for it).
                alloc_misses += 1
                if alloc_misses >= self.max_alloc_misses:
                    break
                continue
            if waiting:
                kv.admit(r)
                slots -= 1
            works.append(w)
            slo.merge(cost, w, best_effort)
            tokens += w.num_tokens
            if w.sample:
                if not firsts:
                    first_at = cost.total
                firsts += self.ttft_weight(r)
            bounds.include(r, w, cost.total, ttft_margin, self.rest(r, w), self.late_delay_share, n)
        return works

    def ttft_weight(self, r: Request) -> float:
        """What a second of ``r``'s TTFT weighs when a merge trades one request's first token
        against others' (:meth:`holds_back`): 1 / its TTFT target (seconds), 1 / the best-effort
        aging deadline without one or when demoted -- a second matters as much to a 1 s chat as
        eight to an 8 s summarization."""
        if r.slo.ttft is not None and not r.demoted:
            return 1.0 / r.slo.ttft
        return 1.0 / self.best_effort_deadline_s

    def alone(self, w: Work) -> float:
        """Predicted seconds of work ``w`` run as a step of its own."""
        return PlanCost(self.lm, self.num_layers, [w]).total

    def holds_back(self, r: Request, w: Work, cost: PlanCost, first_at: float, firsts: float, behind: float,
                   decode_s: float, order: Triage, ttft_margin: float, now: float, deferred: float,
                   later_share: Callable[[], float]) -> bool:
        """Whether work ``w`` of ``r``, next in prefill order, waits for a coming step instead of
        joining this one, which already completes prefills (their first tokens come at its end,
        ``cost.total`` seconds from ``now``; the first of them was merged when the step cost
        ``first_at`` seconds; ``firsts``: their summed :meth:`ttft_weight`, and those of the
        prefills held back from it, which wait for its end too).

        Work that keeps the step within ``first_token_stretch`` x ``first_at`` joins (a newcomer
        catching up to a running chunk, PPoPP'26 Fig. 1b). Beyond that, merging delays each of the
        step's first tokens by what ``w`` adds to the step (``extra``); waiting delays ``r`` and
        every prefill after it in the order (``behind``: their summed weights, ``r``'s included)
        by what the merge saves (``w`` alone less ``extra``: the share of the layer calls it would
        ride on, and the decode part of one more step, ``decode_s`` seconds: a prompt left for the
        next step waits its decode works too). ``w`` waits when the weighted delay of merging is
        over ``merge_preference`` times the weighted delay of waiting and ``r`` can wait; given-up
        work can wait. On a GPU a few prompt tokens ride on the layer calls' weight reads
        (``extra`` is small: they join); on a CPU a layer call costs about its tokens, so a long
        prompt's chunk waits behind short prompts' first tokens -- the order that lowers the mean
        TTFT -- while short prompts of the same class still merge (each saves every prompt behind
        it the layer calls it shares).

        ``r`` can wait when its prefill still ends within ``ttft_margin`` of its TTFT target (by
        its queue deadline without one: best effort, demoted) run after this step at the share of
        each iteration it will get then: ``later_share()``, what T_g leaves beside the decode
        streams of every request now running or pending (:meth:`~.scheduler.LaserScheduler.later_prefill_share`),
        behind the savable work held back before it (``deferred`` seconds, alone). Work held back
        from a step without decode would otherwise run later beside the streams this step starts,
        squeezed into what their T_g leaves, or as one oversized step that breaks their token gaps.
        Returns False (merge) or True (wait); changes nothing.

        Case (issue 28): short chats arriving while a 2,000-token prefill ran were merged with the
        rest of its chunk -- their first token came with the long chunk's, 0.4-0.7 s against 45 ms
        alone. Layer-level chunked prefill (PPoPP'26 §6.1) pauses the long chunk at a layer
        boundary; the newcomer now runs alone, and the chunk resumes at its layer after it.
        Case (the share): eleven 16-token prompts at once, one a code stream (0.1 s TBT), the rest
        loose (5 s TTFT): with ``w`` judged alone at the whole machine, the loose prefills were held
        back from the first step (no decode yet) and later needed a 0.7 s knowing break of T_g
        beside the code stream (two gaps over its target); beside eleven decode streams T_g leaves
        prefill nothing, and they merge into the first step."""
        merged = cost.with_work(w)
        if merged <= self.first_token_stretch * first_at:
            return False
        extra = merged - cost.total
        alone = self.alone(w)
        if firsts * extra <= self.merge_preference * behind * (alone - extra + decode_s):
            return False
        if order.is_given_up(r):
            return True
        if r.slo.ttft is not None and not r.demoted:
            deadline = r.arrival_time + ttft_margin * r.slo.ttft
        else:
            deadline = order.queue_key(r)[0]
        share = later_share()
        return share > 0.0 and now + cost.total + (deferred + alone + self.rest(r, w)) / share <= deadline

    def _candidate_work(self, r: Request, cost: PlanCost, limit: float, bounds: "_Bounds", given_up: bool,
                        works: list[Work], tokens: int) -> Work | None | bool:
        """The work of ``r`` that fits this step (:meth:`fit` under the bound its kind keeps), the
        progress guarantee (one layer of a ``min_chunk`` chunk) when nothing was merged yet, None
        when it does not fit, False when the step's token budget is spent."""
        n = self.num_layers
        if r.in_flight:
            start, k, lo = r.num_computed_tokens, r.chunk_tokens, r.next_layer
        else:
            start, k, lo = r.num_computed_tokens, min(prefill_left(r), self.chunk_tokens - tokens), 0
            if k <= 0:
                return False

        def mk(k, end, r=r, start=start, lo=lo):
            return Work(r.req_id, start, k, lo, end, sample=end == n and start + k == r.num_tokens, masked=r.masked)

        if r.demoted or given_up:
            w = self.fit(cost, mk, k, lo, r.in_flight, limit, bounds.late, bounds.now)
            if w is not None and not w.sample:  # only a whole (rest of a) prompt gets the wider bound
                w = self.fit(cost, mk, k, lo, r.in_flight, limit, bounds.rest, bounds.now)
        else:
            w = self.fit(cost, mk, k, lo, r.in_flight, limit, bounds.met, bounds.now)
        if w is None and not works:
            # progress guarantee for the most urgent prefill: at least one layer
            w = mk(k if r.in_flight else min(k, self.min_chunk), lo + 1)
        return w

    def rest(self, r: Request, w: Work) -> float:
        """Predicted seconds of ``r``'s prefill left after work ``w`` of this step, run alone:
        ``w``'s chunk through the layers after ``w.layer_end``, then the prompt tokens after
        the chunk in one full pass (0 when ``w`` completes the prefill)."""
        n = self.num_layers
        t = (n - w.layer_end) * self.lm.step_layer_time((w.num_tokens,), (w.context_len,)) if w.layer_end < n else 0.0
        left = r.num_tokens - w.context_len
        if left > 0:
            t += self.lm.predict_prefill(left, context_start=w.context_len)
        elif w.layer_end < n:
            t += self.lm.head_time(1)
        return t

    def fit(self, cost: PlanCost, mk, k: int, lo: int, paused: bool, limit: float, met: list[float],
            now: float) -> Work | None:
        """Largest work that fits: a paused chunk advances as many layers as fit; a new chunk
        takes the size that moves the most prefill (tokens x layers) within the bound
        (``limit``, and the earliest deadline of ``met`` from ``now``).

        A new chunk of the whole remaining prompt through every layer is taken when it fits.
        Otherwise the candidates are the most tokens whose full pass fits, and chunks of
        ``min_chunk`` x 2^i tokens (up to ``k``) for as many layers as fit; the one with the
        most token-layers wins (ties: the cheaper, then the full pass). A layer call costs
        nearly the same for a few tokens as for a few dozen (its weights are read once), so
        on a tight bound a larger chunk through fewer layers advances the prompt more per
        second than a small one through more layers -- the chunk then resumes at its layer
        in the next iterations (layer-level chunked prefill, PPoPP'26 §6.1)."""
        n = self.num_layers
        deadline = min(met, default=math.inf) - now
        bound = min(limit, deadline)

        def fits(w):
            return cost.with_work(w) <= bound

        if fits(mk(k, n)):
            return mk(k, n)
        if paused:
            end = largest(lo + 1, n - 1, lambda e: fits(mk(k, e)))
            return None if end is None else mk(k, end)
        cands = []
        best = largest(1, k - 1, lambda x: fits(mk(x, n)))
        if best is not None and best >= min(self.min_chunk, k):
            cands.append(mk(best, n))
        x = min(self.min_chunk, k)
        while True:
            end = largest(lo + 1, n - 1, lambda e, x=x: fits(mk(x, e)))
            if end is None:
                break  # a larger chunk fits even fewer layers
            cands.append(mk(x, end))
            if x >= k:
                break
            x = min(2 * x, k)
        if not cands:
            return None
        return max(cands, key=lambda w: (w.num_tokens * (w.layer_end - w.layer_start), -cost.with_work(w),
                                         w.layer_end))


class _Bounds:
    """The deadlines merged work must keep, one list per kind of work (:meth:`PrefillPlanner.merge`):

    - ``met``: deadlines of included requests this step still meets (bound for savable work);
    - ``rest``: ... less the rest of their prefill after this step: the bound for given-up and
      demoted work, which must never make an admitted request late (its own chunk ends in time,
      but a hopeless prompt merged beside it would push the rest of its prompt past its deadline);
    - ``late``: ``rest`` with a late request's bound widened to the step's decode seconds: for
      given-up work that completes its prefill in this step (see :meth:`include`)."""

    def __init__(self, now: float, decode_s: float):
        self.now = now
        self.decode_s = decode_s  # the decode works' price (seconds)
        self.met: list[float] = []
        self.rest: list[float] = []
        self.late: list[float] = []

    def include(self, r: Request, w: Work, total: float, ttft_margin: float, rest: float,
                late_delay_share: float, num_layers: int) -> None:
        """Record the bounds of ``r``, whose work ``w`` was merged (the plan now costs ``total``
        seconds; ``rest``: seconds of its prefill after this step, :meth:`PrefillPlanner.rest`).

        Case of the late rule: a request already late (e.g. it arrived during a step that could not
        stop sooner) gets its first token with this step, so what is merged after it may delay the
        step by at most ``late_delay_share`` of its TTFT target -- a late request is served nearly as
        early as possible, and short prompts that ride the same layer calls almost free (a GPU's
        weight-bound layers) still join. Given-up work that completes its prefill in this step may
        delay it by up to the step's decode seconds: beside a decode batch, a late prompt left for
        the next step waits that step's whole decode part, so merging it costs the late one less than
        it saves the other (else late prompts go one per iteration behind a decode batch); a chunk of
        a long one that does not finish here may not."""
        now = self.now
        held = r.arrival_time + ttft_margin * r.slo.ttft if r.slo.ttft is not None else r.ttft_deadline
        for bound, extra in ((self.met, 0.0), (self.rest, rest), (self.late, rest)):
            end = now + total + extra
            if end <= held:
                bound.append(held - extra)
            elif end <= r.ttft_deadline:
                bound.append(r.ttft_deadline - extra)  # inside the margin already: later work keeps the rest
        if now + total > r.ttft_deadline and r.slo.ttft is not None and w.layer_end == num_layers and w.sample:
            self.met.append(now + total + late_delay_share * r.slo.ttft)
            self.rest.append(self.met[-1])
            self.late.append(now + total + max(late_delay_share * r.slo.ttft, self.decode_s))
