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

from ...core.pricing import PlanCost
from ...latency import LatencyModel, SimpleLatencyModel
from ...core.plan import StepPlan, Work
from ...core.request import Phase, Request
from ..base import Scheduler
from .decode import DecodeMemo, DecodePlan, _LayerLoad, exec_plan, tbt_infeasible
from .prefill import LaserPrefill


class LaserScheduler(LaserPrefill, Scheduler):
    """Layer-level chunked prefill (§6.1, :class:`~.laser_prefill.LaserPrefill`) and
    layer-level decode batching (§6.2, Alg. 1) on one instance; see the module docstring."""

    name = "laser"

    #: Most of an iteration that the controller's Alg. 1 price leaves to prefill on a mixed instance (fraction).
    max_prefill_share = 0.5
    #: Replan when the measured iteration time exceeds this fraction of T_g.
    replan_threshold = 0.95
    #: Plan iterations to this fraction of T_g: real iterations run a few % over predictions.
    tg_margin = 0.9

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
        self._given_up: set[str] = set()  # ids of prefills Moore-Hodgson's rule gave up (until they finish)
        self._p99_lost: set[str] = set()  # ids of decoding requests seen with their P99 TBT broken
        self.replan_needed = False
        self.num_replans = 0
        self.num_steady_steps = 0  # steps built by _steady_decode_plan
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
            alone = self.prefill_alone(req)
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
        return prefill_rest > paused * self.prefill_alone(req)

    def prefill_alone(self, req: Request) -> float:
        """Predicted seconds of ``req``'s prefill left (after its cached or computed prefix), run alone."""
        return self.lm.predict_prefill(self.prefill_remaining(req), context_start=req.num_computed_tokens)

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
        self._given_up.discard(req.req_id)
        self._p99_lost.discard(req.req_id)
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
        if self.steady_decode:
            plan = self._steady_decode_plan(now)
            if plan is not None:
                return plan
        self.refresh_prefixes()  # the queue is priced by the tokens left after cached prefixes
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
            need, whole = self._prefill_need(now, decode_time)
            if need > budget and self._p99_allowance_left():
                # one knowing break: the prefills up to the deadline that needs it complete in
                # this iteration (the gap over target is spent once; at T_g's pace after it,
                # the share ``need`` alone left them late)
                budget = max(need, whole)
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

    #: Build a decode instance's steady steps directly (:meth:`_steady_decode_plan`); tests
    #: switch it off to check that the generic path makes the same plans.
    steady_decode = True

    def _steady_decode_plan(self, now: float) -> StepPlan | None:
        """The plan :meth:`schedule` makes on a decode instance in steady decode (most of its
        steps): nothing waiting, no replan due, every running request at full depth (Alg. 1's
        L = N) from layer 0, a free block for each one whose new token starts a block. The
        generic path then preempts nobody, allocates those blocks in queue order, runs one token
        of every request through every layer in running order, prices one segment (:class:`PlanCost`)
        and sets ``prefill_rate``; this does the same, with the same float operations in the same
        order. None, having changed nothing, when the state is not steady."""
        if self.config.role != "decode" or self.waiting or self.replan_needed or not self.running:
            return None
        n, plans, covers, decode = self.num_layers, self.plans, self.bm.covers, Phase.DECODE
        grow = []  # requests whose new token starts a block
        works, ctx = [], []
        for r in self.running:
            p = plans.get(r.req_id)
            if p is None or p.layers < n or r.phase is not decode or r.next_layer:
                return None
            rid, c = r.req_id, r.num_tokens
            if not covers(rid, c):
                if not covers(rid, c - 1):
                    return None  # not one uniform block short: the generic path decides
                grow.append(r)
            works.append(Work(rid, c - 1, 1, 0, n, True))
            ctx.append(c)
        if len(grow) > self.bm.min_free():
            return None  # someone would be preempted
        for r in sorted(grow, key=self.queue_key):  # preempt_for_decode's order (a stable sort)
            if not self.try_allocate(r, r.num_tokens):
                raise AssertionError(f"{r.req_id}: a block the pool had room for was refused")
        b = len(works)
        lm = self.lm
        # PlanCost's sum for one segment of n layers (its 0.0 + n*t is n*t: prices are >= 0)
        decode_time = n * lm.layer_time((1,) * b, tuple(ctx)) + lm.embed_time(b) + lm.head_time(b)
        budget = max(0.0, self._iteration_limit(now, decode_time) - decode_time)
        self.prefill_rate = (budget / (decode_time + budget) if math.isfinite(budget) and decode_time + budget > 0
                             else 1.0)
        plan = StepPlan(n, works, predicted=(lm, decode_time))
        self._begin_step(plan)
        self.num_steady_steps += 1
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
            plans = self.plans
            dec = any(w.is_decode and w.req_id in plans for w in plan.works)
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
            elif req.num_tbt_misses and req.req_id not in self._p99_lost and req.p99_tbt_broken:
                self._p99_lost.add(req.req_id)
                self.replan_needed = True  # it has nothing left to keep: T_g may be released
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
        """Alg. 1: relax the most relaxed / restore the strictest, against T_g.

        When no decoding request has an SLO left to keep (:meth:`_nothing_to_keep`), T_g is
        inf and every request runs at full depth: Alg. 1 would cut iterations (and prefill
        time) for targets nobody can meet any more (our rule; the paper is silent)."""
        self.replan_needed = False
        self.num_replans += 1
        if self._nothing_to_keep(decoding):
            self.plans, self.t_g = {r.req_id: DecodePlan(self.num_layers, 0) for r in decoding}, math.inf
            return
        if self.config.role == "mixed":
            # Alg. 1 prices each iteration with the prefill the pending deadlines need merged
            # into its layer calls, to tg_margin * T_g: a decode token costs what it adds to
            # them (on a GPU, a prefill token's compute once the call is compute-bound, where
            # priced alone the decode batch is weight-bound and no plan was ever reduced)
            _, rate, _ = self._prefill_demand(self.clock())
            self.plans, self.t_g, _ = exec_plan(self.lm, self.num_layers, self.iteration, decoding, self.plans,
                                                self.planning_margin(), self.decode_memo, rate,
                                                self.config.max_num_batched_tokens)
        else:
            self.plans, self.t_g, _ = exec_plan(self.lm, self.num_layers, self.iteration, decoding, self.plans,
                                                self.plan_target_factor(), self.decode_memo)
        for r in decoding:
            if not r.tbt_infeasible and tbt_infeasible(self.lm, r, self.decode_memo):
                r.tbt_infeasible = True  # served as well as possible; metrics say so

    @staticmethod
    def _nothing_to_keep(decoding: list[Request]) -> bool:
        """Whether every decoding request with a TBT target has lost its SLO already: its first
        token missed its TTFT target, its P99 TBT is broken, or its TBT target is out of reach
        even alone (``tbt_infeasible``). A request's SLO is met only with both targets
        (:mod:`laser.core.metrics`), so holding T_g for these saves no SLO; it only slows everyone
        (the offline case of issue 16: a batch submitted at once misses every first token)."""
        return all(r.slo.tbt is None or r.ttft_missed or r.p99_tbt_broken or r.tbt_infeasible for r in decoding)

    def planning_margin(self) -> float:
        """Fraction of T_g that iterations are planned to: ``tg_margin`` over the latency model's
        measured :meth:`~laser.latency.LatencyModel.timing_spread` (1.0 unless ``--jitter-margin``), so
        that a step running over its prediction in the worst few percent of steps still fits
        T_g -- for Alg. 1's decode plans as for the prefill budget (:meth:`_iteration_limit`)."""
        return self.tg_margin / self.lm.timing_spread()

    def plan_target_factor(self) -> float:
        """Fraction of T_g that the controller's Alg. 1 prices (``instance/state.py``) plan
        decode iterations to: :meth:`planning_margin`, less the share of each iteration that the pending
        prefills need to meet their deadlines on a mixed instance
        (:meth:`_prefill_share_needed`, at most ``max_prefill_share``). The scheduler's own
        replans on a mixed instance price the merged iteration instead (:meth:`_replan`)."""
        if self.config.role != "mixed":
            return self.planning_margin()
        return self.planning_margin() * (1.0 - min(self.max_prefill_share, self._prefill_share_needed(self.clock())))

    def _iteration_limit(self, now: float, decode_time: float) -> float:
        """Seconds this iteration may take so that every decoding request still gets its
        token within its TBT target: :meth:`planning_margin` ``* T_g``, or less when a request's current
        token gap is already partly spent -- request r with ``g`` iterations left before its
        token (waiting for its next group's turn in Alg. 1's cycle, then its remaining groups) and ``s`` seconds left of its gap may take ``(s - (1 -
        tg_margin) * TBT_r) / g`` (its TBT slack spread over its remaining iterations).
        This matters when Alg. 1 changes a plan mid-token (e.g. T_g rises when the strictest
        request leaves: the reduced request's last group would otherwise run in an iteration
        sized to the new, looser T_g). Requests T_g does not hold for (:meth:`_tg_held`: no TBT
        target, one out of reach even alone, or one below T_g), without a token yet, or whose gap is lost
        already (its share, even without the margin, is below ``decode_time``, this
        iteration's decode seconds) do not limit it; one that makes it only without the
        margin gets an iteration of decode work alone."""
        margin = self.planning_margin()  # a jittery machine: a wider margin
        limit = self.t_g * margin
        n = self.num_layers
        for r in self._tg_held():
            if not r.token_times:
                continue
            tbt = r.slo.tbt
            p = self.plans.get(r.req_id)
            if p is None:
                continue
            if p.layers >= n:
                left = 1
            else:  # iterations until its next group runs (Alg. 1's cycle), then the rest of the groups
                k, g = p.groups(n), r.next_layer // p.layers + 1
                left = (0 if r.next_layer % p.layers else (g + p.offset - self.iteration) % k) + k - g + 1
            own = (r.token_times[-1] + tbt * margin - now) / left
            if own >= decode_time:
                limit = min(limit, own)
            elif (r.token_times[-1] + tbt - now) / left >= decode_time:
                limit = min(limit, decode_time)  # only without prefill (and the margin) it still makes it
            # else its gap is lost already: holding prefill back saves nobody
        return limit

    def _p99_allowance_left(self) -> bool:
        """Whether every decoding request whose TBT target T_g holds (:meth:`_tg_held`) and whose
        P99 TBT is not broken already (:attr:`Request.p99_tbt_broken`) may take one more token gap
        over its target and still meet its P99 TBT (:attr:`Request.tbt_miss_allowance`). A request
        with nothing left to lose does not veto the break."""
        return all(r.p99_tbt_broken or r.num_tbt_misses + 1 <= r.tbt_miss_allowance for r in self._tg_held())

    def _tg_held(self):
        """The decoding requests whose TBT target T_g holds: a target at or above T_g (below it,
        Alg. 1 gave the level up: its own requests overload the iteration) and reachable alone
        (not ``tbt_infeasible``). None while T_g is inf."""
        t_g = self.t_g
        for r in self.running:
            tbt = r.slo.tbt
            if r.phase == Phase.DECODE and tbt is not None and tbt >= t_g and not r.tbt_infeasible:
                yield r

    def predict_decode(self, decoding: list[Request], plans: dict[str, DecodePlan] | None = None) -> float:
        """Worst predicted decode-only iteration time over the next iterations under ``plans``
        (default: this scheduler's), seconds. A request without a plan -- adopted since the last
        replan -- is priced at full depth, as Alg. 1 starts it."""
        given = plans if plans is not None else self.plans
        n = self.num_layers
        plans = {r.req_id: given.get(r.req_id, DecodePlan(n, 0)) for r in decoding}
        return _LayerLoad(self.lm, n, self.iteration, decoding, plans, self.decode_memo).predict()

    def planning_report(self) -> dict:
        """Alg. 1's state for :meth:`Scheduler.report` (T_g, its margin, the plans, the memo)."""
        return dict(prefill_share=self.max_prefill_share, tg_margin=self.tg_margin, t_g=self.t_g,
                    last_iteration_s=self.last_iteration_s, iteration=self.iteration, plans=self.plans,
                    planning_margin=self.planning_margin(), decode_memo=self.decode_memo,
                    layer_stops=self.num_step_preemptions)
