"""``laser``: layer-level chunked prefill and layer-level decode batching (PPoPP'26 §6).

Prefill (§6.1). Queue order is EDF (arrival + TTFT target). Each step the scheduler takes prefill
requests in EDF order and merges them into one batch while every included deadline still holds
under the latency model; a request whose whole prompt would break a deadline contributes a
deadline-sized chunk instead ("split the newcomer and merge a chunk of it"). Chunks paused at a
layer boundary resume *at that layer*, so a newcomer runs alone up to the paused layer and then
merges with it. On arrival, ``slack = deadline - now - predicted prefill``; if the running step's
remaining time exceeds the slack, the step stops at the next layer boundary (``stop_at``), every
in-flight chunk parks its hidden state in the intermediate cache (decode tokens run on to the end
of their layer groups: parking them would put the next step into their token gap), and the next
``schedule`` re-plans with the newcomer in EDF position: merged if the merge meets its deadline,
otherwise first -- and alone, the paused chunks resuming after it, where they can wait and merging
them would delay its first token more than it saves (``PrefillPlanner.holds_back``).

Decode (§6.2, Alg. 1). Decode request r has a plan (L_r, O_r): with K_r = ceil(N/L_r) layer groups,
group g (layers ((g-1)L, gL]) runs in iteration i iff ``(i - g - O_r) mod K_r == 0`` — one group
per iteration, a token every K_r iterations. T_g is the tightest TBT target that can be met (one
out of reach alone, or whose requests alone at full depth overload it, is skipped:
:func:`~.decode.exec_plan`). While the predicted iteration time exceeds T_g, the most relaxed
full-depth request gets ``L = ceil(N/K)`` with ``K = floor(SLO_r/T_g)`` (:func:`~.decode.relaxed_layers`;
the paper's ``ceil(N*T_g/SLO_r)`` when ``SLO_r/T_g`` is whole; best effort: 1 layer), its first
group in the coming iteration (the paper balances layer load by the offset; a later start
stretches the gap in progress); while it is below T_g, the strictest reduced request is restored
to L = N (reverted if that breaks T_g). Plans change only on arrival, departure, or when the
measured iteration time nears T_g.

Colocated (role ``mixed``, not in the paper): prefill layer-work shares iterations with
decode layer-work and gets the time left under T_g, advancing as many layers per
iteration as fit; a prefill's chunk may thus cross several iterations layer by layer.
Alg. 1 prices the iteration with the prefill the pending deadlines need merged into its
layer calls, so decode layers are cut when prefill needs the compute they take.

Best effort gives way (not in the paper): beside SLO work it takes at most ``best_effort_share`` of an
iteration (:func:`~.budget.best_effort_limit`), so SLO streams keep their own pace (issue 28 item 3).

The parts, each a module of this package with explicit inputs (the scheduler owns the state):
``prefill.py`` (the EDF merge, ``fit``, what the pending prefills need), ``triage.py``
(Moore-Hodgson overload triage, pure, computed once per step), ``decode.py`` (Alg. 1, pure),
``budget.py`` (the rules this project added around T_g: the partly spent gap, the planning margin,
the knowing break, the P99 allowance, given-up levels), ``stepwatch.py`` (the arrival rule during
a step), ``increment.py`` (Alg. 2's ``LatencyIncrement`` for the controller).
"""

from __future__ import annotations

import functools
import math
import time

from ...core.depth import exit_plan
from ...core.plan import StepPlan, Work
from ...core.pricing import PlanCost, full_depth_decode_total
from ...core.request import Phase, Request
from ...latency import LatencyModel, SimpleLatencyModel
from ..base import Scheduler
from ..report import prefill_yields
from . import budget as rules
from .decode import DecodeMemo, DecodePlan, _LayerLoad, due_requests, exec_plan, group_end, tbt_infeasible
from .prefill import Demand, KVActions, PrefillPlanner
from .stepwatch import StepWatch
from .triage import Triage, may_give_up, triage


class LaserScheduler(Scheduler):
    """Layer-level chunked prefill (§6.1) and layer-level decode batching (§6.2, Alg. 1) on one
    instance; see the module docstring. It owns the state (queues, Alg. 1's plans and T_g, the
    given-up requests) and composes the parts, each with explicit inputs:
    :class:`~.prefill.PrefillPlanner` (the EDF merge, ``_fit``, the prefill demand),
    :func:`~.triage.triage` (Moore-Hodgson, once per step), :mod:`.decode` (Alg. 1, pure),
    :mod:`.budget` (T_g, its knowing break, the P99 allowance, given-up levels) and
    :class:`~.stepwatch.StepWatch` (the arrival rule during a step)."""

    name = "laser"

    #: Most of an iteration that the controller's Alg. 1 price leaves to prefill on a mixed instance (fraction).
    max_prefill_share = 0.5
    #: Replan when the measured iteration time exceeds this fraction of T_g.
    replan_threshold = 0.95
    #: Plan iterations to this fraction of T_g: real iterations run a few % over predictions.
    tg_margin = 0.9
    #: Build a decode or mixed instance's steady decode steps directly (:meth:`_steady_decode_plan`);
    #: tests switch it off to check that the generic path makes the same plans.
    steady_decode = True

    def __init__(self, config, num_layers, block_manager, icache, latency_model: LatencyModel | None = None,
                 clock=time.monotonic):
        super().__init__(config, num_layers, block_manager, icache, latency_model, clock)
        # Until a profile exists: a rough CPU-scale estimate (replaced by the fitted model).
        self.lm: LatencyModel = latency_model or SimpleLatencyModel(
            num_layers=num_layers, per_layer=2e-4, per_token=4e-5, per_context=2e-7
        )
        #: Most of an iteration with SLO work that best-effort work may take (``--best-effort-share``;
        #: 1.0: the paper's rule): :func:`~.decode.exec_plan`, :meth:`PrefillPlanner.merge`, Alg. 2.
        self.best_effort_share = config.best_effort_share
        self.plans: dict[str, DecodePlan] = {}
        self.decode_memo = DecodeMemo(self.lm)  # Alg. 1 / Alg. 2 prices (this scheduler's and its increments')
        self.iteration = 0
        self._given_up: set[str] = set()  # ids of prefills Moore-Hodgson's rule gave up (until they finish)
        self._p99_lost: set[str] = set()  # ids of decoding requests seen with their P99 TBT broken
        self.replan_needed = False
        self.num_replans = 0
        self.num_steady_steps = 0  # steps built by _steady_decode_plan
        self._last_drift_replan = -(10**9)
        self.prefill = PrefillPlanner(self.lm, num_layers, config.best_effort_deadline_s, config.max_num_seqs,
                                      config.max_num_batched_tokens)
        self.step = StepWatch(self.lm, num_layers)  # the step being executed (the arrival rule)
        self._kv = KVActions(self.lookup_prefix, self.try_allocate, self.admit)
        # (now, rate, preemptions) -> the Triage of the schedule() call under way (None outside one)
        self._step_triage: tuple[tuple, Triage] | None = None
        self.last_iteration_s: float | None = None
        self.t_g = math.inf
        #: Share of an iteration's time that the last step left to prefill (1.0 without decode
        #: work): prefill advances at about this fraction of its alone speed (:meth:`triage`).
        self.prefill_rate = 1.0

    @property
    def num_step_preemptions(self) -> int:
        """Steps stopped at a layer boundary for an arrival (§6.1)."""
        return self.step.num_stops

    # -- events ---------------------------------------------------------------------------------
    def on_arrival(self, req: Request) -> None:
        """§6.1: a request arriving during a step may stop it at the next layer boundary
        (:meth:`StepWatch.arrival_stops`); on a mixed instance the prefill share Alg. 1 leaves
        follows the new deadline (replan)."""
        if self.config.role == "mixed" and self.plans:
            self.replan_needed = True
        if self.step.in_step and self.config.role != "decode":
            key = (prefill_yields(req), *self.queue_key(req))  # the prefill order (triage's)
            leads = all(w is req or key < (prefill_yields(w), *self.queue_key(w)) for w in self.waiting)
            self.step.arrival_stops(req, self.clock(), self.prefill_alone(req), leads, self.plans)

    def prefill_alone(self, req: Request) -> float:
        """Predicted seconds of ``req``'s prefill left (after its cached or computed prefix), run alone."""
        return self.lm.predict_prefill(self.prefill_remaining(req), context_start=req.num_computed_tokens)

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
        return self.step.stop_at(layer)

    # -- the step ---------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """Decode requests run the layer groups their (L, O) plans give for this iteration (Alg. 1,
        replanned only on events); prefill requests fill the time left under T_g (all of it on a
        prefill instance; more on a knowing break) in triage order, merged while every included
        TTFT deadline holds, each advancing as many layers as fit."""
        if self.steady_decode:
            plan = self._steady_decode_plan(now)
            if plan is not None:
                return plan
        self._step_triage = ()  # a schedule() call is under way: its triage is computed once
        self.refresh_prefixes()  # the queue is priced by the tokens left after cached prefixes
        self.preempt_for_stricter()
        works = self._decode_works(now) if self.config.role != "prefill" else []
        spec = self._spec_pricing(works)
        cost = PlanCost(self.lm, self.num_layers, works, *spec)  # the plan's price, grown work by work
        budget = self._prefill_budget(now, cost.total) if works else self._no_decode_budget()
        works += self._prefill_works(now, cost, budget)
        priced = bool(works)  # cost prices exactly ``works``
        if not works:
            works = self._skip_to_due_decode(now)
        self.relieve_deadlock(works)
        plan = StepPlan(self.num_layers, works, predicted=(self.lm, cost.total) if priced else None,
                        speculative=spec if spec[0] else None)
        self._begin_step(plan)
        return plan

    def _spec_pricing(self, works: list[Work]) -> tuple[dict[str, int], int]:
        """(req id -> draft length, exit layer) of the decode works the executor will run
        self-speculatively (:mod:`laser.core.speculation`: a speculating request's token through
        every layer), for :class:`PlanCost`; empty without speculation."""
        sh = self.speculation
        if sh is None:
            return {}, 0
        n, reqs, drafts = self.num_layers, self.requests, {}
        for w in works:
            g = sh.work_draft_len(w, reqs[w.req_id], n)
            if g:
                drafts[w.req_id] = g
        return drafts, sh.exit_layer

    def _prefill_budget(self, now: float, decode_time: float) -> float:
        """Seconds of prefill the step may carry beside ``decode_time`` seconds of decode
        (:func:`~.budget.prefill_budget`: the time left under T_g, or a knowing break), and the
        share it leaves prefill (``prefill_rate``)."""
        limit = self._iteration_limit(now, decode_time)
        demand = self.prefill_demand(now)
        need, whole = rules.prefill_need(demand.share, demand.whole, decode_time)
        budget = rules.prefill_budget(limit, decode_time, need, whole, self._p99_allowance_left)
        self.prefill_rate = rules.prefill_share(budget, decode_time)
        return budget

    def _no_decode_budget(self) -> float:
        """A step without decode work: prefill may take all of it (on a decode-capable instance
        with no plans, at the whole machine's rate)."""
        if self.config.role != "prefill" and not self.plans:
            self.prefill_rate = 1.0
        return math.inf

    def _skip_to_due_decode(self, now: float) -> list[Work]:
        """No decode group is due in this iteration and no prefill fits: the iteration would be
        empty (it takes no time), so skip to the next one with a due group rather than wait on it
        forever."""
        works: list[Work] = []
        if self.plans and self.config.role != "prefill":
            for _ in range(max(p.groups(self.num_layers) for p in self.plans.values())):
                self.iteration += 1
                works = self._decode_works(now)
                if works:
                    break
        return works

    def _steady_decode_plan(self, now: float) -> StepPlan | None:
        """The plan :meth:`schedule` makes in steady decode on a decode or mixed instance (most of
        their steps): nothing waiting, no prefill left in any running request, no replan due, every
        running request at full depth (Alg. 1's L = N) from layer 0, a free block for each one whose
        new token starts a block. The generic path then preempts nobody, merges no prefill (the
        pending prefills' demand is empty: the prefill budget is the time left under the iteration
        limit), allocates those blocks in queue order, runs one token of every request through every
        layer in running order, prices it with :class:`PlanCost` and sets ``prefill_rate``; this does
        the same, with the same float operations in the same order, without the triage, the demand
        and the merge (kept: a decode instance spends 92-94 % of its steps here; without it the
        16P16D simulation took 1.33x the CPU, docs/benchmarks.md; a mixed instance serving chat
        decodes most of its steps). Any event that changes the inputs -- an arrival (``waiting``;
        on a mixed instance also ``replan_needed``), a finish, a preemption, an adoption, a new
        decode request -- sets ``replan_needed`` or leaves a request short of a plan, so the next
        step takes the generic path. None, having changed nothing, when the state is not steady."""
        if (self.config.role == "prefill" or self.waiting or self.replan_needed or not self.running
                or self.speculation is not None):  # (speculating tokens: the generic path prices them)
            return None
        n, plans, covers, decode = self.num_layers, self.plans, self.bm.covers, Phase.DECODE
        grow = []  # requests whose new token starts a block
        works = []
        for r in self.running:
            p = plans.get(r.req_id)
            if p is None or p.layers < n or r.phase is not decode or r.next_layer:
                return None
            rid, c = r.req_id, r.num_tokens
            if not covers(rid, c):
                if not covers(rid, c - 1):
                    return None  # not one uniform block short: the generic path decides
                grow.append(r)
            works.append(Work(rid, c - 1, 1, 0, n, True, r.masked) if r.sampling_params.dynamic_depth is None
                         else Work(rid, c - 1, 1, 0, n, True, r.masked, *exit_plan(r, c - 1, 1, n)))
        if len(grow) > self.bm.min_free():
            return None  # someone would be preempted
        self.refresh_prefixes()  # (nothing waits: it only notes the cache version, as the generic path does)
        for r in sorted(grow, key=self.queue_key):  # preempt_for_decode's order (a stable sort)
            if not self.try_allocate(r, r.num_tokens):
                raise AssertionError(f"{r.req_id}: a block the pool had room for was refused")
        exits = any(w.depth or w.exit_from for w in works)  # (dynamic depth: PlanCost prices each to its depth)
        decode_time = PlanCost(self.lm, n, works).total if exits else full_depth_decode_total(self.lm, n, works)
        budget = max(0.0, self._iteration_limit(now, decode_time) - decode_time)
        self.prefill_rate = rules.prefill_share(budget, decode_time)
        plan = StepPlan(n, works, predicted=(self.lm, decode_time))
        self._begin_step(plan)
        self.num_steady_steps += 1
        return plan

    def _begin_step(self, plan: StepPlan) -> None:
        self._step_triage = None
        self.step.begin(plan, self.plans, self.clock())

    def update(self, plan, stopped_layer, sampled, now, exit_layers=None):
        self.step.end()
        if plan.works:
            # A stop pauses prefill work only: the decode works ran their layer groups, so
            # the decode iteration happened either way (Work.reached).
            plans = self.plans
            dec = any(w.is_decode and w.req_id in plans for w in plan.works)
            complete = stopped_layer == plan.last_layer
            if dec and complete:
                self.last_iteration_s = self.clock() - self.step.start
                if (
                    self.t_g < math.inf
                    and self.last_iteration_s > self.replan_threshold * self.t_g
                    and self.iteration - self._last_drift_replan >= _LayerLoad.HORIZON
                ):
                    self._last_drift_replan = self.iteration
                    self.replan_needed = True
            if complete or dec:
                self.iteration += 1
        out = super().update(plan, stopped_layer, sampled, now, exit_layers)
        if exit_layers:
            self._restart_exited(exit_layers)
        for req in out:
            if req.num_output_tokens == 1 and req.req_id not in self.plans:
                self.replan_needed = True  # a new decode request
            elif req.num_tbt_misses and req.req_id not in self._p99_lost and req.p99_tbt_broken:
                self._p99_lost.add(req.req_id)
                self.replan_needed = True  # it has nothing left to keep: T_g may be released
        return out

    def _restart_exited(self, exit_layers: dict[str, int]) -> None:
        """A reduced request (L < N) whose token left the model early (dynamic depth) starts its
        next token now: its plan's offset moves so that its first group runs in the coming
        iteration (:meth:`_LayerLoad.best_offset`'s rule), instead of waiting out the groups the
        exit skipped."""
        n = self.num_layers
        for rid in exit_layers:
            p = self.plans.get(rid)
            if p is not None and p.layers < n:
                self.plans[rid] = DecodePlan(p.layers, (self.iteration - 1) % p.groups(n))

    # -- prefill (§6.1) ---------------------------------------------------------------------------
    def _pending_prefills(self) -> list[Request]:
        """Running requests with prefill left, then the waiting ones (a decode instance prefills
        only to recompute requests it preempted: those with outputs)."""
        cands = [r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting)
        if self.config.role == "decode":
            cands = [r for r in cands if r.output_token_ids]
        return cands

    def triage(self, now: float) -> Triage:
        """The step's overload triage (:func:`~.triage.triage`) of every pending prefill, at the
        rate :func:`~.budget.triage_rate` gives; the requests it gives up are recorded here (and
        only here: ``Request.given_up``, and the set :func:`~.triage.may_give_up` reads). Within
        one :meth:`schedule` call it is computed once, and again only when the step's own
        decisions changed its inputs (a decode preemption requeued a request, or the prefill
        share this step set, or a replan's T_g, changed the rate it judges at)."""
        break_open = bool(self.plans) and math.isfinite(self.t_g) and self._p99_allowance_left()
        rate = rules.triage_rate(self.prefill_rate, self.prefill.min_prefill_rate, break_open)
        key = (now, rate, self.num_preemptions)
        memo = self._step_triage
        if memo and memo[0] == key:
            return memo[1]
        cands = sorted([r for r in self.running if r.phase != Phase.DECODE] + list(self.waiting), key=self.queue_key)
        has, given_up = self.bm.has, self._given_up
        decided = triage(cands, now, self.lm, self.num_layers, rate,
                         lambda r: may_give_up(r, has(r.req_id), r.req_id in given_up), self.queue_key,
                         self.prefill.max_need_candidates, prefill_yields)
        for r in decided.given_up:
            given_up.add(r.req_id)
            r.given_up = True
        if memo is not None:
            self._step_triage = (key, decided)
        return decided

    def prefill_demand(self, now: float) -> Demand:
        """What the pending prefills need of the time from ``now`` (:meth:`PrefillPlanner.demand`)."""
        cands = self._pending_prefills()
        if not cands:
            return Demand()
        floor = self.tg_margin * self.t_g if math.isfinite(self.t_g) else 0.0
        return self.prefill.demand(cands, self.triage(now), now, floor)

    def _prefill_works(self, now: float, cost: PlanCost, budget: float) -> list[Work]:
        """The EDF merge of prefill work into the step (:meth:`PrefillPlanner.merge`)."""
        order = self.triage(now)
        queued = {id(r) for r in self.waiting}  # not running yet: each one takes a running slot
        later_share = functools.cache(self.later_prefill_share)  # asked at most once per step
        # the SLO decode price of the step before the merge adds prefill; priced only if a best-effort prompt asks
        slo_decode_s = functools.partial(rules.slo_decode_price, self.lm, self.num_layers, list(cost.works),
                                         lambda rid: self.requests[rid].slo)
        return self.prefill.merge(self._pending_prefills(), order, queued, len(self.running), now, cost, budget,
                                  self._kv, later_share, slo_decode_s, self.best_effort_share)

    def later_prefill_share(self) -> float:
        """Share of an iteration that prefill gets while every request now running or waiting
        decodes (:func:`~.budget.prefill_share` of what ``planning_margin() * T_g`` leaves beside
        one full-depth decode iteration of all of them, T_g the tightest TBT target among them that
        may still be met: Alg. 1's T_g of the decoding ones, the targets of the pending ones not
        given up or demoted; 1.0 with none). A lower bound: Alg. 1 runs looser streams on fewer
        layers per iteration, and some streams finish first. What prefill work held back from a
        step gets when it runs (:meth:`PrefillPlanner.holds_back`). 1.0 on a prefill instance (it
        decodes nothing: held-back work there runs with the whole machine)."""
        if self.config.role == "prefill":
            return 1.0
        pending = [r for r in self._pending_prefills() if r.phase != Phase.DECODE]
        t_g = self.t_g
        for r in pending:
            if r.slo.tbt is not None and not (r.given_up or r.demoted):
                t_g = min(t_g, r.slo.tbt)
        if not math.isfinite(t_g):
            return 1.0
        contexts = [r.num_tokens for r in self.running] + [r.num_tokens for r in self.waiting]
        decode_time = self.lm.predict_decode_iteration(contexts)
        return rules.prefill_share(max(0.0, self.planning_margin() * t_g - decode_time), decode_time)

    # -- decode (§6.2) -------------------------------------------------------------------------
    def _decode_works(self, now: float) -> list[Work]:
        """This iteration's decode works: Alg. 1's due groups (:func:`~.decode.due_requests`, after a
        replan when one is due), with KV for each new token (:meth:`preempt_for_decode`)."""
        decoding = [r for r in self.running if r.phase == Phase.DECODE]
        if not decoding:
            self.t_g = math.inf
            return []
        if self.replan_needed or any(r.req_id not in self.plans for r in decoding):
            self._replan(decoding)
        n = self.num_layers
        due = due_requests(decoding, self.plans, n, self.iteration)
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
            end = group_end(r, p, n)
            # (a full-depth token that may exit early is priced at its expected depth; a reduced
            # plan's group keeps its layers: an exit restarts its cycle, _restart_exited)
            depth = exit_plan(r, r.num_tokens - 1, 1, n) if r.next_layer == 0 and end == n else (0, 0)
            works.append(Work(r.req_id, r.num_tokens - 1, 1, r.next_layer, end, end == n, r.masked, *depth))
        return works

    def _replan(self, decoding: list[Request]) -> None:
        """Alg. 1 (:func:`~.decode.exec_plan`): relax the most relaxed / restore the strictest,
        against T_g. When no decoding request has an SLO left to keep
        (:func:`~.budget.nothing_to_keep`), T_g is inf and every request runs at full depth."""
        self.replan_needed = False
        self.num_replans += 1
        if rules.nothing_to_keep(decoding):
            self.plans, self.t_g = {r.req_id: DecodePlan(self.num_layers, 0) for r in decoding}, math.inf
            return
        if self.config.role == "mixed":
            # Alg. 1 prices each iteration with the prefill the pending deadlines need merged
            # into its layer calls, to tg_margin * T_g: a decode token costs what it adds to
            # them (on a GPU, a prefill token's compute once the call is compute-bound, where
            # priced alone the decode batch is weight-bound and no plan was ever reduced)
            rate = self.prefill_demand(self.clock()).rate
            self.plans, self.t_g, _ = exec_plan(self.lm, self.num_layers, self.iteration, decoding, self.plans,
                                                self.planning_margin(), self.decode_memo, rate,
                                                self.config.max_num_batched_tokens, self.speculation,
                                                self.best_effort_share)
        else:
            self.plans, self.t_g, _ = exec_plan(self.lm, self.num_layers, self.iteration, decoding, self.plans,
                                                self.plan_target_factor(), self.decode_memo, spec=self.speculation,
                                                best_effort_share=self.best_effort_share)
        for r in decoding:
            if not r.tbt_infeasible and tbt_infeasible(self.lm, r, self.decode_memo):
                r.tbt_infeasible = True  # served as well as possible; metrics say so

    # -- the budget rules, applied to this scheduler's state (laser.scheduler.laser.budget) -----------
    def planning_margin(self) -> float:
        """Fraction of T_g that iterations are planned to (:func:`~.budget.planning_margin`)."""
        return rules.planning_margin(self.tg_margin, self.lm.timing_spread())

    def plan_target_factor(self) -> float:
        """Fraction of T_g that the controller's Alg. 1 prices (``instance/state.py``) plan
        decode iterations to: :meth:`planning_margin`, less the share of each iteration that the pending
        prefills need to meet their deadlines on a mixed instance
        (:meth:`prefill_demand`, at most ``max_prefill_share``). The scheduler's own
        replans on a mixed instance price the merged iteration instead (:meth:`_replan`)."""
        if self.config.role != "mixed":
            return self.planning_margin()
        return self.planning_margin() * (1.0 - min(self.max_prefill_share, self.prefill_demand(self.clock()).share))

    def _iteration_limit(self, now: float, decode_time: float) -> float:
        """Seconds this iteration may take (:func:`~.budget.iteration_limit` of the token gaps of the
        requests T_g holds for)."""
        n, it, t_g, plans = self.num_layers, self.iteration, self.t_g, self.plans
        gaps = [(r.token_times[-1], r.slo.tbt, p.iterations_left(r.next_layer, n, it)) for r in self.running
                if rules.holds_tg(r, t_g) and r.token_times and (p := plans.get(r.req_id)) is not None]
        return rules.iteration_limit(now, decode_time, t_g, self.planning_margin(), gaps)

    def _p99_allowance_left(self) -> bool:
        """Whether a knowing break of T_g may spend one late gap (:func:`~.budget.p99_allowance_left`)."""
        return rules.p99_allowance_left([r for r in self.running if rules.holds_tg(r, self.t_g)])

    def predict_decode(self, decoding: list[Request], plans: dict[str, DecodePlan] | None = None) -> float:
        """Worst predicted decode-only iteration time over the next iterations under ``plans``
        (default: this scheduler's), seconds. A request without a plan -- adopted since the last
        replan -- is priced at full depth, as Alg. 1 starts it."""
        given = plans if plans is not None else self.plans
        n = self.num_layers
        plans = {r.req_id: given.get(r.req_id, DecodePlan(n, 0)) for r in decoding}
        return _LayerLoad(self.lm, n, self.iteration, decoding, plans, self.decode_memo,
                          spec=self.speculation).predict()

    def on_role_change(self) -> None:
        self.replan_needed = True

    def planning_report(self) -> dict:
        """Alg. 1's part of :meth:`Scheduler.report` (prefill share, T_g, margin, last iteration, layer stops)."""
        return dict(prefill_share=self.max_prefill_share, tg_margin=self.tg_margin, t_g=self.t_g,
                    last_iteration_s=self.last_iteration_s, layer_stops=self.step.num_stops)

    def decode_state(self) -> tuple:
        """Alg. 1's live state: (iteration, plans, the margin it plans to, its price memo, best-effort share)."""
        return self.iteration, self.plans, self.planning_margin(), self.decode_memo, self.best_effort_share
