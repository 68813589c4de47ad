"""Decode steps in a streak (issue 26, session 28): a CPU runs a stream of small decode steps faster than one
such step right after other work (on an AMX Xeon, 1 thread, SmolLM2: a batch-1 step 0.93x its profiled price
right after a step with prefill, 0.76x seven decode steps later). The profiler times decode steps of up to
``WARM_DECODE_MAX_ROWS`` rows in streaks (``WarmDecodeStepSample``), the fit keeps a factor per row count and
streak position (``FittedLatencyModel.decode_warm``), the instance core counts the streak
(``laser.core.pricing.warm_streak`` -> ``StepPlan.warm``) and the model, the online calibration and the
simulator's clock price the step at that factor. Fake timings, exact truths."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from laser.core.config import SchedulerConfig
from laser.core.plan import StepPlan, Work
from laser.core.pricing import PlanCost, quiet_step, warm_streak
from laser.core.request import SLO, Request, SamplingParams
from laser.latency import (
    AttentionSample,
    CalibratedLatencyModel,
    DecodeStepSample,
    EmbedSample,
    FittedLatencyModel,
    HeadSample,
    SimpleLatencyModel,
    StatelessSample,
    WarmDecodeStepSample,
    fit,
)
from laser.latency.fitting_steps import DECODE_WARM_MIN, fit_decode_warm
from laser.latency.machine_speed import fit_machine_speed
from laser.profiler.pipeline import samples_from_cases
from laser.profiler.timing import Bench, Case
from laser.sim import SimInstance

N = 6
#: the truth of a warm step, per row count: the factor at streak 1, 2, 3, ... (the last holds past it)
TRUTH = {1: (0.95, 0.9, 0.85, 0.8), 2: (0.96, 0.92, 0.9, 0.88), 4: (0.98, 0.96, 0.95, 0.95), 8: (1.0, 1.0, 1.0, 1.0)}


class WarmModel(SimpleLatencyModel):
    """A simple model that prices decode steps of up to 4 rows warm: ``factor ** streak`` (at least 0.7)."""

    def __init__(self, factor=0.9, **kw):
        super().__init__(num_layers=N, per_layer=2e-4, per_token=2e-6, per_context=1e-8, **kw)
        self.factor = factor

    def decode_warm_factor(self, n_rows, streak=1):
        return max(0.7, self.factor ** streak) if streak > 0 and n_rows <= 4 else 1.0


def decode_plan(rows, start=0, end=N, ctx=40):
    return StepPlan(N, [Work(f"r{i}", ctx + i, 1, start, end, end == N) for i in range(rows)])


def test_fit_keeps_a_non_increasing_factor_per_streak_and_stops_at_rows_that_save_nothing():
    def price(c):
        return 1e-3 * (1 + len(c))

    samples = [WarmDecodeStepSample(tuple(range(40, 40 + b)), k + 1, f * price(tuple(range(40, 40 + b))))
               for b, fs in TRUTH.items() for k, f in enumerate(fs)]
    samples += [WarmDecodeStepSample((40,), 2, 0.93 * price((40,)))]  # a second repeat of streak 2: median
    samples += [WarmDecodeStepSample((40, 41, 42), 1, 1.2 * price((40, 41, 42)))]  # slower than cold: 1.0
    samples += [WarmDecodeStepSample((40,) * 16, 1, 1.1 * price((40,) * 16))]  # past the edge: dropped
    got = dict(fit_decode_warm(samples, price))
    assert got[1] == pytest.approx((0.95, 0.915, 0.85, 0.8))  # median of 0.9 and 0.93, never above streak 1
    assert got[2] == pytest.approx(TRUTH[2]) and got[4] == pytest.approx(TRUTH[4])
    assert got[3] == (1.0,)  # kept between row counts that save
    assert got[8] == (1.0, 1.0, 1.0, 1.0) and 16 not in got  # the edge kept, what lies past it not
    assert dict(fit_decode_warm([WarmDecodeStepSample((40,), 1, 1e-9)], price))[1] == (DECODE_WARM_MIN,)
    assert fit_decode_warm([WarmDecodeStepSample((40,), 1, 2 * price((40,)))], price) == ()
    assert fit_decode_warm([], price) == ()


def test_the_fit_divides_by_the_same_step_timed_after_other_work_when_there_is_one():
    """A model that prices a step 5 % low must not hide its saving (nor add its error to it)."""
    def price(c):
        return 1e-3

    cold = [DecodeStepSample((40, 41), 1.05e-3)]
    warm = [WarmDecodeStepSample((40, 41), k, t) for k, t in ((1, 1.04e-3), (2, 1.0e-3), (3, 0.945e-3))]
    got = dict(fit_decode_warm(warm, price, cold))[2]
    assert got == pytest.approx((1.04 / 1.05, 1.0 / 1.05, 0.9))
    assert dict(fit_decode_warm(warm, price))[2] == (1.0, 1.0, pytest.approx(0.945))  # (against the price)


def test_a_row_count_that_saves_only_later_in_a_streak_keeps_the_streak_going():
    m = fit(_profile_samples(), num_layers=N)
    m.decode_warm = ((1, (1.0, 0.97, 0.9)), (2, (1.0, 1.0, 1.0)))
    assert quiet_step(m, decode_plan(1)) and warm_streak(m, 3, decode_plan(1)) == 3
    assert not quiet_step(m, decode_plan(2))  # (2 rows save nothing)


def test_malformed_decode_warm_in_a_profile_names_the_field():
    doc = fit(_profile_samples(), num_layers=N).to_dict()
    for bad in ("abc", None, {"1": [0.9]}, [1, 0.9], [[2.7, [0.9]]], [[1, ["0.9"]]], [[1, [0.8, 0.95]]]):
        d = copy.deepcopy(doc)
        d["model"]["decode_warm"] = bad
        with pytest.raises(Exception, match="decode_warm"):
            FittedLatencyModel.from_dict(d)


def _profile_samples():
    s = [StatelessSample(n, 2e-4 + 3e-6 * n) for n in range(1, 130)]
    s += [EmbedSample(n, 1e-5 + 1e-8 * n) for n in (1, 8, 64, 256)]
    s += [HeadSample(r, 5e-4 + 2e-5 * r) for r in range(1, 65)]
    s += [AttentionSample((1,) * b, (64,) * b, 1e-5 + 2e-7 * 64 * b) for b in (1, 2, 4, 8, 16)]
    s += [AttentionSample((q,), (q,), 1e-5 + 4e-6 * q + 2e-7 * q) for q in (16, 64, 128)]
    return s


def test_the_default_form_fits_warm_factors_against_its_own_decode_step_price_and_keeps_them_in_the_file(tmp_path):
    base = fit(_profile_samples(), num_layers=N)
    assert base.decode_warm == () and base.decode_warm_factor(1, 5) == 1.0

    def cold(c):
        b = len(c)
        return N * base.step_layer_time((1,) * b, c) + base.embed_time(b) + base.head_time(b)

    warm = [WarmDecodeStepSample((64,) * b, k + 1, f * cold((64,) * b)) for b, fs in TRUTH.items()
            for k, f in enumerate(fs)]
    m = fit(_profile_samples() + warm, num_layers=N)
    assert dict(m.decode_warm)[1] == pytest.approx(TRUTH[1], rel=1e-9)
    assert m.decode_warm_factor(1, 0) == 1.0  # after other work: the profile's price
    assert m.decode_warm_factor(1, 2) == pytest.approx(0.9)
    assert m.decode_warm_factor(1, 40) == pytest.approx(0.8)  # past the longest measured streak: its factor
    assert m.decode_warm_factor(3, 1) == pytest.approx((0.96 + 0.98) / 2)  # between measured row counts
    assert m.decode_warm_factor(9, 3) == 1.0  # past the last measured row count
    assert m.report["decode_warm"]["n"] == len(warm)
    path = m.save(tmp_path / "p.json")
    back = FittedLatencyModel.load(path)
    assert back.decode_warm == m.decode_warm
    again = back.refit().decode_warm
    assert [r for r, _ in again] == [r for r, _ in m.decode_warm]
    assert np.allclose(np.concatenate([fs for _, fs in again]), np.concatenate([fs for _, fs in m.decode_warm]))
    assert sum(isinstance(s, WarmDecodeStepSample) for s in back.samples) == len(warm)
    doc = m.to_dict()
    del doc["model"]["decode_warm"], doc["samples"]["decode_step_warm"]  # a profile made before them
    assert FittedLatencyModel.from_dict(doc).decode_warm == ()
    assert "decode_step_warm" not in base.to_dict()["samples"]  # (readable by a Laser before them)
    bad = copy.deepcopy(m.to_dict())
    bad["model"]["decode_warm"] = [[1, [0.9]], [1, [0.8]]]
    with pytest.raises(Exception, match="decode_warm"):
        FittedLatencyModel.from_dict(bad)


def test_profile_cases_give_one_warm_sample_per_streak_position():
    run = SimpleNamespace(decode_contexts=(40, 90), warm=[[0.010, 0.009, 0.008], [0.012, 0.011, 0.010],
                                                          [0.011, 0.010, 0.009, 0.007]])
    out = samples_from_cases([Case(("decode_warm", 0), run, times=[0.03] * 3, clean=[0.03] * 3)], 0.03, Bench(),
                             None, warn=False)
    assert [(s.context_lens, s.streak) for s in out] == [((40, 90), 1), ((40, 90), 2), ((40, 90), 3)]
    assert [s.seconds for s in out] == pytest.approx([0.011, 0.010, 0.009])  # medians; the longest streak cut


def test_a_streak_counts_quiet_decode_steps_and_only_full_depth_ones_are_priced_warm():
    lm, plain = WarmModel(), SimpleLatencyModel(num_layers=N)
    assert quiet_step(lm, decode_plan(2)) and quiet_step(lm, decode_plan(2, 0, 3))  # any depth keeps it going
    assert not quiet_step(lm, decode_plan(5))  # a row count the model does not price warm
    assert not quiet_step(plain, decode_plan(1))  # a model without warm factors
    mixed = StepPlan(N, [Work("p", 0, 12, 0, N, True), *decode_plan(1).works])
    assert not quiet_step(lm, mixed) and warm_streak(lm, 3, mixed) == 0
    assert warm_streak(lm, 3, decode_plan(2)) == 3 and warm_streak(lm, 0, decode_plan(2)) == 0
    assert warm_streak(lm, 3, decode_plan(2, 2, N)) == 0  # resumed mid-model: priced as profiled
    spec = decode_plan(1)
    spec.speculative = ({"r0": 2}, 3)
    assert warm_streak(lm, 3, spec) == 0
    p = decode_plan(2)
    cold = lm.predict_iteration(p)
    p.warm = 3
    assert lm.predict_iteration(p) == pytest.approx(0.9 ** 3 * cold)
    assert PlanCost(lm, N, p.works).total == pytest.approx(cold)  # (the plan's price as profiled)


def _chat(i, tokens, arrival=0.0):
    return Request([1] * (20 + 3 * i), SamplingParams(max_tokens=tokens, ignore_eos=True), SLO(0.5, 0.05, "chat"),
                   arrival_time=arrival, req_id=f"c{i}")


@pytest.mark.parametrize("policy", ["laser", "vllm", "sarathi"])
def test_the_simulated_clock_runs_a_decode_streak_at_its_warm_price_and_the_plans_say_so(policy):
    """Two requests: their prefills (priced as profiled), then a streak of decode steps whose clock
    advances by exactly ``predict_iteration`` of each plan -- warm from the second decode step on, and cold
    again after a third request's prefill. With the plain model every step costs its profiled price."""
    times = {}
    for name, lm in (("warm", WarmModel()), ("plain", SimpleLatencyModel(num_layers=N, per_layer=2e-4,
                                                                             per_token=2e-6, per_context=1e-8))):
        inst = SimInstance(policy, N, lm, SchedulerConfig(policy=policy), num_blocks=1024, record_plans=True)
        for i in range(2):
            inst.add_request(_chat(i, 30))
        seen = []
        for k in range(40):
            if k == 20:
                inst.add_request(_chat(2, 10, inst.clock.t))
            inst._release()
            plan = inst.schedule()
            if not plan:
                break
            t0 = inst.clock.t
            inst.execute(plan)
            seen.append((plan.warm, inst.clock.t - t0, lm.predict_iteration(plan), plan))
        times[name] = seen
        for warm, dt, pred, plan in seen:
            assert dt == pytest.approx(pred, rel=1e-9)  # the clock is the model's price, warm or not
            if warm:
                assert all(w.is_decode and w.layer_start == 0 and w.layer_end == N for w in plan.works)
    warm = [w for w, *_ in times["warm"]]
    assert max(warm) >= 10 and warm.count(0) >= 3  # a long streak, broken by the third request's prefill
    assert all(w == 0 for w, *_ in times["plain"])
    assert sum(dt for _, dt, *_ in times["warm"]) < 0.95 * sum(dt for _, dt, *_ in times["plain"])


def test_the_calibration_sees_a_warm_step_at_its_warm_price():
    """A machine that runs decode streaks as the model prices them: the online calibration's decode factor and
    spread stay at 1.0 (the warm saving is not read as the machine being faster, nor as jitter)."""
    lm = WarmModel()
    cal = CalibratedLatencyModel(lm, spread_quantile=0.98)
    for k in range(40):
        p = decode_plan(1 + k % 3)
        p.warm = k % 10  # streaks of 9, broken every tenth step
        cal.observe_step(cal.predict_iteration(p), lm.predict_iteration(p), p)
    assert cal.decode_factor == pytest.approx(1.0) and cal.timing_spread() == pytest.approx(1.0)


def test_outputs_do_not_depend_on_warm_pricing(tiny_llama):
    """The invariant: warm pricing changes prices (and so, maybe, plans), never a request's greedy output."""
    from laser import LLM

    outs, streaks = [], []
    for warm in (True, False):
        lm = WarmModel(factor=0.5) if warm else SimpleLatencyModel(num_layers=N)
        lm.num_layers = 4  # (the tiny model's)
        llm = LLM(str(tiny_llama), policy="laser", dtype="float32", max_model_len=128, latency_model=lm)
        llm.engine.core.step_log = []
        rng = np.random.default_rng(3)
        prompts = [[int(x) for x in rng.integers(5, 200, 9 + 4 * i)] for i in range(3)]
        res = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        outs.append([r.token_ids for r in res])
        streaks.append(max(p.warm for p, _ in llm.engine.core.step_log))
    assert outs[0] == outs[1]
    assert streaks[0] >= 5 and streaks[1] == 0  # the warm run priced a streak of decode steps


def test_an_arrival_inside_a_warm_step_leaves_its_price_warm_in_the_simulator():
    """The simulator's layer-by-layer path (a delivery due inside the step) prices a warm step as its fast path."""
    lm = WarmModel()
    inst = SimInstance("laser", N, lm, SchedulerConfig(), num_blocks=1024)
    inst.add_request(_chat(0, 40))
    seen = 0
    for k in range(30):
        inst._release()
        plan = inst.schedule()
        if not plan:
            break
        if plan.warm >= 3 and not seen:  # a delivery halfway through this step
            inst.submit(_chat(1, 5, inst.clock.t + 0.5 * lm.predict_iteration(plan)))
            seen = 1
        t0 = inst.clock.t
        inst.execute(plan)
        if plan.warm and all(w.is_decode for w in plan.works):
            assert inst.clock.t - t0 == pytest.approx(lm.predict_iteration(plan), rel=1e-9)
    assert seen


def test_the_machine_speed_fit_prices_warm_steps_as_the_engine_did():
    lm = WarmModel()
    steps = []
    for k in range(12):
        p = decode_plan(1 + k % 2)
        p.warm = k
        steps.append((p, lm.predict_iteration(p)))
    sp = fit_machine_speed(lm, steps, N)
    assert sp.decode_factor == pytest.approx(1.0) and sp.error < 1e-9


def test_an_empty_plan_executes_to_nothing():
    inst = SimInstance("laser", N, WarmModel(), SchedulerConfig(), num_blocks=64)  # (an InstanceCore)
    assert inst.execute(StepPlan(N, [])) == [] and inst._streak == 0
