"""The simulated benchmark target (:class:`SimTarget`): the same schedulers on
:class:`~laser.sim.SimInstance` with a latency model as the clock (virtual time), and the
prefill/decode pair driver (:func:`run_sim_pair`)."""

from __future__ import annotations

import dataclasses
import math
import time

from laser.bench.target import RunOutput, Target, _slo_for, _summary_duration
from laser.bench.workloads import WorkloadRequest
from laser.core.metrics import record_from_request
from laser.core.request import SLO, Request, SamplingParams
from laser.latency.machine_speed import refuse_scattered, step_hook


def run_sim_pair(p, d, until: float = math.inf, max_steps: int = 2_000_000) -> None:
    """Advance a prefill sim ``p`` and a decode sim ``d`` together in virtual time: always
    step the one that is behind, so every hand-off is known before ``d`` passes its time."""
    for _ in range(max_steps):
        for h in p.handoffs:
            d.receive(h, h.time)
        p.handoffs.clear()
        tp, td = p.next_event(), d.next_event()
        if math.isinf(tp) and math.isinf(td):
            return
        if min(tp, td) > until:
            return
        if tp <= td:
            p.clock.t = max(p.clock.t, tp)
            p._release()
            if p.scheduler.has_unfinished():
                p.step()
        else:
            d.clock.t = max(d.clock.t, td)
            d._release()
            if d.scheduler.has_unfinished():
                d.step()
            elif d.adopts.num_waiting():
                # the pool cannot hold the next hand-off and nothing runs to free it
                raise RuntimeError("decode instance KV pool too small for a hand-off")
    raise RuntimeError("simulation did not finish within max_steps")


class SimTarget(Target):
    """One policy on simulated instances (virtual time; ``latency_model`` is the clock and
    what the policy plans with).

    ``served``: simulate the engine behind ``laser serve``'s HTTP front end: every output token
    reaches the client ``latency_model.frontend_ttft_s`` later than its step ends (the front end's
    measured share of a served TTFT; TBT unchanged). False (default): in process, no front end.

    ``machine_model``: the simulated machine's clock when it is not ``latency_model`` (e.g.
    :meth:`laser.latency.machine_speed.MachineSpeed.model`: the machine as a real run measured it;
    one whose steps scatter, :class:`~laser.latency.machine_speed.JitteredLatencyModel` (also
    under a wrapper), is reseeded at the start of every run, so each run sees the same draws;
    ``latency_model`` must not scatter: ValueError);
    ``planner``: ``latency_model -> the model the policy plans with``, called afresh for every run
    (e.g. ``laser.instance.model_instance.planning_model``: the engine's online calibration, which
    then learns the simulated machine's speed as the engine learns the real one's); None: both are
    ``latency_model``.

    ``frontend_override_s``: when ``served``, the seconds the front end adds as a real served run
    measured them under load (a served run's twin: the client's TTFT minus the engine's; the idle
    ``frontend_ttft_s`` is the front end with nothing else to do), instead of the latency model's."""

    kind = "sim"
    simulated = True

    def __init__(self, policy: str, latency_model, num_layers: int | None = None, config=None,
                 num_blocks: int = 4096, block_size: int = 16, icache_tokens: int = 16384,
                 disaggregated: bool = False, decode_icache_tokens: int = 2048, label: str | None = None,
                 served: bool = False, machine_model=None, planner=None, frontend_override_s: float | None = None):
        from laser.core.config import SchedulerConfig

        refuse_scattered(latency_model, "SimTarget's latency_model (what its scheduler plans with)")
        self.policy = policy
        self.lm = latency_model
        self.num_layers = num_layers or latency_model.num_layers
        self.config = config or SchedulerConfig(policy=policy)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.icache_tokens, self.decode_icache_tokens = icache_tokens, decode_icache_tokens
        self.disaggregated = disaggregated
        self.label = label or policy
        self.served = served
        self.machine_model, self.planner = machine_model, planner
        self.frontend_override_s = frontend_override_s
        self.last_sims: list = []

    def describe(self) -> dict:
        return {**super().describe(), "policy": self.policy, "disaggregated": self.disaggregated,
                "latency_model": type(self.lm).__name__, "num_layers": self.num_layers,
                "frontend_ttft_s": self.frontend_s(),
                "num_blocks": self.num_blocks, "block_size": self.block_size,
                "scheduler": dataclasses.asdict(self.config)}

    def frontend_s(self) -> float:
        """Seconds the front end adds to each token's arrival at the client: when ``served``,
        ``frontend_override_s`` if set, else the latency model's ``frontend_ttft_s``; else 0.0."""
        from laser.latency.base import frontend_ttft

        if not self.served:
            return 0.0
        return frontend_ttft(self.lm) if self.frontend_override_s is None else max(0.0, self.frontend_override_s)

    def _sim(self, role: str, icache: int):
        from laser.sim import SimInstance

        cfg = dataclasses.replace(self.config, policy=self.policy, role=role)
        lm = self.planner(self.lm) if self.planner is not None else self.lm
        return SimInstance(self.policy, self.num_layers, lm, cfg, num_blocks=self.num_blocks,
                           block_size=self.block_size, icache_tokens=icache, machine_model=self.machine_model)

    def run(self, requests, slos, timeout_s=None, progress=False, stop_below=None, background=None) -> RunOutput:
        """(Virtual time is cheap: ``stop_below`` is ignored and every run goes to the end.)
        ``background``: a :class:`~laser.bench.batchjob.JobDispatcher` run beside ``requests``
        (not disaggregated)."""
        t_start = time.perf_counter()
        reseed = step_hook(self.machine_model, "reseed")
        if reseed is not None:
            reseed()
        reqs = [_sim_request(wr, _slo_for(slos, wr.slo_class), wr.arrival_time, f"{self.label}-{i}")
                for i, wr in enumerate(requests)]
        until = math.inf if timeout_s is None else timeout_s
        if background is not None and self.disaggregated:
            raise ValueError("a background batch job runs on a mixed instance, not a disaggregated pair")
        if not self.disaggregated:
            sim = self._sim("mixed", self.icache_tokens)
            for r in reqs:
                sim._arrivals.append(r)
            sim._arrivals.sort(key=lambda r: r.arrival_time)
            if background is not None:
                background.attach(_sim_job_adder(sim), sim.scheduler, sim.clock, self.label)
            try:
                sim.run(until=until, max_steps=5_000_000,
                        before_step=background.dispatch if background is not None else None)
            finally:
                if background is not None:
                    background.abort_unfinished(sim.abort)
            self.last_sims = [sim]
            final = reqs
        else:
            p = self._sim("prefill", self.icache_tokens)
            d = self._sim("decode", self.decode_icache_tokens)
            p._arrivals = sorted(reqs, key=lambda r: r.arrival_time)
            run_sim_pair(p, d, until)
            self.last_sims = [p, d]
            final = [d.adopted.get(r.req_id, r) for r in reqs]
        records = [record_from_request(r) for r in final]
        fe = self.frontend_s()
        if fe > 0.0:  # served: the client reads every token fe later (TBT gaps unchanged)
            for rec in records:
                rec.token_times = [t + fe for t in rec.token_times]
        if all(r.finished for r in records):
            for s in self.last_sims:
                s.scheduler.check_integrity(expect_empty=True)
        busy = sum(s.stats.busy_s for s in self.last_sims)
        span = max(s.clock.t for s in self.last_sims) * len(self.last_sims)
        return RunOutput(records, _summary_duration(records), time.perf_counter() - t_start, busy_s=busy, span_s=span)


def _sim_request(wr: WorkloadRequest, slo: SLO, arrival: float, req_id: str) -> Request:
    """A simulated request of ``wr``'s lengths (dummy token ids; greedy, ``ignore_eos``)."""
    return Request(prompt_token_ids=[1] * wr.prompt_len,
                   sampling_params=SamplingParams(max_tokens=wr.output_len, temperature=0.0, ignore_eos=True),
                   slo=slo, arrival_time=arrival, req_id=req_id)


def _sim_job_adder(sim):
    """``add(req_id, workload request, slo, now)`` for a batch job's requests on ``sim``."""
    def add(req_id: str, wr: WorkloadRequest, slo: SLO, now: float) -> Request:
        req = _sim_request(wr, slo, now, req_id)
        sim.add_request(req)
        return req
    return add
