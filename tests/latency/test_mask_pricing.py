"""The grammar mask in the latency model's sampling term (structured output, issue 30).

A sampled row that goes through a grammar mask costs ``mask_row_s`` more
(``LatencyModel.mask_time``): plan pricing (PlanCost, the Laser scheduler's steady decode
path and Alg. 1's iteration constant) adds it for the works of requests with structured
output, the simulator's clock too; a plan without such a work is priced exactly as before.
The value is measured by the profiler with llguidance on the model's tokenizer and kept in the
profile, or estimated from the vocabulary.
"""

from __future__ import annotations

import json

import pytest

from laser.core.config import SchedulerConfig
from laser.core.plan import StepPlan, Work
from laser.core.pricing import PlanCost
from laser.core.request import Request, SamplingParams
from laser.latency import CalibratedLatencyModel, FittedLatencyModel, SimpleLatencyModel
from laser.sim import SimInstance

N = 4
MASK_S = 3e-3
GRAMMAR = ("json", json.dumps({"type": "object"}))


def lm(mask_row_s: float = MASK_S) -> SimpleLatencyModel:
    m = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=2e-5, per_context=1e-6, per_embed_token=1e-6,
                           head_const=2e-4, per_head_row=1e-4)
    m.mask_row_s = mask_row_s
    return m


def test_plan_cost_adds_one_mask_per_masked_sampled_row():
    works = [Work("a", 10, 1, 0, N, True, True), Work("b", 20, 1, 0, N, True), Work("c", 0, 16, 0, N, True, True),
             Work("d", 0, 8, 0, 2, False, True)]  # d: a masked request's chunk that samples nothing
    plain = [Work(w.req_id, w.token_start, w.num_tokens, w.layer_start, w.layer_end, w.sample) for w in works]
    m = lm()
    assert PlanCost(m, N, works).total - PlanCost(m, N, plain).total == pytest.approx(2 * MASK_S, abs=1e-15)
    grown = PlanCost(m, N, works[:1])
    priced = grown.with_work(works[2])
    grown.add(works[2])
    assert priced == grown.total  # with_work prices what add then holds
    # no masked work: the same sum, bit for bit, whatever mask_row_s is
    assert PlanCost(m, N, plain).total == PlanCost(lm(0.0), N, plain).total
    assert m.predict_iteration(StepPlan(N, plain)) == lm(0.0).predict_iteration(StepPlan(N, plain))
    scaled = CalibratedLatencyModel(m)
    scaled.decode_factor = 2.0  # (per-row terms follow the calibration's decode factor)
    assert scaled.mask_time(3) == pytest.approx(2.0 * 3 * MASK_S)


def _run(policy: str, masked: bool, role: str = "mixed"):
    """Two requests on a simulated instance of ``policy`` (``role`` decode: handed off after
    their first token), the first with a grammar when ``masked``: (busy seconds, the scheduler's
    predicted plan times vs PlanCost's, sampled masked rows, steady decode steps)."""
    from laser.core.request import Phase
    from laser.instance.core import Handoff

    m = lm()
    sim = SimInstance(policy, N, m, SchedulerConfig(policy=policy, role=role, max_num_batched_tokens=16),
                      record_plans=True)
    seen = []
    execute = sim.executor.execute

    def spy(plan, requests, stop_at=None):
        if plan.predicted is not None and plan.predicted[0] is m:
            seen.append((plan.predicted[1], PlanCost(m, N, plan.works).total))
        return execute(plan, requests, stop_at)

    sim.executor.execute = spy
    for i in range(2):  # two requests: the second decodes beside the first (a batch of two)
        sp = SamplingParams(max_tokens=6 + (role == "decode"), ignore_eos=True,
                            structured_output=GRAMMAR if masked and i == 0 else None)
        r = Request([5] * (40 + 3 * i), sp, req_id=f"r{i}")
        if role == "decode":
            r.num_computed_tokens, r.output_token_ids, r.token_times, r.phase = 40 + 3 * i, [0], [0.0], Phase.DECODE
            sim.receive(Handoff(r, None, 0.0), 0.0)
        else:
            sim.submit(r)
    sim.run()
    sim.check_integrity(expect_empty=True)
    rows = sum(1 for p in sim.stats.plans for w in p.works if w.masked and w.sample and w.layer_end == N)
    return sim.stats.busy_s, seen, rows, getattr(sim.scheduler, "num_steady_steps", 0)


@pytest.mark.parametrize("policy,role", [("laser", "mixed"), ("laser", "decode"), ("sarathi", "mixed"),
                                         ("vllm", "mixed")])
def test_a_grammar_request_is_priced_and_simulated_by_the_calibrated_amount(policy, role):
    """The same load with one request carrying a grammar: every plan's prediction equals PlanCost's
    (the Laser scheduler's steady decode path on a decode instance included), and the simulated
    time is longer by exactly one mask per sampled row of that request (6 tokens: 6 masks)."""
    busy0, seen0, rows0, _ = _run(policy, False, role)
    busy1, seen1, rows1, steady = _run(policy, True, role)
    assert rows0 == 0 and rows1 == 6
    assert steady > 0 or role != "decode"
    assert busy1 - busy0 == pytest.approx(6 * MASK_S, rel=1e-9)
    for predicted, cost in seen1:
        assert predicted == pytest.approx(cost, rel=1e-12)
    assert len(seen0) == len(seen1)
    if policy == "laser":
        assert seen1, "the Laser scheduler prices its plans"
        assert sum(b - a for (a, _), (b, _) in zip(seen0, seen1)) == pytest.approx(6 * MASK_S, rel=1e-9)


def test_the_laser_decode_planner_counts_masks_in_its_iteration():
    """Alg. 1's iteration price (``_LayerLoad``) of a decode batch with a masked request is
    larger by one mask."""
    from laser.scheduler.laser.decode import DecodePlan, _LayerLoad

    def reqs(masked):
        out = []
        for i in range(3):
            r = Request([3] * 30, SamplingParams(structured_output=GRAMMAR if masked and i == 1 else None),
                        req_id=f"q{i}")
            r.output_token_ids = [4]
            out.append(r)
        return out

    m = lm()
    plans = {f"q{i}": DecodePlan(N, 0) for i in range(3)}
    base = _LayerLoad(m, N, 0, reqs(False), plans).predict()
    assert _LayerLoad(m, N, 0, reqs(True), plans).predict() - base == pytest.approx(MASK_S, rel=1e-9)


def test_the_profile_keeps_the_measured_mask_cost(tmp_path):
    m = lm()
    fitted = FittedLatencyModel.fit(
        [s for n in (1, 2, 4, 8, 16, 32, 64) for s in _samples(m, n)], num_layers=N)
    assert fitted.mask_row_s == 0.0  # not measured
    fitted.mask_row_s = 1.25e-3
    back = FittedLatencyModel.from_dict(fitted.to_dict())
    assert back.mask_row_s == 1.25e-3 and back.refit().mask_row_s == 1.25e-3
    doc = fitted.to_dict()
    del doc["model"]["mask_row_s"]  # a profile made before it was measured
    assert FittedLatencyModel.from_dict(doc).mask_row_s == 0.0
    doc["model"]["mask_row_s"] = -1.0
    from laser.latency import LatencyProfileError

    with pytest.raises(LatencyProfileError, match="mask_row_s"):
        FittedLatencyModel.from_dict(doc)


def _samples(m, n):
    from laser.latency import AttentionSample, EmbedSample, HeadSample, StatelessSample

    return [StatelessSample(n, m.stateless_time(n) + 1e-6), AttentionSample((n,), (n,), m.attention_time((n,), (n,)) + 1e-6),
            AttentionSample((1,) * n, (64,) * n, m.attention_time((1,) * n, (64,) * n) + 1e-6),
            EmbedSample(n, m.embed_time(n) + 1e-6), HeadSample(n, m.head_time(n))]


def test_the_profiler_measures_the_mask_with_the_grammar_library(tiny_llama):
    from laser.model.loader import load_tokenizer
    from laser.profiler.mask import estimate_mask_row_s, measure_mask_row_s

    tok = load_tokenizer(tiny_llama)
    s = measure_mask_row_s(tok, len(tok), {tok.eos_token_id}, steps=8)
    assert 0.0 < s < 1.0
    assert measure_mask_row_s(str(tiny_llama), len(tok), steps=1) > 0.0  # the tokenizer loaded from the model
    with pytest.raises(ValueError):
        measure_mask_row_s(tok, len(tok), steps=0)
    assert estimate_mask_row_s(2 * len(tok)) == pytest.approx(2 * estimate_mask_row_s(len(tok)))


def test_an_engine_without_a_measurement_prices_masks_by_the_estimate(tiny_llama, tmp_path, monkeypatch):
    """No profile for this setup: the roofline model, with the vocabulary's estimated mask cost."""
    from laser.frontend.engine import Engine
    from laser.profiler.mask import estimate_mask_row_s

    monkeypatch.setenv("LASER_CACHE_DIR", str(tmp_path))  # (no profile there)
    e = Engine(str(tiny_llama), policy="laser", dtype="float32")
    assert e.latency_model.mask_row_s == pytest.approx(estimate_mask_row_s(e.model_config.vocab_size))
