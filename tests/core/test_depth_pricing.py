"""A plan's price of a decode token that may exit early (issue 31 item 3): its expected layers
plus its exit checks (:class:`laser.core.depth.ExitCost`, one owner), the same rule in the
scheduler's plans (:class:`laser.core.pricing.PlanCost`) and on the simulator's clock
(:class:`laser.sim.instance.SimDepth`). Torch-free."""

from __future__ import annotations

import pytest

from laser.core.depth import DynamicDepth, ExitCost, exit_plan
from laser.core.plan import StepPlan, Work
from laser.core.pricing import PlanCost
from laser.core.request import SLO, Request, SamplingParams
from laser.latency import SimpleLatencyModel

N = 12


def _lm(cost=None):
    lm = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-5, per_context=1e-7, per_embed_token=1e-6,
                            head_const=5e-4, per_head_row=1e-4)
    lm.exit_cost = cost
    return lm


def _works(depth: int, exit_from: int) -> list[Work]:
    return [Work("a", 40, 1, 0, N, True, depth=depth, exit_from=exit_from),  # a decode token that may exit
            Work("b", 70, 1, 0, N, True),  # one that does not opt in
            Work("c", 0, 32, 0, N, True)]  # a prefill chunk


def test_opting_token_priced_at_expected_depth_plus_its_checks():
    cost = ExitCost(frozenset({4, 8}), head_fraction=0.25, fill_fraction=0.5)
    lm = _lm(cost)
    alone = Work("a", 40, 1, 0, N, True)
    full = PlanCost(lm, N, [alone]).total  # as priced before: every layer, the LM head
    shallow = PlanCost(lm, N, [Work("a", 40, 1, 0, N, True, depth=8, exit_from=3)])
    checks = 2 * 0.25 * lm.head_time(1)  # at layers 4 and 8
    fill = 0.5 * (N - 8) * lm.stateless_time(1)
    assert shallow.total < full
    assert shallow.total == pytest.approx(8 * lm.layer_time((1,), (41,)) + lm.embed_time(1) + checks + fill)
    # in a batch: layers 8..11 run without it, its LM head row goes, its checks and fill come
    full = PlanCost(lm, N, _works(0, 0)).total
    shallow = PlanCost(lm, N, _works(8, 3))
    q_all, c_all = (1, 1, 32), (41, 71, 32)
    layer_gain = (N - 8) * (lm.layer_time(q_all, c_all) - lm.layer_time((1, 32), (71, 32)))
    assert shallow.exits == pytest.approx(checks + fill)
    assert shallow.total == pytest.approx(full - layer_gain - (lm.head_time(3) - lm.head_time(2)) + checks + fill)
    # the checks are counted: the same plan with free checks is cheaper by exactly them
    free = PlanCost(_lm(ExitCost(frozenset({4, 8}), 0.0, 0.5)), N, _works(8, 3)).total
    assert shallow.total - free == pytest.approx(checks)
    # a token expected to run every layer pays every check from its min depth on, and its head
    assert PlanCost(lm, N, _works(N, 3)).total == pytest.approx(full + checks)
    assert PlanCost(lm, N, _works(N, 5)).exits == pytest.approx(0.25 * lm.head_time(1))  # min depth 5: only 8
    # a model without an exit cost prices the depth only
    assert PlanCost(_lm(), N, _works(8, 3)).total == pytest.approx(shallow.total - checks - fill)


def test_with_work_and_predict_iteration_agree():
    lm = _lm(ExitCost(frozenset({4, 8}), head_fraction=0.25, fill_fraction=0.5))
    ws = _works(8, 3)
    for i in range(len(ws)):
        rest = ws[:i] + ws[i + 1:]
        assert PlanCost(lm, N, rest).with_work(ws[i]) == pytest.approx(PlanCost(lm, N, ws).total, rel=1e-12)
    assert lm.predict_iteration(StepPlan(N, ws)) == PlanCost(lm, N, ws).total


def test_non_opting_plans_priced_as_before():
    """No work opts in: the price is the same sum as without dynamic depth, bit for bit."""
    lm = _lm(ExitCost(frozenset({4, 8}), head_fraction=0.25, fill_fraction=0.5))
    ws = _works(0, 0)
    plain = _lm()
    assert PlanCost(lm, N, ws).total == PlanCost(plain, N, ws).total
    assert PlanCost(lm, N, ws[1:]).with_work(ws[0]) == PlanCost(plain, N, ws[1:]).with_work(ws[0])


def _request(rid: str, dd: DynamicDepth | None, expected: float | None = None) -> Request:
    r = Request([1] * 20, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, dynamic_depth=dd),
                SLO(ttft=None, tbt=1.0, name="x"), req_id=rid)
    r.output_token_ids = [5]
    r.num_computed_tokens = 20
    r.expected_layers = expected
    return r


def test_exit_plan_of_a_request():
    dd = DynamicDepth(threshold=0.5, min_depth=3)
    assert exit_plan(_request("a", dd, 6.2), 20, 1, N) == (7, 3)  # a whole layer slot: rounded up
    assert exit_plan(_request("a", dd), 20, 1, N) == (N, 3)  # no expectation yet: full depth, still checked
    assert exit_plan(_request("a", DynamicDepth()), 20, 1, N) == (N, 3)  # min depth: a quarter of 12
    assert exit_plan(_request("a", None, 6.0), 20, 1, N) == (0, 0)  # not opted in
    assert exit_plan(_request("a", dd, 6.0), 19, 2, N) == (0, 0)  # not a decode token


@pytest.mark.parametrize("policy", ["vllm", "laser"])
def test_simulator_clock_agrees_with_the_plan_price(policy):
    """One opting request alone on a simulated instance whose tokens all leave at layer 8: once
    its expected depth is 8, every step's simulated time equals the price its plan was given,
    checks and fill included (the scheduler and the machine use one rule)."""
    from laser.sim.instance import SimDepth, SimInstance

    lm = _lm()
    dm = SimDepth(((8, 1.0),), frozenset({4, 8}), head_fraction=0.25, fill_fraction=0.5)
    sim = SimInstance(policy, N, lm, depth_model=dm, record_plans=True)
    assert lm.exit_cost == dm.cost
    req = Request([1] * 20, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                           dynamic_depth=DynamicDepth(threshold=0.5, min_depth=3)),
                  SLO(ttft=None, tbt=1.0, name="x"), arrival_time=0.0, req_id="r")
    sim.submit(req)
    sim.run()
    sim.check_integrity(expect_empty=True)
    assert req.num_depth_tokens == 9 and req.mean_depth == 8
    plans = [p for p in sim.stats.plans if p.works[0].num_tokens == 1]  # the decode steps, in order
    assert len(plans) == 9
    assert (plans[0].works[0].depth, plans[0].works[0].exit_from) == (N, 3)  # no expectation yet
    gaps = [b - a for a, b in zip(req.token_times, req.token_times[1:])]
    for p, gap in zip(plans[1:], gaps[1:]):
        w = p.works[0]
        assert (w.depth, w.exit_from) == (8, 3)
        assert gap == pytest.approx(lm.predict_iteration(p), rel=1e-9)
    # and each is cheaper than the same step priced at full depth
    w = plans[-1].works[0]
    full = Work(w.req_id, w.token_start, 1, 0, N, True)
    assert lm.predict_iteration(plans[-1]) < lm.predict_iteration(StepPlan(N, [full]))


def test_alg1_layer_load_prices_as_the_plan():
    """Alg. 1's iteration price (:class:`laser.scheduler.laser.decode._LayerLoad`) of decoding
    requests, one opting in, equals the price of the plan that runs them (one rule)."""
    from laser.scheduler.laser.decode import DecodePlan, _LayerLoad

    lm = _lm(ExitCost(frozenset({4, 8}), head_fraction=0.25, fill_fraction=0.5))
    dd = DynamicDepth(threshold=0.5, min_depth=3)
    reqs = [_request("a", dd, 7.5), _request("b", None), _request("c", dd)]
    plans = {r.req_id: DecodePlan(N, 0) for r in reqs}
    works = [Work(r.req_id, 20, 1, 0, N, True, False, *exit_plan(r, 20, 1, N)) for r in reqs]
    assert [(w.depth, w.exit_from) for w in works] == [(8, 3), (0, 0), (N, 3)]
    load = _LayerLoad(lm, N, 0, reqs, plans)
    assert load.predict() == pytest.approx(PlanCost(lm, N, works).total, rel=1e-12)
    plain = [Work(r.req_id, 20, 1, 0, N, True) for r in reqs]
    assert load.predict() != pytest.approx(PlanCost(lm, N, plain).total)
