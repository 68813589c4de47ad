"""A decode or mixed instance's steady steps, built directly (``LaserScheduler._steady_decode_plan``), make
the same plans, allocations and virtual times as the generic ``schedule`` path; the simulated
executor's one-segment run and its per-composition layer price match the walker; a cluster
instance's reused report equals a fresh one. Each case runs with the shortcut on and off
(``steady_decode``) and compares every request's times, every executed plan and the KV pool."""

from __future__ import annotations

import random

import pytest

from laser.core.config import SchedulerConfig
from laser.instance.core import Handoff
from laser.instance.state import build_report
from laser.latency import SimpleLatencyModel
from laser.core.request import SLO, Phase, Request, SamplingParams
from laser.scheduler.laser.scheduler import LaserScheduler
from laser.sim import SimInstance
from laser.sim.cluster import ClusterConfig, ClusterSim, ClusterSpec, paper_config
from laser.sim.cluster_instance import SimClusterInstance

N = 6
LM = SimpleLatencyModel(num_layers=N, per_layer=2e-4, per_token=2e-6, per_context=1e-8)


def _handoffs(n: int, seed: int, tight: bool = False) -> list[Handoff]:
    """Prefilled requests reaching a decode instance: prompts that end on and off block boundaries
    (16-token blocks), outputs of equal lengths (several finish in one step), deliveries spread
    over the run (they land mid-step); ``tight``: TBT targets that make Alg. 1 cut some requests
    to L < N."""
    rng = random.Random(seed)
    slos = ([SLO(0.01, 0.0014, "strict"), SLO(0.05, 0.004, "loose"), SLO(None, None, "best-effort")] if tight
            else [SLO(0.1, 0.02, "chat"), SLO(0.2, 0.05, "code"), SLO()])
    out = []
    for i in range(n):
        p = rng.choice([15, 16, 17, 31, 32, 33, rng.randint(1, 120)])
        r = Request([1] * p, SamplingParams(max_tokens=rng.choice([1, 2, 17, 17, rng.randint(3, 60)]), ignore_eos=True),
                    slos[i % 3], arrival_time=0.002 * i, req_id=f"d{i}")
        r.num_computed_tokens = p
        r.output_token_ids = [0]
        r.token_times = [r.arrival_time + 0.001]
        r.phase = Phase.DECODE
        out.append(Handoff(r, None, r.arrival_time + 0.001))
    return out


def _decode_run(steady: bool, num_blocks: int, tight: bool, seed: int, lm=LM):
    inst = SimInstance("laser", N, lm, SchedulerConfig(role="decode", max_num_seqs=64), num_blocks=num_blocks,
                       record_plans=True)
    inst.scheduler.steady_decode = steady
    for h in _handoffs(40, seed, tight):
        inst.receive(h, h.time)
    return _run_outcome(inst)


@pytest.mark.parametrize("num_blocks,tight", [(4096, False), (24, False), (4096, True), (30, True)],
                         ids=["roomy", "preempting", "alg1-cuts", "alg1-cuts-preempting"])
@pytest.mark.parametrize("seed", [1, 2])
def test_steady_decode_steps_equal_the_generic_path(num_blocks, tight, seed):
    on, off = _decode_run(True, num_blocks, tight, seed), _decode_run(False, num_blocks, tight, seed)
    assert on[:-1] == off[:-1]  # every token time, plan, price, preemption, bit for bit
    assert on[-1] > 0 and off[-1] == 0  # the shortcut ran, and was off in the reference
    if num_blocks < 100:
        assert on[5] > 0  # the small pool forced preemptions (the shortcut declines those steps)
    if tight:  # Alg. 1 cut requests to L < N layers per iteration (the shortcut declines those steps)
        assert any(w.layer_end < N for works, _ in on[1] for w in works)


@pytest.mark.parametrize("role", ["decode", "mixed"])
def test_steady_steps_price_the_step_overhead_as_the_generic_path(role):
    """With a latency model that prices the step's own overhead (a profiled engine's), every step's
    prediction and prefill share are the generic path's (PlanCost's overhead terms included)."""
    lm = SimpleLatencyModel(num_layers=N, per_layer=2e-4, per_token=2e-6, per_context=1e-8)
    lm.step_overhead_s, lm.compose_overhead_s, lm.compose_work_s = 3e-4, 5e-5, 2e-6
    runs = []
    for steady in (True, False):
        inst = SimInstance("laser", N, lm, SchedulerConfig(role=role), num_blocks=4096)
        s = inst.scheduler
        s.steady_decode = steady
        if role == "decode":  # prefilled elsewhere
            for h in _handoffs(4, seed=3):
                h.request.sampling_params = SamplingParams(max_tokens=30, ignore_eos=True)
                inst.receive(h, 0.0)
        else:
            for i in range(4):
                inst.add_request(Request([1] * (20 + 7 * i), SamplingParams(max_tokens=30, ignore_eos=True),
                                         SLO(0.2, 0.004, "chat"), req_id=f"o{i}"))
        seen = []
        for _ in range(25):
            inst._release()
            plan = inst.schedule()
            seen.append((plan.works, plan.predicted[1] if plan.predicted else None, s.prefill_rate))
            inst.execute(plan)
        runs.append((seen, s.num_steady_steps))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] > 0 and runs[1][1] == 0


def _decode_instance(steady: bool, num_blocks: int = 64) -> SimInstance:
    inst = SimInstance("laser", N, LM, SchedulerConfig(role="decode"), num_blocks=num_blocks)
    inst.scheduler.steady_decode = steady
    return inst


def test_steady_plan_allocates_block_boundaries_in_queue_order_and_declines_what_it_cannot_do():
    """Two schedulers in the same state: the block ids each request gets at a block boundary,
    the plan and the prefill share match; with the pool one block short the shortcut declines
    (nothing changed) and the generic path preempts."""
    for free_short in (False, True):
        states = []
        for steady in (True, False):
            inst = _decode_instance(steady, num_blocks=9 if free_short else 64)
            for h in _handoffs(6, seed=3):
                h.request.prompt_token_ids = [1] * 15  # KV of 15 tokens: one block each
                h.request.num_computed_tokens = 15
                h.request.sampling_params = SamplingParams(max_tokens=50, ignore_eos=True)
                inst.receive(h, 0.0)
            inst._release()
            inst.step()  # a replan (new requests): the generic path; each request's 17th token is next
            s = inst.scheduler
            before = (s.num_steady_steps, s.bm.min_free())
            events = inst.step()
            states.append((sorted((r.req_id, tuple(s.bm.table(r.req_id, 0))) for r in s.running),
                           [(e.request.req_id, e.token) for e in events], s.prefill_rate, s.num_preemptions,
                           s.num_steady_steps - before[0]))
        assert states[0][:4] == states[1][:4]
        assert states[0][4] == (0 if free_short else 1)  # declined when someone must be preempted
        assert (states[1][3] > 0) == free_short


@pytest.mark.parametrize("scenario", ["paper-2P2D", "small-tight-2P2D", "small-pool-2P2D"])
def test_cluster_with_steady_decode_steps_is_bit_identical(monkeypatch, scenario):
    rng = random.Random(4)

    def reqs(n, rate, slos, scale):
        t, out = 0.0, []
        for i in range(n):
            t += rng.expovariate(rate)
            out.append(Request([1] * max(1, int(rng.lognormvariate(0, 0.5) * 300 * scale)),
                               SamplingParams(max_tokens=max(1, int(rng.lognormvariate(0, 0.5) * 150 * scale)),
                                              ignore_eos=True), slos[i % len(slos)], arrival_time=t, req_id=f"c{i}"))
        return out

    out = []
    for steady in (True, False):
        monkeypatch.setattr(LaserScheduler, "steady_decode", steady)
        rng.seed(4)
        if scenario == "paper-2P2D":
            sim = ClusterSim("laser", ClusterSpec.parse("2P2D"), paper_config("qwen2.5-14b", "a100"))
            work = reqs(50, 10.0, [SLO(0.25, 0.1, "chat"), SLO(0.125, 0.05, "code"), SLO(2.0, 0.2, "sum")], 1.0)
        else:
            small = SimpleLatencyModel(num_layers=4, per_layer=2e-4, per_token=2e-6, per_context=1e-8)
            cfg = ClusterConfig(latency_model=small, kv_bytes_per_token_layer=4096,
                                num_blocks=48 if scenario == "small-pool-2P2D" else 400, gpus_per_node=2)
            sim = ClusterSim("laser", ClusterSpec.parse("2P2D"), cfg)
            slos = [SLO(0.01, 0.0011, "strict"), SLO(0.05, 0.004, "loose"), SLO(0.2, None, "best-effort")]
            work = reqs(60, 400.0, slos, 0.2)
        res = sim.run(work)
        steady_steps = sum(getattr(i.scheduler, "num_steady_steps", 0) for i in sim.instances)
        out.append(([(r.req_id, r.first_token_time, tuple(r.token_times), r.finish_time, r.finish_reason)
                     for r in res.requests], res.events, res.transfers, res.migrations, res.reassigned, steady_steps))
    assert out[0][:-1] == out[1][:-1]
    assert out[0][-1] > 0 and out[1][-1] == 0


def test_reused_report_equals_a_fresh_one(monkeypatch):
    """Every report a cluster run's controller reads equals the report built afresh at that moment."""
    checked = {"n": 0, "reused": 0}
    original = SimClusterInstance.report

    def report(self):
        cached = self._report
        rep = original(self)
        busy = self.plan_end if self.plan is not None else self.clock
        fresh = build_report(self.instance_id, self.role, self.scheduler, self.sim.bm, self.sim.icache, self.clock, busy,
                             self.sim.queued(), self.sim.adopting(), len(self.reserved))
        assert rep == fresh
        checked["n"] += 1
        checked["reused"] += cached is not None and rep is cached[1]
        return rep

    monkeypatch.setattr(SimClusterInstance, "report", report)
    sim = ClusterSim("laser", ClusterSpec.parse("3P2D"), paper_config("qwen2.5-14b", "a100"))
    rng = random.Random(2)
    t, work = 0.0, []
    for i in range(60):
        t += rng.expovariate(15.0)
        work.append(Request([1] * rng.randint(50, 3000), SamplingParams(max_tokens=rng.randint(1, 80), ignore_eos=True),
                            SLO(0.5, 0.1, "chat"), arrival_time=t, req_id=f"q{i}"))
    sim.run(work)
    assert checked["n"] > 100 and checked["reused"] > 0


def test_one_segment_execute_equals_the_layer_by_layer_walk():
    """Plans whose works all run layers [0, N) (decode steps at full depth, whole prefills): the
    executor's direct run gives the walker's clock (layer by layer), samples and layer calls."""
    from laser.core.block_manager import BlockManager
    from laser.core.walk import walk
    from laser.core.intermediate_cache import IntermediateCache
    from laser.core.plan import StepPlan, StepResult, Work
    from laser.sim.instance import SimExecutor, SimStats, VirtualClock

    lm = paper_config("qwen2.5-14b", "a100").latency_model
    n = lm.num_layers
    rng = random.Random(9)
    for _ in range(200):
        works = [Work(f"w{i}", s, q, 0, n, rng.random() < 0.8)
                 for i, (s, q) in enumerate((rng.randint(0, 4000), rng.choice([1, 1, rng.randint(1, 900)]))
                                           for _ in range(rng.randint(1, 12)))]
        plan = StepPlan(n, works)
        t0, out = rng.random(), []
        for direct in (True, False):
            clock = VirtualClock(t0)
            ex = SimExecutor(lm, n, BlockManager(n, 8, 16), IntermediateCache(1 << 20), clock, SimStats())
            if direct:
                res = ex.execute(plan, {})
            else:  # the walker, one layer call at a time (the executor's price per composition)
                ex._res = res = StepResult(stopped_layer=0)
                clock.t += lm.embed_time(sum(w.num_tokens for w in works))
                res.stopped_layer = walk(plan, ex, lambda j: False)
            out.append((clock.t, res.stopped_layer, res.num_layer_calls, res.sampled))
        assert out[0] == out[1]


def _mixed_run(steady: bool, num_blocks: int, tight: bool, seed: int):
    """A mixed (colocated) instance serving a Poisson stream: prefills arrive while others decode."""
    rng = random.Random(seed)
    slos = ([SLO(0.01, 0.0014, "strict"), SLO(0.05, 0.004, "loose"), SLO(None, None, "best-effort")] if tight
            else [SLO(0.1, 0.02, "chat"), SLO(0.2, 0.05, "code"), SLO()])
    inst = SimInstance("laser", N, LM, SchedulerConfig(role="mixed", max_num_seqs=64), num_blocks=num_blocks,
                       record_plans=True)
    inst.scheduler.steady_decode = steady
    t = 0.0
    for i in range(40):
        t += rng.expovariate(300.0)
        inst.submit(Request([1] * rng.choice([15, 16, 17, rng.randint(1, 120)]),
                            SamplingParams(max_tokens=rng.choice([1, 17, rng.randint(3, 80)]), ignore_eos=True),
                            slos[i % 3], arrival_time=t, req_id=f"m{i}"))
    return _run_outcome(inst)


@pytest.mark.parametrize("num_blocks,tight", [(4096, False), (40, False), (4096, True)],
                         ids=["roomy", "preempting", "alg1-cuts"])
@pytest.mark.parametrize("seed", [1, 2])
def test_mixed_instance_steady_steps_equal_the_generic_path(num_blocks, tight, seed):
    """A mixed instance takes the steady shortcut between arrivals, with the generic path's plans."""
    on, off = _mixed_run(True, num_blocks, tight, seed), _mixed_run(False, num_blocks, tight, seed)
    assert on[:-1] == off[:-1]  # every token time, plan, price, preemption, bit for bit
    assert on[-1] > 0 and off[-1] == 0  # the shortcut ran on the mixed instance


def _steady_mixed(n: int = 3, num_blocks: int = 64) -> SimInstance:
    """A mixed instance whose ``n`` requests all decode at full depth, the last step a steady one."""
    inst = SimInstance("laser", N, LM, SchedulerConfig(role="mixed"), num_blocks=num_blocks)
    for i in range(n):
        inst.add_request(Request([1] * 20, SamplingParams(max_tokens=60, ignore_eos=True), SLO(0.1, 0.02, "chat"),
                                 req_id=f"s{i}"))
    for _ in range(10):
        inst.step()
    assert inst.scheduler.num_steady_steps > 0
    return inst


@pytest.mark.parametrize("event", ["arrival", "finish", "preemption"])
def test_mixed_steady_shortcut_yields_to_the_generic_path_after_an_event(event):
    """An arrival, a finished request or a preemption changes what the plan rests on: the next step
    is planned by the generic path (and the one after it is steady again)."""
    inst = _steady_mixed()
    s = inst.scheduler
    if event == "arrival":
        inst.add_request(Request([1] * 30, SamplingParams(max_tokens=5, ignore_eos=True), SLO(0.1, 0.02, "chat"),
                                 req_id="new"))
    elif event == "finish":
        inst.abort("s1")
    else:
        s.preempt(s.running[-1])
    before = s.num_steady_steps
    plan = inst.schedule()
    assert s.num_steady_steps == before and plan.works
    inst.execute(plan)
    if event == "finish":
        inst.step()
        assert s.num_steady_steps == before + 1


def _run_outcome(inst):
    """Run a simulated instance to the end and return what the shortcut must not change: each
    finished request's token times, finish and misses, every plan with its price, the clock and the
    scheduler's counters (steady steps last)."""
    inst.run()
    inst.check_integrity(expect_empty=True)
    s = inst.scheduler
    done = sorted((r.req_id, tuple(r.token_times), r.finish_time, r.finish_reason, r.num_tbt_misses, r.num_preemptions)
                  for r in inst.finished)
    plans = [(p.works, p.predicted) for p in inst.stats.plans]
    return done, plans, inst.clock.t, s.iteration, s.num_replans, s.num_preemptions, s.num_steady_steps
