"""The online calibration scales decode and prefill layer calls apart (laser.latency.calibrated,
issue 26 item 4, knee23): a machine that drifts from its profile moves memory-bound decode and
compute-bound prefill by different factors. Simulated machines (virtual time): deterministic."""

import pytest

from laser.core.config import SchedulerConfig
from laser.core.plan import StepPlan, Work
from laser.core.request import SLO, Request, SamplingParams
from laser.latency import CalibratedLatencyModel, SimpleLatencyModel
from laser.latency.calibrated import JITTER_SPREAD_QUANTILE
from laser.latency.machine_speed import KindScaledLatencyModel
from laser.scheduler.laser.memo import DecodeMemo
from laser.sim import SimInstance

N = 4
LM = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=1e-5, per_context=1e-8)


def _decode_plan(k: int) -> StepPlan:
    return StepPlan(N, [Work(f"d{i}", 40 + k, 1, 0, N, sample=True) for i in range(3)])


def _prefill_plan(k: int) -> StepPlan:
    return StepPlan(N, [Work("p", 0, 96 + k, 0, N, sample=True), Work("d0", 40 + k, 1, 0, N, sample=True)])


def test_each_kind_of_step_teaches_its_own_factor():
    """Decode steps at 0.8x of the profile, steps with a prefill chunk at 1.3x (its layer calls;
    the decode parts of those steps at 0.8x): the calibration learns both factors, prices each
    kind by its own, and measures no spread (the machine is steady). One factor over the same
    steps was the 0.8 quantile of the mix, with the kinds' difference as spread."""
    machine = KindScaledLatencyModel(LM, 0.8, 1.3)
    m = CalibratedLatencyModel(LM, min_steps=4, spread_quantile=JITTER_SPREAD_QUANTILE)
    for k in range(40):
        plan = _prefill_plan(k) if k % 3 == 0 else _decode_plan(k)
        m.observe_step(m.predict_iteration(plan), machine.predict_iteration(plan), plan)
    assert m.decode_factor == pytest.approx(0.8) and m.factor == pytest.approx(1.3)
    assert m.timing_spread() == pytest.approx(1.0)
    for plan in (_decode_plan(50), _prefill_plan(50)):
        assert m.predict_iteration(plan) == pytest.approx(machine.predict_iteration(plan))
    assert m.ratio_quantile(0.8) > 1.0  # the one-factor ratios of the same steps: a mix


def test_steps_without_the_split_keep_one_factor():
    """``observe`` without a prefill part (or ``observe_step`` without a plan) is a one-factor
    calibration, as before the split: both factors are the quantile of every step's ratio."""
    m = CalibratedLatencyModel(LM, window=10, min_steps=4)
    for r in (1.1, 1.2, 1.3, 1.4, 1.2):
        m.observe_step(0.01 * m.decode_factor, 0.01 * r)
    assert m.decode_factor == m.factor == pytest.approx(m.ratio_quantile(0.8))


def test_decode_memo_scales_decode_and_mixed_layer_calls_by_their_factors():
    m = CalibratedLatencyModel(LM)
    m.decode_factor, m.factor = 0.5, 2.0
    memo = DecodeMemo(m)
    assert memo.layer_time(3, 64) == pytest.approx(m.layer_time((1, 1, 1), (64, 64, 64)))
    assert memo.layer_time(3, 64, 128) == pytest.approx(2.0 * LM.layer_time((1, 1, 1, 128), (64, 64, 64, 128)))
    assert memo.tbt_infeasible(64, 0.6 * LM.predict_decode_iteration((64,))) is False  # at 0.5x it fits


def test_a_simulated_engine_on_a_machine_that_drifts_per_kind_learns_both_factors():
    """Laser on a simulated machine that runs decode at 0.7x and prefill at 1.25x of the
    profile it plans with, calibrated online with the timing spread on (the engine's default):
    the factors it ends with are the machine's, and the spread it divides its margins by is 1.0
    (the machine is steady: no jitter to plan for)."""
    lm = SimpleLatencyModel(num_layers=N, per_layer=2e-3, per_token=2e-5, per_context=1e-8)
    machine = KindScaledLatencyModel(lm, 0.7, 1.25)
    slo = SLO(ttft=5.0, tbt=0.2, name="chat")

    def run(calibrated):
        sim = SimInstance("laser", N, calibrated, SchedulerConfig(policy="laser"), machine_model=machine)
        for i in range(24):
            sim.submit(Request([3] * (16 + 40 * (i % 5)), SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True),
                               slo, arrival_time=0.02 * i, req_id=f"r{i}"))
        sim.run(max_steps=200_000)
        sim.check_integrity(expect_empty=True)
        return calibrated

    two = run(CalibratedLatencyModel(lm, min_steps=4, spread_quantile=JITTER_SPREAD_QUANTILE))
    assert len(two.prefill_ratios) >= 4 and len(two.decode_ratios) >= 4
    assert two.decode_factor == pytest.approx(0.7, rel=1e-6) and two.factor == pytest.approx(1.25, rel=1e-6)
    assert two.timing_spread() == pytest.approx(1.0)


def test_the_spread_counts_steps_in_the_order_they_ran():
    """A prefill step (one in 16) is 30 % over its factor one time in ten: one step in 160, under the
    98th percentile of the steps -- no spread. Over the two kind windows pooled, the prefill steps
    would weigh half and the spread would be 1.3 (a replayed real run: 1.30 against 1.10 in order)."""
    machine = KindScaledLatencyModel(LM, 0.8, 1.3)
    m = CalibratedLatencyModel(LM, min_steps=4, spread_quantile=JITTER_SPREAD_QUANTILE)
    pre = 0
    for k in range(2000):
        plan = _prefill_plan(k % 7) if k % 16 == 0 else _decode_plan(k % 7)
        measured = machine.predict_iteration(plan)
        if k % 16 == 0:
            pre += 1
            measured *= 1.3 if pre % 10 == 0 else 1.0
        m.observe_step(m.predict_iteration(plan), measured, plan)
    assert m.decode_factor == pytest.approx(0.8) and m.factor == pytest.approx(1.3)
    assert m.timing_spread() == pytest.approx(1.0)
    assert sum(r > 1.31 for r in m.prefill_ratios) >= 6  # (the slow prefill steps are in its window)
