"""The capacity planner (``laser plan``): the plan passes the target, one instance fewer
does not (among the splits searched), and bad input is rejected."""

from __future__ import annotations

import pytest

from laser.bench.plan import CapacityPlanner, attainment, balanced_split, parse_mix, table1_requests
from laser.latency import SimpleLatencyModel
from laser.sim.cluster import ClusterConfig

LM = SimpleLatencyModel(num_layers=4, per_layer=2e-4, per_token=2e-5, per_context=1e-7)


def config() -> ClusterConfig:
    return ClusterConfig(latency_model=LM, kv_bytes_per_token_layer=4096, num_blocks=1024, gpus_per_node=2)


@pytest.mark.parametrize("controller", ["laser", "colocated"])
def test_plan_is_the_smallest_passing_cluster(controller):
    planner = CapacityPlanner(controller, config(), requests=60, target=0.9, max_instances=16, log=lambda *_: None)
    plan = planner.plan(40.0, (1, 1, 1))
    assert plan.best is not None and plan.best.attainment >= 0.9
    smaller = [p for p in plan.probes if p.total < plan.best.total]
    assert smaller, "the search probed no smaller cluster"
    assert all(p.attainment < 0.9 for p in smaller)
    if controller == "laser":
        assert 1 <= plan.best.prefill < plan.best.total
    else:
        assert plan.best.prefill == 0


def test_more_load_needs_no_fewer_instances():
    planner = CapacityPlanner("laser", config(), requests=60, max_instances=16, log=lambda *_: None)
    low, high = planner.plan(20.0, (1, 1, 1)), planner.plan(80.0, (1, 1, 1))
    assert low.best is not None and high.best is not None
    assert high.best.total >= low.best.total


def test_workload_follows_mix_and_scale():
    reqs = table1_requests(600, 10.0, (0, 1, 0), seed=1, slo_scale=0.8)
    assert {r.slo.name for r in reqs} == {"code"}
    assert all(r.slo.ttft == pytest.approx(0.1) and r.slo.tbt == pytest.approx(0.04) for r in reqs)
    mean_prompt = sum(r.num_prompt_tokens for r in reqs) / len(reqs)
    assert 170 < mean_prompt < 235  # Table 1: 201.5
    assert attainment([]) == 0.0
    assert 1 <= balanced_split(LM, 8, (1, 1, 1)) <= 7


@pytest.mark.parametrize("bad", ["1:1", "a:b:c", "0:0:0", "-1:1:1", "1:1:inf"])
def test_bad_mix_is_rejected(bad):
    with pytest.raises(ValueError):
        parse_mix(bad)


@pytest.mark.parametrize("controller,max_instances,rate", [("laser", 1, 40.0), ("colocated", 2, 4000.0)])
def test_plan_never_probes_more_than_max_instances(controller, max_instances, rate):
    """``laser plan --max-instances 1`` (a disaggregated controller needs 2) and ``--rate 200
    --max-instances 4`` (the prefill work alone keeps 23 instances busy) probed and answered
    clusters of 2 and 23 instances ('plan: 18P5D (23 instances ...)'). No cluster larger than
    ``max_instances`` is probed; there is no plan."""
    planner = CapacityPlanner(controller, config(), requests=30, max_instances=max_instances, log=lambda *_: None)
    plan = planner.plan(rate, (1, 1, 1))
    assert plan.best is None
    assert all(p.total <= max_instances for p in plan.probes)
