"""The simulator's segment fast path gives the same virtual times, parks and outputs as the
layer-by-layer walk: on random plans (executor level), on single instances under every
policy, and on whole clusters (the fast path switched off by clearing ``next_release``)."""

from __future__ import annotations

import random

import pytest

from laser.core.block_manager import BlockManager
from laser.core.walk import walk
from laser.core.intermediate_cache import IntermediateCache
from laser.latency import AnalyticLatencyModel, HARDWARE, ModelShape, SimpleLatencyModel
from laser.core.plan import StepPlan, StepResult
from laser.core.request import SLO, Request, SamplingParams
from laser.sim import SimInstance
from laser.sim.cluster import ClusterConfig, ClusterSim, ClusterSpec
from laser.sim.instance import SimExecutor, SimStats, VirtualClock
from simutil import random_plan

N = 12
LM = SimpleLatencyModel(num_layers=N, per_layer=2e-4, per_token=2e-6, per_context=1e-8)
ANALYTIC = AnalyticLatencyModel(ModelShape.preset("qwen2.5-14b"), HARDWARE["a100-80gb"], tp=1)


class _PerLayer:
    """The same executor without ``run_layers``: the walker calls ``run_layer`` per layer."""

    def __init__(self, ex: SimExecutor):
        self.ex = ex

    def __getattr__(self, name):
        if name == "run_layers":
            raise AttributeError(name)
        return getattr(self.ex, name)


def run_plan(plan: StepPlan, lm, segments: bool):
    n = plan.num_layers
    icache = IntermediateCache(1 << 20)
    for w in plan.works:  # a work starting mid-model resumes a paused state
        if w.layer_start > 0:
            icache.put(w.req_id, None, w.num_tokens)
    clock = VirtualClock(1.0)
    ex = SimExecutor(lm, n, BlockManager(n, 8, 16), icache, clock, SimStats())
    ex._res = res = StepResult(stopped_layer=0)
    res.stopped_layer = walk(plan, ex if segments else _PerLayer(ex), None)
    return clock.t, res.stopped_layer, res.num_layer_calls, dict(icache._entries), getattr(res, "sampled", {})


@pytest.mark.parametrize("lm", [LM, ANALYTIC], ids=["simple", "analytic"])
def test_segment_walk_equals_layer_walk_on_random_plans(lm):
    rng = random.Random(7)
    for _ in range(300):
        plan = random_plan(rng, lm.num_layers if lm is ANALYTIC else N, sample_p=0.8)
        fast, slow = run_plan(plan, lm, True), run_plan(plan, lm, False)
        assert fast == slow  # bit-identical clock, parks, samples and layer-call count


def workload(n: int, rate: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    slos = [SLO(0.05, 0.01, "code"), SLO(0.1, 0.02, "chat"), SLO(0.8, 0.04, "summarization"), SLO()]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        p = rng.choice([1, 8, rng.randint(1, 200), rng.randint(200, 900)])
        out.append(Request([1] * p, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True),
                           slos[i % len(slos)], arrival_time=t, req_id=f"r{i}"))
    return out


def timings(reqs):
    return [(r.req_id, r.first_token_time, r.finish_time, tuple(r.token_times), r.finish_reason) for r in reqs]


@pytest.mark.parametrize("policy", ["laser", "sarathi", "vllm"])
def test_instance_fast_path_changes_nothing(policy):
    out = []
    for fast in (True, False):
        inst = SimInstance(policy, N, LM, num_blocks=96)
        if not fast:
            inst.executor.next_release = None
        for r in workload(80, 300.0, seed=5):
            inst.submit(r)
        done = inst.run()
        assert len(done) == 80
        inst.check_integrity(expect_empty=True)
        out.append((sorted(timings(done)), inst.stats.layer_calls, inst.executor.fast_steps))
    assert out[0][:2] == out[1][:2]
    assert out[0][2] > 0 and out[1][2] == 0  # the fast path ran, and was off in the reference


@pytest.mark.parametrize("controller,spec", [("laser", "2P2D"), ("distserve", "2P2D"), ("colocated", "3M")])
def test_cluster_fast_path_changes_nothing(controller, spec):
    cfg = dict(latency_model=LM, kv_bytes_per_token_layer=4096, num_blocks=256, gpus_per_node=2)
    out = []
    for fast in (True, False):
        sim = ClusterSim(controller, ClusterSpec.parse(spec), ClusterConfig(**cfg))
        if not fast:
            for i in sim.instances:
                i.sim.executor.next_release = None
        res = sim.run(workload(80, 200.0, seed=11))
        out.append((timings(res.requests), res.events, sum(i.sim.executor.fast_steps for i in sim.instances)))
    assert out[0][:2] == out[1][:2]
    assert out[0][2] > 0 and out[1][2] == 0
