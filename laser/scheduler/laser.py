"""``laser``: layer-level chunked prefill and layer-level decode batching (PPoPP'26 §6).

Prefill (§6.1). Queue order is EDF (arrival + TTFT target). Each step the scheduler
takes prefill requests in EDF order and merges them into one batch while every
included deadline still holds under the latency model; a request whose whole prompt
would break a deadline contributes a deadline-sized chunk instead ("split the newcomer
and merge a chunk of it"). Chunks paused at a layer boundary resume *at that layer*,
so a newcomer runs alone up to the paused layer and then merges with it. On arrival,
``slack = deadline - now - predicted prefill``; if the running step's remaining time
exceeds the slack, the step stops at the next layer boundary (``stop_at``), every
in-flight chunk parks its hidden state in the intermediate cache (decode tokens run on
to the end of their layer groups: parking them would put the next step into their
token gap), and the next
``schedule`` re-plans with the newcomer in EDF position: merged if the merge meets its
deadline, otherwise first.

Decode (§6.2, Alg. 1). Decode request r has a plan (L_r, O_r): with K_r = ceil(N/L_r)
layer groups, group g (layers ((g-1)L, gL]) runs in iteration i iff
``(i - g - O_r) mod K_r == 0`` — one group per iteration, a token every K_r
iterations. T_g is the tightest TBT target present. While the predicted iteration time
exceeds T_g, the most relaxed full-depth request gets ``L = ceil(N*T_g/SLO_r)``, its
first group in the coming iteration (the paper balances layer load by the offset; a
later start stretches the gap in progress); while it is below T_g, the strictest reduced
request is restored to L = N (reverted if that breaks T_g). Plans change only on arrival,
departure, or when the measured iteration time nears T_g.

Colocated (role ``mixed``, not in the paper): prefill layer-work shares iterations with
decode layer-work and gets the time left under T_g, advancing as many layers per
iteration as fit; a prefill's chunk may thus cross several iterations layer by layer.
Alg. 1 prices the iteration with the prefill the pending deadlines need merged into its
layer calls, so decode layers are cut when prefill needs the compute they take.
"""

from __future__ import annotations

import math
import time

from ..core.pricing import PlanCost
from ..latency import LatencyModel, SimpleLatencyModel
from ..plan import StepPlan, Work
from ..request import Phase, Request
from .base import Scheduler, ceil_div, largest
from .decode_plan import DecodeMemo, DecodePlan, _LayerLoad, exec_plan, tbt_infeasible


class LaserScheduler(Scheduler):
    name = "laser"

    #: Most of an iteration that the controller's Alg. 1 price leaves to prefill on a mixed instance (fraction).
    max_prefill_share = 0.5
    #: Pending prefills looked at when sizing the prefill time per iteration.
    max_need_candidates = 64
    #: Replan when the measured iteration time exceeds this fraction of T_g.
    replan_threshold = 0.95
    #: Plan iterations to this fraction of T_g: real iterations run a few % over predictions.
    tg_margin = 0.9
    #: Smallest prefill chunk worth a layer call (tokens).
    min_chunk = 16
    #: Work merged after a late request's last chunk may delay its first token by this
    #: fraction of its TTFT target (its deadline is missed already; others' need not be).
    late_delay_share = 0.1
    #: Floor on the prefill rate that overload triage assumes (:meth:`_prefill_key`).
    min_prefill_rate = 0.1

    def __init__(self, config, num_layers, block_manager, icache, latency_model: LatencyModel | None = None,
                 clock=time.monotonic):
        super().__init__(config, num_layers, block_manager, icache, latency_model, clock)
        # Until a profile exists: a rough CPU-scale estimate (replaced by the fitted model).
        self.lm: LatencyModel = latency_model or SimpleLatencyModel(
            num_layers=num_layers, per_layer=2e-4, per_token=4e-5, per_context=2e-7
        )
        self.plans: dict[str, DecodePlan] = {}
        self.decode_memo = DecodeMemo(self.lm)  # Alg. 1 / Alg. 2 prices (this scheduler's and its increments')
        self.iteration = 0
        self.replan_needed = False
        self.num_replans = 0
        self._last_drift_replan = -(10**9)
        self.num_step_preemptions = 0
        # State of the step being executed (for the arrival-time slack check).
        self._in_step = False
        self._step_cum: list[float] | None = []  # predicted seconds to finish layers < j of the plan
        self._step_plan = StepPlan(num_layers, [])
        self._step_first = 0
        self._cur_layer = 0
        self._preempt = False
        self._step_has_prefill = False
        self._step_resumes = False  # the step resumes a paused prefill chunk
        self._step_start = 0.0
        self.last_iteration_s: float | None = None
        self.t_g = math.inf
        #: Share of an iteration's time that the last step left to prefill (1.0 without decode
        #: work): prefill advances at about this fraction of its alone speed (:meth:`_prefill_key`).
        self.prefill_rate = 1.0

    # -- events ---------------------------------------------------------------------------------
    def on_arrival(self, req: Request) -> None:
        # §6.1: stop the running step at the next layer boundary when (a) its remaining
        # time exceeds the newcomer's slack (preempt), or (b) it is running prefill work and
        # the newcomer is the only one queued (merge: the newcomer catches up to the paused
        # layer and joins it; the next schedule sizes its chunk so every deadline holds).
        if self.config.role == "mixed" and self.plans:
            self.replan_needed = True  # the prefill share Alg. 1 leaves follows the new deadline
        if not self._in_step or self.config.role == "decode":
            return
        if req.slo.ttft is not None and not req.demoted:
            now = self.clock()
            alone = self.lm.predict_prefill(req.num_tokens)
            slack = req.ttft_deadline - now - alone
            remaining = self._remaining_from(self._cur_layer)
            # (a request already hopeless even if it ran next does not disrupt the others)
            if remaining > slack and slack > -alone:
                self._preempt = True
                return
        # (b) only stops a step of fresh chunks: a chunk resumed at its paused layer is not
        # paused again for a merge (a stream of arrivals would otherwise keep it parked one
        # layer before its end, iteration after iteration, while each newcomer catches up).
        if (self._step_has_prefill and not self._step_resumes and len(self.waiting) == 1
                and self._cur_layer < self.num_layers - 1 and self._merge_pays(req)):
            self._preempt = True

    def _merge_pays(self, req: Request) -> bool:
        """Whether stopping the running step at the next layer boundary j for ``req`` to
        catch up and merge (§6.1, Fig. 1b) lowers the summed TTFT. ``req`` gains the
        prefill part of the step's rest (the rest, ``_remaining_from(j)``, less its decode
        works' layers from j on, which run to their ends either way); each of the k paused
        prefill chunks loses about ``req``'s prefill alone (its catch-up through [0, j), then
        its tokens in the merged layers from j on, which the paused chunks re-read). On a CPU
        a layer call costs about its tokens: a short newcomer costs the paused chunk little.
        On a GPU a layer call costs its weight read (tokens ride almost free): the stop
        costs the paused chunk about a whole iteration and saves the newcomer only the
        rest's prefill tokens -- it pays only against a long chunk early in the step."""
        n = self.num_layers
        j = min(max(self._cur_layer + 1, self._step_first), n)
        dec, paused = [], 0
        for w in self._step_plan.works:
            if w.req_id in self.plans:
                if w.layer_end > j:
                    dec.append(Work(w.req_id, w.token_start, w.num_tokens, max(w.layer_start, j), w.layer_end,
                                    w.sample))
            elif w.layer_end > j:
                paused += 1
        prefill_rest = self._remaining_from(j) - (PlanCost(self.lm, n, dec).total if dec else 0.0)
        return prefill_rest > paused * self.lm.predict_prefill(req.num_tokens)

    def _remaining_from(self, layer: int) -> float:
        """Predicted seconds of the executing step's layers from ``layer`` on (cumulative
        layer times, built once per step, one latency-model call per constant segment)."""
        cum = self._step_cum
        if cum is None:
            cum = self._step_cum = [0.0]
            plan = self._step_plan
            if plan.works:
                first = plan.first_layer
                cum.extend([0.0] * first)
                for a, b, _, _, t in PlanCost(self.lm, self.num_layers, plan.works).segs:
                    if b <= first or a >= plan.last_layer:
                        continue
                    for _ in range(max(a, first), b):
                        cum.append(cum[-1] + t)
        j = min(max(layer, self._step_first), len(cum) - 1)
        return cum[-1] - cum[j]

    def on_adopt(self, req: Request) -> None:
        self.replan_needed = True

    def on_preempt(self, req: Request, was_decoding: bool) -> None:
        if self.plans.pop(req.req_id, None) is not None or was_decoding:
            self.replan_needed = True

    def on_finish(self, req: Request) -> None:
        if self.plans.pop(req.req_id, None) is not None or req.phase == Phase.DECODE:
            self.replan_needed = True

    def stop_at(self, layer: int) -> bool:
        self._cur_layer = layer
        if self._preempt:
            self._preempt = False
            self.num_step_preemptions += 1
            return True
        return False

    # -- the step ---------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        # Rule: decode requests run the layer groups their (L, O) plans give for this
        # iteration (Alg. 1, replanned only on events); prefill requests fill the time left
        # under T_g (all of it on a prefill instance) in EDF order, merged while every
        # included TTFT deadline holds, each advancing as many layers as fit.
        self.preempt_for_stricter()
        n = self.num_layers
        works: list[Work] = []
        if self.config.role != "prefill":
            works = self._decode_works(now)
        budget = math.inf
        cost = PlanCost(self.lm, n, works)  # the plan's price, grown work by work
        if works:
            # Prefill gets the time left under T_g; more only when a waiting prefill's
            # deadline needs it *and* every decode request can still absorb one gap over
            # its target within its P99 allowance (the plan breaks T_g knowingly).
            decode_time = cost.total
            budget = max(0.0, self._iteration_limit(now, decode_time) - decode_time)
            need = self._prefill_need(now, decode_time)
            if need > budget and self._p99_allowance_left():
                budget = need
            self.prefill_rate = (budget / (decode_time + budget) if math.isfinite(budget) and decode_time + budget > 0
                                 else 1.0)
        elif self.config.role != "prefill" and not self.plans:
            self.prefill_rate = 1.0
        works += self._prefill_works(now, cost, budget)
        priced = bool(works)  # cost prices exactly ``works``
        if not works and self.plans and self.config.role != "prefill":
            # No decode group is due in this iteration and no prefill fits: the iteration
            # would be empty (it takes no time), so skip to the next one with a due group
            # rather than wait on it forever.
            for _ in range(max(p.groups(n) for p in self.plans.values())):
                self.iteration += 1
                works = self._decode_works(now)
                if works:
                    break
        self.relieve_deadlock(works)
        plan = StepPlan(n, works, predicted=(self.lm, cost.total) if priced else None)
        self._begin_step(plan)
        return plan

    def _begin_step(self, plan: StepPlan) -> None:
        self._step_plan = plan
        self._step_cum = None  # built on the first arrival during the step (_remaining_from)
        self._step_first = plan.first_layer if plan.works else 0
        self._cur_layer = self._step_first
        self._in_step = bool(plan.works)
        self._step_has_prefill = any(w.num_tokens > 1 or w.req_id not in self.plans for w in plan.works)
        self._step_resumes = any(w.layer_start > 0 and w.req_id not in self.plans for w in plan.works)
        self._preempt = False
        self._step_start = self.clock()

    def update(self, plan, stopped_layer, sampled, now):
        self._in_step = False
        if plan.works:
            # A stop pauses prefill work only: the decode works ran their layer groups, so
            # the decode iteration happened either way (Work.reached).
            dec = [w for w in plan.works if w.is_decode and w.req_id in self.plans]
            complete = stopped_layer == plan.last_layer
            if dec and complete:
                self.last_iteration_s = self.clock() - self._step_start
                if (
                    self.t_g < math.inf
                    and self.last_iteration_s > self.replan_threshold * self.t_g
                    and self.iteration - self._last_drift_replan >= _LayerLoad.HORIZON
                ):
                    self._last_drift_replan = self.iteration
                    self.replan_needed = True
            if complete or dec:
                self.iteration += 1
        out = super().update(plan, stopped_layer, sampled, now)
        for req in out:
            if req.num_output_tokens == 1 and req.req_id not in self.plans:
                self.replan_needed = True  # a new decode request
        return out

    # -- decode (§6.2) -------------------------------------------------------------------------
    def _decode_works(self, now: float) -> list[Work]:
        decoding = [r for r in self.running if r.phase == Phase.DECODE]
        if not decoding:
            self.t_g = math.inf
            return []
        if self.replan_needed or any(r.req_id not in self.plans for r in decoding):
            self._replan(decoding)
        n = self.num_layers
        due = []
        for r in decoding:
            p = self.plans[r.req_id]
            if p.layers >= n or r.next_layer % p.layers:
                due.append(r)  # full depth, or finishing a group cut short by a preemption
                continue
            g = r.next_layer // p.layers + 1
            if (self.iteration - g - p.offset) % p.groups(n) == 0:
                due.append(r)
        # KV for the new token (only those starting a token need a slot)
        need = [r for r in due if r.next_layer == 0]
        preempted = self.num_preemptions
        ok = set(id(r) for r in self.preempt_for_decode(sorted(need, key=self.queue_key)))
        preempted = self.num_preemptions != preempted  # (else every due request still runs)
        works = []
        for r in due:
            if r.next_layer == 0 and id(r) not in ok:
                continue
            if preempted and r not in self.running:
                continue
            p = self.plans.get(r.req_id)
            if p is None:
                continue
            end = n if p.layers >= n else min(n, (r.next_layer // p.layers + 1) * p.layers)
            works.append(Work(r.req_id, r.num_tokens - 1, 1, r.next_layer, end, sample=end == n))
        return works

    def _replan(self, decoding: list[Request]) -> None:
        """Alg. 1: relax the most relaxed / restore the strictest, against T_g."""
        self.replan_needed = False
        self.num_replans += 1
        if self.config.role == "mixed":
            # Alg. 1 prices each iteration with the prefill the pending deadlines need merged
            # into its layer calls, to tg_margin * T_g: a decode token costs what it adds to
            # them (on a GPU, a prefill token's compute once the call is compute-bound, where
            # priced alone the decode batch is weight-bound and no plan was ever reduced)
            _, rate = self._prefill_demand(self.clock())
            self.plans, self.t_g, _ = exec_plan(self.lm, self.num_layers, self.iteration, decoding, self.plans,
                                                self.tg_margin, self.decode_memo, rate,
                                                self.config.max_num_batched_tokens)
        else:
            self.plans, self.t_g, _ = exec_plan(self.lm, self.num_layers, self.iteration, decoding, self.plans,
                                                self.plan_target_factor(), self.decode_memo)
        for r in decoding:
            if not r.tbt_infeasible and tbt_infeasible(self.lm, r, self.decode_memo):
                r.tbt_infeasible = True  # served as well as possible; metrics say so

    def plan_target_factor(self) -> float:
        """Fraction of T_g that the controller's Alg. 1 prices (``instance/state.py``) plan
        decode iterations to: ``tg_margin``, less the share of each iteration that the pending
        prefills need to meet their deadlines on a mixed instance
        (:meth:`_prefill_share_needed`, at most ``max_prefill_share``). The scheduler's own
        replans on a mixed instance price the merged iteration instead (:meth:`_replan`)."""
        if self.config.role != "mixed":
            return self.tg_margin
        return self.tg_margin * (1.0 - min(self.max_prefill_share, self._prefill_share_needed(self.clock())))

    def _prefill_share_needed(self, now: float) -> float:
        """Fraction f of the time from now that prefill must get for every pending prefill to
        meet its queue deadline (:meth:`_prefill_demand`'s first half)."""
        return self._prefill_demand(now)[0]

    def _prefill_demand(self, now: float) -> tuple[float, float]:
        """What the pending prefills need to meet their queue deadlines, in prefill order
        (:meth:`_prefill_key`: EDF, the given-up ones behind the urgent savable ones): ``(f,
        rate)``. ``f = max_k W_k / (D_k - now)`` is the fraction of the time from now that
        prefill must get, W_k the predicted time of the first k savable requests' remaining
        prefill run as one merged pass (PlanCost: on a GPU their layer calls share the weight
        reads, so k short prompts cost about one; on a CPU about their sum; the first
        ``max_need_candidates``), D_k the k-th deadline: arrival + TTFT target, or the
        best-effort aging deadline. ``rate = max_k T_k / max(D_k - now, tg_margin * T_g)`` is
        the prefill throughput that takes (tokens/s), T_k the prompt tokens left of every
        pending request up to the k-th, the given-up ones included (they are served, and
        their work comes first), over all of them; a deadline inside the coming iteration
        counts as one iteration away (no plan serves it sooner). Requests past their deadline,
        and those given up under overload, have no D_k (nothing can save them). ``(0, 0)``
        with nothing pending. Alg. 1 on a mixed instance prices its iterations with ``rate``
        (:meth:`_replan`)."""
        cands = [r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting)
        if self.config.role == "decode":
            cands = [r for r in cands if r.output_token_ids]
        if not cands:
            return 0.0, 0.0
        key = self._prefill_key(now)
        cands.sort(key=key)
        n = self.num_layers
        work = PlanCost(self.lm, n, [])
        f = rate = 0.0
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
                if priced and work.works:
                    f = max(f, work.total / slack)
        return f, rate

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
        than the newcomer (a late started request gives up no one: nothing would save it). A
        given-up request is still served: behind the savable prefills that need the time,
        ahead of those whose deadlines hold with all given-up work run first; its record says
        it missed. Returns the sort key function (tier 0: savable and urgent, 1: given up, 2:
        savable with room; then ``queue_key``)."""
        cands = sorted([r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting),
                       key=self.queue_key)
        hopeless: set[int] = set()
        rate = max(self.prefill_rate, self.min_prefill_rate)
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
            while room > 0 and ends[room - 1] <= kept[room - 1][0].ttft_deadline:
                room -= 1
        tier = {id(q): (0 if i < room else 2) for i, (q, _) in enumerate(kept)}

        def key(r: Request):
            return (1 if id(r) in hopeless else tier.get(id(r), 2), *self.queue_key(r))
        return key

    @staticmethod
    def _may_give_up(r: Request) -> bool:
        """Whether Moore-Hodgson's rule (:meth:`_prefill_key`) may put ``r`` behind the others:
        a prefill with a TTFT target that has not started (no work sunk into it), neither
        demoted nor boosted."""
        return (r.slo.ttft is not None and not r.demoted and not r.boosted and r.num_computed_tokens == 0
                and not r.in_flight)

    def _prefill_need(self, now: float, decode_time: float) -> float:
        """Seconds of prefill per iteration the pending prefills need (an iteration of
        ``decode_time`` seconds of decode work plus p of prefill gives prefill the share
        p / (decode_time + p) >= f, :meth:`_prefill_share_needed`). 0 when ``f >= 1``: a
        prefill that misses its deadline even with the whole machine from now on is not saved
        by breaking the decode requests' T_g (an unbounded iteration that spent their P99
        allowance for nobody)."""
        f = self._prefill_share_needed(now)
        if f <= 0.0 or f >= 1.0:
            return 0.0
        return decode_time * f / (1.0 - f)

    def _iteration_limit(self, now: float, decode_time: float) -> float:
        """Seconds this iteration may take so that every decoding request still gets its
        token within its TBT target: ``tg_margin * T_g``, or less when a request's current
        token gap is already partly spent -- request r with ``g`` iterations left before its
        token (waiting for its next group's turn in Alg. 1's cycle, then its remaining groups) and ``s`` seconds left of its gap may take ``(s - (1 -
        tg_margin) * TBT_r) / g`` (its TBT slack spread over its remaining iterations).
        This matters when Alg. 1 changes a plan mid-token (e.g. T_g rises when the strictest
        request leaves: the reduced request's last group would otherwise run in an iteration
        sized to the new, looser T_g). Requests without a TBT target, without a token yet,
        with a target out of reach even alone (``tbt_infeasible``), or whose gap is lost
        already (its share, even without the margin, is below ``decode_time``, this
        iteration's decode seconds) do not limit it; one that makes it only without the
        margin gets an iteration of decode work alone."""
        limit = self.t_g * self.tg_margin
        n = self.num_layers
        for r in self.running:
            tbt = r.slo.tbt
            if r.phase != Phase.DECODE or tbt is None or r.tbt_infeasible or not r.token_times:
                continue
            p = self.plans.get(r.req_id)
            if p is None:
                continue
            if p.layers >= n:
                left = 1
            else:  # iterations until its next group runs (Alg. 1's cycle), then the rest of the groups
                k, g = p.groups(n), r.next_layer // p.layers + 1
                left = (0 if r.next_layer % p.layers else (g + p.offset - self.iteration) % k) + k - g + 1
            own = (r.token_times[-1] + tbt * self.tg_margin - now) / left
            if own >= decode_time:
                limit = min(limit, own)
            elif (r.token_times[-1] + tbt - now) / left >= decode_time:
                limit = min(limit, decode_time)  # only without prefill (and the margin) it still makes it
            # else its gap is lost already: holding prefill back saves nobody
        return limit

    def _p99_allowance_left(self) -> bool:
        """Whether every decoding request may take one more token gap over its TBT target and
        still meet its P99 TBT (a request expecting g gaps tolerates floor((g - 1) / 100)
        misses; g from ``max_tokens``, an upper bound)."""
        for r in self.running:
            if r.phase != Phase.DECODE or r.slo.tbt is None:
                continue
            if r.num_tbt_misses + 1 > (r.sampling_params.max_tokens - 2) // 100:
                return False
        return True

    def predict_decode(self, decoding: list[Request], plans: dict[str, DecodePlan] | None = None) -> float:
        """Worst predicted decode-only iteration time over the next iterations under ``plans``."""
        plans = plans if plans is not None else self.plans
        return _LayerLoad(self.lm, self.num_layers, self.iteration, decoding, plans, self.decode_memo).predict()

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
        cands = sorted([r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting),
                       key=self._prefill_key(now))
        if self.config.role == "decode":
            # a decode instance prefills only to recompute requests it preempted
            cands = [r for r in cands if r.output_token_ids]
        works: list[Work] = []
        met: list[float] = []  # deadlines of included requests this step still meets
        tokens = 0
        misses = alloc_misses = 0
        queued = {id(r) for r in self.waiting}  # not running yet: each one takes a running slot
        for r in cands:
            # a preempted request with outputs waits in the PREFILL phase: it counts too
            # (and a running chunk behind it still proceeds)
            if id(r) in queued and len(self.running) >= self.config.max_num_seqs:
                continue
            if r.in_flight:
                start, k, lo = r.num_computed_tokens, r.chunk_tokens, r.next_layer
            else:
                start, k, lo = r.num_computed_tokens, min(self.prefill_remaining(r), self.config.max_num_batched_tokens - tokens), 0
                if k <= 0:
                    break

            def mk(k, end, r=r, start=start, lo=lo):
                return Work(r.req_id, start, k, lo, end, sample=end == n and start + k == r.num_tokens)

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
            if now + cost.total <= r.ttft_deadline:
                met.append(r.ttft_deadline)
            elif r.slo.ttft is not None and w.layer_end == n and w.sample:
                # Already late (e.g. it arrived during a step that could not stop sooner):
                # its first token comes with this step, so what is merged after it may delay
                # the step by at most ``late_delay_share`` of its TTFT target -- a late
                # request is served nearly as early as possible, and short prompts that ride
                # the same layer calls almost free (a GPU's weight-bound layers) still join.
                met.append(now + cost.total + self.late_delay_share * r.slo.ttft)
        return works

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
