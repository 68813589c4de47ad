"""A simulated instance: the real scheduler, the latency model instead of the model runner.

Torch-free. It mirrors :meth:`laser.model_runner.ModelRunner.execute` exactly — layer by
layer, parking leaving works in the intermediate cache, asking ``stop_at`` at each
boundary — but advances a virtual clock by the latency model's prediction of each
layer call instead of running it. Arrivals are released at the boundary where the
virtual clock passes their time, as a server would deliver them mid-iteration.

This is the seed of the cluster simulator (same schedulers, the latency model as the
clock); unit tests use it to check scheduling decisions against deadlines.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..block_manager import BlockManager
from ..config import SchedulerConfig
from ..intermediate_cache import IntermediateCache
from ..plan import LayerStep, StepPlan, Work
from ..request import Request
from ..scheduler import get_policy


class VirtualClock:
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


class SimInstance:
    """One instance driven by a latency model.

    Args:
        policy: policy name. num_layers: N. latency_model: predicts each layer call.
        config: scheduler config (policy name is taken from ``policy``).
        num_blocks / block_size: KV pool per layer. icache_tokens: intermediate cache capacity.
        record_plans: keep every executed plan in ``stats.plans`` (tests).
    """

    def __init__(self, policy: str, num_layers: int, latency_model, config: SchedulerConfig | None = None,
                 num_blocks: int = 4096, block_size: int = 16, icache_tokens: int = 16384,
                 record_plans: bool = False):
        cfg = config or SchedulerConfig()
        cfg = SchedulerConfig(**{**cfg.__dict__, "policy": policy})
        self.clock = VirtualClock()
        self.lm = latency_model
        self.num_layers = num_layers
        self.bm = BlockManager(num_layers, num_blocks, block_size)
        self.icache = IntermediateCache(icache_tokens)
        self.scheduler = get_policy(policy)(cfg, num_layers, self.bm, self.icache, latency_model)
        self.scheduler.clock = self.clock
        self.stats = SimStats()
        self.record_plans = record_plans
        self._arrivals: list[Request] = []  # sorted by arrival_time
        self.finished: list[Request] = []

    def submit(self, req: Request) -> None:
        """Queue ``req`` for release at ``req.arrival_time`` (virtual seconds)."""
        self._arrivals.append(req)
        self._arrivals.sort(key=lambda r: r.arrival_time)

    def _release(self) -> None:
        while self._arrivals and self._arrivals[0].arrival_time <= self.clock.t:
            self.scheduler.add_request(self._arrivals.pop(0))

    def run(self, until: float = float("inf"), max_steps: int = 1_000_000) -> list[Request]:
        """Run until every submitted request finished (or ``until``). Returns finished requests."""
        for _ in range(max_steps):
            self._release()
            if not self.scheduler.has_unfinished():
                if not self._arrivals or self._arrivals[0].arrival_time > until:
                    break
                self.clock.t = self._arrivals[0].arrival_time
                continue
            if self.clock.t > until:
                break
            self.step()
        return self.finished

    def step(self) -> None:
        """One engine step: :meth:`begin_step` then :meth:`finish_step`."""
        plan = self.begin_step()
        if plan:
            self.finish_step(plan)

    def begin_step(self) -> StepPlan:
        """Schedule the next step at the current virtual time (allocates, admits). An
        empty plan lets time pass to the next queued arrival."""
        plan = self.scheduler.schedule(self.clock.t)
        if not plan:
            # nothing runnable (e.g. waiting on memory): let time pass to the next arrival
            if self._arrivals:
                self.clock.t = max(self.clock.t, self._arrivals[0].arrival_time)
        return plan

    def finish_step(self, plan: StepPlan) -> None:
        """Execute ``plan`` (from :meth:`begin_step`, clock unchanged since) layer by layer
        in virtual time, releasing arrivals at layer boundaries, then update the scheduler
        and finish requests that reached ``max_tokens``."""
        sched = self.scheduler
        if self.record_plans:
            self.stats.plans.append(StepPlan(plan.num_layers, list(plan.works)))
        t_start = self.clock.t
        stopped, sampled = self._execute(plan)
        self.stats.steps += 1
        self.stats.busy_s += self.clock.t - t_start
        for req in sched.update(plan, stopped, sampled, self.clock.t):
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                sched.finish(req, "length", self.clock.t)
                self.finished.append(req)

    def _execute(self, plan: StepPlan) -> tuple[int, dict[str, int]]:
        """Advance the clock through ``plan`` as ``ModelRunner.execute`` runs it (the same
        stop rule: a stop pauses prefill work, decode works run on; ``Work.reached``)."""
        n = self.num_layers
        starts, ends = plan.boundaries()
        active: list[Work] = []
        first, last = plan.first_layer, plan.last_layer
        stopped_at = None
        self.clock.t += self.lm.embed_time(sum(w.num_tokens for w in plan.works if w.layer_start == 0))
        for j in range(first, last):
            for w in ends.get(j, ()):
                if w in active:  # (not if a stop paused it, or kept it from starting)
                    active.remove(w)
                    self.icache.put(w.req_id, None, w.num_tokens)
            self._release()
            if stopped_at is None and j > first and self.scheduler.stop_at(j):
                stopped_at = j
                for w in [w for w in active if w.reached(j) == j]:
                    active.remove(w)
                    self.icache.put(w.req_id, None, w.num_tokens)
                if not active and not plan.starts_after_stop(j):
                    return j, {}
            for w in starts.get(j, ()):
                if stopped_at is not None and w.reached(stopped_at) <= j:
                    continue
                if w.layer_start > 0:
                    self.icache.pop(w.req_id)
                active.append(w)
            if active:
                step = LayerStep(j, tuple(w.num_tokens for w in active), tuple(w.context_len for w in active))
                self.clock.t += self.lm.predict_layer(step)
                self.stats.layer_calls += 1
        final = [w for w in active if w.layer_end == n]
        for w in active:
            if w.layer_end < n:
                self.icache.put(w.req_id, None, w.num_tokens)
        self.clock.t += self.lm.head_time(len(final))
        return (last if stopped_at is None else stopped_at), {w.req_id: 0 for w in final if w.sample}
