"""A simulated instance: the real instance core and scheduler, the latency model instead of the model.

Torch-free. :class:`SimInstance` is an :class:`~laser.instance.core.InstanceCore` (the same
step, finish rule and prefill -> decode hand-off as the engine) whose executor,
:class:`SimExecutor`, runs plans with the engine's walker (:mod:`laser.core.walk`: layer by
layer, parking leaving works in the intermediate cache, asking ``stop_at`` at each boundary)
but advances a virtual clock by the latency model's prediction of each layer call instead of
running it. Arrivals are released at the boundary where the virtual clock passes their time,
as a server would deliver them mid-iteration; a decode-role instance adopts hand-offs the
same way once their time has come and its KV pool can hold them.

Unit tests use it to check scheduling decisions against deadlines; the benchmark's simulated
targets and the cluster simulator run many of them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import reduce
from itertools import repeat
from operator import add
from typing import Callable

from ..core.block_manager import BlockManager, OutOfBlocksError
from ..core.config import SchedulerConfig
from ..core.depth import ExitCost
from ..core.walk import walk
from ..instance.core import Handoff, InstanceCore, make_scheduler
from ..instance.handoff import AdoptQueue
from ..core.intermediate_cache import IntermediateCache
from ..core.plan import LayerStep, StepPlan, StepResult
from ..core.pricing import has_step_overhead
from ..core.request import Request
from ..latency.machine_speed import refuse_scattered, step_hook


class VirtualClock:
    """A settable time source (seconds)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass
class SimStats:
    steps: int = 0
    layer_calls: int = 0
    busy_s: float = 0.0
    plans: list[StepPlan] = field(default_factory=list)


@dataclass(frozen=True)
class SimDepth:
    """Dynamic depth in the simulator (:mod:`laser.core.depth`): how many layers a decode token of
    a request that opted in runs, drawn from ``histogram`` (layers -> weight; measured on the
    real model, e.g. by ``benchmarks/dynamic_depth.py``) by a hash of (request id, position,
    ``seed``) -- the same draw whatever the schedule. ``exit_layers``: the boundaries with an exit
    head (where the exit head's check is priced for every opted-in token at least ``min_depth``
    deep: ``head_fraction`` x the LM head's time per row); a token that exits at ``k`` also pays
    its skipped layers' K/V projections: ``fill_fraction`` x a layer's stateless time per layer
    (the K/V rows of the fused QKV weight over a layer's weights)."""

    histogram: tuple[tuple[int, float], ...]
    exit_layers: frozenset[int]
    head_fraction: float = 0.0
    fill_fraction: float = 0.0
    seed: int = 0

    @property
    def cost(self) -> ExitCost:
        """The exit checks' and fills' price (:class:`laser.core.depth.ExitCost`: the rule the
        plans are priced by, so the simulated clock and the scheduler's price agree)."""
        return ExitCost(self.exit_layers, self.head_fraction, self.fill_fraction)

    def depth(self, req_id: str, position: int) -> int:
        import zlib

        u = zlib.crc32(f"{req_id}:{position}:{self.seed}".encode()) / 2**32
        total = sum(w for _, w in self.histogram)
        acc = 0.0
        for d, w in self.histogram:
            acc += w / total
            if u < acc:
                return d
        return self.histogram[-1][0]


class SimExecutor:
    """The simulated executor: each layer call advances the virtual clock by the latency model's
    prediction; paused works park in the intermediate cache as token counts (no payload);
    hand-offs carry no tensors (their KV is allocated on import).

    Fast path (``next_release`` set): when nothing can be delivered before the step's predicted
    end, no layer boundary can stop it (a scheduler stops a step only for a request that
    arrived during it, :meth:`laser.scheduler.base.Scheduler.stop_at`), so the walker runs in
    segment mode: one latency-model call per constant-composition segment instead of one per
    layer, the clock advanced layer by layer by that segment's time (the same floating-point
    sums as the layer-by-layer walk), and ``stop_at`` asked once, at the last boundary, so the
    arrival hook still retries what waits on memory. Same virtual times, parks and samples.
    """

    #: Margin (s) between the predicted end of a step and the next delivery for the fast path
    #: (the prediction and the walked clock may differ in the last bits).
    QUIET_MARGIN_S = 1e-9

    def __init__(self, lm, num_layers: int, bm: BlockManager, icache: IntermediateCache, clock: VirtualClock,
                 stats: SimStats, record_plans: bool = False):
        self.lm = lm
        # a machine whose steps scatter (laser.latency.machine_speed.JitteredLatencyModel), also
        # under a wrapper: each step draws its ratio before it is priced
        self._begin_step = step_hook(lm, "begin_step")
        self.n = num_layers
        self.bm = bm
        self.icache = icache
        self.clock = clock
        self.stats = stats
        self.record_plans = record_plans
        self._res: StepResult | None = None
        # (the walker's batch list, its layer time): run_layer prices a batch once per step
        self._priced: tuple[list | None, float] = (None, 0.0)
        # () -> virtual time of the next delivery the arrival hook could release (None: no fast path)
        self.next_release = None
        self.fast_steps = 0
        # dynamic depth (SimDepth; None: every token runs every layer) and the walker's exit
        # boundaries in the running step
        self.depth_model: SimDepth | None = None
        self.exit_layers: frozenset[int] = frozenset()
        self._requests = None
        self._step_terms = False  # (set per step: whether the latency model prices step overhead)

    # -- laser.instance.core.Executor ------------------------------------------------------------------
    def execute(self, plan: StepPlan, requests, stop_at=None) -> StepResult:
        if self.record_plans:
            self.stats.plans.append(StepPlan(plan.num_layers, list(plan.works)))
        t0 = self.clock.t
        self._res = res = StepResult(stopped_layer=0)
        self._priced = (None, 0.0)
        if self._begin_step is not None:  # a machine whose steps scatter (machine_speed.JitteredLatencyModel)
            self._begin_step(plan)
        works, n = plan.works, self.n
        embed, whole = 0, bool(works)  # tokens embedded; whether every work runs layers [0, N)
        for w in works:
            if w.layer_start == 0:
                embed += w.num_tokens
                whole = whole and w.layer_end == n
            else:
                whole = False
        dm = self.depth_model
        self.exit_layers = frozenset()
        if dm is not None and any(w.num_tokens == 1 and requests[w.req_id].sampling_params.dynamic_depth is not None
                                  for w in works):
            self.exit_layers, self._requests, whole = dm.exit_layers, requests, False
        if stop_at is not None and self.next_release is not None and works:
            end = t0 + self.lm.predict_iteration(plan)
            if self.next_release() > end + self.QUIET_MARGIN_S:
                first, last = (0, n) if whole else (plan.first_layer, plan.last_layer)
                if last - first >= 2 and stop_at(last - 1):
                    raise AssertionError("a scheduler stopped a step with no arrival during it")
                stop_at = None
                self.fast_steps += 1
        self._step_terms = has_step_overhead(self.lm)
        if self._step_terms and works:  # the step's own overhead (LatencyModel.step_overhead_time):
            self.clock.t += self.lm.step_overhead_s  # once per step here, per composition in compose()
        self.clock.t += self.lm.embed_time(embed)
        if stop_at is None and whole:
            # one segment, every work from embedding to sampling (a decode step at full depth,
            # whole prefills): the walk's segment mode without its bookkeeping
            self.compose(works, range(n))
            self.run_layers(range(n), works)
            self.finish(works, n)
            res.stopped_layer = n
        else:
            res.stopped_layer = walk(plan, self, stop_at)
        if plan.warm and res.stopped_layer >= n:  # a decode step in a streak (laser.core.pricing.warm_streak)
            self.clock.t = t0 + (self.clock.t - t0) * self.lm.decode_warm_factor(len(works), plan.warm)
        res.compute_seconds = self.clock.t - t0
        self.exit_layers, self._requests = frozenset(), None
        self.stats.steps += 1
        self.stats.busy_s += self.clock.t - t0
        return res

    def export_kv(self, req: Request) -> None:
        return None

    def import_kv(self, req: Request, kv) -> None:
        """Allocate KV for the computed tokens at every layer. Raises OutOfBlocksError (nothing kept)."""
        if not self.bm.can_allocate(req.req_id, req.num_computed_tokens):
            raise OutOfBlocksError(f"no room for {req.req_id}'s {req.num_computed_tokens} tokens of KV")
        self.bm.allocate(req.req_id, req.num_computed_tokens)

    def release(self, req_id: str) -> None:
        pass

    # -- laser.core.walk.LayerExecutor -------------------------------------------------------------------
    def park(self, active, leaving, layer):
        ids = {id(w) for w in leaving}
        if layer < self.n:
            for w in leaving:
                self.icache.put(w.req_id, None, w.num_tokens)
        return [w for w in active if id(w) not in ids]

    def join(self, active, joining):
        for w in joining:
            if w.layer_start > 0:
                self.icache.pop(w.req_id)
        return active + list(joining)

    def compose(self, active, layers) -> None:
        """One batch composition: its share of the step overhead (none for a model without it)."""
        if self._step_terms:
            lm = self.lm
            self.clock.t += lm.compose_overhead_s + lm.compose_work_s * len(active)

    def run_layer(self, layer, active) -> None:
        if active is not self._priced[0]:  # the walker builds a new list whenever the batch changes
            step = LayerStep(layer, tuple(w.num_tokens for w in active), tuple(w.context_len for w in active))
            self._priced = (active, self.lm.predict_layer(step))  # (all layers cost the same)
        self.clock.t += self._priced[1]
        self.stats.layer_calls += 1
        self._res.num_layer_calls += 1

    def run_layers(self, layers: range, active) -> None:
        """Segment mode: ``len(layers)`` layer calls of the same batch, priced once."""
        t = self.lm.step_layer_time(tuple([w.num_tokens for w in active]), tuple([w.context_len for w in active]))
        # layer by layer, ((t0 + t) + t) + ...: the same sums as run_layer (a left fold, not sum())
        self.clock.t = reduce(add, repeat(t, len(layers)), self.clock.t)
        self.stats.layer_calls += len(layers)
        self._res.num_layer_calls += len(layers)

    def early_exit(self, active, layer):
        """The walker's exit check (see :meth:`laser.model.runner.ModelRunner.early_exit`): each
        eligible decode work whose drawn depth (:class:`SimDepth`) is ``layer`` leaves, its token
        sampled (id 0), its skipped layers' K/V fill and every eligible work's exit-head check priced."""
        dm, reqs, n = self.depth_model, self._requests, self.n
        gone, checked = [], 0
        for w in active:
            if w.num_tokens != 1:
                continue
            r = reqs[w.req_id]
            dd = r.sampling_params.dynamic_depth
            if dd is None or layer < dd.min_layers(n) or not r.output_token_ids or w.token_start != r.num_tokens - 1:
                continue
            checked += 1
            if dm.depth(w.req_id, w.token_start) == layer:
                gone.append(w)
        cost = dm.cost
        if checked:
            self.clock.t += cost.check_time(self.lm, checked)
        if not gone:
            return active
        self.clock.t += cost.fill_time(self.lm, n - layer, len(gone))
        ids = {id(w) for w in gone}
        for w in gone:
            self._res.sampled[w.req_id] = 0
            self._res.exit_layers[w.req_id] = layer
        return [w for w in active if id(w) not in ids]

    def finish(self, active, layer) -> None:
        if layer < self.n:
            self.park(active, active, layer)
            return
        self.clock.t += self.lm.head_time(len(active))
        masked = sum(1 for w in active if w.masked and w.sample)
        if masked:  # grammar masks (structured output), as PlanCost prices them
            self.clock.t += self.lm.mask_time(masked)
        self._res.sampled.update({w.req_id: 0 for w in active if w.sample})


class SimInstance(InstanceCore):
    """One instance driven by a latency model in virtual time.

    Args:
        policy: policy name. num_layers: N. latency_model: predicts each layer call.
        config: scheduler config (its policy name is replaced by ``policy``; its role decides
            whether the instance hands requests off (``prefill``) or adopts them (``decode``)).
        num_blocks / block_size: KV pool per layer. icache_tokens: intermediate cache capacity.
        record_plans: keep every executed plan in ``stats.plans`` (tests).
        machine_model: what each layer call really takes (the clock; default: ``latency_model``,
            the exact model). E.g. ``ScaledLatencyModel(m, 1.3)`` for a machine 30 % slower than
            the profile ``m`` the scheduler plans with; a
            :class:`~laser.latency.CalibratedLatencyModel` as ``latency_model`` then learns the
            factor from the simulated steps, as a real instance does.
        enable_prefix_caching: model the prefix cache (:mod:`laser.core.block_manager`, the engine's
            code): off by default, as simulated requests usually carry dummy token ids.
        depth_model: dynamic depth of the requests that opt in (:class:`SimDepth`); None: none exits.
    """

    def __init__(self, policy: str, num_layers: int, latency_model, config: SchedulerConfig | None = None,
                 num_blocks: int = 4096, block_size: int = 16, icache_tokens: int = 16384,
                 record_plans: bool = False, machine_model=None, enable_prefix_caching: bool = False,
                 depth_model: SimDepth | None = None):
        refuse_scattered(latency_model, "SimInstance's latency_model (what the scheduler plans with)")
        cfg = dataclasses.replace(config or SchedulerConfig(), policy=policy)
        clock = VirtualClock()
        self.lm = latency_model
        self.num_layers = num_layers
        # the engine's prefix cache, block for block (hits only where requests share token ids)
        self.bm = BlockManager(num_layers, num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.icache = IntermediateCache(icache_tokens)
        self.stats = SimStats()
        executor = SimExecutor(machine_model or latency_model, num_layers, self.bm, self.icache, clock, self.stats,
                               record_plans)
        executor.next_release = self.next_release
        executor.depth_model = depth_model
        if depth_model is not None:  # the scheduler prices exits as the simulated machine runs them
            latency_model.exit_cost = depth_model.cost
        super().__init__(make_scheduler(cfg, num_layers, self.bm, self.icache, latency_model, clock), executor, clock)
        self.arrival_hook = self._release
        self._arrivals: list[Request] = []  # sorted by arrival_time
        self.adopts = AdoptQueue()  # decode role: hand-offs by the time they reach this instance
        self.adopted: dict[str, Request] = {}  # req_id -> this instance's copy of a handed-off request
        self.finished: list[Request] = []

    def submit(self, req: Request) -> None:
        """Queue ``req`` for release at ``req.arrival_time`` (virtual seconds)."""
        self._arrivals.append(req)
        self._arrivals.sort(key=lambda r: r.arrival_time)

    def receive(self, h: Handoff, at: float) -> None:
        """Decode role: a hand-off that reaches this instance at virtual time ``at``."""
        self.adopts.deliver(dataclasses.replace(h, time=at), at)

    def _release(self) -> None:
        t = self.clock.t
        while self._arrivals and self._arrivals[0].arrival_time <= t:
            self.add_request(self._arrivals.pop(0))
        for req in self.adopts.adopt_ready(self.adopt, t):  # (one that does not fit waits for the pool)
            self.adopted[req.req_id] = req

    def next_release(self) -> float:
        """Virtual time of the next arrival or hand-off not yet due (inf when none); a hand-off
        already due but waiting for KV blocks does not count (nothing frees blocks mid-step)."""
        t = self.clock.t
        nxt = self._arrivals[0].arrival_time if self._arrivals else math.inf
        return min(nxt, self.adopts.next_due(after=t))

    def next_event(self) -> float:
        """Virtual time of this instance's next action (now while it has work)."""
        if self.has_unfinished():
            return self.clock.t
        return min(self._arrivals[0].arrival_time if self._arrivals else math.inf, self.adopts.earliest())

    def run(self, until: float = float("inf"), max_steps: int = 1_000_000,
            before_step: Callable[[], None] | None = None) -> list[Request]:
        """Run until every submitted request finished (or ``until``). Returns finished requests.

        ``before_step`` is called after the arrivals are released, before every step decision
        (and when idle): a driver that adds requests of its own, e.g. a batch job's runner.
        """
        for _ in range(max_steps):
            self._release()
            if before_step is not None:
                before_step()
            if not self.has_unfinished():
                t = self.next_event()
                if t == math.inf or t > until:
                    break
                self.clock.t = max(self.clock.t, t)
                continue
            if self.clock.t > until:
                break
            self.step()
        return self.finished

    def step(self):
        """One step (see :meth:`InstanceCore.step`): :meth:`begin_step` then :meth:`finish_step`."""
        plan = self.begin_step()
        return self.finish_step(plan) if plan else []

    def begin_step(self) -> StepPlan:
        """Schedule the next step at the current virtual time (allocates, admits). An empty plan
        lets time pass to the next queued arrival (nothing is runnable, e.g. waiting on memory)."""
        plan = self.schedule()
        if not plan and self._arrivals:
            self.clock.t = max(self.clock.t, self._arrivals[0].arrival_time)
        return plan

    def finish_step(self, plan: StepPlan):
        """Execute ``plan`` (from :meth:`begin_step`, clock unchanged since) layer by layer in
        virtual time, releasing arrivals at layer boundaries; update, finish, hand off."""
        events = self.execute(plan)
        self.finished.extend(ev.request for ev in events if ev.finish_reason is not None)
        return events
