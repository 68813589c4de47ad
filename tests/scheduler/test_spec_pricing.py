"""Pricing self-speculation for the Laser scheduler (laser.core.speculation), torch-free: the
speculative step's layer calls, a plan with speculating decode works (PlanCost), and Alg. 1's
iteration price (a speculating full-depth request costs its draft and verify passes; relaxed to
layer groups it decodes them plainly)."""

from __future__ import annotations

import pytest

from laser.core.plan import Work
from laser.core.pricing import PlanCost
from laser.core.request import SLO, Request, SamplingParams
from laser.core.speculation import SpecShape, spec_decode_time, speculates
from laser.latency import SimpleLatencyModel
from laser.scheduler.laser.decode import DecodePlan, _LayerLoad, exec_plan

N = 4
LM = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=2e-5, per_context=1e-6, per_embed_token=1e-6,
                        head_const=1e-4, per_head_row=1e-5)


def _req(prompt_len: int, max_tokens: int = 50, tbt=None, temperature=0.0, **sp) -> Request:
    return Request(prompt_token_ids=[5] * prompt_len,
                   sampling_params=SamplingParams(max_tokens=max_tokens, temperature=temperature, **sp),
                   slo=SLO(ttft=1.0, tbt=tbt, name="x"), arrival_time=0.0)


def test_spec_decode_time_is_the_executors_layer_calls():
    rows = [(10, 2), (20, 0)]
    k = 1
    want = (k * LM.layer_time((1, 1), (10, 20)) + LM.embed_time(2) + LM.head_time(1)  # pass 0, one drafts
            + k * LM.layer_time((1,), (11,)) + LM.embed_time(1) + LM.head_time(1)  # pass 1
            + k * LM.layer_time((1,), (12,)) + LM.embed_time(1)  # pass 2 feeds the last draft
            + (N - k) * LM.layer_time((3, 1), (12, 20)) + LM.head_time(4))  # verify chunk
    assert spec_decode_time(LM, N, k, rows) == pytest.approx(want, rel=1e-12)
    assert spec_decode_time(LM, N, k, []) == 0.0


def test_draft_len_and_who_speculates():
    sh = SpecShape(exit_layer=2, draft_tokens=3, max_model_len=64)
    assert sh.draft_len(_req(8)) == 3
    assert sh.draft_len(_req(8, max_tokens=2)) == 1  # emitted tokens <= max_tokens
    assert sh.draft_len(_req(62)) == 2  # the context limit
    assert sh.draft_len(_req(8, temperature=0.8, top_p=0.9, seed=3)) == 3
    assert not speculates(_req(8, logprobs=1).sampling_params)
    assert not speculates(_req(8, presence_penalty=0.5).sampling_params)  # greedy with processing
    assert speculates(_req(8, temperature=0.8, presence_penalty=0.5).sampling_params)
    # a dynamic-depth request leaves the model at an exit; it is not verified (a fresh user's
    # server with both flags decoded it speculatively at full depth)
    assert not speculates(_req(8, dynamic_depth=True).sampling_params)
    assert sh.draft_len(_req(8, dynamic_depth={"threshold": 0.9})) == 0


def test_plan_cost_prices_speculating_works_apart():
    dec = [Work("a", 11, 1, 0, N), Work("b", 29, 1, 0, N), Work("c", 15, 1, 0, 2)]
    pre = Work("p", 0, 16, 0, N)
    drafts = {"a": 3, "b": 1}
    cost = PlanCost(LM, N, dec, drafts, 2)
    spec = spec_decode_time(LM, N, 2, [(12, 3), (30, 1)])
    assert cost.spec_seconds == pytest.approx(spec)
    assert cost.total == pytest.approx(PlanCost(LM, N, dec[2:]).total + spec, rel=1e-12)
    assert cost.with_work(pre) == pytest.approx(PlanCost(LM, N, [dec[2], pre]).total + spec, rel=1e-12)
    # without speculation the plan is priced as before, float for float
    assert PlanCost(LM, N, dec, {}, 0).total == PlanCost(LM, N, dec).total


def test_alg1_prices_speculation_and_relaxing_stops_it():
    """Five decoding requests, one with a tight TBT target: plain, their full-depth iteration fits
    T_g; speculating with 3 drafts it does not, so Alg. 1 relaxes loose ones (which then decode
    their layer groups plainly, in the step's layer calls) until it fits."""
    tbt = 0.015
    tight = _req(30, tbt=tbt)
    loose = [_req(30, tbt=0.2) for _ in range(4)]
    reqs = [tight, *loose]
    for r in reqs:
        r.output_token_ids.append(7)
    plans0 = {r.req_id: DecodePlan(N, 0) for r in reqs}
    sh = SpecShape(exit_layer=2, draft_tokens=3, max_model_len=1024)
    plain = _LayerLoad(LM, N, 0, reqs, plans0).predict()
    spec_load = _LayerLoad(LM, N, 0, reqs, plans0, spec=sh)
    assert spec_load.num_spec == 5 and spec_load.full == 0
    ctx = reqs[0].num_tokens
    assert spec_load.predict() == pytest.approx(spec_decode_time(LM, N, 2, [(ctx, 3)] * 5), rel=1e-12)
    assert plain < tbt * 0.9 < spec_load.predict()

    plans, t_g, load = exec_plan(LM, N, 0, reqs, {}, 0.9)
    assert t_g == tbt and all(p.layers == N for p in plans.values())  # plain: nobody relaxed
    plans, t_g, load = exec_plan(LM, N, 0, reqs, {}, 0.9, spec=sh)
    assert t_g == tbt
    assert plans[tight.req_id].layers == N
    relaxed = [r for r in loose if plans[r.req_id].layers < N]
    assert relaxed
    assert load.num_spec == 1 + len(loose) - len(relaxed) and load.predict() <= tbt * 0.9
    # the relaxed ones are priced as plain layer groups: without the speculating ones, no spec time
    for r in reqs:
        if plans[r.req_id].layers == N:
            load.remove(plans[r.req_id], rid=r.req_id)
    assert load.num_spec == 0 and load.spec_time() == 0.0 and 0 < load.predict() < plain
