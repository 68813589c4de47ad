"""Laser's prefill side (PPoPP'26 §6.1): EDF merge of layer-level prefill work under the TTFT
deadlines, the overload triage (Moore-Hodgson), and what the pending prefills need of each
iteration on a mixed instance (the share Alg. 1 leaves them, the rate it prices in).

:class:`LaserPrefill` is a mixin of :class:`~laser.scheduler.laser.scheduler.LaserScheduler` (which owns
the state it reads: the running and waiting queues, the latency model ``lm``, ``prefill_rate``,
``t_g``, ``_given_up``); it is not a scheduler on its own. Torch-free.
"""

from __future__ import annotations

import math

from ...core.pricing import PlanCost
from ...core.plan import Work
from ...core.request import Phase, Request
from ..base import largest


class LaserPrefill:
    """Prefill methods of :class:`~laser.scheduler.laser.scheduler.LaserScheduler` (see the module docstring)."""

    #: Pending prefills looked at when sizing the prefill time per iteration.
    max_need_candidates = 64
    #: Work merged into a step after a request with a TTFT target may delay that request's
    #: first token to at most this fraction of its target (as ``tg_margin`` for T_g): the
    #: merge plans to the model's prediction, and a step that runs 10-15 % over it must not
    #: turn a deadline planned to the last millisecond into a miss. The request itself is
    #: admitted when it meets its full deadline. With ``--jitter-margin`` the margin is divided
    #: by the latency model's measured ``timing_spread()`` (steps that run over their prediction).
    ttft_margin = 0.9
    #: Smallest prefill chunk worth a layer call (tokens).
    min_chunk = 16
    #: Work merged after a late request's last chunk may delay its first token by this
    #: fraction of its TTFT target (its deadline is missed already; others' need not be);
    #: given-up work by the step's decode seconds when that is more (:meth:`_prefill_works`).
    late_delay_share = 0.1
    #: Floor on the prefill rate that overload triage assumes (:meth:`_prefill_key`).
    min_prefill_rate = 0.1

    def _prefill_share_needed(self, now: float) -> float:
        """Fraction f of the time from now that prefill must get for every pending prefill to
        meet its queue deadline (:meth:`_prefill_demand`'s first half)."""
        return self._prefill_demand(now)[0]

    def _prefill_demand(self, now: float) -> tuple[float, float, float]:
        """What the pending prefills need to meet their queue deadlines, in prefill order
        (:meth:`_prefill_key`: EDF, the given-up ones behind the urgent savable ones): ``(f,
        rate, whole)``. ``f = max_k W_k / (D_k - now)`` is the fraction of the time from now that
        prefill must get, W_k the predicted time of the first k savable requests' remaining
        prefill run as one merged pass (PlanCost: on a GPU their layer calls share the weight
        reads, so k short prompts cost about one; on a CPU about their sum; the first
        ``max_need_candidates``), D_k the k-th deadline: arrival + TTFT target, or the
        best-effort aging deadline. ``rate = max_k T_k / max(D_k - now, tg_margin * T_g)`` is
        the prefill throughput that takes (tokens/s), T_k the prompt tokens left of every
        pending request up to the k-th, the given-up ones included (they are served, and
        their work comes first), over all of them; a deadline inside the coming iteration
        counts as one iteration away (no plan serves it sooner). Requests past their deadline,
        and those given up under overload, have no D_k (nothing can save them). ``(0, 0, 0)``
        with nothing pending. Alg. 1 on a mixed instance prices its iterations with ``rate``
        (:meth:`_replan`). Returns ``(f, rate, whole)``: ``whole`` is the W_k that sets ``f``
        (seconds; 0 when ``f`` is 0) -- what one iteration must carry to complete those
        prefills at once (:meth:`_prefill_need`)."""
        cands = [r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting)
        if self.config.role == "decode":
            cands = [r for r in cands if r.output_token_ids]
        if not cands:
            return 0.0, 0.0, 0.0
        key = self._prefill_key(now)
        cands.sort(key=key)
        n = self.num_layers
        work = PlanCost(self.lm, n, [])
        f = rate = whole = 0.0
        tokens = 0.0
        # (a deadline within the coming iteration is not served sooner by any plan: the rate
        # looks at least one iteration ahead)
        floor = self.tg_margin * self.t_g if math.isfinite(self.t_g) else 0.0
        for i, r in enumerate(cands):
            given_up = key(r)[0] == 1
            priced = i < self.max_need_candidates and not given_up
            start, left = r.num_computed_tokens, r.num_tokens - r.num_computed_tokens
            if r.in_flight:  # the chunk has run layers [0, next_layer) already
                if priced:
                    work.add(Work(r.req_id, start, r.chunk_tokens, r.next_layer, n, left == r.chunk_tokens))
                tokens += r.chunk_tokens * (n - r.next_layer) / n
                start, left = start + r.chunk_tokens, left - r.chunk_tokens
            if left > 0:
                if priced:
                    work.add(Work(r.req_id, start, left, 0, n, True))
                tokens += left
            ttft = r.slo.ttft if r.slo.ttft is not None else self.config.best_effort_deadline_s
            slack = r.arrival_time + ttft - now
            if slack > 0 and not given_up:
                rate = max(rate, tokens / max(slack, floor))
                if priced and work.works and work.total / slack > f:
                    f, whole = work.total / slack, work.total
        return f, rate, whole

    def _prefill_key(self, now: float):
        """Prefill order: EDF (``queue_key``), except for the prefills given up under overload,
        which go behind every other one (EDF's domino effect: serving the hopeless first makes
        the savable late too). They are chosen by Moore-Hodgson's rule, which minimises the
        number of late jobs on one machine (Moore, "An n job, one machine sequencing algorithm
        for minimizing the number of late jobs", Management Science 1968) -- the number of
        requests meeting their TTFT is what SLO attainment and goodput count: walk the
        prefills in EDF order, adding each to a set run from now as one merged pass (PlanCost:
        on a GPU their layer calls share the weight reads) at ``prefill_rate``, the share of
        each iteration that the last step left to prefill beside its decode work (at least
        ``min_prefill_rate``; the pass alone ignored the decodes and kept prompts that then
        missed by a few %); whenever the request just added, not started, would miss its TTFT
        target, give up the *longest* prefill of the set that may be given up (not started,
        with a TTFT target, neither demoted nor boosted), again until it makes it or is itself
        given up -- often a long prompt ahead that would make several short ones late, rather
        than the newcomer (a late started request gives up no one: nothing would save it; one
        that misses even run alone from now is given up itself). A given-up request is still
        served: behind the savable prefills that need the time, ahead of those whose deadlines hold with all given-up work run first; its record says
        it missed. Returns the sort key function (tier 0: savable and urgent, 1: given up, 2:
        savable with room; then ``queue_key``)."""
        cands = sorted([r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting),
                       key=self.queue_key)
        hopeless: set[int] = set()
        rate = max(self.prefill_rate, self.min_prefill_rate)
        if self.plans and math.isfinite(self.t_g) and self._p99_allowance_left():
            # a deadline may break T_g knowingly (schedule(): one iteration that completes the
            # urgent prefill); judged at the share T_g leaves, a 190-token chat beside one code
            # stream was given up and missed, where the break met both SLOs
            rate = 1.0
        kept: list[tuple[Request, Work]] = []  # the savable prefills so far, in EDF order
        ahead = PlanCost(self.lm, self.num_layers, [])  # ``kept``, merged in one pass
        for r in cands[: self.max_need_candidates]:
            w = Work(r.req_id, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens, 0, self.num_layers, True)
            if w.num_tokens <= 0:
                continue
            def late() -> bool:
                return (r.slo.ttft is not None and not r.demoted
                        and now + ahead.with_work(w) / rate > r.ttft_deadline)
            if not late() or not self._may_give_up(r):
                # on time, or started (its work is sunk, and giving up others would not save it)
                ahead.add(w)
                kept.append((r, w))
                continue
            while True:  # give up the longest until r makes it (or r itself is the longest)
                drop = max([qx for qx in kept if self._may_give_up(qx[0])] + [(r, w)],
                           key=lambda qx: (qx[1].num_tokens, self.queue_key(qx[0])))
                hopeless.add(id(drop[0]))
                self._given_up.add(drop[0].req_id)
                drop[0].given_up = True
                if drop[0] is r:
                    break
                kept = [qx for qx in kept if qx[0] is not drop[0]]
                ahead = PlanCost(self.lm, self.num_layers, [x for _, x in kept])
                if not late():
                    ahead.add(w)
                    kept.append((r, w))
                    break
        # The given-up prefills wait only behind the savable ones that need the time: the
        # savable ones from index ``room`` on still make their deadlines with all given-up
        # work run before them, so they go after it (a long prompt with a far deadline must
        # not keep a late short one waiting for seconds).
        room = len(kept)
        if hopeless and kept:
            given = [Work(q.req_id, q.num_computed_tokens, q.num_tokens - q.num_computed_tokens, 0, self.num_layers,
                          True) for q in cands if id(q) in hopeless]
            pre = PlanCost(self.lm, self.num_layers, given)
            ends = []
            for _, x in kept:
                pre.add(x)
                ends.append(now + pre.total / rate)
            # (a best-effort request's deadline is its aging deadline, as in EDF: once that is
            # near, it needs the time too -- else a stream of given-up prompts starves it)
            while room > 0 and ends[room - 1] <= self.queue_key(kept[room - 1][0])[0]:
                room -= 1
        tier = {id(q): (0 if i < room else 2) for i, (q, _) in enumerate(kept)}

        def key(r: Request):
            return (1 if id(r) in hopeless else tier.get(id(r), 2), *self.queue_key(r))
        return key

    def _may_give_up(self, r: Request) -> bool:
        """Whether Moore-Hodgson's rule (:meth:`_prefill_key`) may put ``r`` behind the others:
        a prefill with a TTFT target that has not started (holds no KV: no work sunk into it; a
        cached prefix it would attach is not its work), or that was
        given up before -- a piece of it merged into a step with room since must not promote
        it ahead of the savable ones it was given up for --, neither demoted nor boosted."""
        return (r.slo.ttft is not None and not r.demoted and not r.boosted
                and ((not self.bm.has(r.req_id) and not r.in_flight) or r.req_id in self._given_up))

    def _prefill_need(self, now: float, decode_time: float) -> tuple[float, float]:
        """Seconds of prefill per iteration the pending prefills need (an iteration of
        ``decode_time`` seconds of decode work plus p of prefill gives prefill the share
        p / (decode_time + p) >= f, :meth:`_prefill_share_needed`). 0 when ``f >= 1``: a
        prefill that misses its deadline even with the whole machine from now on is not saved
        by breaking the decode requests' T_g (an unbounded iteration that spent their P99
        allowance for nobody). Returns ``(need, whole)``: ``whole`` (seconds) is the prefill
        that completes the requests setting ``f`` in one iteration (:meth:`_prefill_demand`),
        what a knowing break of T_g gives (:meth:`schedule`)."""
        f, _, whole = self._prefill_demand(now)
        if f <= 0.0 or f >= 1.0:
            return 0.0, 0.0
        return decode_time * f / (1.0 - f), whole

    # -- prefill (§6.1) ---------------------------------------------------------------------------
    #: Stop looking for more prefill work after this many candidates did not fit in time...
    max_misses = 2
    #: ... or in the KV pool.
    max_alloc_misses = 8

    def _prefill_works(self, now: float, cost: PlanCost, budget: float) -> list[Work]:
        """EDF merge of prefill layer-work into the step, within ``budget`` seconds beyond the
        decode part (``cost``: the price of the decode works; each merged work is added to it)
        and without breaking any included TTFT deadline that was being met."""
        n = self.num_layers
        limit = cost.total + budget
        decode_s = cost.total  # the decode works' price (the prefill works are added below)
        key = self._prefill_key(now)
        cands = sorted([r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting), key=key)
        if self.config.role == "decode":
            # a decode instance prefills only to recompute requests it preempted
            cands = [r for r in cands if r.output_token_ids]
        works: list[Work] = []
        met: list[float] = []  # deadlines of included requests this step still meets
        # ... less the rest of their prefill after this step: the bound for given-up and demoted
        # work, which must never make an admitted request late (its own chunk ends in time, but a
        # hopeless prompt merged beside it would push the rest of its prompt past its deadline)
        met_rest: list[float] = []
        # ... with a late request's bound widened to the step's decode seconds: for given-up work
        # that completes its prefill in this step (see the late rule below)
        met_late: list[float] = []
        tokens = 0
        misses = alloc_misses = 0
        ttft_margin = self.ttft_margin / self.lm.timing_spread()
        queued = {id(r) for r in self.waiting}  # not running yet: each one takes a running slot
        for r in cands:
            # a preempted request with outputs waits in the PREFILL phase: it counts too
            # (and a running chunk behind it still proceeds)
            if id(r) in queued:
                if len(self.running) >= self.config.max_num_seqs:
                    continue
                self.lookup_prefix(r)  # fresh: an allocation above may have evicted its prefix
            if r.in_flight:
                start, k, lo = r.num_computed_tokens, r.chunk_tokens, r.next_layer
            else:
                start, k, lo = r.num_computed_tokens, min(self.prefill_remaining(r), self.config.max_num_batched_tokens - tokens), 0
                if k <= 0:
                    break

            def mk(k, end, r=r, start=start, lo=lo):
                return Work(r.req_id, start, k, lo, end, sample=end == n and start + k == r.num_tokens)

            if r.demoted or key(r)[0] == 1:
                w = self._fit(cost, mk, k, lo, r.in_flight, limit, met_late, now)
                if w is not None and not w.sample:  # only a whole (rest of a) prompt gets the wider bound
                    w = self._fit(cost, mk, k, lo, r.in_flight, limit, met_rest, now)
            else:
                w = self._fit(cost, mk, k, lo, r.in_flight, limit, met, now)
            if w is None:
                if works:
                    misses += 1
                    if misses >= self.max_misses:
                        break
                    continue
                # progress guarantee for the most urgent prefill: at least one layer
                w = mk(k if r.in_flight else min(k, self.min_chunk), lo + 1)
            if not self.try_allocate(r, w.context_len, range(w.layer_start, w.layer_end)):
                # Short of KV for this one: the next candidates may fit (or already hold their
                # blocks: a chunk paused behind a more urgent newcomer must not starve for it).
                alloc_misses += 1
                if alloc_misses >= self.max_alloc_misses:
                    break
                continue
            if r.phase == Phase.WAITING or r in self.waiting:
                self.admit(r)
            works.append(w)
            cost.add(w)
            tokens += w.num_tokens
            held = r.arrival_time + ttft_margin * r.slo.ttft if r.slo.ttft is not None else r.ttft_deadline
            rest = self._prefill_rest(r, w)
            for bound, extra in ((met, 0.0), (met_rest, rest), (met_late, rest)):
                end = now + cost.total + extra
                if end <= held:
                    bound.append(held - extra)
                elif end <= r.ttft_deadline:
                    bound.append(r.ttft_deadline - extra)  # inside the margin already: later work keeps the rest
            if now + cost.total > r.ttft_deadline and r.slo.ttft is not None and w.layer_end == n and w.sample:
                # Already late (e.g. it arrived during a step that could not stop sooner):
                # its first token comes with this step, so what is merged after it may delay
                # the step by at most ``late_delay_share`` of its TTFT target -- a late
                # request is served nearly as early as possible, and short prompts that ride
                # the same layer calls almost free (a GPU's weight-bound layers) still join.
                # Given-up work that completes its prefill in this step may delay it by up to
                # the step's decode seconds: beside a decode batch, a late prompt left for the
                # next step waits that step's whole decode part, so merging it costs the late
                # one less than it saves the other (else late prompts go one per iteration
                # behind a decode batch); a chunk of a long one that does not finish here may not.
                met.append(now + cost.total + self.late_delay_share * r.slo.ttft)
                met_rest.append(met[-1])
                met_late.append(now + cost.total + max(self.late_delay_share * r.slo.ttft, decode_s))
        return works

    def _prefill_rest(self, r: Request, w: Work) -> float:
        """Predicted seconds of ``r``'s prefill left after work ``w`` of this step, run alone:
        ``w``'s chunk through the layers after ``w.layer_end``, then the prompt tokens after
        the chunk in one full pass (0 when ``w`` completes the prefill)."""
        n = self.num_layers
        t = (n - w.layer_end) * self.lm.layer_time((w.num_tokens,), (w.context_len,)) if w.layer_end < n else 0.0
        left = r.num_tokens - w.context_len
        if left > 0:
            t += self.lm.predict_prefill(left, context_start=w.context_len)
        elif w.layer_end < n:
            t += self.lm.head_time(1)
        return t

    def _fit(self, cost: "PlanCost", mk, k: int, lo: int, paused: bool, limit, met, now) -> Work | None:
        """Largest work that fits: a paused chunk advances as many layers as fit; a new chunk
        takes the size that moves the most prefill (tokens x layers) within the bound.

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
